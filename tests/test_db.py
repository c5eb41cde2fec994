import contextlib
import json
import sqlite3

import pytest

from tuner.db import (
    DBError,
    MissLengths,
    MissRow,
    Problem,
    TuningDB,
    current_fingerprint,
    current_fingerprint_id,
    export_document,
    fingerprint_id,
    import_document,
)
from tuner.db.jsonio import DocumentError
from tuner.keys import attention_run_key

FP = (current_fingerprint_id(), current_fingerprint())
OTHER_DATA = dict(current_fingerprint(), device="Some Other GPU")
OTHER = (fingerprint_id(OTHER_DATA), OTHER_DATA)


def problem(batch=4, q=1, kv=1000, op="op", static='{"h":8}'):
    return Problem(op, static, attention_run_key(batch, q, kv))


def save(db, p, config, fp=FP, median=10.0, default_median=12.0):
    db.save_record(p, fp, config, median_us=median, spread_us=0.5, samples=9, default_config={"c": 0},
                   default_median_us=default_median, default_spread_us=0.4, method={"timer": "test"})


def test_fingerprint_names_device_and_versions():
    fp = current_fingerprint()
    for field in ("device", "device_kind", "torch", "triton", "sgl_kernel", "flashinfer", "tuner"):
        assert field in fp
    assert fp["torch"] and fp["tuner"]
    assert fingerprint_id(fp) == current_fingerprint_id()
    assert fingerprint_id(OTHER_DATA) != current_fingerprint_id()


