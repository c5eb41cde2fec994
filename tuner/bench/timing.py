"""What timing is: a rotation of callables, the Timing of its samples, and the Timer protocol
both timers follow."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

# A timer times one call of a config as the mean over a rotation: one callable per copy of
# the inputs, run in turn, so each call finds its data out of cache as in a real model
# (consecutive layers read different KV). A single callable is a rotation of one.
Rotation = Callable[[], Any] | Sequence[Callable[[], Any]]


def as_rotation(fns: Rotation) -> Sequence[Callable[[], Any]]:
    return [fns] if callable(fns) else list(fns)


@dataclass(frozen=True)
class Timing:
    """Per-call time statistics in microseconds. spread_us is the interquartile range."""

    median_us: float
    spread_us: float
    samples: int


def summarize(samples_us: list[float]) -> Timing:
    if not samples_us:
        raise ValueError("no samples")
    ordered = sorted(samples_us)
    if len(ordered) >= 4:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        spread = q3 - q1
    else:
        spread = ordered[-1] - ordered[0]
    return Timing(statistics.median(ordered), spread, len(ordered))


class Timer(Protocol):
    """What sweeps, tune mode and verification time configs with."""

    @property
    def method(self) -> dict[str, Any]:
        """How it measured (stored with every measurement), as of the last call."""
        ...

    def __call__(self, fns: Rotation) -> Timing: ...

    def paired(self, fns_a: Rotation, fns_b: Rotation) -> tuple[Timing, Timing]:
        """Two rotations timed in alternation, for confirming a winner against the default."""
        ...

    def quick(self) -> "Timer":
        """A cheaper timer, for successive halving's first rung."""
        ...
