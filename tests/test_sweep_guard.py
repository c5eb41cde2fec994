"""A sweep that nothing kills: a config whose kernel kills its process, hangs, or loses the
CUDA context is refused with its error, the sweep goes on in a fresh worker, and nothing
measured is lost."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.db import TuningDB

FAULTY = Path(__file__).parent / "support" / "faulty_sweep.py"
SHAPE = dict(batch=1, kv_len=200, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32")


def _sweep(tmp_path, *extra, shapes_list=None, **faults):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(shapes_list or [SHAPE, dict(SHAPE, batch=2)]))
    env = dict(os.environ, FAULTY_LOG=str(tmp_path / "runs.log"), TUNER_CANDIDATE_TIMEOUT_S="4",
               **{f"FAULTY_{k.upper()}": str(v) for k, v in faults.items()})
    env.pop("TUNER_SWEEP_FLIGHT", None)
    return subprocess.run([sys.executable, str(FAULTY), "sweep", "faulty", "--shapes", str(shapes), "--db",
                           str(tmp_path / "t.db"), "--repeats", "2", "--search", "exhaustive", *extra],
                          capture_output=True, text=True, env=env, timeout=300)


def _measured(tmp_path) -> list[tuple[str, int]]:
    """(worker pid, chunk) of each measurement a worker started."""
    return [(pid, int(chunk)) for pid, chunk in
            (line.split() for line in (tmp_path / "runs.log").read_text().splitlines())]


def _measurements(tmp_path):
    db = TuningDB(tmp_path / "t.db")
    try:
        return {r.problem.run_key.batch: sorted(db.measurements(r.problem, r.fingerprint_id), key=lambda m: m.config["chunk"])
                for r in db.records()}, db.records()
    finally:
        db.close()


def _assert_refused_on_each_shape(tmp_path, done, says: str) -> None:
    """The sweep of the two shapes ended well, chunk 64 refused on each with `says` in its
    error, the winners and the other chunks' measurements as without it."""
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("refused {'chunk': 64}") == 2, done.stderr  # once per shape
    measurements, records = _measurements(tmp_path)
    assert len(records) == 2 and all(r.config != {"chunk": 64} for r in records)
    for batch in (1, 2):
        by_chunk = {m.config["chunk"]: m for m in measurements[batch]}
        assert set(by_chunk) == {0, 64, 128}
        assert by_chunk[64].status == "error" and says in by_chunk[64].error
        assert by_chunk[0].status == by_chunk[128].status == "ok"


@pytest.mark.parametrize("fault, says", [("kills", "illegal memory access"), ("hangs", "hung: no result after 4 s"),
                                         ("sticky", "unspecified launch failure")])
def test_a_config_that_kills_hangs_or_breaks_its_worker_is_refused_and_the_sweep_goes_on(tmp_path, fault, says):
    _assert_refused_on_each_shape(tmp_path, _sweep(tmp_path, **{fault: 64}), says)
    # one worker per death, each starting where the last one died: every measurement the
    # dead worker had made is stored, none is made again (an exhaustive search measures each
    # config once per shape), and the refused config never runs again for its shape
    measured = _measured(tmp_path)
    assert len({pid for pid, _ in measured}) == 3
    assert sorted(chunk for _, chunk in measured) == [0, 0, 64, 64, 128, 128]


