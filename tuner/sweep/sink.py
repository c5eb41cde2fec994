"""A shape's measurements to and from the DB: the stored ones it resumes, the new ones stored together."""

from __future__ import annotations

import os
import time
import warnings
from types import TracebackType
from typing import Any, Callable

from tuner import settings
from tuner.bench import OK, Outcome, Timing
from tuner.bench.runner import is_sticky_cuda_error
from tuner.db import MeasurementRow, Problem, TuningDB
from tuner.errors import TunerError
from tuner.keys import Config, canonical_json
from tuner.search import Step
from tuner.sweep.flight import FAULT_EXIT, Flight, end_if_lost
from tuner.workload import DecodeShape
from tuner.workload.traffic import draws_per_distribution


def rounds(shape: DecodeShape) -> dict[str, int]:
    """A serving trial's rounds of draws (draws_per_distribution), as a method says them:
    only where there is more than one."""
    count = draws_per_distribution(shape.batch) if shape.lengths != "graph" else 1
    return {"rounds": count} if count > 1 else {}


def batches_of(shape: DecodeShape, lengths: str) -> dict[str, Any]:
    """What a measurement's method says of the batches it was timed on: their lengths and
    their rounds of draws; a stored timing resumes only a measurement on the same kind of batches."""
    return {} if lengths == "full" else {"lengths": lengths, **rounds(shape)}


def timed_on(method: dict[str, Any], shape: DecodeShape, lengths: str) -> bool:
    """Whether a stored measurement's method names the batches shape's trial of `lengths`
    holds (timings of one round, stored before trials drew more, are not resumed)."""
    want = batches_of(shape, lengths)
    return method.get("lengths", "full") == lengths and method.get("rounds", 1) == want.get("rounds", 1)


def stored_outcome(row: MeasurementRow) -> Outcome:
    timing = Timing(row.median_us, row.spread_us, row.samples) if row.status == OK else None
    return Outcome(row.config, row.status, timing, row.max_error, row.error)


class MeasurementSink:
    """A shape's measurements on their way to the DB. Stored together (a write costs
    milliseconds on a GPU host), at the latest settings.STORE_EVERY_S after the oldest one
    not yet stored, so a process killed outright loses at most that much of its work; at
    once where other ranks read them (at_once); and whatever is left by store() when the
    shape ends, fails or is interrupted (leaving a `with` block does that). `stored`: the
    measurements a sweep resumes, by canonical config."""

    def __init__(self, db: TuningDB, problem: Problem, env: Any, method: dict[str, Any], kv_len: int, *,
                 at_once: bool = False, clock: Callable[[], float] = time.monotonic,
                 stored: dict[str, MeasurementRow] | None = None, label: str = "",
                 flight: Flight | None = None) -> None:
        self.db, self.problem, self.env, self.method, self.kv_len = db, problem, env, method, kv_len
        self.at_once, self.clock, self.label, self.flight = at_once, clock, label, flight
        self.stored = stored or {}
        self.pending: list[dict[str, Any]] = []
        self._oldest: float | None = None

    @classmethod
    def resuming(cls, db: TuningDB, problem: Problem, env: Any, method: dict[str, Any], shape: DecodeShape,
                 lengths: str, *, force: bool, at_once: bool = False, flight: Flight | None = None,
                 run_id: str | None = None) -> MeasurementSink:
        """The sink of shape's trial of `lengths` (its method says so), holding the stored
        measurements of that kind of batch to resume (with force: only those of the supervised
        run run_id, made before its worker restarted)."""
        stored = {} if force and run_id is None else {
            canonical_json(m.config): m for m in db.measurements(problem, env.id)
            if timed_on(m.method, shape, lengths) and (not force or m.method.get("sweep_run") == run_id)}
        return cls(db, problem, env, dict(method, **batches_of(shape, lengths)), shape.kv_len, at_once=at_once,
                   stored=stored, label=shape.label(), flight=flight)

    def resume(self, config: Config) -> tuple[Outcome, int] | None:
        """config's stored outcome and rung, for the pipeline to reuse; None if none is stored."""
        row = self.stored.get(canonical_json(config))
        return (stored_outcome(row), row.rung) if row is not None else None

    def starting(self, step: Step) -> None:
        """Before step's config runs: the flight recorder's refusal, should it never return."""
        if self.flight is not None:
            self.flight.running(self.problem, self.env, dict(self.method, **step.timer.method), self.kv_len,
                                step.config, self.label)

    def precompiling(self) -> None:
        """Before the shape's configs are built ahead (Flight.precompiling)."""
        if self.flight is not None:
            self.flight.precompiling(self.problem, self.env, self.label)

    def running(self, config: Config) -> None:
        """Before config runs outside a measurement (a second trial): its refusal in the flight
        recorder, should it never return."""
        if self.flight is not None:
            self.flight.running(self.problem, self.env, self.method, self.kv_len, config, self.label)

    def landed(self, error: str | None = None) -> None:
        """That config returned, with its error if any (Flight.landed; with no flight, a lost
        CUDA context ends the sweep: end_if_lost)."""
        if self.flight is not None:
            self.flight.landed(error)
        else:
            end_if_lost(error)

    def add(self, step: Step, outcome: Outcome) -> None:
        if is_sticky_cuda_error(outcome.error):
            # the CUDA context is lost: every later config would fail alike. The supervisor
            # stores what is pending and this config's refusal, and starts a fresh worker;
            # with none, the sweep stops (what is pending is stored on the way out: __exit__)
            if self.flight is None:
                end_if_lost(outcome.error)
            self.flight.running(self.problem, self.env, dict(self.method, **step.timer.method), self.kv_len,
                                step.config, self.label, error=outcome.error)
            os._exit(FAULT_EXIT)
        t = outcome.timing
        self.pending.append(dict(
            config=step.config, kv_len=self.kv_len, status=outcome.status,
            # the timer's method as of this measurement (a failed capture says so); a quick
            # rung's also in method, where a tuner before the rung column reads it
            method=dict(self.method, **step.timer.method, **({"rung": step.rung} if step.rung != 1 else {})),
            rung=step.rung, median_us=t and t.median_us, spread_us=t and t.spread_us,
            samples=t.samples if t else 0, max_error=outcome.max_error, error=outcome.error,
        ))
        now = self.clock()
        if self._oldest is None:
            self._oldest = now
        if self.flight is not None:
            self.flight.measured(self.problem, self.env, self.pending[-1], self.label)
        if self.at_once or now - self._oldest >= settings.STORE_EVERY_S:
            self.store()

    def store(self) -> None:
        """Write what is pending, in one transaction. A write that fails leaves it pending, and
        in the flight recorder's journal, which a supervisor stores once the worker has ended."""
        if self.pending:
            self.db.save_measurements(self.problem, self.env, self.pending)
        self.pending, self._oldest = [], None
        if self.flight is not None:
            self.flight.stored()

    def __enter__(self) -> MeasurementSink:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """Store what is pending. Where the block failed or was interrupted, its error is the
        one raised (a DB that cannot take the write too: that is a warning)."""
        if kind is None:
            self.store()
            return
        try:
            self.store()
        except TunerError as e:
            warnings.warn(f"tuner: the measurements of {self.label} were not stored: {e}", stacklevel=2)
