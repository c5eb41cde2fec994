"""The tuning DB as a fleet uses it: readers racing writers see one committed state, an
interrupted creation is finished rather than refused, --force never moves what is not
tuner's own damaged file, and read-only media are read."""

import os
import sqlite3
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from support.db_children import create_db
from tuner.db import DBError, MissRow, Problem, TuningDB, current_fingerprint, fingerprint_id
from tuner.keys import attention_run_key

FP_DATA = current_fingerprint()


def problem(batch=4, kv=1000):
    return Problem("op", '{"h":8}', attention_run_key(batch, 1, kv))


def environment(i: int) -> tuple[str, dict]:
    """A new environment per i: the same GPU and libraries, another driver (so it applies here)."""
    data = dict(FP_DATA, driver=f"race-{i}")
    return fingerprint_id(data), data


def save(db, p, fp, config=None):
    db.save_record(p, fp, config or {"c": 1}, median_us=10.0, spread_us=0.5, samples=9, default_config={"c": 0},
                   default_median_us=12.0, default_spread_us=0.4, method={"timer": "test"})


def test_readers_racing_a_writer_that_adds_environments_see_one_committed_state(make_db):
    """Each read of fingerprints, records and misses is one snapshot: a reader never sees a
    record whose environment it read before that environment was committed. Before, every
    statement saw its own state, and most checks while a writer added environments reported
    malformed rows that were not there (records() raised, snapshot() skipped fresh records)."""
    target = make_db()
    TuningDB(target).close()
    stop = threading.Event()
    written: list[int] = []
    failures: list[str] = []

    def writer() -> None:
        db = TuningDB(target)
        i = 0
        while not stop.is_set():
            fp = environment(i)
            save(db, problem(batch=1 + i % 64, kv=1000 + i), fp)
            db.save_misses(fp, [MissRow(problem(batch=1 + i % 64, kv=5000), "default", 1)])
            written.append(i)
            i += 1
        db.close()

    def reader() -> None:
        db = TuningDB(target, create=False)
        while not stop.is_set():
            try:
                problems = db.integrity()
                if problems:
                    failures.append(f"integrity: {problems[0]}")
                db.records()
                snap = db.snapshot(FP_DATA)
                if snap.skipped:
                    failures.append(f"snapshot skipped: {snap.skipped[0]}")
                for fp in list(db.fingerprints())[-2:]:
                    db.misses(fp)
            except DBError as e:
                failures.append(f"{type(e).__name__}: {e}")
        db.close()

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline and len(written) < 150:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert len(written) >= 20, "the writer barely ran: the race was not exercised"
    assert failures == [], f"{len(failures)} inconsistent reads, first: {failures[0]}"
    db = TuningDB(target, create=False)
    assert len(db.records()) == len(written) and db.integrity() == []


def _finished_or_refused(path) -> str:
    """What a reader makes of the file a killed creator left."""
    try:
        TuningDB(path, create=False).close()
        return "ready"
    except DBError as e:
        return type(e).__name__


def test_a_creation_killed_at_any_moment_is_finished_by_the_next_writer(tmp_path):
    """SIGKILL within the first tens of milliseconds of a new DB: creation is one
    transaction, so what is left is no tables or every table with the version row. Before,
    SQLite committed each CREATE TABLE at once, and most kills left tables without a version
    row that every later command refused as damaged."""
    import multiprocessing
    import random
    import signal

    fork = multiprocessing.get_context("forkserver")
    fork.set_forkserver_preload(["support.db_children"])
    rng = random.Random(34)
    seen: dict[str, int] = {}
    for trial in range(16):
        path = tmp_path / f"killed{trial}.db"
        ready, go = fork.Event(), fork.Event()
        child = fork.Process(target=create_db, args=(path, ready, go))
        child.start()
        assert ready.wait(timeout=60)
        go.set()
        time.sleep(rng.uniform(0.0, 0.025))
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.join()
        left = _finished_or_refused(path) if path.exists() else "no file"
        seen[left] = seen.get(left, 0) + 1
        assert left in ("ready", "MissingDBError", "no file"), f"trial {trial}: a reader got {left}"
        db = TuningDB(path)  # the next writer: finishes or creates it
        save(db, problem(), (fingerprint_id(FP_DATA), FP_DATA))
        assert len(db.records()) == 1 and db.integrity() == []
        db.close()
    assert seen.get("ready", 0) < 16, f"every child finished before its kill: {seen}"


def test_an_unfinished_db_from_an_older_tuner_is_finished_not_refused(db_path):
    """Tables, none holding a row, and no version row: what an older tuner left when killed
    while creating. A reader finds no DB yet; a writer finishes the creation."""
    from tuner.db import MissingDBError

    TuningDB(db_path).close()
    with sqlite3.connect(db_path) as conn:
        conn.execute("DELETE FROM tuner_meta")
        conn.execute("PRAGMA application_id = 0")
    with pytest.raises(MissingDBError):
        TuningDB(db_path, create=False)
    db = TuningDB(db_path)
    save(db, problem(), (fingerprint_id(FP_DATA), FP_DATA))
    assert len(db.records()) == 1 and db.integrity() == []
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT value FROM tuner_meta").fetchone() is not None
        assert conn.execute("PRAGMA application_id").fetchone()[0] != 0
