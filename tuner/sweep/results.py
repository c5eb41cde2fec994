"""What a sweep reports: a ShapeResult per shape, and SweepInterrupted with those it finished."""

from __future__ import annotations

from dataclasses import dataclass

from tuner.ops import Config
from tuner.workload import DecodeShape

# a shape's status: a new winner measured, its stored winner kept, no config ran right, or
# the same key as an earlier shape (not "tuned": tuner.ops.base.TUNED is another thing)
MEASURED, SKIPPED, FAILED, DUPLICATE = "measured", "skipped", "failed", "duplicate"


@dataclass(frozen=True)
class ShapeResult:
    shape: DecodeShape
    status: str  # measured | skipped (its stored winner is reported) | failed | duplicate
    winner: Config | None
    winner_us: float | None
    default_us: float | None
    measured: int  # configs measured in this run
    resumed: int  # configs whose stored measurement was reused
    failures: int  # configs that crashed, ran out of memory or were wrong
    note: str = ""  # why a shape failed, or which shape it duplicates

    @property
    def speedup(self) -> float | None:
        if self.winner_us and self.default_us:
            return self.default_us / self.winner_us
        return None


class SweepInterrupted(KeyboardInterrupt):
    """A sweep interrupted (Ctrl-C, or SIGINT at a deadline): the shapes it finished, in
    the order given, and how many it was given."""

    def __init__(self, done: list[ShapeResult], total: int) -> None:
        super().__init__(f"interrupted after {len(done)} of {total} shapes")
        self.done, self.total = done, total
