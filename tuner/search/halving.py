"""Successive halving: every candidate timed quickly (rung 0), then only the contenders (the
default and those within settings.HALVING_KEEP of the fastest, at most
settings.HALVING_MAX_KEEP) fully (rung 1); the winner is chosen among those."""

from __future__ import annotations

from tuner.bench import OK, Outcome, Timer, contenders
from tuner.search.base import Config, Step


class Halving:
    name = "halving"
    description = "every candidate timed quickly, then the contenders fully"

    def first(self, configs: list[Config], timer: Timer) -> list[Step]:
        quick = timer.quick()
        return [Step(c, quick, 0) for c in configs]

    def then(self, outcomes: list[Outcome], default: Config, timer: Timer, rung: int) -> list[Step]:
        if rung >= 1:
            return []
        return [Step(o.config, timer, 1) for o in contenders([o for o in outcomes if o.status == OK], default)]


STRATEGY = Halving()
