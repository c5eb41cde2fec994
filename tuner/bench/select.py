"""Choosing a winner: the default stays unless a candidate beats it by more than the noise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tuner.bench.timer import Timing

OK, WRONG, ERROR, OOM = "ok", "wrong", "error", "oom"


@dataclass(frozen=True)
class Outcome:
    """What happened to one candidate config: its status, and its timing when it ran right."""

    config: dict[str, Any]
    status: str
    timing: Timing | None = None
    max_error: float | None = None
    error: str | None = None


def beats(candidate: Timing, default: Timing, min_gain: float = 0.01) -> bool:
    """candidate is faster than default by more than the noise (mean of the two
    interquartile ranges) and by at least min_gain of the default's median."""
    noise = (candidate.spread_us + default.spread_us) / 2
    margin = max(noise, min_gain * default.median_us)
    return candidate.median_us < default.median_us - margin


def select_winner(
    outcomes: list[Outcome], default_config: dict[str, Any], min_gain: float = 0.01
) -> Outcome | None:
    """The fastest correct candidate if it beats the default, else the default.

    Failed candidates are never chosen. When the default itself failed, the fastest
    correct candidate wins; when nothing ran correctly, there is no winner (None).
    """
    ok = [o for o in outcomes if o.status == OK and o.timing is not None]
    if not ok:
        return None
    fastest = min(ok, key=lambda o: o.timing.median_us)
    default = next((o for o in ok if o.config == default_config), None)
    if default is None or fastest is default:
        return fastest
    return fastest if beats(fastest.timing, default.timing, min_gain) else default
