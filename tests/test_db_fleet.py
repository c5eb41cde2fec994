"""The tuning DB as a fleet uses it: readers racing writers see one committed state, an
interrupted creation is finished rather than refused, --force never moves what is not
tuner's own damaged file, and read-only media are read."""

import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support.db_children import create_db
from support.robustness_report import report
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
    checks: list[int] = []

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
                checks.append(1)
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
    report(f"readers_racing_a_writer_{make_db.backend}", environments_added=len(written), reader_rounds=len(checks),
           inconsistent_reads=len(failures), records_lost=len(written) - len(db.records()))


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
    report("sigkill_at_creation", trials=16, left_by_the_kill=seen, refused_by_a_reader=0, finished_by_a_writer=16)


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


# -- sweep --force ---------------------------------------------------------------------

def _cli(*args):
    from typer.testing import CliRunner

    from tuner.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _tiny_sweep(db, *extra):
    shapes = Path(db).parent / "shapes.json"
    shapes.write_text('[{"batch": 1, "kv_len": 64, "num_q_heads": 2, "num_kv_heads": 1, "head_dim": 8, '
                      '"page_size": 4, "dtype": "float32"}]')
    return _cli("sweep", "torch_split_decode", "--shapes", shapes, "--db", db, "--repeats", 2, "--warmup", 0, *extra)


def _one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert all(f in lines[0] for f in fragments), lines[0]


def _foreign_sqlite(path):
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, owner TEXT)")
        conn.execute("INSERT INTO accounts (owner) VALUES ('someone')")


def _foreign_with_tuner_names(path):
    """Another application's DB that happens to use a table name tuner uses too, damaged."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE records (id INTEGER PRIMARY KEY, song TEXT)")
        conn.executemany("INSERT INTO records (song) VALUES (?)", [("la" * 500,)] * 50)
    data = path.read_bytes()
    path.write_bytes(data[: int.from_bytes(data[16:18], "big") * 2])  # its data pages cut off


@pytest.mark.parametrize("make_foreign", [
    _foreign_sqlite,
    _foreign_with_tuner_names,
    lambda path: path.write_text("not a database, someone's notes\n"),
    lambda path: path.write_bytes(b"SQLite format 3\x00" + bytes(200)),  # a SQLite header, then nothing sane
    lambda path: os.mkfifo(path),
], ids=["another app's SQLite DB", "a DB with a table named records", "a text file", "a broken foreign header",
        "a named pipe"])
def test_sweep_force_never_moves_a_file_tuner_did_not_make(tmp_path, make_foreign, request):
    """--force renamed aside whatever was at --db and could not be read as a tuning DB:
    another application's DB, a text file, a device node. It now sets aside only tuner's own
    damaged files; anything else stays where it is, byte for byte."""
    path = tmp_path / "elsewhere.db"
    make_foreign(path)
    before = None if not path.is_file() else path.read_bytes()
    for extra in ((), ("--force",)):
        result = _tiny_sweep(path, *extra)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert "renames it aside" not in result.output
    assert not [p for p in tmp_path.iterdir() if "unreadable" in p.name] and os.path.lexists(path)
    if before is not None:
        assert path.read_bytes() == before
    report(f"sweep_force_on {request.node.callspec.id}", exit_code=2, moved=0, written=0)


def test_sweep_force_does_not_set_aside_a_db_for_what_prune_mends(tmp_path):
    """One malformed misses row: --force renamed the whole DB, every winner in it, aside.
    Now a sweep says `tuner prune` removes it, with or without --force, and moves nothing."""
    path = tmp_path / "tuning.db"
    assert _tiny_sweep(path).exit_code == 0
    db = TuningDB(path)
    db.save_misses((fingerprint_id(FP_DATA), FP_DATA), [MissRow(problem(), "default", 3)])
    winners = len(db.records())
    db.close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE misses SET served = 'sideways'")
    for extra in ((), ("--force",)):
        _one_line_error(_tiny_sweep(path, *extra), "malformed", "tuner prune")
    assert not [p for p in tmp_path.iterdir() if "unreadable" in p.name]
    assert len(TuningDB(path).records()) == winners
    assert _cli("prune", "--db", path).exit_code == 0 and _tiny_sweep(path).exit_code == 0


def test_sweep_force_sets_aside_tuners_damaged_file_made_before_the_application_id(tmp_path):
    """A DB made by an older tuner carries no application id: its schema, still listed,
    says it is tuner's."""
    path = tmp_path / "old.db"
    TuningDB(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA application_id = 0")
        conn.execute("DROP TABLE measurements")
    _one_line_error(_tiny_sweep(path), "damaged", "--force")
    forced = _tiny_sweep(path, "--force")
    assert forced.exit_code == 0, forced.output
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("old.db.unreadable-") and p.name[-4:] not in ("-wal", "-shm")]
    with sqlite3.connect(aside) as conn:
        assert "measurements" not in {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}


