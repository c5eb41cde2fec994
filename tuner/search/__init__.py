"""Search strategies, one a module (exhaustive, halving), chosen by name; and the one
measuring pipeline they run in (tuner.search.pipeline): a trial's candidates measured by
the strategy, the winner confirmed against the default. A module of this package with a
STRATEGY (a tuner.search.base.Strategy) is a strategy: adding one is adding its file."""

from __future__ import annotations

import functools
import importlib
import pkgutil

from tuner import settings
from tuner.errors import TunerError
from tuner.search.base import GuidesShapes, ShapeGuide, Step, Strategy

DEFAULT_STRATEGY = settings.DEFAULT_STRATEGY


@functools.cache
def strategies() -> dict[str, Strategy]:
    """Every strategy by name, found once (on first use: the pipeline, itself a module here,
    imports this package)."""
    found: dict[str, Strategy] = {}
    for module in pkgutil.iter_modules(__path__):
        strategy = getattr(importlib.import_module(f"{__name__}.{module.name}"), "STRATEGY", None)
        if strategy is not None:
            found[strategy.name] = strategy
    return dict(sorted(found.items()))


def get_strategy(name: str) -> Strategy:
    try:
        return strategies()[name]
    except KeyError:
        raise TunerError(f"unknown search strategy {name!r}; known: {', '.join(strategies())}") from None


__all__ = ["DEFAULT_STRATEGY", "GuidesShapes", "ShapeGuide", "Step", "Strategy", "get_strategy", "strategies"]