def test_sqlite_file_uses_wal(db_path):
    TuningDB(db_path)
    mode = sqlite3.connect(db_path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_record_round_trip_and_upsert(make_db):
    db = TuningDB(make_db())
    p = problem()
    save(db, p, {"c": 64})
    save(db, p, {"c": 128}, median=9.0)  # same key: replaces, does not duplicate
    records = db.records()
    assert len(records) == 1
    r = records[0]
    assert r.config == {"c": 128} and r.median_us == 9.0 and r.samples == 9
    assert r.default_config == {"c": 0} and r.default_median_us == 12.0
    assert r.problem == p and r.fingerprint_id == FP[0] and r.method == {"timer": "test"}
    assert r.created_at.tzinfo is not None
    assert r.speedup == pytest.approx(12.0 / 9.0)


def test_records_persist_across_connections(make_db):
    target = make_db()
    save(TuningDB(target), problem(), {"c": 64})
    assert TuningDB(target).records()[0].config == {"c": 64}


def test_kv_bucket_is_its_own_column_up_to_2_to_40(make_db):
    db = TuningDB(make_db())
    save(db, problem(batch=1, kv=2**40), {"c": 1})
    save(db, problem(batch=2, kv=2**40), {"c": 2})
    save(db, problem(batch=1, kv=2**39), {"c": 3})
    table = db.snapshot(FP[1]).table[("op", '{"h":8}')]
    assert table[attention_run_key(1, 1, 2**40)].config == {"c": 1}
    assert table[attention_run_key(2, 1, 2**40)].config == {"c": 2}
    assert table[attention_run_key(1, 1, 2**39)] == ({"c": 3}, 10.0, 12.0)  # config, its time, the default's


def test_snapshot_holds_only_what_applies_in_this_environment(make_db):
    db = TuningDB(make_db())
    save(db, problem(batch=1), {"c": 1})
    save(db, problem(batch=2), {"c": 2}, fp=OTHER)
    snap = db.snapshot(FP[1])
    assert list(snap.table[("op", '{"h":8}')]) == [attention_run_key(1, 1, 1000)] and snap.skipped == []
    assert db.counts() == {FP[0]: {"records": 1, "measurements": 0}, OTHER[0]: {"records": 1, "measurements": 0}}


def test_measurements_upsert_per_config(make_db):
    db = TuningDB(make_db())
    p = problem()
    db.save_measurement(p, FP, {"c": 1}, kv_len=1000, status="ok", method={}, median_us=5.0, spread_us=1.0, samples=3)
    db.save_measurement(p, FP, {"c": 1}, kv_len=1000, status="ok", method={}, median_us=4.0, spread_us=1.0, samples=3)
    db.save_measurement(p, FP, {"c": 2}, kv_len=1000, status="error", method={}, error="boom")
    rows = db.measurements(p, FP[0])
    assert [(m.config, m.status, m.median_us) for m in rows] == [({"c": 1}, "ok", 4.0), ({"c": 2}, "error", None)]
    assert rows[1].error == "boom"
    assert db.measurements(p, OTHER[0]) == []


def test_a_shapes_measurements_stored_together_upsert_per_config_the_later_kept(make_db):
    db = TuningDB(make_db())
    p = problem()
    db.save_measurement(p, FP, {"c": 3}, kv_len=1000, status="ok", method={}, median_us=9.0, spread_us=1.0, samples=3)
    db.save_measurements(p, FP, [
        dict(config={"c": 1}, kv_len=1000, status="ok", method={"rung": 0}, median_us=5.0, spread_us=1.0,
             samples=3, rung=0),
        dict(config={"c": 2}, kv_len=1000, status="error", method={}, error="boom"),
        dict(config={"c": 1}, kv_len=1000, status="ok", method={}, median_us=4.0, spread_us=0.5, samples=15),
        dict(config={"c": 3}, kv_len=1000, status="ok", method={}, median_us=8.0, spread_us=1.0, samples=3),
    ])
    db.save_measurements(p, FP, [])
    with pytest.raises(TypeError, match="medain_us"):  # a misspelt field is not stored as missing
        db.save_measurements(p, FP, [dict(config={"c": 4}, kv_len=1000, status="ok", method={}, medain_us=1.0)])
    rows = db.measurements(p, FP[0])
    assert sorted((m.config["c"], m.status, m.median_us, m.rung) for m in rows) == [
        (1, "ok", 4.0, 1), (2, "error", None, 1), (3, "ok", 8.0, 1)]


def test_integrity_ok_on_a_sound_db(make_db):
    db = TuningDB(make_db())
    save(db, problem(), {"c": 1})
    assert db.integrity() == []


def test_tuner_db_env_selects_the_db(tmp_path, monkeypatch):
    target = tmp_path / "from_env.db"
    monkeypatch.setenv("TUNER_DB", str(target))
    db = TuningDB()
    assert db.path == target.resolve() and target.exists()
    monkeypatch.setenv("TUNER_DB", f"sqlite:///{tmp_path / 'url.db'}")
    assert TuningDB().path == (tmp_path / "url.db").resolve()


def test_unusable_paths_raise_one_line_db_errors(tmp_path):
    with pytest.raises(DBError, match="is a directory"):
        TuningDB(tmp_path)
    with pytest.raises(DBError, match="does not exist"):
        TuningDB(tmp_path / "missing" / "x.db")
    with pytest.raises(DBError, match="no tuning DB"):
        TuningDB(tmp_path / "absent.db", create=False)
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(DBError) as e:
        TuningDB(garbage)
    assert "\n" not in str(e.value) and "garbage.db" in str(e.value)
    assert garbage.read_bytes() == b"this is not a database at all" * 100  # nothing overwritten
    with pytest.raises(DBError, match="cannot open tuning DB nosuchdialect"):
        TuningDB("nosuchdialect://x")


def test_export_import_round_trip(make_db):
    src = TuningDB(make_db("a"))
    save(src, problem(batch=1), {"c": 1})
    save(src, problem(batch=3, static='["float32",8,2]'), {"c": 3})  # a tuple key of a user's own function
    # null is a config value too (FA3's pack_gqa=None): an export holding one must import
    save(src, problem(batch=2, kv=2**40), {"c": 2, "mode": "fast", "on": True, "pack_gqa": None}, fp=OTHER)
    doc = json.loads(json.dumps(export_document(src)))
    assert doc["schema"] == "tuner.tunings" and doc["version"] == 1
    assert set(doc["fingerprints"]) == {FP[0], OTHER[0]}
    dst = TuningDB(make_db("b"))
    assert import_document(dst, doc).written == 3
    strip = lambda rs: [(r.problem, r.fingerprint_id, r.config, r.median_us, r.default_config, r.method) for r in rs]  # noqa: E731
    assert strip(dst.records()) == strip(src.records())
    assert dst.fingerprints()[OTHER[0]]["device"] == "Some Other GPU"


def test_export_filters_by_op(make_db):
    db = TuningDB(make_db())
    save(db, problem(op="a"), {"c": 1})
    save(db, problem(op="b"), {"c": 1})
    assert [r["op"] for r in export_document(db, op="b")["records"]] == ["b"]


def _doc(db_path):
    db = TuningDB(db_path)
    save(db, problem(batch=1), {"c": 1})
    save(db, problem(batch=2), {"c": 2})
    return json.loads(json.dumps(export_document(db)))


def _mutations():
    def rec(f):
        return lambda d: f(d["records"][1])

    return {
        "wrong schema": lambda d: d.update(schema="other"),
        "future version": lambda d: d.update(version=2),
        "unknown top field": lambda d: d.update(extra=1),
        "records not a list": lambda d: d.update(records={}),
        "missing op": rec(lambda r: r.pop("op")),
        "unknown record field": rec(lambda r: r.update(evil=1)),
        "batch zero": rec(lambda r: r["run_key"].update(batch=0)),
        "batch string": rec(lambda r: r["run_key"].update(batch="4")),
        "bucket not power of two": rec(lambda r: r["run_key"].update(kv_len_bucket=1000)),
        "huge bucket": rec(lambda r: r["run_key"].update(kv_len_bucket=2**80)),
        "negative time": rec(lambda r: r["timing"].update(median_us=-1)),
        "bool samples": rec(lambda r: r["timing"].update(samples=True)),
        "config list": rec(lambda r: r.update(config=[1])),
        "nested config": rec(lambda r: r.update(config={"a": {"b": 1}})),
        "newline in a key": rec(lambda r: r.update(config={"a\nb": [1]})),  # found by hypothesis
        "unknown fingerprint": rec(lambda r: r.update(fingerprint="deadbeef")),
        "bad time": rec(lambda r: r.update(created_at="yesterday")),
        "edited fingerprint": lambda d: next(iter(d["fingerprints"].values())).update(device="forged"),
    }


@pytest.mark.parametrize("name", sorted(_mutations()))
def test_import_rejects_bad_documents_and_leaves_db_unchanged(tmp_path, make_db, name):
    doc = _doc(tmp_path / "src.db")
    _mutations()[name](doc)
    dst = TuningDB(make_db("dst"))
    save(dst, problem(batch=9), {"c": 9})
    before = [(r.problem, r.config) for r in dst.records()]
    with pytest.raises(DocumentError) as e:
        import_document(dst, doc)
    assert "\n" not in str(e.value)
    assert [(r.problem, r.config) for r in dst.records()] == before


def _writer(path, worker, n):
    db = TuningDB(path)
    for i in range(n):
        p = problem(batch=1 + worker, kv=2**i)
        db.save_measurement(p, FP, {"c": i}, kv_len=2**i, status="ok", method={}, median_us=1.0, spread_us=0.0, samples=1)
        save(db, p, {"c": i})


def test_concurrent_writer_processes_lose_nothing(make_db):
    import multiprocessing

    db_path = make_db()
    TuningDB(db_path).close()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(db_path, w, 15)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs)
    db = TuningDB(db_path)
    assert db.counts() == {FP[0]: {"records": 45, "measurements": 45}}
    assert db.integrity() == []


def test_import_stores_times_in_utc_and_wants_object_keys(tmp_path, make_db):
    doc = _doc(tmp_path / "src.db")
    doc["records"][0]["created_at"] = "2026-01-01T12:00:00+05:00"
    dst = TuningDB(make_db("dst"))
    import_document(dst, doc)
    stamps = {r.created_at.isoformat() for r in dst.records()}
    assert "2026-01-01T07:00:00+00:00" in stamps
    doc["records"][0]["static_key"] = 5
    with pytest.raises(DocumentError, match="static_key"):
        import_document(dst, doc)


