"""What a search strategy is: which configs to measure, with which timer, in which rungs.

A strategy lists a first rung of steps over the candidates (shared round robin between the
ranks of a torchrun sweep), then, from every outcome so far, further steps (the leading rank
alone runs them) until it returns none. The winner is then confirmed against the default
by tuner.bench.decide, whatever the strategy. A strategy may also guide a sweep across its
shapes (GuidesShapes, which a sweep checks for: tuner.search.guided).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

from tuner.bench import Outcome, Timer
from tuner.keys import Config

if TYPE_CHECKING:  # search composes ops, never imports them to run
    from tuner.workload.shapes import DecodeShape


@dataclass(frozen=True)
class Step:
    """Measure `config` with `timer`; `rung` is stored with the measurement (a later rung's
    measurement stands for an earlier one when a sweep resumes)."""

    config: Config
    timer: Timer
    rung: int


class Strategy(Protocol):
    name: str
    description: str

    def first(self, configs: list[Config], timer: Timer) -> list[Step]:
        """The first rung: every step over the candidates (the default first among them)."""
        ...

    def then(self, outcomes: list[Outcome], default: Config, timer: Timer, rung: int) -> list[Step]:
        """The steps after `rung`, from every outcome so far; [] when the search is done."""
        ...


class ShapeGuide(Protocol):
    """What one sweep learns across its shapes, to search some of them over fewer configs
    (tuner.search.guided.Guide)."""

    def order(self, shapes: Sequence[DecodeShape]) -> list[int]:
        """The shapes' indices in the order to sweep them (those that teach first)."""
        ...

    def record(self, shape: DecodeShape, outcomes: Sequence[Outcome], winner: Config | None = None) -> None:
        """What shape's measurement (or its stored winner) taught."""
        ...

    def shortlist(self, shape: DecodeShape, configs: list[Config]) -> list[Config]:
        """The candidates to search for shape, of configs (the default first)."""
        ...


@runtime_checkable
class GuidesShapes(Protocol):
    """A strategy that guides a sweep across its shapes: a sweep asks it for a ShapeGuide
    (across_kv: one for the dense passes, which also learns across kv lengths)."""

    def guide(self, *, across_kv: bool = False) -> ShapeGuide:
        ...
