"""Misses: the keys the runtime served without an exact winner (from a neighbour's or the
default), counted in memory off the hot path and written to the DB's misses table, for
`tuner show --misses` and `tuner sweep --from-misses`."""

from __future__ import annotations

from tuner.db import Problem
from tuner.keys import AttentionRunKey


class MissLog:
    def __init__(self) -> None:
        # (op, static json, run key) -> [how it was served, times]
        self._pending: dict[tuple[str, str, AttentionRunKey], list] = {}

    def record(self, name: str, static_json: str, run: AttentionRunKey, served: str) -> None:
        entry = self._pending.setdefault((name, static_json, run), [served, 0])
        entry[0], entry[1] = served, entry[1] + 1

    def take(self) -> list[tuple[Problem, str, int]]:
        """The misses recorded since the last take, as (problem, served, count) rows."""
        pending, self._pending = self._pending, {}
        return [(Problem(name, static_json, run), served, count)
                for (name, static_json, run), (served, count) in pending.items()]