def test_reading_never_writes(tmp_path):
    db_path = tmp_path / "r.db"
    save(TuningDB(db_path), problem(), {"c": 1})
    before = db_path.stat().st_mtime_ns
    TuningDB(db_path, create=False).records()
    assert db_path.stat().st_mtime_ns == before


def test_writers_take_the_file_lock(db_path, monkeypatch):
    from filelock import FileLock

    import tuner.db.store as store

    TuningDB(db_path).close()
    monkeypatch.setattr(store, "WRITE_LOCK_TIMEOUT_S", 0.2)
    db = TuningDB(db_path)
    with FileLock(str(db_path) + ".lock"):  # another writer holds it
        with pytest.raises(DBError, match="locked by another writer"):
            save(db, problem(), {"c": 1})
    save(db, problem(), {"c": 1})  # and once it is free, the write lands
    assert len(db.records()) == 1


def test_prune_keeps_only_this_environment(make_db):
    db = TuningDB(make_db())
    save(db, problem(batch=1), {"c": 1})
    save(db, problem(batch=2), {"c": 2}, fp=OTHER)
    db.save_measurement(problem(batch=2), OTHER, {"c": 2}, kv_len=1000, status="ok", method={}, median_us=1.0,
                        spread_us=0.0, samples=1)
    expected = {OTHER[0]: {"records": 1, "measurements": 1}}
    assert db.prune(FP[1], dry_run=True) == expected and OTHER[0] in db.counts()
    assert db.prune(FP[1]) == expected
    assert db.counts() == {FP[0]: {"records": 1, "measurements": 0}} and set(db.fingerprints()) == {FP[0]}
    assert db.integrity() == [] and db.prune(FP[1]) == {}


def test_a_db_without_its_schema_version_is_damage_not_an_empty_db(db_path):
    """Tables with rows but no tuner_meta (or no version row): not "no DB yet" (the runtime
    would serve defaults beside stored winners, a sweep would adopt the file), but damage:
    refused with one line, written to by nothing. (Empty tables without a version are a
    creation cut short: test_db_fleet.py.)"""
    import sqlite3

    from tuner.db.location import MissingDBError

    save(TuningDB(db_path), problem(), {"c": 1})
    with sqlite3.connect(db_path) as conn:
        conn.execute("DELETE FROM tuner_meta")
    for create in (False, True):
        with pytest.raises(DBError, match="damaged: it has tuner's tables, with rows, but no schema version") as e:
            TuningDB(db_path, create=create)
        assert not isinstance(e.value, MissingDBError)
    with sqlite3.connect(db_path) as conn:
        conn.execute("DROP TABLE tuner_meta")
        assert conn.execute("SELECT count(*) FROM records").fetchone() == (1,)  # nothing touched
    with pytest.raises(DBError, match="damaged"):
        TuningDB(db_path)


def test_a_db_missing_a_core_table_is_damage(db_path):
    import sqlite3

    save(TuningDB(db_path), problem(), {"c": 1})
    with sqlite3.connect(db_path) as conn:
        conn.execute("DROP TABLE measurements")
    with pytest.raises(DBError, match="damaged: table measurements is missing"):
        TuningDB(db_path, create=False)


def test_misses_add_up_and_drop_out_once_tuned(make_db):
    db = TuningDB(make_db())
    a, b = problem(batch=1), problem(batch=2)
    db.save_misses(FP, [(a, "nearest", 2), (b, "default", 1)])
    db.save_misses(FP, [(a, "nearest", 3)])
    db.save_misses(OTHER, [(a, "default", 1)])
    assert db.misses(FP[0]) == [MissRow(a, "nearest", 5), MissRow(b, "default", 1)]
    save(db, b, {"c": 1})  # b now has an exact winner
    assert db.misses(FP[0]) == [MissRow(a, "nearest", 5)] and db.misses(OTHER[0]) == [MissRow(a, "default", 1)]
    db.prune(FP[1])
    assert db.misses(OTHER[0]) == [] and db.integrity() == []


def test_a_windowed_miss_past_its_window_stays_until_its_own_kv_bucket_is_tuned(make_db):
    """A miss at kv bucket 16384 of a 127-key window is that bucket's: a winner at the
    window's bucket (128) does not solve it, one at 16384 does."""
    db = TuningDB(make_db())
    static = '{"h":8,"window_left":127,"window_right":0}'
    missed = problem(kv=16384, static=static)
    db.save_misses(FP, [(missed, "default", 4)])
    save(db, problem(kv=128, static=static), {"c": 1})
    assert db.misses(FP[0]) == [MissRow(missed, "default", 4)]
    save(db, missed, {"c": 1})
    assert db.misses(FP[0]) == []


def test_missed_calls_lengths_merge_across_saves(make_db):
    """Each process saves its own calls' length statistics; the table keeps sums, so the
    misses read back average over every call that had its lengths on the host."""
    db = TuningDB(make_db())
    a = problem(batch=4)
    db.save_misses(FP, [MissRow(a, "default", 1, MissLengths(1, 1000.0, 4000.0, 300.0))])
    db.save_misses(FP, [MissRow(a, "default", 2)])  # calls without host lengths
    db.save_misses(FP, [MissRow(a, "default", 1, MissLengths(3, 2000.0, 4096.0, 100.0))])
    [row] = db.misses(FP[0])
    assert row.count == 4 and row.lengths.calls == 4
    assert row.lengths.mean == pytest.approx(1750.0) and row.lengths.longest == pytest.approx(4072.0)
    assert row.lengths.spread == pytest.approx(150.0)


