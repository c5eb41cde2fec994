"""The `tuner` command line: `app` and `main()`, and the modules that register its commands."""

from tuner.cli.base import app, main

# each registers its commands on app as it is imported: in this order, `tuner --help`'s
from tuner.cli import sweep  # noqa: E402
from tuner.cli import show  # noqa: E402
from tuner.cli import exchange  # noqa: E402
from tuner.cli import doctor  # noqa: E402

COMMAND_MODULES = (sweep, show, exchange, doctor)

__all__ = ["app", "main"]