def test_a_sweep_without_faults_runs_in_one_worker_and_as_before(tmp_path):
    done = _sweep(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "refused" not in done.stderr
    assert len({pid for pid, _ in _measured(tmp_path)}) == 1
    measurements, records = _measurements(tmp_path)
    assert len(records) == 2 and all(m.status == "ok" for ms in measurements.values() for m in ms)


def test_no_isolate_runs_in_this_process_and_a_fault_ends_the_sweep(tmp_path):
    done = _sweep(tmp_path, "--no-isolate", kills=64)
    assert done.returncode == -9 and "illegal memory access" in done.stderr


def test_bad_input_is_answered_by_the_command_itself_with_no_worker(tmp_path):
    done = subprocess.run([sys.executable, str(FAULTY), "sweep", "faulty", "--shapes", str(tmp_path / "none.json"),
                           "--db", str(tmp_path / "t.db")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("error:") == 1 and "refused" not in done.stderr


def test_a_forced_sweep_restarted_after_a_fault_resumes_its_own_run_and_measures_again_the_rest(tmp_path):
    """--force re-measures what the DB holds: a restarted worker that took --force as given
    would measure everything again, hit the faulting config again and never end; one that
    dropped it would resume what the DB held before the run."""
    assert _sweep(tmp_path).returncode == 0  # winners and measurements from before
    (tmp_path / "runs.log").unlink()
    done = _sweep(tmp_path, "--force", kills=64)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("refused {'chunk': 64}") == 2
    measured = _measured(tmp_path)
    assert len({pid for pid, _ in measured}) == 3
    assert sorted(chunk for _, chunk in measured) == [0, 0, 64, 64, 128, 128]  # all again, each once


@pytest.mark.parametrize("fault, says", [("kills_later", "illegal memory access"),
                                         ("sticky_later", "unspecified launch failure")])
def test_a_winner_that_faults_on_its_second_trial_is_refused_and_the_default_stored(tmp_path, fault, says):
    """A serving shape's winner is run again on fresh lengths (its second trial): where it
    kills its worker there, or loses the CUDA context, it is refused for the shape, and the
    sweep goes on with what the first trial measured. A second trial answers a failure with
    its error rather than raising it: a lost context was not refused, and the sweep went on in
    it, where the next config to run (another shape's default, say) was refused in its place
    (a helper's review)."""
    serving = dict(SHAPE, batch=3, lengths="serving")
    done = _sweep(tmp_path, shapes_list=[serving], fast=64, kv_len=SHAPE["kv_len"], **{fault: 64})
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("refused {'chunk': 64}") == 1, done.stderr
    measurements, [record] = _measurements(tmp_path)
    assert record.config == record.default_config != {"chunk": 64}
    by_chunk = {m.config["chunk"]: m for m in measurements[3]}
    assert by_chunk[64].status == "error" and says in by_chunk[64].error
    assert len({pid for pid, _ in _measured(tmp_path)}) == 1  # the fresh worker resumed every measurement


@pytest.mark.parametrize("fault, says", [("kills_confirming", "illegal memory access"),
                                         ("sticky_confirming", "illegal memory access")])
def test_a_challenger_that_faults_when_re_timed_against_the_default_is_refused(tmp_path, fault, says):
    """The first pass's fastest config is re-timed side by side with the default
    (tuner.bench.decide) with nothing in the journal: a fault there left the supervisor no
    config to blame, and the restarted worker died the same way until it gave up; a lost
    context was kept as "the re-timing failed" and the sweep went on in it. Now the
    challenger is refused for its shape, and the default or the next config wins."""
    _assert_refused_on_each_shape(tmp_path, _sweep(tmp_path, fast=64, **{fault: 64}), says)
    # a fresh worker after each shape's fault; the one after the second measures nothing
    # (it resumes every measurement), and none is made twice
    measured = _measured(tmp_path)
    assert len({pid for pid, _ in measured}) == 2
    assert sorted(chunk for _, chunk in measured) == [0, 0, 64, 64, 128, 128]


@pytest.mark.parametrize("fault, says", [("kills_later", "illegal memory access"),
                                         ("sticky_later", "unspecified launch failure")])
def test_a_default_that_faults_on_the_second_trial_is_refused_not_the_winner(tmp_path, fault, says):
    """The second trial ran the default on its lengths for the first time under the winner's
    name: a fault of the default there refused the winner, and the faulty default was stored
    as the record (a helper's review). The default now runs there first, alone, under its own."""
    serving = dict(SHAPE, batch=3, lengths="serving")
    done = _sweep(tmp_path, shapes_list=[serving], fast=64, kv_len=SHAPE["kv_len"], **{fault: 0})
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("refused {'chunk': 0}") == 1 and "refused {'chunk': 64}" not in done.stderr, done.stderr
    measurements, [record] = _measurements(tmp_path)
    assert record.config == {"chunk": 64} and record.default_config == {"chunk": 0}
    by_chunk = {m.config["chunk"]: m for m in measurements[3]}
    assert by_chunk[0].status == "error" and says in by_chunk[0].error


def test_a_lost_context_with_no_supervisor_stops_the_sweep_in_one_line(tmp_path):
    """--no-isolate (and torchrun ranks): a lost CUDA context let the sweep go on, and every
    later config was stored with its error, never measured again by a resumed sweep."""
    done = _sweep(tmp_path, "--no-isolate", sticky_later=0, kv_len=SHAPE["kv_len"],
                  shapes_list=[dict(SHAPE, batch=3, lengths="serving"), dict(SHAPE, batch=2)])
    assert done.returncode == 2, done.stderr
    assert "the CUDA context is lost" in done.stderr and "Traceback" not in done.stderr
    import sqlite3

    with sqlite3.connect(tmp_path / "t.db") as conn:  # no config's error of the lost context is stored as its own
        assert conn.execute("SELECT COUNT(*) FROM measurements WHERE status != 'ok'").fetchone() == (0,)
        assert conn.execute("SELECT COUNT(*) FROM records WHERE batch = 2").fetchone() == (0,)


def test_a_trial_whose_reference_loses_the_context_ends_the_worker(tmp_path):
    """A lost context while a trial is built (its reference) was taken for "the reference
    failed": the shape failed and the sweep went on in the dead context. Now the worker ends;
    with no config to blame, its restarts are blind, and the sweep gives up after two."""
    done = _sweep(tmp_path, trial_sticky=1)
    assert done.returncode == 1, done.stderr
    assert "died 2 times with no config in flight" in done.stderr


def test_a_refusal_the_db_cannot_take_counts_as_no_progress(tmp_path):
    """The supervisor counted a refusal it could not store as progress and restarted the
    worker into the same fault, forever (a helper's review): it is a blind restart now."""
    from tuner.sweep.guard import supervise

    class Locked(TuningDB):
        def save_measurements(self, *args, **kwargs):
            raise TunerError("database is locked")

    from tuner.errors import TunerError

    db, said = Locked(tmp_path / "t.db"), []
    try:
        code = supervise([sys.executable, "-c", _WORKER + "os.kill(os.getpid(), signal.SIGKILL)"], db,
                         say=said.append, timeout_s=50.0)
    finally:
        db.close()
    assert code == 1 and "died 2 times with no config in flight" in said[-1], said
    assert not any(line.startswith("tuner: refused") for line in said), said


@pytest.mark.parametrize("fault", ["precompile_kills", "precompile_hangs"])
def test_a_worker_that_dies_building_configs_ahead_is_restarted_building_each_as_it_runs(tmp_path, fault):
    """Triton's configs are built ahead of a shape's measurements, with nothing journaled: a
    compiler crash there was a blind death (the restarted worker died the same way, and the
    sweep gave up), and a hang there was never timed out (a helper's review)."""
    done = _sweep(tmp_path, **{fault: 64})
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("died building") == 1 and "refused" not in done.stderr, done.stderr
    measurements, records = _measurements(tmp_path)
    assert len(records) == 2 and all(m.status == "ok" for ms in measurements.values() for m in ms)


_WORKER = """
import os, signal, sys, time
from tuner.db import Problem, current_fingerprint, fingerprint_id
from tuner.keys import attention_run_key
from tuner.sweep.flight import Flight
flight, data = Flight(os.environ["TUNER_SWEEP_FLIGHT"]), current_fingerprint()
problem, env = Problem("faulty", '{"heads":4}', attention_run_key(1, 1, 256)), (fingerprint_id(data), data)
row = dict(config={"chunk": 0}, kv_len=256, status="ok", method={}, rung=1, median_us=10.0, spread_us=0.1,
           samples=5, max_error=0.0, error=None)
flight.measured(problem, env, row, "b1")
flight.running(problem, env, {}, 256, {"chunk": 64}, "b1")
if os.environ.get("READY_FILE"):
    open(os.environ["READY_FILE"], "w").close()
"""


def _supervised(tmp_path, worker_end: str, **kwargs) -> tuple[int, list, list[str]]:
    """supervise() over a worker that journals one measurement of chunk 0 and chunk 64 in
    flight, then does worker_end: its exit code, the measurements in the DB, what it said."""
    from tuner.db import Problem, current_fingerprint_id
    from tuner.keys import attention_run_key
    from tuner.sweep.guard import supervise

    db, said = TuningDB(tmp_path / "t.db"), []
    try:
        code = supervise([sys.executable, "-c", _WORKER + worker_end], db, say=said.append, **kwargs)
        problem = Problem("faulty", '{"heads":4}', attention_run_key(1, 1, 256))
        return code, [(m.config["chunk"], m.status) for m in db.measurements(problem, current_fingerprint_id())], said
    finally:
        db.close()


def test_measurements_a_worker_could_not_store_are_stored_when_it_exits_on_its_own(tmp_path):
    """A worker whose DB write failed exits 2 (a DB error is an answer, not a death), its
    measurements left in its journal: the supervisor stores them, and refuses nothing."""
    code, stored, said = _supervised(tmp_path, "sys.exit(2)")
    assert code == 2 and stored == [(0, "ok")] and said == []


def test_ctrl_c_stops_a_sweep_whose_worker_is_stuck_in_a_kernel(tmp_path, monkeypatch):
    """Ctrl-C is forwarded to the worker; one stuck in a kernel cannot act on it, and was
    killed as hung only at the candidate timeout, then restarted as after a fault, the sweep
    running on. Now it is killed settings.INTERRUPT_GRACE_S after Ctrl-C and the sweep ends
    (130) with what it measured stored, the config it was running not refused (it did not fault)."""
    import signal
    import threading
    import time

    from tuner import settings

    monkeypatch.setattr(settings, "INTERRUPT_GRACE_S", 1.0)
    ready = tmp_path / "ready"
    monkeypatch.setenv("READY_FILE", str(ready))
    stuck = "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"

    def ctrl_c_once_stuck():
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=ctrl_c_once_stuck, daemon=True).start()
    began = time.monotonic()
    code, stored, said = _supervised(tmp_path, stuck, timeout_s=50.0)
    assert code == 130 and time.monotonic() - began < 20
    assert stored == [(0, "ok")]
    assert len(said) == 1 and said[0].startswith("interrupted:") and "resumes the rest" in said[0]


def test_a_worker_that_dies_with_no_config_in_flight_is_given_up_after_two_restarts(tmp_path):
    done = _sweep(tmp_path, dies_at_start=1)
    assert done.returncode == 1
    assert done.stderr.count("restarting it") == 1
    assert "died 2 times with no config in flight" in done.stderr