# -- read-only media -------------------------------------------------------------------

def _on_read_only_media(db_file: Path, mount: Path, code: str) -> subprocess.CompletedProcess:
    """Run Python code in a child that sees db_file's copy, mount/baked.db, on a read-only
    mount (a private tmpfs, in a mount namespace of its own; root writes a read-only
    directory regardless, so a read-only file system is the honest stand-in)."""
    import shutil

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) for a private read-only mount")
    script = ('mount -t tmpfs -o size=16m tmpfs "$MOUNT" && cp "$SOURCE" "$MOUNT/baked.db" '
              '&& mount -o remount,ro "$MOUNT" && exec "$PYTHON" -c "$CODE"')
    flags = ["-m"] if os.geteuid() == 0 else ["-r", "-m"]
    env = dict(os.environ, MOUNT=str(mount), SOURCE=str(db_file), PYTHON=sys.executable, CODE=code,
               TUNER_SHIPPED="off")
    probe = subprocess.run([unshare, *flags, "sh", "-c", 'mount -t tmpfs tmpfs "$MOUNT"'], env=env,
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private read-only mount here: {probe.stderr.strip()[:120]}")
    return subprocess.run([unshare, *flags, "sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_db_on_read_only_media_is_read_read_only(tmp_path):
    """A DB baked into an image or on a read-only mount: SQLite cannot make the write-ahead
    log's -shm file there, so nothing was read (show, doctor and export exited 2, and every
    tuned call ran the library default). It is now opened immutable, and writes say why not."""
    source = tmp_path / "source.db"
    db = TuningDB(source)
    save(db, problem(), (fingerprint_id(FP_DATA), FP_DATA), {"c": 7})
    db.close()  # the last connection merges the log into the file and removes it
    assert not source.with_name("source.db-wal").exists()
    mount = tmp_path / "media"
    mount.mkdir()
    path = mount / "baked.db"
    code = f"""
import contextlib, io, json, warnings
warnings.simplefilter("error")
from tuner.cli import main
from tuner.db import TuningDB, DBError
from tuner.runtime.table import load_table
db = TuningDB({str(path)!r}, create=False)
records = [r.config for r in db.records()]
table, keeps_misses = load_table({str(path)!r}, "off")
try:
    TuningDB({str(path)!r})
    write = "opened for writing"
except DBError as e:
    write = str(e)
exits = {{}}
for command in (["show"], ["doctor"], ["export", "--out", {str(tmp_path / "export.json")!r}]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(command + ["--db", {str(path)!r}])
        except SystemExit as e:
            exits[command[0]] = e.code
import os
print(json.dumps(dict(records=records, served=[w.config for runs in table.values() for w in runs.values()],
                     keeps_misses=keeps_misses, write=write, exits=exits, files=sorted(os.listdir({str(mount)!r})))))
"""
    child = _on_read_only_media(source, mount, code)
    assert child.returncode == 0, child.stderr[-2000:]
    import json

    out = json.loads(child.stdout.splitlines()[-1])
    assert out["records"] == [{"c": 7}] and out["served"] == [{"c": 7}]
    assert out["keeps_misses"] is False  # nothing could write them there
    assert "read-only" in out["write"]
    assert out["exits"] == {"show": 0, "doctor": 0, "export": 0}
    assert out["files"] == ["baked.db"]  # no -shm, -wal or lock file made
    assert "records" in (tmp_path / "export.json").read_text()


def test_sqlite_uri_targets_are_read_as_uris(tmp_path):
    """TUNER_DB=sqlite:///file:PATH?immutable=1&uri=true was read as a relative path named
    'file:...', missing, so silently nothing was read."""
    path = tmp_path / "uri.db"
    writer = TuningDB(path)
    save(writer, problem(), (fingerprint_id(FP_DATA), FP_DATA), {"c": 3})
    with pytest.raises(DBError, match="not merged"):  # an immutable read would not see the write
        TuningDB(f"file:{path}?immutable=1", create=False)
    writer.close()
    for target in (f"sqlite:///file:{path}?immutable=1&uri=true", f"file:{path}?mode=ro"):
        db = TuningDB(target, create=False)
        assert [r.config for r in db.records()] == [{"c": 3}] and db.read_only
        with pytest.raises(DBError, match="read-only"):
            db.save_misses((fingerprint_id(FP_DATA), FP_DATA), [MissRow(problem(), "default", 1)])
        db.close()
