"""Search strategies, one a module (exhaustive, halving), chosen by name; and the one
measuring pipeline they run in (tuner.search.pipeline): a trial's candidates measured by
the strategy, the winner confirmed against the default."""

from __future__ import annotations

from tuner.errors import TunerError
from tuner.search import exhaustive, halving
from tuner.search.base import Step, Strategy

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (exhaustive.STRATEGY, halving.STRATEGY)}
DEFAULT_STRATEGY = "exhaustive"


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise TunerError(f"unknown search strategy {name!r}; known: {', '.join(STRATEGIES)}") from None


__all__ = ["DEFAULT_STRATEGY", "STRATEGIES", "Step", "Strategy", "get_strategy"]
