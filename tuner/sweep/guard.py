"""A sweep that nothing kills: the sweep runs in a worker process, and its supervisor (which
touches no GPU) restarts it after a fault, a kill or a hang, first storing the refusal of the
config that was running and every measurement the worker had not stored yet. The restarted
worker resumes from the DB, so it never runs a refused config again for that shape."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Callable

from tuner import settings
from tuner.db import TuningDB
from tuner.errors import TunerError
from tuner.sweep.flight import PRECOMPILING, Flight, problem_of, read_flight

WORKER_ENV = "TUNER_SWEEP_FLIGHT"  # set in a worker: where its flight recorder writes
RUN_ENV = "TUNER_SWEEP_RUN"  # set in a worker: the supervised run it belongs to, alike across restarts
FINAL_EXITS = (0, 2, 130)  # done, bad input, interrupted: the worker's answer, not a death


def worker_flight() -> Flight | None:
    """In a supervised worker, its flight recorder; else None."""
    path = os.environ.get(WORKER_ENV)
    return Flight(path) if path else None


def worker_run() -> str | None:
    """In a supervised worker, the id of its run (a --force sweep resumes what that run did)."""
    return os.environ.get(RUN_ENV) or None


def supervise(command: list[str], db: TuningDB, *, timeout_s: float | None = None,
              say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> int:
    """Run `command` (a sweep) as a worker until it ends on its own: its exit code, or 1 once it
    has died settings.MAX_BLIND_RESTARTS times in a row with no config in flight."""
    timeout_s = timeout_s or settings.candidate_timeout_s()
    run_id = uuid.uuid4().hex[:16]
    blind = 0
    env = {}  # for the workers: once one died precompiling, the next build each config as it runs
    with tempfile.TemporaryDirectory(prefix="tuner-flight-") as tmp:
        path = Path(tmp) / "flight.jsonl"
        while True:
            path.unlink(missing_ok=True)
            code, tail, hung, interrupted = _run_worker(command, path, run_id, timeout_s, env)
            if code in FINAL_EXITS and not hung:
                # (a write that failed, the reason for a bad-input exit perhaps, left its measurements here)
                _store_flight(db, read_flight(path), None, say)
                return code
            reason = f"hung: no result after {timeout_s:g} s" if hung else _death(code, tail)
            if interrupted:  # the user's stop, not a fault: the config in flight is refused only if it hung
                _store_flight(db, read_flight(path), reason if hung else None, say)
                say(f"interrupted: the sweep's worker did not stop ({reason}); what it measured is stored, and "
                    "the same command resumes the rest")
                return 130
            journal = read_flight(path)
            refused = _store_flight(db, journal, reason, say)
            if journal and journal[-1][2] == PRECOMPILING and not env:
                env = {settings.ENV_NO_PRECOMPILE: "1"}
                say(f"tuner: the sweep's worker died building {journal[-1][0].get('label', '')}'s configs ahead "
                    f"({reason}); restarting it, each config built as it runs")
                continue
            if refused is None:
                blind += 1
                if blind >= settings.MAX_BLIND_RESTARTS:
                    say(f"error: the sweep's worker died {blind} times with no config in flight, last: {reason}")
                    return 1
                say(f"tuner: the sweep's worker died ({reason}); restarting it")
                continue
            blind = 0
            why = refused["error"].removeprefix("refused: ")  # (a lost context's own error, not "exit code 75")
            say(f"tuner: refused {refused['config']} for {refused['label']}: {why}; the sweep goes on")


def _run_worker(command: list[str], flight_path: Path, run_id: str, timeout_s: float,
                env: dict[str, str] | None = None) -> tuple[int, list[str], bool, bool]:
    """(exit code, the last lines of its stderr, whether it was killed as hung, whether Ctrl-C
    came). Its stderr is passed through; Ctrl-C reaches it once, forwarded (it runs in a
    process group of its own), and a worker that has not stopped settings.INTERRUPT_GRACE_S
    later (stuck in a kernel) is killed."""
    env = {**os.environ, **(env or {}), WORKER_ENV: str(flight_path), RUN_ENV: run_id}
    worker = subprocess.Popen(command, env=env,
                              stderr=subprocess.PIPE,
                              text=True, errors="replace", preexec_fn=_worker_process)
    tail: deque[str] = deque(maxlen=40)
    reader = threading.Thread(target=_pass_through, args=(worker.stderr, tail), daemon=True)
    reader.start()
    # Ctrl-C (or a deadline's SIGINT to this process): the worker reports the shapes it
    # finished and exits 130, which ends the supervision
    interrupted_at: list[float] = []

    def interrupt(*_: Any) -> None:
        interrupted_at.append(time.monotonic())
        worker.send_signal(signal.SIGINT)
    previous = signal.signal(signal.SIGINT, interrupt)
    hung = False
    try:
        while True:
            try:
                code = worker.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                pass
            if _running_for(flight_path) > timeout_s:
                worker.kill()
                hung = True
            elif interrupted_at and time.monotonic() - interrupted_at[0] > settings.INTERRUPT_GRACE_S:
                worker.kill()
    finally:
        signal.signal(signal.SIGINT, previous)
    reader.join(timeout=5.0)
    return code, list(tail), hung, bool(interrupted_at)


def _worker_process() -> None:
    """In the worker, before it runs: a process group of its own (a terminal's Ctrl-C reaches
    the supervisor, which forwards it once), and, on Linux, death with its supervisor (a
    killed supervisor must not leave a sweep running)."""
    os.setsid()
    # a supervisor started with SIGINT ignored (a background job) would pass that on, and the
    # Ctrl-C it forwards would never stop the worker
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _pass_through(stream: Any, tail: deque[str]) -> None:
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        tail.append(line.rstrip("\n"))


def _death(code: int, tail: list[str]) -> str:
    """What killed the worker, in one line: its last error line, else its signal or exit code."""
    for line in reversed(tail):
        if "error" in line.lower():
            return " ".join(line.split())[:300]
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _running_for(flight_path: Path) -> float:
    """Seconds since the worker's journal last changed while a config is in flight (0 when
    none is): a config runs with no event until it returns."""
    journal = read_flight(flight_path)
    if not journal or journal[-1][2] is None:
        return 0.0
    try:
        return time.time() - flight_path.stat().st_mtime
    except OSError:
        return 0.0


def _store_flight(db: TuningDB, journal: list, reason: str | None,
                  say: Callable[[str], None]) -> dict[str, Any] | None:
    """Store what an ended worker left: its unstored measurements and, given a reason (what it
    died of), the refusal of the config that was running. The refusal, with its shape's label.
    A DB that cannot take them is said in one line: they are lost."""
    refused = None
    for context, rows, running in journal:
        refusal = None
        if running and running != PRECOMPILING and reason is not None:
            refusal = dict(running, error=running.get("error") or f"refused: {reason}",
                           label=context.get("label", ""))
            rows = rows + [dict(running, error=refusal["error"])]
        if not rows:
            continue
        try:
            db.save_measurements(problem_of(context), tuple(context["environment"]), rows)
        except TunerError as e:
            say(f"error: the worker's last {len(rows)} measurement(s) of {context.get('label', '')} could not be "
                f"stored, by it nor here, and are lost: {e}")
            continue  # a refusal not stored is no progress: the next worker would run that config again
        refused = refusal or refused
    return refused
