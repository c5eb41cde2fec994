"""tuner: kernel autotuning with a persistent tuning DB for LLM-serving attention kernels.

Public API: autotune, configure, flush_misses, graph_capture, TuningDB, TunerError,
__version__. The functions and TuningDB load on first use, so `import tuner` (and
`tuner --help`) does not pay for torch and SQLAlchemy.
"""

from typing import TYPE_CHECKING, Any

from tuner.errors import TunerError
from tuner.version import __version__

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from tuner.db import TuningDB
    from tuner.runtime import autotune, configure, flush_misses, graph_capture

__all__ = ["TunerError", "TuningDB", "__version__", "autotune", "configure", "flush_misses", "graph_capture"]

_LAZY = {"autotune": "tuner.runtime", "configure": "tuner.runtime", "flush_misses": "tuner.runtime",
         "graph_capture": "tuner.runtime",
         "TuningDB": "tuner.db"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tuner' has no attribute {name!r}")
