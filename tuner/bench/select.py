"""Outcomes of candidates, and the rule a challenger must pass to replace the default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tuner import settings
from tuner.bench.timing import Timing
from tuner.keys import canonical_json

OK, WRONG, ERROR, OOM = "ok", "wrong", "error", "oom"


@dataclass(frozen=True)
class Outcome:
    """What happened to one candidate config: its status, and its timing when it ran right."""

    config: dict[str, Any]
    status: str
    timing: Timing | None = None
    max_error: float | None = None
    error: str | None = None


def beats(candidate: Timing, default: Timing, min_gain: float = settings.MIN_GAIN) -> bool:
    """candidate is faster than default by more than the noise (mean of the two
    interquartile ranges) and by at least min_gain of the default's median."""
    noise = (candidate.spread_us + default.spread_us) / 2
    margin = max(noise, min_gain * default.median_us)
    return candidate.median_us < default.median_us - margin


def with_default_first(default: dict[str, Any], configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The default first (so it is always measured), then each other config once."""
    seen = {canonical_json(default)}
    out = [default]
    for config in configs:
        key = canonical_json(config)
        if key not in seen:
            seen.add(key)
            out.append(config)
    return out


def same_config(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as stored: (1, 2) and [1, 2], 2.0 and 2 are the same config value."""
    return canonical_json(a) == canonical_json(b)


def contenders(
    outcomes: list[Outcome], default_config: dict[str, Any], keep: float = settings.HALVING_KEEP,
    max_keep: int = settings.HALVING_MAX_KEEP,
) -> list[Outcome]:
    """What a first, quick pass keeps for a full measurement: the default (when it ran
    right) and the fastest correct configs within `keep` of the fastest, at most max_keep."""
    ok = sorted((o for o in outcomes if o.status == OK and o.timing), key=lambda o: o.timing.median_us)
    if not ok:
        return []
    limit = ok[0].timing.median_us * (1 + keep)
    kept = [o for o in ok if o.timing.median_us <= limit][:max_keep]
    default = next((o for o in ok if same_config(o.config, default_config)), None)
    if default is not None and all(o is not default for o in kept):
        kept.append(default)
    return kept
