"""A sweep worker's flight recorder: the measurements not yet stored, and before each config
runs, the refusal to store should it never return, in a journal its supervisor reads once the
process has died (a CUDA fault takes the whole process, and its context, with it).

The journal is a file of JSON lines, one write() each, appended: a process that dies leaves
every line it wrote whole (but perhaps a last one it was writing), and an event costs tens of
microseconds, not the milliseconds of rewriting a file per config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tuner.bench import ERROR
from tuner.bench.runner import is_sticky_cuda_error

from tuner.db import Problem
from tuner.errors import TunerError
from tuner.keys import Config, attention_run_key

# the rung of a refusal: above any strategy's, so a resumed sweep takes it at every rung and
# never runs the config again for that shape
REFUSED_RUNG = 1 << 20
FAULT_EXIT = 75
PRECOMPILING = {"precompiling": True}  # what is in flight while a shape's configs are built ahead


class LostContext(TunerError):
    """The CUDA context is lost (a sticky error) in a sweep no supervisor restarts (torchrun
    ranks, --no-isolate): it stops, rather than go on to store every later config's error as
    that config's (resumed sweeps would never measure them again)."""


def end_if_lost(error: str | None) -> None:
    """LostContext where error says the CUDA context is lost; else nothing."""
    if is_sticky_cuda_error(error):
        raise LostContext(f"the CUDA context is lost ({error}); the sweep stops, what it measured is stored, and "
                          "the same command resumes the rest")


class Flight:
    """Appends the worker's events to the journal at `path`: which problem (context), a config
    about to run (running), a measurement made but not stored (measured), a config that
    returned outside a measurement (landed), and everything stored (which empties it)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._context: tuple[Any, ...] | None = None
        self._running: dict[str, Any] | None = None

    def running(self, problem: Problem, env: tuple[str, dict[str, Any]], method: dict[str, Any], kv_len: int,
                config: Config, label: str, error: str | None = None) -> None:
        self._in(problem, env, label)
        self._running = dict(config=config, kv_len=kv_len, status=ERROR, method=dict(method, refused=True),
                             rung=REFUSED_RUNG, median_us=None, spread_us=None, samples=0, max_error=None,
                             error=error)
        self._append(running=self._running)

    def measured(self, problem: Problem, env: tuple[str, dict[str, Any]], row: dict[str, Any], label: str) -> None:
        self._in(problem, env, label)
        self._running = None
        self._append(measured=row)

    def precompiling(self, problem: Problem, env: tuple[str, dict[str, Any]], label: str) -> None:
        """The shape's configs are about to be built ahead: in flight with no config (a crash
        or hang there refuses none; the supervisor restarts the worker building each config
        as it runs, tuner.sweep.guard)."""
        self._in(problem, env, label)
        self._running = dict(PRECOMPILING)
        self._append(running=self._running)

    def landed(self, error: str | None = None) -> None:
        """The config in flight returned. Where its error says the CUDA context is lost (a
        second trial answers with the error rather than raising it), every later config would
        fail alike: the config in flight, if any, is refused with it, and the worker exits for
        its supervisor to start a fresh one, as a measurement's sink does (tuner.sweep.sink)."""
        if is_sticky_cuda_error(error):
            if self._running is not None:
                self._append(running=dict(self._running, error=error))
            os._exit(FAULT_EXIT)
        self._running = None
        self._append(landed=True)

    def stored(self) -> None:
        """What was measured is in the DB: the journal starts over."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
        self._context = self._running = None

    def _in(self, problem: Problem, env: tuple[str, dict[str, Any]], label: str) -> None:
        context = (problem, env[0], label)
        if context != self._context:
            self._append(context=dict(problem=_problem(problem), environment=list(env), label=label))
            self._context = context

    def _append(self, **event: Any) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.write(self._fd, (json.dumps(event, default=str) + "\n").encode())


def _problem(problem: Problem) -> list[Any]:
    run = problem.run_key
    return [problem.op, problem.static_key, run.batch, run.max_q_len, run.kv_len_bucket]


def problem_of(context: dict[str, Any]) -> Problem:
    op, static_key, batch, q_len, kv_bucket = context["problem"]
    return Problem(op, static_key, attention_run_key(batch, q_len, kv_bucket))


def read_flight(path: str | os.PathLike) -> list[tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]]:
    """What a dead worker's journal holds: for each problem in it, (its context, the
    measurements not stored, the refusal of the config that was running or None)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    out: list[tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]] = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:  # the line it was writing when it died
            continue
        if "context" in event:
            out.append((event["context"], [], None))
        elif out:
            context, rows, _ = out[-1]
            if "measured" in event:
                rows.append(event["measured"])
            out[-1] = (context, rows, event.get("running"))
    return out
