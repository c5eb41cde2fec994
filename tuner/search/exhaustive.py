"""Exhaustive search: every candidate measured once with the full timer."""

from __future__ import annotations

from tuner.bench import Outcome, Timer
from tuner.search.base import Config, Step


class Exhaustive:
    name = "exhaustive"
    description = "every candidate, fully timed"

    def first(self, configs: list[Config], timer: Timer) -> list[Step]:
        return [Step(c, timer, 1) for c in configs]

    def then(self, outcomes: list[Outcome], default: Config, timer: Timer, rung: int) -> list[Step]:
        return []


STRATEGY = Exhaustive()
