"""The `tuner` command line: `app` and `main()`, and the modules that register its commands."""

from tuner.cli.app import app, main
from tuner.cli import sweep, show, exchange, doctor  # registers the commands, in `tuner --help`'s order

__all__ = ["app", "main", "sweep", "show", "exchange", "doctor"]
