"""What the tuning DB takes and hands out: problems, winners, measurements, misses, the
runtime's snapshot, and what a save did."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from tuner.keys import AttentionRunKey

STATUSES = ("ok", "wrong", "error", "oom")  # a measurement's outcome
SERVED = ("nearest", "default")  # how the runtime served a missed key


class MissLengths(NamedTuple):
    """The kv lengths of a missed key's calls that had them on the host: how many calls,
    and over those calls the mean of their mean length, longest and spread (std)."""

    calls: int
    mean: float
    longest: float
    spread: float


class MissRow(NamedTuple):
    """A key the runtime served without an exact winner: how (nearest or default), how many
    times, and its calls' lengths where known (None: no call had them on the host)."""

    problem: "Problem"
    served: str
    count: int
    lengths: MissLengths | None = None


@dataclass(frozen=True)
class Problem:
    """Which problem a row is about: op, canonical static key JSON, run key."""

    op: str
    static_key: str
    run_key: AttentionRunKey

    def columns(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "static_key": self.static_key,
            "batch": self.run_key.batch,
            "max_q_len": self.run_key.max_q_len,
            "kv_len_bucket": self.run_key.kv_len_bucket,
        }


@dataclass(frozen=True)
class Record:
    """A stored winner, with JSON fields parsed."""

    problem: Problem
    fingerprint_id: str
    config: dict[str, Any]
    median_us: float
    spread_us: float
    samples: int
    default_config: dict[str, Any]
    default_median_us: float | None
    default_spread_us: float | None
    method: dict[str, Any]
    created_at: datetime

    @property
    def speedup(self) -> float | None:
        """Default time over winner time (1.0 when the default won)."""
        if not self.default_median_us or not self.median_us:
            return None
        return self.default_median_us / self.median_us


@dataclass(frozen=True)
class MeasurementRow:
    """One candidate config measured (or failed) on one problem, with JSON fields parsed."""

    config: dict[str, Any]
    status: str
    median_us: float | None
    spread_us: float | None
    samples: int
    max_error: float | None
    error: str | None
    method: dict[str, Any] = field(default_factory=dict)
    kv_len: int | None = None  # the kv length actually measured
    rung: int = 1  # the search's rung it was measured at (tuner.search)


class Timed(NamedTuple):
    """A winner as the runtime reads it: its config, and its and the default's times at its
    own key (the default's None when the default did not run right)."""

    config: dict[str, Any]
    median_us: float
    default_median_us: float | None


@dataclass
class Snapshot:
    """Every winner that applies in one environment, for the runtime: (op, static key JSON)
    -> {run key: Timed}, and the malformed rows left out."""

    table: dict[tuple[str, str], dict[AttentionRunKey, Timed]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # one line per malformed row left out


@dataclass(frozen=True)
class SaveResult:
    """What save_records did with each record: written where none was, replaced an older
    one, kept the stored one (it was newer), or found it identical."""

    written: int = 0
    replaced: int = 0
    kept: int = 0
    same: int = 0

    @property
    def total(self) -> int:
        return self.written + self.replaced + self.kept + self.same
