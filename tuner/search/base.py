"""What a search strategy is: which configs to measure, with which timer, in which rungs.

A strategy lists a first rung of steps over the candidates (shared round robin between the
ranks of a torchrun sweep), then, from every outcome so far, further steps (the leading rank
alone runs them) until it returns none. The winner is then confirmed against the default
by tuner.bench.decide, whatever the strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tuner.bench import Outcome, Timer
from tuner.keys import Config



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
