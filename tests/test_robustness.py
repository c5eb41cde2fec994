"""Many writers and killed runs on one tuning DB: nothing lost, nothing duplicated,
integrity intact, and a killed sweep resumes where it stopped.

With TUNER_ROBUSTNESS_REPORT=path, each test adds what it tried to that JSON file
(benchmarks/results/cpu/robustness.json is one such run)."""

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path


from support.robustness_report import report
from tuner.bench import WallClockTimer
from tuner.db import Problem, TuningDB, current_fingerprint_id
from tuner.ops import get_op
from tuner.workload import DecodeShape
from tuner.sweep import SKIPPED, MEASURED, candidate_configs, sweep

SMALL = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32")
OP = get_op("torch_split_decode")
# forkserver: children fork from a clean server, never from this process, whose torch
# thread pools would deadlock a forked child (seen: a child stuck in a futex)
FORK = multiprocessing.get_context("forkserver")
FORK.set_forkserver_preload(["torch", "tuner.sweep", "tuner.ops", "support.db_children"])


def _timer():
    return WallClockTimer(warmup=0, repeats=1, min_repeats=1)


def _sweep_in_child(db_path, shapes, barrier=None):
    if barrier is not None:
        barrier.wait()
    db = TuningDB(db_path)
    results = sweep(OP, shapes, db, timer=_timer(), strategy="exhaustive")
    os._exit(0 if all(r.status in (MEASURED, SKIPPED) for r in results) else 3)


def _problem(shape):
    return Problem(OP.name, shape.static_key().to_json(), shape.run_key())


def test_eight_processes_sweeping_one_db_lose_and_duplicate_nothing(make_db):
    db_path = make_db("shared")  # a SQLite file, and a PostgreSQL database where one is given
    shared = DecodeShape(batch=9, kv_len=300, **SMALL)  # every process sweeps this one too
    shapes = [[DecodeShape(batch=1 + p, kv_len=2 ** (8 + s), **SMALL) for s in range(2)] + [shared] for p in range(8)]
    barrier = FORK.Barrier(8)
    procs = [FORK.Process(target=_sweep_in_child, args=(db_path, s, barrier)) for s in shapes]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * 8
    db = TuningDB(db_path)
    expected = {_problem(s) for per_process in shapes for s in per_process}
    records = db.records()
    assert len(records) == len(expected) == 17 and {r.problem for r in records} == expected
    fp = current_fingerprint_id()
    for problem, shape in {_problem(s): s for per_process in shapes for s in per_process}.items():
        configs = [json.dumps(m.config, sort_keys=True) for m in db.measurements(problem, fp)]
        assert sorted(configs) == sorted(json.dumps(c, sort_keys=True) for c in candidate_configs(OP, shape))
    assert db.integrity() == []
    report(f"concurrent_writers_{make_db.backend}", processes=8, shapes=17, records=len(records),
           measurements=db.counts()[fp]["measurements"], lost=0, duplicated=0, integrity="ok")


KILL_TRIALS = 24


def _stored_measurements(db_path: Path) -> int:
    """Read with the sqlite3 module, apart from tuner: a second reader, as a user would."""
    import sqlite3

    if not db_path.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=1) as conn:
            return conn.execute("SELECT count(*) FROM measurements").fetchone()[0]
    except sqlite3.Error:  # not created yet
        return 0


def test_sigkill_at_random_points_leaves_a_sound_db_that_resumes(tmp_path):
    shapes = [DecodeShape(batch=b, kv_len=kv, **SMALL) for b, kv in ((1, 512), (2, 1024), (3, 768))]
    total = {_problem(s): len(candidate_configs(OP, s)) for s in shapes}
    rng = random.Random(1234)
    fp = current_fingerprint_id()
    stats = {"killed_before_any_record": 0, "killed_mid_sweep": 0, "finished_before_kill": 0,
             "measurements_resumed": 0, "measurements_remeasured": 0}
    for trial in range(KILL_TRIALS):
        db_path = tmp_path / f"trial{trial}.db"
        # kill once the child has stored a random number of measurements, at a random
        # moment up to 5 ms after that (inside the next measurement, write or winner; with
        # 50 ms most children finished first, and under load too few kills landed mid-sweep)
        target = rng.randrange(0, sum(total.values()) + 1)
        child = FORK.Process(target=_sweep_in_child, args=(db_path, shapes))
        child.start()
        while child.is_alive() and _stored_measurements(db_path) < target:
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.005))
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:  # it finished, and is_alive() reaped it
            pass
        child.join()
        if not db_path.exists():
            stats["killed_before_any_record"] += 1
            continue
        db = TuningDB(db_path)
        assert db.integrity() == [], f"trial {trial}"
        done = {p: len(db.measurements(p, fp)) for p in total}
        had_winner = {p for p in total if db.record(p, fp) is not None}
        if child.exitcode == 0:
            stats["finished_before_kill"] += 1
        elif sum(done.values()):
            stats["killed_mid_sweep"] += 1
        results = sweep(OP, shapes, db, timer=_timer(), strategy="exhaustive")
        for shape, result in zip(shapes, results):
            p = _problem(shape)
            if p in had_winner:
                assert result.status == SKIPPED
                continue
            assert result.status == MEASURED, f"trial {trial}: {result}"
            assert result.resumed == done[p] and result.measured == total[p] - done[p], f"trial {trial}: {result}"
            stats["measurements_resumed"] += result.resumed
            stats["measurements_remeasured"] += result.measured
        assert {p: len(db.measurements(p, fp)) for p in total} == total  # each config stored once
        assert all(db.record(p, fp) is not None for p in total) and db.integrity() == []
        db.close()
    assert stats["killed_mid_sweep"] >= KILL_TRIALS // 4, stats  # the kills did land inside sweeps
    report("sigkill_resume", trials=KILL_TRIALS, integrity_failures=0,
           lost_measurements=0, duplicated_measurements=0, **stats)


def test_a_sweep_killed_mid_shape_keeps_what_it_measured_up_to_store_every_s_before(tmp_path):
    """A shape's measurements were stored only when it ended: a SIGKILL (or a CUDA fault that
    takes the process) lost the whole shape in progress. They are now stored at least every
    settings.STORE_EVERY_S; here the child stores each at once and is killed once some are."""
    import sqlite3

    from support.db_children import sweep_one_shape

    db_path = tmp_path / "killed.db"
    child = FORK.Process(target=sweep_one_shape, args=(db_path, 0.0))
    child.start()
    stored, deadline = 0, time.monotonic() + 120
    while child.is_alive() and time.monotonic() < deadline:
        stored = _stored_measurements(db_path)
        if stored:
            break
        time.sleep(0.005)
    try:
        os.kill(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.join()
    with sqlite3.connect(db_path) as conn:
        records = conn.execute("SELECT count(*) FROM records").fetchone()[0]
    total = len(candidate_configs(OP, _shape_of_child()))
    assert 0 < stored < total and records == 0, f"{stored} of {total} measurements stored first ({records} records)"
    db = TuningDB(db_path)
    assert db.integrity() == [] and len(db.measurements(_problem(_shape_of_child()), current_fingerprint_id())) >= stored


def _shape_of_child():
    return DecodeShape(batch=3, kv_len=700, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32")
