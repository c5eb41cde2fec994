"""A sweep worker's flight recorder: before each config runs, the measurements not yet stored
and the refusal to store should that config never return, in a file its supervisor reads
once the process has died (a CUDA fault takes the whole process, and its context, with it)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tuner.bench import ERROR
from tuner.db import Problem
from tuner.keys import Config, attention_run_key

# the rung of a refusal: above any strategy's, so a resumed sweep takes it at every rung and
# never runs the config again for that shape
REFUSED_RUNG = 1 << 20
# errors after which a CUDA context is unusable: the worker stops as if the fault had killed it
STICKY_CUDA_ERRORS = ("illegal memory access", "unspecified launch failure", "misaligned address",
                      "illegal instruction", "device-side assert")
FAULT_EXIT = 75


def is_sticky_cuda_error(error: str | None) -> bool:
    return bool(error) and any(s in error for s in STICKY_CUDA_ERRORS)


class Flight:
    """Writes the worker's state to `path`, replacing it whole each time (a reader never sees
    half of one). `running(...)` before a config runs, `landed(...)` once it has returned."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def running(self, problem: Problem, env: tuple[str, dict[str, Any]], method: dict[str, Any], kv_len: int,
                pending: list[dict[str, Any]], config: Config, label: str, error: str | None = None) -> None:
        refusal = dict(config=config, kv_len=kv_len, status=ERROR, method=dict(method, refused=True),
                       rung=REFUSED_RUNG, median_us=None, spread_us=None, samples=0, max_error=None, error=error)
        self._write(dict(problem=_problem(problem), environment=list(env), pending=pending, running=refusal,
                         label=label, started=time.time()))

    def landed(self, problem: Problem, env: tuple[str, dict[str, Any]], pending: list[dict[str, Any]]) -> None:
        self._write(dict(problem=_problem(problem), environment=list(env), pending=pending, running=None))

    def _write(self, state: dict[str, Any]) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(state, default=str))
        os.replace(temporary, self.path)


def _problem(problem: Problem) -> list[Any]:
    run = problem.run_key
    return [problem.op, problem.static_key, run.batch, run.max_q_len, run.kv_len_bucket]


def read_flight(path: str | os.PathLike) -> dict[str, Any] | None:
    """What a dead worker's recorder holds, or None (no file, or none it finished writing)."""
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def problem_of(state: dict[str, Any]) -> Problem:
    op, static_key, batch, q_len, kv_bucket = state["problem"]
    return Problem(op, static_key, attention_run_key(batch, q_len, kv_bucket))