def test_misses_written_before_the_length_columns_read_without_lengths_and_gain_them(db_path):
    import sqlite3

    db = TuningDB(db_path)
    db.save_misses(FP, [MissRow(problem(), "default", 2)])
    db.close()
    with sqlite3.connect(db_path) as conn:  # the misses table as it shipped, before the length columns
        for column in ("length_calls", "length_mean_sum", "length_max_sum", "length_spread_sum"):
            conn.execute(f"ALTER TABLE misses DROP COLUMN {column}")
    reader = TuningDB(db_path, create=False)
    assert reader.misses(FP[0]) == [MissRow(problem(), "default", 2)] and reader.integrity() == []
    writer = TuningDB(db_path)  # opened to write: the columns are added; old rows' sums start at null
    writer.save_misses(FP, [MissRow(problem(), "default", 1, MissLengths(1, 10.0, 20.0, 5.0))])
    [row] = writer.misses(FP[0])
    assert row.count == 3 and row.lengths == MissLengths(1, 10.0, 20.0, 5.0)


def test_a_version_1_db_without_the_misses_table_still_works(db_path):
    """The misses table came after schema version 1 shipped: reading such a DB never adds
    it (and finds no misses); opening it to write adds it."""
    import sqlite3

    save(TuningDB(db_path), problem(), {"c": 1})
    with sqlite3.connect(db_path) as conn:
        conn.execute("DROP TABLE misses")
    reader = TuningDB(db_path, create=False)
    assert reader.misses(FP[0]) == [] and reader.integrity() == [] and len(reader.records()) == 1
    with sqlite3.connect(db_path) as conn:
        assert "misses" not in {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    writer = TuningDB(db_path)
    writer.save_misses(FP, [MissRow(problem(batch=3), "default", 1)])
    assert len(writer.misses(FP[0])) == 1


# -- issue 10: a DB and imports that cannot poison the runtime ---------------------------------


def _doc_with(tmp_path, mutate):
    doc = _doc(tmp_path / "src.db")
    mutate(doc)
    return doc


@pytest.mark.parametrize("name, mutate, fragment", [
    ("lone surrogate", lambda d: d["records"][1]["config"].update(c="\ud800"), "records[1].config"),
    ("zero median", lambda d: d["records"][1]["timing"].update(median_us=0), "records[1].timing.median_us"),
    ("zero default median", lambda d: d["records"][0]["default"].update(median_us=0.0), "records[0].default"),
    ("year 1", lambda d: d["records"][1].update(created_at="0001-01-01T00:00:00+00:00"), "records[1].created_at"),
    ("year 9999", lambda d: d["records"][1].update(created_at="9999-12-31T23:59:59"), "records[1].created_at"),
    ("in the future", lambda d: d["records"][1].update(created_at="2999-01-01T00:00:00"), "records[1].created_at"),
    ("export time not a time", lambda d: d.update(exported_at="yesterday"), "document.exported_at"),
    ("export time a number", lambda d: d.update(exported_at=1.5), "document.exported_at"),
    ("export time in the future", lambda d: d.update(exported_at="2999-01-01T00:00:00"), "document.exported_at"),
    ("export time a megabyte", lambda d: d.update(exported_at="2024" * 250_000), "document.exported_at"),
    ("version a number", lambda d: d.update(tuner_version=1), "document.tuner_version"),
    ("version a megabyte", lambda d: d.update(tuner_version="0.1" * 300_000), "document.tuner_version"),
])
def test_import_refuses_what_no_db_should_hold_naming_the_record(tmp_path, make_db, name, mutate, fragment):
    doc = _doc_with(tmp_path, mutate)
    dst = TuningDB(make_db("dst"))
    with pytest.raises(DocumentError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        import_document(dst, doc)
    assert dst.records() == []


@pytest.mark.parametrize("mutate", [
    lambda d: d["fingerprints"].update({"f" * 10**6: {"device": "x"}}),
    lambda d: d.update({"x" * 10**6: 1}),
    lambda d: d["records"][0].update({f"{i}" * 10**5: 1 for i in range(9)}),
    lambda d: d["records"][0].update(config={"c" * 10**6: 1, "c" * 10**6 + "d": 2}),
])
def test_a_megabyte_of_key_text_is_refused_in_a_short_line(tmp_path, make_db, mutate):
    """Ids and field names are quoted in the message, which is one line and must stay short."""
    doc = _doc_with(tmp_path, mutate)
    with pytest.raises(DocumentError) as e:
        import_document(TuningDB(make_db("dst")), doc)
    assert len(str(e.value)) < 400, str(e.value)[:400]


def test_a_key_given_twice_in_one_json_object_is_refused(tmp_path, make_db):
    from tuner.db.jsonio import load_document

    doc = _doc(tmp_path / "src.db")
    text = json.dumps(doc).replace('"config": {"c": 2}', '"config": {"c": 2, "c": 3}', 1)
    assert '"c": 3' in text
    f = tmp_path / "dup.json"
    f.write_text(text)
    with pytest.raises(DocumentError, match=r"records\[1\]\.config: key 'c' appears more than once"):
        import_document(TuningDB(make_db("dst")), load_document(f))


def test_an_import_never_replaces_a_newer_winner_unless_told_and_keeps_what_it_replaced(tmp_path, make_db):
    """Upserts replaced unconditionally: importing an old 1.05x record overwrote a 2.0x winner."""
    from sqlalchemy import func, select

    from tuner.db.schema import ReplacedRecord

    target = make_db("dst")
    db = TuningDB(target)
    p = problem(batch=1)
    save(db, p, {"c": 2}, median=5.0, default_median=10.0)  # 2.0x, measured now
    doc = _doc(tmp_path / "src.db")
    doc["records"][0].update(config={"c": 9}, created_at="2026-01-01T00:00:00+00:00")  # older, 1.2x
    result = import_document(db, doc)
    assert (result.kept, result.written) == (1, 1) and db.record(p, FP[0]).config == {"c": 2}
    result = import_document(db, doc, replace=True)
    assert result.replaced == 1 and db.record(p, FP[0]).config == {"c": 9}
    with db._read() as session:
        history = session.execute(select(ReplacedRecord.config, ReplacedRecord.median_us)).all()
    assert [(json.loads(c), m) for c, m in history if json.loads(c) == {"c": 2}] == [({"c": 2}, 5.0)]
    assert import_document(db, doc, replace=True).same == 2  # the same again: nothing to do, nothing kept twice
    with db._read() as session:
        assert session.scalar(select(func.count()).select_from(ReplacedRecord)) == len(history)


def test_one_key_twice_in_a_file_keeps_the_newest_on_import_and_in_the_shipped_layer(tmp_path, make_db):
    from tuner.db.shipped import load_shipped

    doc = _doc(tmp_path / "src.db")
    first = json.loads(json.dumps(doc["records"][0]))
    newer = dict(first, config={"c": 42}, created_at="2026-06-01T00:00:00+00:00")
    older = dict(first, config={"c": 7}, created_at="2026-01-01T00:00:00+00:00")
    doc["records"] = [newer, older]  # the newer first: "the last wins" would keep the older
    dst = TuningDB(make_db("dst"))
    import_document(dst, doc)
    assert [r.config for r in dst.records()] == [{"c": 42}]
    f = tmp_path / "x.tunings.json"
    f.write_text(json.dumps(doc))
    layer = load_shipped(FP[1], f)
    assert [t.config for t in layer.table[("op", '{"h":8}')].values()] == [{"c": 42}]


def test_prune_keeps_records_that_still_apply_and_removes_malformed_rows(make_db):
    db = TuningDB(make_db())
    older_tuner = dict(FP[1], tuner="0.0.1", driver="1.0")
    save(db, problem(batch=1), {"c": 1}, fp=(fingerprint_id(older_tuner), older_tuner))
    save(db, problem(batch=2), {"c": 2}, fp=OTHER)
    removed = db.prune(FP[1])
    assert set(removed) == {OTHER[0]} and [r.config for r in db.records()] == [{"c": 1}]


def test_doctor_and_prune_find_malformed_rows(tmp_path):
    import sqlite3

    path = tmp_path / "m.db"
    db = TuningDB(path)
    save(db, problem(batch=1), {"c": 1})
    save(db, problem(batch=2), {"c": 2})
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE records SET config = 'oops' WHERE batch = 2")
    problems = db.integrity()
    assert len(problems) == 1 and "1 malformed rows" in problems[0] and "records id 2.config" in problems[0]
    with pytest.raises(DBError, match="malformed records .*tuner prune"):
        db.records()
    assert db.prune(FP[1])["malformed"]["records"] == 1
    assert db.integrity() == [] and [r.config for r in db.records()] == [{"c": 1}]


def test_rows_of_one_config_text_read_as_their_own_dicts_and_a_bad_text_is_still_found(tmp_path):
    """Config texts are checked once per text (a sweep read the same few dozen thousands of
    times): each row still gets a dict of its own, and a text breaking the rules is named
    in every row that holds it."""
    path = tmp_path / "m.db"
    db = TuningDB(path)
    p, q = problem(batch=4), problem(batch=5)
    for key in (p, q, p):
        db.save_measurement(key, FP, {"c": 1} if key is q else {"c": len(key.static_key)}, kv_len=1000,
                            status="ok", method={}, median_us=5.0, spread_us=1.0, samples=3)
    db.save_measurement(p, FP, {"c": 1}, kv_len=1000, status="ok", method={}, median_us=5.0, spread_us=1.0,
                        samples=3)
    (first,), (second,) = ([m for m in db.measurements(k, FP[0]) if m.config == {"c": 1}] for k in (p, q))
    assert first.config is not second.config
    first.config["c"] = 99  # a caller's own
    assert [m.config for m in db.measurements(p, FP[0])] == [{"c": 7}, {"c": 1}]
    with sqlite3.connect(path) as conn:  # a value no config may hold, in two rows of one text
        conn.execute("""UPDATE measurements SET config = '{"c":[1]}' WHERE config = '{"c":1}'""")
    problems = db.integrity()
    assert len(problems) == 1 and problems[0].startswith("2 malformed rows (measurements id 2.config.c:"), problems
    with pytest.raises(DBError, match="malformed measurements .*config.c"):
        db.measurements(q, FP[0])


def test_versions_come_from_the_modules_version_file_without_package_metadata(tmp_path, monkeypatch):
    """Staged installs (unpacked, no dist-info) left sgl_kernel=None in every sweep DB."""
    from tuner.db.fingerprint import library_version

    pkg = tmp_path / "fake_kernel_lib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('importing a kernel library is never needed')\n")
    (pkg / "version.py").write_text('__version__ = "0.4.10"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert library_version(("no-such-distribution",), "fake_kernel_lib") == "0.4.10"
    assert library_version(("no-such-distribution",), "no_such_module_at_all") is None
    assert library_version(("torch",), "torch") == torch_version()


def torch_version():
    from importlib import metadata

    return metadata.version("torch")


def test_an_undated_import_never_replaces_a_dated_winner(tmp_path, make_db):
    """An undated record was dated now on import, and so replaced any stored winner."""
    db = TuningDB(make_db("dst"))
    p = problem(batch=1)
    save(db, p, {"c": 2}, median=5.0, default_median=10.0)
    doc = _doc(tmp_path / "src.db")
    doc["records"][0].pop("created_at")
    doc["records"][0]["config"] = {"c": 9}
    assert import_document(db, doc).kept == 1 and db.record(p, FP[0]).config == {"c": 2}
    fresh = TuningDB(make_db("fresh"))  # where nothing is stored, it is written, dated the oldest possible
    import_document(fresh, doc)
    assert fresh.record(p, FP[0]).created_at.year == 2020


def test_prune_keeps_an_environment_a_writer_adds_while_it_runs(tmp_path):
    """prune read what to keep outside its transaction, then removed every other environment:
    a server storing a winner under a new (applying) environment meanwhile lost it."""
    import threading

    import tuner.db.repair as repair

    path = tmp_path / "p.db"
    db = TuningDB(path)
    save(db, problem(batch=2), {"c": 2}, fp=OTHER)  # stale: prune removes it
    newer_driver = dict(FP[1], driver="999.1")
    real_applies = repair.applies
    writer_done = threading.Event()

    def write_new_environment():
        save(TuningDB(path), problem(batch=1), {"c": 1}, fp=(fingerprint_id(newer_driver), newer_driver))
        writer_done.set()

    def applies_while_a_writer_writes(recorded, current):
        if not writer_done.is_set() and not hasattr(applies_while_a_writer_writes, "started"):
            applies_while_a_writer_writes.started = threading.Thread(target=write_new_environment)
            applies_while_a_writer_writes.started.start()
            writer_done.wait(0.5)  # the writer blocks on prune's lock (fixed) or finishes (not)
        return real_applies(recorded, current)

    repair.applies = applies_while_a_writer_writes
    try:
        removed = db.prune(FP[1])
    finally:
        repair.applies = real_applies
    applies_while_a_writer_writes.started.join(10)
    assert set(removed) == {OTHER[0]}
    assert [r.config for r in TuningDB(path).records()] == [{"c": 1}]  # the writer's winner survived


def test_a_db_from_before_the_rung_column_reads_and_gains_it_when_written(db_path):
    """Successive halving's rung was a key inside `method`; it is a column now. A DB made
    before it reads (the rung from the method) and gains the column when opened to write."""
    import sqlite3

    db = TuningDB(db_path)
    p = problem()
    db.save_measurement(p, FP, {"c": 1}, kv_len=1000, status="ok", method={"rung": 0}, median_us=5.0, spread_us=1.0,
                        samples=3)
    db.close()
    with sqlite3.connect(db_path) as conn:
        conn.execute("ALTER TABLE measurements DROP COLUMN rung")
        conn.execute("""UPDATE measurements SET method = '{"rung":0}'""")
    reader = TuningDB(db_path, create=False)
    assert [m.rung for m in reader.measurements(p, FP[0])] == [0] and reader.integrity() == []
    with sqlite3.connect(db_path) as conn:
        assert "rung" not in {r[1] for r in conn.execute("PRAGMA table_info(measurements)")}  # reading wrote nothing
    writer = TuningDB(db_path)
    writer.save_measurement(p, FP, {"c": 2}, kv_len=1000, status="ok", method={}, median_us=4.0, spread_us=1.0,
                            samples=3, rung=1)
    assert [(m.config, m.rung) for m in writer.measurements(p, FP[0])] == [({"c": 1}, 0), ({"c": 2}, 1)]


def test_a_db_from_before_the_problem_index_gains_it_when_written_and_its_reads_use_it(db_path):
    """A sweep reads a stored shape's measurements on every shape it passes; without an index
    on the problem's columns SQLite scanned all of an environment's rows each time (H200
    re-ship DB: 12 ms a read). A DB made before the index reads without it, gains it when
    opened to write, and a problem's read then searches that index."""
    import sqlite3

    TuningDB(db_path).save_measurement(problem(), FP, {"c": 1}, kv_len=1000, status="ok", method={},
                                       median_us=5.0, spread_us=1.0, samples=3)
    with sqlite3.connect(db_path) as conn:
        conn.execute("DROP INDEX ix_measurements_problem")

    def indexes():
        with sqlite3.connect(db_path) as conn:
            return {r[1] for r in conn.execute("PRAGMA index_list(measurements)")}
    reader = TuningDB(db_path, create=False)
    assert [m.config for m in reader.measurements(problem(), FP[0])] == [{"c": 1}] and reader.integrity() == []
    assert "ix_measurements_problem" not in indexes()  # reading wrote nothing
    writer = TuningDB(db_path)
    assert "ix_measurements_problem" in indexes()
    from sqlalchemy import event

    sent = []
    event.listen(writer.engine, "before_cursor_execute",
                 lambda conn, cursor, statement, params, *_: sent.append((statement, params)))
    assert len(writer.measurements(problem(), FP[0])) == 1
    [(statement, params)] = [(q, p) for q, p in sent if "FROM measurements" in q]
    with sqlite3.connect(db_path) as conn:  # the read as SQLAlchemy sent it
        plan = conn.execute("EXPLAIN QUERY PLAN " + statement, params).fetchall()
    assert "USING INDEX ix_measurements_problem" in plan[0][-1], plan


@contextlib.contextmanager
def _row_role(url: str, changes: tuple[str, ...] = (), grants: tuple[str, ...] = ()):
    """A PostgreSQL login role with row rights on url's tables (and grants, "{role}" in
    them named), after the owner made changes; yields its URL and the owner's engine, and
    drops the role after."""
    import uuid

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    role = f"tuner_rows_{uuid.uuid4().hex[:8]}"
    owner = create_engine(url, isolation_level="AUTOCOMMIT")
    with owner.connect() as conn:
        for statement in changes:
            conn.execute(text(statement))
        conn.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD 'rows'"))
        conn.execute(text(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}"))
        conn.execute(text(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}"))
        for grant in grants:
            conn.execute(text(grant.format(role=role)))
    try:
        yield make_url(url).set(username=role, password="rows").render_as_string(hide_password=False), owner
    finally:
        with owner.connect() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))
        owner.dispose()


def test_a_writer_that_may_not_alter_the_tables_still_writes_without_the_new_columns(make_db):
    """A fleet DB's writers may hold row rights only. Opening to write upgraded the misses
    table (ALTER TABLE), and a role that does not own it lost every write (review of issue
    12): the upgrade is now best effort, and writes leave out what the DB lacks."""
    if make_db.backend != "postgresql":
        pytest.skip("roles and table ownership are PostgreSQL's")
    url = make_db()
    TuningDB(url).close()
    dropped = tuple(f"ALTER TABLE misses DROP COLUMN {c}"
                    for c in ("length_calls", "length_mean_sum", "length_max_sum", "length_spread_sum"))
    with _row_role(url, dropped) as (rows_only, _):
        with pytest.warns(UserWarning, match="writing without the newer tables and columns"):
            db = TuningDB(rows_only)
        db.save_misses(FP, [MissRow(problem(), "default", 2, MissLengths(1, 10.0, 20.0, 5.0))])
        db.save_misses(FP, [MissRow(problem(), "default", 1)])
        assert db.misses(FP[0]) == [MissRow(problem(), "default", 3)]  # counted; lengths not kept
        save(db, problem(), {"c": 1})
        save(db, problem(), {"c": 2})  # replaces (the history table is there: kept)
        assert db.record(problem(), FP[0]).config == {"c": 2}
        db.close()


def test_a_writer_that_may_not_build_the_problem_index_writes_and_keeps_the_other_upgrades(make_db):
    """Review of 8310f79: the index was built in the upgrade's one transaction, so a role
    that may create tables but not index one it does not own lost the misses table too,
    and a row-only role warned on every open that it wrote "without the newer tables and
    columns" when none were missing. The index is its own step, with its own warning."""
    if make_db.backend != "postgresql":
        pytest.skip("roles and table ownership are PostgreSQL's")
    from sqlalchemy import inspect

    url = make_db()
    TuningDB(url).close()
    with _row_role(url, ("DROP INDEX ix_measurements_problem", "DROP TABLE misses"),
                   ("GRANT CREATE ON SCHEMA public TO {role}",
                    "GRANT REFERENCES ON ALL TABLES IN SCHEMA public TO {role}")) as (rows_only, owner):
        with pytest.warns(UserWarning) as warned:
            db = TuningDB(rows_only)
        assert [str(w.message) for w in warned if "ix_measurements_problem" in str(w.message)], \
            [str(w.message) for w in warned]
        assert not [w for w in warned if "newer tables and columns" in str(w.message)]
        with owner.connect() as conn:
            tables = set(inspect(conn).get_table_names())
            indexes = {i["name"] for i in inspect(conn).get_indexes("measurements")}
        assert "misses" in tables and "ix_measurements_problem" not in indexes
        db.save_measurement(problem(), FP, {"c": 1}, kv_len=1000, status="ok", method={}, median_us=5.0,
                            spread_us=1.0, samples=3)
        assert [m.config for m in db.measurements(problem(), FP[0])] == [{"c": 1}]
        db.close()
        TuningDB(url).close()  # the owner builds it
        with owner.connect() as conn:
            assert "ix_measurements_problem" in {i["name"] for i in inspect(conn).get_indexes("measurements")}


def test_an_opener_whose_look_straddles_a_creators_commit_waits_and_opens(make_db):
    """Found by the eight-process sweep test (1 run in 7 on PostgreSQL): an opener read "no
    tuner_meta table" just before another process's creation committed, then listed every
    table, and called the DB damaged (tables, no version row). It now waits for creators in
    flight and looks again. Here the creator commits exactly between the opener's two looks."""
    if make_db.backend != "postgresql":
        pytest.skip("SQLite creators are waited for under the file lock (test_partial_db_* cover it)")
    from sqlalchemy import Engine, create_engine, event, insert, text

    from tuner.db.schema import SCHEMA_VERSION, Base, Meta

    url = make_db()
    creator_engine = create_engine(url)
    creator = creator_engine.connect()
    creation = creator.begin()
    creator.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": 0x74756E6572})
    Base.metadata.create_all(creator)
    creator.execute(insert(Meta).values(key="schema_version", value=str(SCHEMA_VERSION)))
    looks = []

    def commit_between_looks(conn, cursor, statement, parameters, context, executemany):
        if conn.engine is not creator_engine and "pg_class" in statement and creation.is_active:
            looks.append(statement)
            if len(looks) == 2:  # the opener's second look at the tables
                creation.commit()

    event.listen(Engine, "before_cursor_execute", commit_between_looks)
    try:
        db = TuningDB(url)
    finally:
        event.remove(Engine, "before_cursor_execute", commit_between_looks)
        creator.close()
        creator_engine.dispose()
    assert len(looks) == 2, "the creator never committed between the opener's looks"
    db.save_measurement(problem(), FP, {"c": 1}, kv_len=1000, status="ok", method={}, median_us=5.0,
                        spread_us=1.0, samples=3)
    assert len(db.measurements(problem(), FP[0])) == 1


def test_postgresql_upgraders_take_turns(make_db):
    """The column upgrade took no lock on PostgreSQL: an opener that looked while another's
    ALTER was uncommitted ran the ALTER too, and one of them failed ("column already
    exists"). Upgraders now hold the creators' advisory lock: one waits for the other, then
    finds the column in."""
    if make_db.backend != "postgresql":
        pytest.skip("PostgreSQL's transactional DDL; SQLite writers share a file lock")
    import threading

    from sqlalchemy import create_engine, text

    url = make_db()
    TuningDB(url).close()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE measurements DROP COLUMN rung"))
    opened: list[object] = []
    other = engine.connect()
    upgrade = other.begin()  # another upgrader, under the lock
    other.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": 0x74756E6572})

    def open_to_write():
        try:
            opened.append(TuningDB(url))
        except Exception as e:  # noqa: BLE001 - the failure is what is checked
            opened.append(e)
    opener = threading.Thread(target=open_to_write)
    opener.start()
    opener.join(1.0)
    waited = opener.is_alive()
    other.execute(text("ALTER TABLE measurements ADD COLUMN IF NOT EXISTS rung INTEGER"))
    upgrade.commit()
    other.close()
    opener.join(30)
    engine.dispose()
    assert waited, "the opener upgraded without waiting for the other upgrader"
    [db] = opened
    assert isinstance(db, TuningDB), db
    db.save_measurement(problem(), FP, {"c": 1}, kv_len=1000, status="ok", method={}, median_us=5.0,
                        spread_us=1.0, samples=3, rung=0)
    assert [m.rung for m in db.measurements(problem(), FP[0])] == [0]


@pytest.mark.parametrize("calls, sums", [(0, ("zz", 1.0, 1.0)), (0, (-1.0, 0.0, 0.0)), (5, (1.0, 1.0, 1.0)),
                                         (1, (None, 1.0, 1.0)), (2, (300.0, 200.0, 0.0)), (2, (20.0, 40.0, 30.0)),
                                         (2, (20.0, 40.0, -2.0))])
def test_a_misses_row_with_bad_length_sums_is_malformed_whatever_its_calls(db_path, calls, sums):
    """Sums no calls could give (a mean above the longest, a spread above half of it) were
    accepted, and --from-misses drew lengths from them."""
    import sqlite3

    db = TuningDB(db_path)
    db.save_misses(FP, [MissRow(problem(), "default", 2)])
    with sqlite3.connect(db_path) as conn:  # count 2: five calls with lengths cannot be
        conn.execute("UPDATE misses SET length_calls = ?, length_mean_sum = ?, length_max_sum = ?, "
                     "length_spread_sum = ?", (calls, *sums))
    assert any("misses id" in p for p in db.integrity())


def test_a_writer_without_a_misses_table_says_misses_were_not_recorded(make_db):
    """A row-only role on a DB made before the misses table dropped every miss, while
    flush_misses() reported them written. Now the write raises, and the flush warns and
    counts none."""
    if make_db.backend != "postgresql":
        pytest.skip("roles and table ownership are PostgreSQL's")
    import tuner

    url = make_db()
    TuningDB(url).close()
    with _row_role(url, ("DROP TABLE misses",)) as (rows_only, _):
        with pytest.warns(UserWarning, match="writing without the newer tables"):
            db = TuningDB(rows_only)
        with pytest.raises(DBError, match="no misses table"):
            db.save_misses(FP, [MissRow(problem(), "default", 2)])
        db.close()
        tuner.configure(db=rows_only)
        lookup = tuner.autotune("rows_only_op", configs=[{"c": 1}], default={"c": 0},
                                key=lambda n: (("k",), n, 1, 1000))(lambda n, *, config: config["c"])
        assert lookup(4) == 0  # no winner: the default, and a miss
        with pytest.warns(UserWarning, match="could not record 1 missed keys.*no misses table"):
            assert tuner.flush_misses() == 0


def test_many_records_in_one_call_decide_each_key_in_order(make_db):
    """save_records decides each key's first record against the rows read at once and
    writes them in batches (an import of 100k records took 113 s a row at a time); a key
    given twice is decided again after its first, as if one by one."""
    from datetime import datetime, timedelta, timezone

    from sqlalchemy import select

    from tuner.db.schema import ReplacedRecord

    db = TuningDB(make_db())
    t0 = datetime(2026, 6, 1, tzinfo=timezone.utc)
    a, b, c = problem(batch=1), problem(batch=2), problem(batch=3)

    def row(p, config, at):
        return (p, FP, dict(config=config, median_us=10.0, spread_us=0.5, samples=9, default_config={"c": 0},
                            default_median_us=12.0, default_spread_us=0.4, method={}, created_at=at))

    db.save_records([row(b, {"c": "b-old"}, t0), row(c, {"c": "c-new"}, t0 + timedelta(days=9))])
    result = db.save_records([row(a, {"c": "a1"}, t0), row(b, {"c": "b-new"}, t0 + timedelta(days=1)),
                              row(c, {"c": "c-old"}, t0), row(a, {"c": "a2"}, t0 + timedelta(days=2)),
                              row(a, {"c": "a0"}, t0 - timedelta(days=1))])
    assert (result.written, result.replaced, result.kept, result.same) == (1, 2, 2, 0)
    assert {r.problem.run_key.batch: r.config["c"] for r in db.records()} == {1: "a2", 2: "b-new", 3: "c-new"}
    with db._read() as session:
        kept = sorted(json.loads(cfg)["c"] for cfg in session.scalars(select(ReplacedRecord.config)))
    assert kept == ["a1", "b-old"]


def test_a_db_of_another_schema_version_is_refused_and_left_as_it_is(db_path):
    save(TuningDB(db_path), problem(), {"c": 1})
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE tuner_meta SET value = '2' WHERE key = 'schema_version'")
    with pytest.raises(DBError, match="has schema version '2'; this tuner reads version 1"):
        TuningDB(db_path).records()
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT value FROM tuner_meta WHERE key = 'schema_version'").fetchone() == ("2",)


def test_of_two_environments_that_apply_the_newest_winner_serves(db_path):
    """Two machines of one kind (their drivers differ) tuned one key: the later tuning wins,
    whichever row was written last (its date set back by hand)."""
    db = TuningDB(db_path)
    older, newer = (dict(FP[1], driver=d) for d in ("1.0", "2.0"))
    save(db, problem(), {"c": "newer"}, fp=(fingerprint_id(newer), newer))
    save(db, problem(), {"c": "older"}, fp=(fingerprint_id(older), older))
    with sqlite3.connect(db_path) as conn:
        [(stamp,)] = conn.execute("SELECT created_at FROM records WHERE fingerprint_id = ?", (fingerprint_id(older),))
        conn.execute("UPDATE records SET created_at = ? WHERE fingerprint_id = ?",
                     ("2020" + stamp[4:], fingerprint_id(older)))
    db = TuningDB(db_path)
    table = db.snapshot(FP[1]).table[("op", '{"h":8}')]
    assert table[attention_run_key(4, 1, 1000)].config == {"c": "newer"}
    assert [r.config for r in db.records(environment=FP[1])] == [{"c": "newer"}]


def test_a_recorded_environment_that_lacks_a_field_this_one_has_does_not_apply():
    from tuner.db.fingerprint import applies, why_not

    recorded = {k: v for k, v in FP[1].items() if k != "triton"}
    assert applies(FP[1], FP[1]) and not applies(recorded, FP[1]) and "triton" in why_not(recorded, FP[1])
    assert not applies(FP[1], recorded)
