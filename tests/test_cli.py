import dataclasses
import io
import json
import gzip
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import pytest
from typer.testing import CliRunner

from tuner.cli import app
from tuner.db import TuningDB
from tuner.keys import AttentionStaticKey

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:")
    for f in fragments:
        assert f in lines[0]
    assert "Traceback" not in result.output


@pytest.fixture
def tiny_shapes(tmp_path):
    f = tmp_path / "shapes.json"
    common = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32")
    f.write_text(json.dumps([dict(batch=1, kv_len=200, **common), dict(batch=2, kv_len=130, q_len=2, **common)]))
    return f


def sweep(db_path, shapes, *extra):
    return cli("sweep", "torch_split_decode", "--shapes", shapes, "--db", db_path,
               "--repeats", 3, "--warmup", 1, *extra)


def test_an_interrupted_sweep_shows_the_shapes_it_finished_and_the_same_command_resumes(db_path, tiny_shapes,
                                                                                        monkeypatch):
    """A sweep stopped by Ctrl-C (or a deadline's SIGINT) printed nothing of what it had
    finished: its table came at the end (a re-ship sweep's log on the H200 held only its
    header). Now it shows the finished shapes, says how to go on, and exits 130."""
    import tuner.sweep.measure

    real, built = tuner.sweep.measure.build_trial, []

    def interrupt_the_second(*args, **kwargs):
        built.append(args)
        if len(built) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(tuner.sweep.measure, "build_trial", interrupt_the_second)
    result = sweep(db_path, tiny_shapes)
    assert result.exit_code == 130, result.output
    assert "winners" in result.stdout and "200" in result.stdout and "130" not in result.stdout.split("winners")[1]
    assert "interrupted after 1 of 2 shapes" in result.stderr and "the same command resumes" in result.stderr
    assert "Traceback" not in result.output
    assert [r.problem.run_key.batch for r in TuningDB(db_path).records()] == [1]
    monkeypatch.undo()
    again = sweep(db_path, tiny_shapes)
    assert again.exit_code == 0 and again.output.count("already in DB") == 1 and len(TuningDB(db_path).records()) == 2
    built.clear()  # --force measures everything again: running it again starts over, and says so
    monkeypatch.setattr(tuner.sweep.measure, "build_trial", interrupt_the_second)
    forced = sweep(db_path, tiny_shapes, "--force")
    assert forced.exit_code == 130 and "without --force resumes the rest (with it, it starts over)" in forced.stderr


def test_ops_lists_the_ops_and_the_heads_each_grid_is_swept_at(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line a row
    result = cli("ops")
    assert result.exit_code == 0
    assert "torch_split_decode" in result.output and "triton_decode" in result.output
    assert "serving (452: 32/8 heads d128 bfloat16)" in result.output
    assert "--model NAME" in result.output


def test_sweep_show_export_import_doctor(tmp_path, db_path, tiny_shapes):
    result = sweep(db_path, tiny_shapes)
    assert result.exit_code == 0, result.output
    assert "winners" in result.output and "2 shapes" in result.output
    records = TuningDB(db_path).records()
    assert len(records) == 2

    again = sweep(db_path, tiny_shapes)
    assert again.exit_code == 0 and again.output.count("already in DB") == 2

    shown = cli("show", "--db", db_path)
    assert shown.exit_code == 0 and "torch_split_decode" in shown.output and "2 winners" in shown.output
    assert "chunk=" in shown.output

    out = tmp_path / "export.json"
    exported = cli("export", "--format", "json", "--out", out, "--db", db_path)
    assert exported.exit_code == 0, exported.output
    doc = json.loads(out.read_text())
    assert len(doc["records"]) == 2 and doc["schema"] == "tuner.tunings"

    other = tmp_path / "other.db"
    imported = cli("import", out, "--db", other)
    assert imported.exit_code == 0, imported.output
    assert [r.config for r in TuningDB(other).records()] == [r.config for r in records]

    doctor = cli("doctor", "--db", db_path)
    assert doctor.exit_code == 0, doctor.output
    assert "integrity: ok" in doctor.output and "fingerprint" in doctor.output


def test_sweep_with_successive_halving(db_path, tiny_shapes):
    result = sweep(db_path, tiny_shapes, "--halving")
    assert result.exit_code == 0, result.output
    db = TuningDB(db_path)
    assert len(db.records()) == 2
    for record in db.records():
        rows = db.measurements(record.problem, record.fingerprint_id)
        assert all(m.rung in (0, 1) for m in rows)
        # the default and the winner were measured fully
        full = [m.config for m in rows if m.rung == 1]
        assert record.default_config in full and record.config in full
    again = sweep(db_path, tiny_shapes, "--search", "halving", "--force")
    assert again.exit_code == 0, again.output
    one_line_error(sweep(db_path, tiny_shapes, "--search", "no-such-search"), "no-such-search")


def test_a_sweep_halves_unless_told_otherwise(db_path, tiny_shapes, monkeypatch):
    """Halving is the default search (it agreed with a precise timing as well as exhaustive
    search on the H200, at under half the GPU time); --search exhaustive times all fully.
    Which configs halving re-times fully depends on their quick timings (on a slow machine
    all may be within 10% of the fastest, and every row is then a full one), so the default's
    use is seen through the strategy itself."""
    from tuner.search import strategies

    halving = strategies()["halving"]
    searched = []

    class Spy:
        name, description = halving.name, halving.description

        def first(self, configs, timer):
            searched.append(len(configs))
            return halving.first(configs, timer)

        def then(self, *args):
            return halving.then(*args)

    monkeypatch.setitem(strategies(), "halving", Spy())

    def rungs(path):
        db = TuningDB(path)
        return {m.rung for r in db.records() for m in db.measurements(r.problem, r.fingerprint_id)}

    assert sweep(db_path, tiny_shapes).exit_code == 0
    assert len(searched) == 2 and rungs(db_path) <= {0, 1}
    other = db_path.with_name("exhaustive.db")
    assert sweep(other, tiny_shapes, "--search", "exhaustive").exit_code == 0
    assert rungs(other) == {1} and len(searched) == 2


def test_a_decode_attention_sweep_searches_only_the_backends_named(db_path):
    from tuner.ops.decode_attention import BACKENDS

    before = list(BACKENDS)
    result = cli("sweep", "decode_attention", "--grid", "cpu-tiny", "--db", db_path, "--backends", "triton_decode",
                 "--repeats", 2, "--warmup", 0, "--max-seconds", 0.01)
    assert result.exit_code == 0, result.output
    db = TuningDB(db_path)
    backends = {m.config["backend"] for r in db.records() for m in db.measurements(r.problem, r.fingerprint_id)}
    assert backends == {"triton_decode"} and list(BACKENDS) == before  # and put back after
    # FA3 alone cannot run on a CPU, where Triton (interpreted) could: the others are left out
    one_line_error(cli("sweep", "decode_attention", "--grid", "cpu-tiny", "--db", db_path, "--backends", "fa3"),
                   "cannot run here")
    one_line_error(cli("sweep", "decode_attention", "--grid", "cpu-tiny", "--db", db_path, "--backends", "nope"),
                   "nope")
    one_line_error(cli("sweep", "torch_split_decode", "--grid", "cpu-tiny", "--db", db_path, "--backends", "fa3"),
                   "--backends")
    assert list(BACKENDS) == before


def test_sweep_a_named_grid(db_path):
    result = cli("sweep", "torch_split_decode", "--grid", "cpu-tiny", "--db", db_path, "--repeats", 2,
                 "--warmup", 0, "--max-seconds", 0.01)
    assert result.exit_code == 0, result.output
    assert len(TuningDB(db_path).records()) == 4


def test_sweep_on_serving_lengths_measures_mixed_batches(db_path, tiny_shapes):
    result = sweep(db_path, tiny_shapes, "--lengths", "serving")
    assert result.exit_code == 0, result.output
    db = TuningDB(db_path)
    assert [r.method.get("lengths") for r in db.records()] == ["serving", "serving"]
    one_line_error(sweep(db_path, tiny_shapes, "--lengths", "zipf"), "--lengths", "full, serving")


@pytest.mark.parametrize("flag, second_trial", [((), True), (("--no-second-trial",), False)])
def test_sweep_confirms_serving_winners_on_a_second_trial_unless_told_not_to(db_path, tiny_shapes, monkeypatch,
                                                                              flag, second_trial):
    import tuner.sweep

    seen = {}
    real = tuner.sweep.sweep
    monkeypatch.setattr(tuner.sweep, "sweep", lambda *a, **kw: seen.update(kw) or real(*a, **kw))
    result = sweep(db_path, tiny_shapes, "--lengths", "serving", *flag)
    assert result.exit_code == 0, result.output
    assert seen["second_trial"] is second_trial


@pytest.mark.parametrize(
    "args, fragments",
    [
        (("sweep", "nosuchop"), ("unknown op", "torch_split_decode")),
        (("sweep", "torch_split_decode", "--grid", "nosuchgrid"), ("no grid", "cpu-small")),
        (("sweep", "torch_split_decode", "--shapes", "/nonexistent.json"), ("cannot read",)),
        (("sweep", "torch_split_decode", "--grid", "cpu-tiny", "--shapes", "x.json"), ("--shapes goes alone",)),
        # a graph op's grid lengths become graph ones; an explicit --lengths full was dropped silently
        (("sweep", "decode_attention_graph", "--grid", "cpu-serving", "--lengths", "full", "--plan"),
         ("not full batches",)),
        # --head-dim 128 (its old default) without --heads was ignored, any other value refused
        (("sweep", "torch_split_decode", "--grid", "cpu-tiny", "--head-dim", "128", "--plan"), ("go with --heads",)),
        (("sweep", "torch_split_decode", "--from-misses", "--dtype", "float16"), ("--dtype",)),
        # (it said `tuner sweep OP` makes one: the misses the user looks for are a server's)
        (("show", "--misses", "--db", "/nonexistent/dir/x.db"), ("no misses recorded: no tuning DB", "lookup mode")),
        (("show", "--db", "/"), ("directory",)),
        (("doctor", "--db", "nosuchdialect://x"), ("cannot open",)),
        (("import", "/nonexistent.json"), ("cannot read",)),
    ],
)
def test_bad_input_gives_one_line_and_exit_2(args, fragments):
    one_line_error(cli(*args), *fragments)


def test_bad_shapes_file(tmp_path, db_path):
    f = tmp_path / "bad.json"
    f.write_text('[{"batch": -1, "kv_len": 10}]')
    one_line_error(sweep(db_path, f), "batch")
    assert not db_path.exists()  # nothing was created for a sweep that could not start


def test_malformed_import_leaves_the_db_unchanged(tmp_path, db_path, tiny_shapes):
    assert sweep(db_path, tiny_shapes).exit_code == 0
    before = [(r.problem, r.config) for r in TuningDB(db_path).records()]
    for content in ("{not json", json.dumps({"schema": "tuner.tunings", "version": 1, "fingerprints": {},
                                              "records": [{"op": 1}]}), "[" * 50000):
        f = tmp_path / "bad.json"
        f.write_text(content)
        one_line_error(cli("import", f, "--db", db_path))
    assert [(r.problem, r.config) for r in TuningDB(db_path).records()] == before


def test_a_gzip_export_imports_like_a_plain_one(tmp_path, db_path, tiny_shapes):
    """A .gz name writes gzip-compressed JSON (a serving grid's tunings run to megabytes)."""
    import gzip

    assert sweep(db_path, tiny_shapes).exit_code == 0
    plain, packed = tmp_path / "x.tunings.json", tmp_path / "x.tunings.json.gz"
    assert cli("export", "--out", plain, "--db", db_path).exit_code == 0
    assert cli("export", "--out", packed, "--db", db_path).exit_code == 0
    unpacked, doc = json.loads(gzip.decompress(packed.read_bytes())), json.loads(plain.read_text())
    assert unpacked.pop("exported_at") and doc.pop("exported_at") and unpacked == doc
    assert packed.stat().st_size < plain.stat().st_size
    first = packed.read_bytes()
    other = tmp_path / "other.db"
    imported = cli("import", packed, "--db", other)
    assert imported.exit_code == 0, imported.output
    assert [r.config for r in TuningDB(other).records()] == [r.config for r in TuningDB(db_path).records()]
    for name, content in (("cut.json.gz", first[: len(first) // 2]), ("not.json.gz", b"plain text"),
                          ("bad.json.gz", gzip.compress(b"{not json"))):
        (tmp_path / name).write_bytes(content)
        one_line_error(cli("import", tmp_path / name, "--db", other), name)


def test_garbage_db_file_is_reported_not_overwritten(tmp_path, tiny_shapes):
    bad = tmp_path / "garbage.db"
    bad.write_bytes(b"not sqlite" * 1000)
    one_line_error(cli("show", "--db", bad), "garbage.db")
    one_line_error(sweep(bad, tiny_shapes), "garbage.db")
    assert bad.read_bytes() == b"not sqlite" * 1000


def test_export_format_must_be_known(tmp_path, db_path):
    TuningDB(db_path)  # (a DB that exists: the format, not the DB, is refused)
    result = cli("export", "--format", "yaml", "--out", tmp_path / "x", "--db", db_path)
    assert result.exit_code == 2 and "--format" in result.stderr and "yaml" in result.stderr
    assert not (tmp_path / "x").exists()


def test_console_script_and_module_entry_points(tmp_path):
    script = Path(sys.executable).parent / "tuner"  # installed by the project's console script
    for cmd in ([sys.executable, "-m", "tuner"], [str(script)]):
        ok = subprocess.run(cmd + ["--version"], capture_output=True, text=True)
        assert ok.returncode == 0 and "tuner 0." in ok.stdout
        bad = subprocess.run(cmd + ["sweep", "nosuchop"], capture_output=True, text=True)
        assert bad.returncode == 2 and "unknown op" in bad.stderr and "Traceback" not in bad.stderr


def run_main(*args):
    """The console script's entry point, as a user's shell runs it."""
    from tuner.cli import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return e.value.code


@pytest.mark.parametrize(
    "args",
    [("export", "--format", "yaml", "--out", "x"), ("sweep",), ("nosuchcommand",),
     ("sweep", "torch_split_decode", "--repeats", "0"), ("export",)],
)
def test_usage_errors_are_one_line_and_exit_2(args, capsys):
    assert run_main(*args) == 2
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if line.strip()]) == 1 and err.startswith("error:")


def test_no_arguments_shows_help_once(capsys):
    assert run_main() == 0
    assert capsys.readouterr().out.count("Usage") == 1


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("sweep", "[/x]"), "unknown op '[/x]'"),  # user text is never read as rich markup
        (("show", "--misses", "--db", "/tmp/[/x]/none.db"), "[/x]"),
        (("show", "--db", "postgresql://u@h:notaport/db"), "URL"),
        (("show", "--db", "/tmp/" + "x" * 5000 + ".db"), "unusable tuning DB path"),
    ],
)
def test_awkward_input_is_reported_in_one_line(args, fragment):
    result = cli(*args)
    one_line_error(result)
    assert fragment in result.stderr


def test_markup_in_stored_configs_is_shown_as_text(tmp_path, db_path, tiny_shapes):
    assert sweep(db_path, tiny_shapes).exit_code == 0
    out = tmp_path / "e.json"
    assert cli("export", "--out", out, "--db", db_path).exit_code == 0
    doc = json.loads(out.read_text())
    # an op of the user's own (tuner's ops refuse a chunk of "[/x]": it breaks their rules)
    doc["records"][0].update(op="my_op", config={"chunk": "[/x]"})
    out.write_text(json.dumps(doc))
    assert cli("import", out, "--db", db_path).exit_code == 0
    shown = cli("show", "--db", db_path)
    assert shown.exit_code == 0 and "chunk=[/x]" in shown.output


def _exported(tmp_path, db_path, tiny_shapes):
    """A swept DB's winners exported as JSON: the file."""
    assert sweep(db_path, tiny_shapes).exit_code == 0
    out = tmp_path / "e.json"
    assert cli("export", "--out", out, "--db", db_path).exit_code == 0
    return out


def test_import_refuses_configs_the_op_cannot_run(tmp_path, db_path, tiny_shapes):
    """decode_attention configs with block_n "banana", a missing key, backend "bogus",
    block_n 3, num_kv_splits 0 were imported, and then every call of that shape raised."""
    out = _exported(tmp_path, db_path, tiny_shapes)
    good = json.loads(out.read_text())
    triton = {"backend": "triton_decode", "block_n": 32, "num_kv_splits": 4, "num_warps": 4, "num_stages": 2}
    bad_configs = [dict(triton, block_n="banana"), {k: v for k, v in triton.items() if k != "num_stages"},
                   dict(triton, backend="bogus"), dict(triton, block_n=3), dict(triton, num_kv_splits=0),
                   dict(triton, num_warps=True)]
    before = TuningDB(db_path).records()
    for config in bad_configs:
        doc = json.loads(json.dumps(good))
        doc["records"][0].update(op="decode_attention", config=config)
        out.write_text(json.dumps(doc))
        result = cli("import", out, "--db", db_path)
        one_line_error(result)
        assert "decode_attention" in result.stderr and "batch" in result.stderr  # names the record
    assert TuningDB(db_path).records() == before  # nothing written
    doc = json.loads(json.dumps(good))
    doc["records"][0].update(op="decode_attention", config=triton)
    out.write_text(json.dumps(doc))
    assert cli("import", out, "--db", db_path).exit_code == 0


def test_a_failed_import_creates_no_db(tmp_path, db_path, tiny_shapes):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "nope"}')
    target = tmp_path / "new.db"
    one_line_error(cli("import", bad, "--db", target))
    assert not target.exists()
    # a document that parses, with a config its op refuses: refused before any DB is made
    doc = json.loads(_exported(tmp_path, db_path, tiny_shapes).read_text())
    doc["records"][0].update(op="decode_attention", config={"backend": "bogus"})
    bad.write_text(json.dumps(doc))
    one_line_error(cli("import", bad, "--db", target), "decode_attention")
    assert not target.exists()


def test_an_import_into_a_db_with_malformed_rows_is_refused_untouched(tmp_path, db_path, tiny_shapes):
    import sqlite3

    export = _exported(tmp_path, db_path, tiny_shapes)
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE records SET config = 'oops' WHERE id = (SELECT min(id) FROM records)")
        before = conn.execute("SELECT * FROM records ORDER BY id").fetchall()
    one_line_error(cli("import", export, "--db", db_path), "will not import into")
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT * FROM records ORDER BY id").fetchall() == before


def test_a_foreign_sqlite_file_is_refused_untouched(tmp_path):
    import sqlite3

    foreign = tmp_path / "app.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE records (x INTEGER)")
    conn.commit()
    conn.close()
    before = foreign.read_bytes()
    one_line_error(cli("show", "--db", foreign), "not a tuning DB")
    one_line_error(cli("sweep", "torch_split_decode", "--grid", "cpu-tiny", "--db", foreign), "not a tuning DB")
    assert foreign.read_bytes() == before


def test_an_unwritable_lock_is_a_one_line_error(tmp_path, tiny_shapes):
    db_path = tmp_path / "t.db"
    (tmp_path / "t.db.lock").mkdir()  # the lock file cannot be created, as in a read-only directory
    one_line_error(sweep(db_path, tiny_shapes), "cannot create tuning DB")


def test_doctor_lists_records_of_other_environments(tmp_path, db_path):
    from tuner.db import Problem, current_fingerprint, fingerprint_id
    from tuner.keys import attention_run_key

    other = dict(current_fingerprint(), device="Some Other GPU")
    db = TuningDB(db_path)
    db.save_record(Problem("op", '{"h":1}', attention_run_key(1, 1, 8)), (fingerprint_id(other), other), {"c": 1},
                   median_us=1.0, spread_us=0.0, samples=1, default_config={"c": 0}, default_median_us=1.0,
                   default_spread_us=0.0, method={})
    result = cli("doctor", "--db", db_path)
    assert result.exit_code == 0
    row = next(line for line in result.output.splitlines() if fingerprint_id(other) in line)
    assert "Some Other GPU" in row and row.rstrip("│ ").endswith("no")
    shown = cli("show", "--db", db_path)
    assert "0 winners stored that apply here" in shown.output
    every = cli("show", "--db", db_path, "--all")  # the environment in each table's title, not a column
    assert f"environment {fingerprint_id(other)}" in every.output and "1 winner stored in" in every.output
    here = current_fingerprint()
    db.save_record(Problem("op", '{"h":1}', attention_run_key(1, 1, 8)), (fingerprint_id(here), here), {"c": 1},
                   median_us=1.0, spread_us=0.0, samples=1, default_config={"c": 0}, default_median_us=1.0,
                   default_spread_us=0.0, method={})
    assert "1 winner stored that applies here" in cli("show", "--db", db_path).output


def test_show_folds_configs_at_80_columns(tmp_path, db_path, monkeypatch):
    """A long config is folded onto more lines, never cut off with an ellipsis."""
    from tuner.db import Problem, current_fingerprint, current_fingerprint_id
    from tuner.keys import attention_run_key

    monkeypatch.setenv("COLUMNS", "80")
    config = {"backend": "triton_decode", "block_n": 128, "num_kv_splits": 128, "num_stages": 3, "num_warps": 4}
    db = TuningDB(db_path)
    db.save_record(Problem("decode_attention", '{"h":1}', attention_run_key(1, 1, 131072)),
                   (current_fingerprint_id(), current_fingerprint()), config, median_us=31.8, spread_us=0.1,
                   samples=20, default_config={"backend": "fa3"}, default_median_us=36.8, default_spread_us=0.1,
                   method={})
    db.save_record(Problem("torch_split_decode", '{"h":2}', attention_run_key(16, 1, 8192)),
                   (current_fingerprint_id(), current_fingerprint()), {"chunk": 0}, median_us=169734.4,
                   spread_us=0.1, samples=5, default_config={"chunk": 0}, default_median_us=169734.4,
                   default_spread_us=0.1, method={})
    # a long config with 6-digit timings: the config column gives way to the numbers
    db.save_record(Problem("decode_attention", '{"h":3}', attention_run_key(1, 1, 131072)),
                   (current_fingerprint_id(), current_fingerprint()), config, median_us=123456.7, spread_us=0.1,
                   samples=20, default_config={"backend": "fa3"}, default_median_us=234567.8, default_spread_us=0.1,
                   method={})
    out = cli("show", "--db", db_path, "--all").output
    assert "…" not in out and max(map(len, out.splitlines())) <= 80
    assert "234,567.8" in out and "1.90x │" in out
    for name, value in config.items():
        assert f"{name}={value}" in out
    # a short config leaves the room to the numbers: that table is whole too (its right border)
    assert "│ 1.00x │" in out.replace("   1.00x", " 1.00x")


def test_prune_removes_other_environments_only_and_dry_run_removes_nothing(tmp_path, db_path, tiny_shapes):
    from tuner.db import Problem, current_fingerprint, current_fingerprint_id, fingerprint_id
    from tuner.keys import attention_run_key

    assert sweep(db_path, tiny_shapes).exit_code == 0
    ours = TuningDB(db_path).counts()[current_fingerprint_id()]
    other = dict(current_fingerprint(), torch="0.0-old")
    db = TuningDB(db_path)
    problem = Problem("op", '{"h":1}', attention_run_key(1, 1, 8))
    db.save_record(problem, (fingerprint_id(other), other), {"c": 1}, median_us=1.0, spread_us=0.0, samples=1,
                   default_config={"c": 0}, default_median_us=1.0, default_spread_us=0.0, method={})
    db.save_measurement(problem, (fingerprint_id(other), other), {"c": 1}, kv_len=8, status="ok", median_us=1.0,
                        spread_us=0.0, samples=1, method={})

    dry = cli("prune", "--dry-run", "--db", db_path)
    assert dry.exit_code == 0 and "would remove" in dry.output and fingerprint_id(other) in dry.output
    assert fingerprint_id(other) in TuningDB(db_path).counts()

    done = cli("prune", "--db", db_path)
    assert done.exit_code == 0 and "removed" in done.output
    after = TuningDB(db_path)
    assert after.counts() == {current_fingerprint_id(): ours}
    assert set(after.fingerprints()) == {current_fingerprint_id()} and after.integrity() == []
    again = cli("prune", "--db", db_path)
    assert again.exit_code == 0 and "nothing to prune" in again.output


def test_prune_of_a_missing_db_is_one_line_exit_2(tmp_path):
    one_line_error(cli("prune", "--db", tmp_path / "none.db"), "no tuning DB")
    assert not (tmp_path / "none.db").exists()


def _truncated_db(tmp_path, tiny_shapes):
    path = tmp_path / "truncated.db"
    assert sweep(path, tiny_shapes).exit_code == 0
    import sqlite3

    with sqlite3.connect(path) as conn:  # everything into the main file, then cut it in half
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for side in ("-wal", "-shm"):
        (tmp_path / f"truncated.db{side}").unlink(missing_ok=True)
    data = path.read_bytes()
    page_size = int.from_bytes(data[16:18], "big")
    path.write_bytes(data[: 2 * page_size])  # the schema page survives, the tables' pages do not
    return path, path.read_bytes()


def test_a_truncated_db_is_reported_and_kept_until_sweep_force_sets_it_aside(tmp_path, tiny_shapes):
    path, truncated = _truncated_db(tmp_path, tiny_shapes)
    for args in (("show",), ("export", "--out", tmp_path / "x.json")):
        one_line_error(cli(*args, "--db", path), "truncated.db")
    doctor = cli("doctor", "--db", path)
    assert doctor.exit_code == 1 and "Traceback" not in doctor.output  # doctor: integrity problems, exit 1
    one_line_error(sweep(path, tiny_shapes), "truncated.db", "--force")
    assert path.read_bytes() == truncated  # nothing overwritten
    forced = sweep(path, tiny_shapes, "--force")
    assert forced.exit_code == 0, forced.output
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("truncated.db.unreadable-") and "-" not in p.name[-4:]]
    assert aside.read_bytes() == truncated and len(TuningDB(path).records()) == 2


def test_runtime_on_a_truncated_db_warns_once_and_runs_defaults(tmp_path, tiny_shapes):
    import warnings

    import torch

    import tuner

    path, truncated = _truncated_db(tmp_path, tiny_shapes)
    tuner.configure(db=path, mode="lookup")

    @tuner.autotune("t", configs=[{"c": 1}], default={"c": 0}, static_key=lambda x: "s",
                    run_key=lambda x: (1, 1, 8))
    def f(x, *, config):
        return config["c"]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [f(torch.zeros(1)) for _ in range(3)] == [0, 0, 0]
    assert len([w for w in caught if "tuner" in str(w.message)]) == 1
    assert path.read_bytes() == truncated


def test_runtime_misses_are_listed_and_swept(tmp_path, db_path):
    import tuner
    from tuner.workload import DecodeShape

    common = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32")
    shapes = tmp_path / "one.json"
    shapes.write_text(json.dumps([dict(batch=1, kv_len=200, **common)]))
    assert sweep(db_path, shapes).exit_code == 0
    static_json = DecodeShape(batch=1, kv_len=200, **common).static_key().to_json()
    tuner.configure(db=db_path, mode="lookup")

    @tuner.autotune("torch_split_decode", configs=[{"chunk": 0}], default={"chunk": 0},
                    key=lambda batch, kv: (static_json, batch, 1, kv), static_json=lambda s: s)
    def decode(batch, kv, *, config):
        return config

    for _ in range(3):  # one key, resolved once: the hot path records nothing
        decode(2, 400)
    decode(1, 200)  # an exact winner: not a miss
    assert tuner.flush_misses() == 1

    shown = cli("show", "--misses", "--db", db_path)
    [record] = TuningDB(db_path).records()  # lent to batch 2 only if it beat its default by 10%
    served = "nearest" if record.speedup and record.speedup >= 1.1 else "default"
    assert shown.exit_code == 0 and "1 missed key without" in shown.output and served in shown.output
    [suggested] = [line.strip() for line in shown.output.splitlines() if line.strip().startswith("tuner sweep")]
    assert suggested == f"tuner sweep torch_split_decode --from-misses --db {db_path}"
    swept = cli(*shlex.split(suggested)[1:], "--repeats", "2")  # the command it suggests, as given
    assert swept.exit_code == 0, swept.output
    run_keys = {(r.problem.run_key.batch, r.problem.run_key.kv_len_bucket) for r in TuningDB(db_path).records()}
    assert run_keys == {(1, 256), (2, 512)}
    again = cli("show", "--misses", "--db", db_path)
    assert "0 missed keys" in again.output
    # misses are this environment's (tuned here): --all, which widens winners, was ignored
    both = cli("show", "--misses", "--all", "--db", db_path)
    assert both.exit_code == 2 and "--all is for winners" in both.output
    assert "no missed keys" in cli("sweep", "torch_split_decode", "--from-misses", "--db", db_path).output


def test_show_misses_of_a_function_no_sweep_knows_suggests_tune_mode(db_path):
    """`tuner sweep OP --from-misses` was suggested for every miss: for a user's own function
    it fails, as sweeps know tuner's ops only."""
    import tuner

    tuner.configure(db=db_path, mode="lookup")

    @tuner.autotune("my_softmax", configs=[{"rows": 1}, {"rows": 64}], default={"rows": 1},
                    key=lambda n: (("float32", 64), n, 1, 64))
    def softmax(n, *, config):
        return config

    softmax(8)
    assert tuner.flush_misses() == 1
    shown = cli("show", "--misses", "--db", db_path)
    assert shown.exit_code == 0, shown.output
    assert f"TUNER_MODE=tune TUNER_DB={db_path} python YOUR_PROGRAM.py" in shown.output
    assert "tuner sweep" not in shown.output
    assert "unknown op" in cli("sweep", "my_softmax", "--from-misses", "--db", db_path).output


def test_a_grid_is_swept_for_every_static_key_the_runtime_missed(tmp_path, db_path):
    """--grid with --from-misses: a new deployment's whole grid (the serving grid, say) for the
    static keys its calls missed, not only the run keys they happened to call."""
    import tuner
    from tuner.ops import get_grid, get_op
    from tuner.workload import DecodeShape

    common = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32")
    static_json = DecodeShape(batch=1, kv_len=200, **common).static_key().to_json()
    TuningDB(db_path).close()
    tuner.configure(db=db_path, mode="lookup")

    @tuner.autotune("torch_split_decode", configs=[{"chunk": 0}], default={"chunk": 0},
                    key=lambda batch, kv: (static_json, batch, 1, kv), static_json=lambda s: s)
    def decode(batch, kv, *, config):
        return config

    decode(3, 300)
    assert tuner.flush_misses() == 1
    swept = cli("sweep", "torch_split_decode", "--grid", "cpu-tiny", "--from-misses", "--db", db_path,
                "--repeats", "2", "--warmup", "0", "--max-seconds", "0.01")
    assert swept.exit_code == 0, swept.output
    records = TuningDB(db_path).records()
    assert {r.problem.static_key for r in records} == {static_json}
    grid = get_grid(get_op("torch_split_decode"), "cpu-tiny")
    assert {r.problem.run_key for r in records} == {s.run_key() for s in grid}
    one_line_error(cli("sweep", "torch_split_decode", "--shapes", str(tmp_path / "x.json"), "--from-misses",
                       "--db", db_path), "--shapes")


def test_misses_are_not_recorded_without_a_readable_db(tmp_path):
    import tuner

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not sqlite" * 100)
    tuner.configure(db=garbage, mode="lookup")

    @tuner.autotune("op", configs=[{"c": 0}], default={"c": 0}, key=lambda x: ("s", 1, 1, x))
    def f(x, *, config):
        return config

    with pytest.warns(UserWarning):
        f(8)
    assert tuner.flush_misses() == 0 and garbage.read_bytes() == b"not sqlite" * 100


def test_report_plots_and_summarises_the_winners(tmp_path, db_path, tiny_shapes):
    assert sweep(db_path, tiny_shapes).exit_code == 0
    out = tmp_path / "report"
    result = cli("report", "--out", out, "--db", db_path, "--bandwidth-gbps", "100")
    assert result.exit_code == 0, result.output
    pngs = sorted(out.glob("*.png"))
    assert [p.name.split("__")[-1] for p in pngs] == ["roofline.png", "speedup.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000 for p in pngs)
    md = (out / "report.md").read_text()
    assert "## torch_split_decode" in md and "geometric-mean speedup" in md and "| roofline |" in md
    records = TuningDB(db_path).records()
    assert md.count("| 1 |") + md.count("| 2 |") >= len(records)  # a row per winner
    assert all(f"![{p.name}]({p.name})" in md for p in pngs)
    assert "winners by op and static key" in result.output
    empty = cli("report", "--out", tmp_path / "empty", "--db", tmp_path / "none.db")
    one_line_error(empty, "no tuning DB")


def test_a_report_of_an_op_without_winners_says_so_and_leaves_no_earlier_plots(tmp_path, db_path, tiny_shapes):
    """`report --op X` where X has no winners printed an empty table and kept the plots an
    earlier report had drawn into the directory, as if they were this report's."""
    assert sweep(db_path, tiny_shapes).exit_code == 0
    out = tmp_path / "report"
    assert cli("report", "--out", out, "--db", db_path).exit_code == 0
    assert list(out.glob("*__speedup.png"))
    mine = out / "notes.png"
    mine.write_bytes(b"a user's file")
    again = cli("report", "--out", out, "--db", db_path, "--op", "decode_attention")
    assert again.exit_code == 0, again.output
    assert "no winners of decode_attention apply here" in again.output
    assert "No winners of decode_attention" in (out / "report.md").read_text()
    assert sorted(p.name for p in out.glob("*.png")) == ["notes.png"]  # a file not of a report stays


def test_report_of_another_environment(tmp_path, db_path):
    """A GPU's winners, reported from a machine without that GPU (--environment)."""
    from tuner.db import Problem, current_fingerprint, fingerprint_id
    from tuner.keys import attention_run_key
    from tuner.workload.shapes import DecodeShape

    gpu = dict(current_fingerprint(), device="NVIDIA H200", device_kind="cuda")
    gpu_id = fingerprint_id(gpu)
    shape = DecodeShape(batch=4, kv_len=2048)
    db = TuningDB(db_path)
    db.save_record(Problem("fa3", shape.static_key().to_json(), attention_run_key(4, 1, 2048)), (gpu_id, gpu),
                   {"num_splits": 2, "pack_gqa": True}, median_us=10.0, spread_us=0.1, samples=20,
                   default_config={"num_splits": 0, "pack_gqa": None}, default_median_us=12.0,
                   default_spread_us=0.1, method={"timer": "cuda-graph"})
    db.close()
    here = cli("report", "--out", tmp_path / "here", "--db", db_path)
    assert here.exit_code == 0 and "no winners apply here" in here.output  # this machine has none of its own
    there = cli("report", "--out", tmp_path / "there", "--db", db_path, "--environment", gpu_id)
    assert there.exit_code == 0, there.output
    assert "1.200x" in there.output and list((tmp_path / "there").glob("*speedup.png"))
    one_line_error(cli("report", "--out", tmp_path / "x", "--db", db_path, "--environment", "nope"),
                   "is not in the DB")


# -- issue 10: every bad input one line, exit 2; damage found by doctor, exit 1 -------------------


@pytest.mark.parametrize("option, value", [("--max-seconds", "inf"), ("--max-seconds", "nan"),
                                           ("--min-gain", "nan")])
def test_non_finite_numbers_are_refused_before_any_measurement(tmp_path, tiny_shapes, option, value, capsys):
    code = run_main("sweep", "torch_split_decode", "--shapes", tiny_shapes, "--db", tmp_path / "x.db", option, value)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and option in err and "Traceback" not in err
    assert not (tmp_path / "x.db").exists()


@pytest.mark.parametrize("command", [("show",), ("sweep", "torch_split_decode"), ("doctor",)])
def test_an_empty_db_option_is_refused_not_taken_for_the_default(tmp_path, tiny_shapes, command, capsys, monkeypatch):
    """--db "$UNSET" used the default DB, silently."""
    monkeypatch.setenv("TUNER_DB", str(tmp_path / "default.db"))
    extra = ("--shapes", tiny_shapes) if command[0] == "sweep" else ()
    code = run_main(*command, *extra, "--db", " ")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--db" in err and "is empty" in err
    assert not (tmp_path / "default.db").exists()


@pytest.mark.parametrize("env, fragment", [
    ({"WORLD_SIZE": "banana"}, "WORLD_SIZE must be an integer"),
    ({"WORLD_SIZE": "2"}, "RANK is not"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK must be in [0, 1]"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR is not set"),
])
def test_a_broken_launcher_environment_is_one_line(tmp_path, tiny_shapes, env, fragment):
    result = runner.invoke(app, ["sweep", "torch_split_decode", "--shapes", str(tiny_shapes), "--db",
                                 str(tmp_path / "x.db")], env=env)
    one_line_error(result, fragment)


def test_an_unknown_op_is_bad_input_everywhere(tmp_path, db_path, tiny_shapes):
    assert sweep(db_path, tiny_shapes).exit_code == 0
    for args in (("show", "--op", "no_such_op"), ("export", "--op", "no_such_op", "--out", tmp_path / "e.json"),
                 ("report", "--op", "no_such_op", "--out", tmp_path / "r")):
        one_line_error(cli(*args, "--db", db_path), "unknown op 'no_such_op'")
    assert cli("show", "--op", "torch_split_decode", "--db", db_path).exit_code == 0


def test_flags_show_no_value_in_help():
    """typer 0.29 printed `--force <bool>`, a value the parser then refuses."""
    for command in ([], ["sweep"], ["show"], ["export"], ["import"], ["prune"], ["doctor"]):
        result = runner.invoke(app, command + ["--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0 and "<bool>" not in result.output, command
    assert "<int range>" in runner.invoke(app, ["sweep", "--help"], env={"COLUMNS": "200"}).output


def test_malformed_rows_give_one_line_in_the_cli_and_doctor_lists_them(tmp_path, db_path, tiny_shapes):
    import sqlite3

    assert sweep(db_path, tiny_shapes).exit_code == 0
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE records SET config = '[1, 2]' WHERE batch = 1")
    for args in (("show",), ("export", "--out", tmp_path / "e.json"), ("report", "--out", tmp_path / "r"),
                 ("sweep", "torch_split_decode", "--shapes", tiny_shapes)):
        one_line_error(cli(*args, "--db", db_path), "malformed")
    doctor = cli("doctor", "--db", db_path)
    assert doctor.exit_code == 1 and "malformed" in doctor.stderr and "integrity: ok" not in doctor.output
    assert cli("prune", "--db", db_path).exit_code == 0
    assert cli("doctor", "--db", db_path).exit_code == 0 and cli("show", "--db", db_path).exit_code == 0


def test_a_db_without_its_version_row_is_damage_for_every_command(tmp_path, db_path, tiny_shapes):
    import sqlite3

    out = _exported(tmp_path, db_path, tiny_shapes)
    with sqlite3.connect(db_path) as conn:
        conn.execute("DELETE FROM tuner_meta")
    before = db_path.read_bytes()
    doctor = cli("doctor", "--db", db_path)
    assert doctor.exit_code == 1 and "no schema version" in doctor.stderr
    one_line_error(cli("import", out, "--db", db_path), "damaged")
    one_line_error(sweep(db_path, tiny_shapes), "damaged")  # not adopted as a new DB
    one_line_error(cli("show", "--db", db_path), "damaged")
    assert db_path.read_bytes() == before


def test_a_file_past_the_size_bound_is_one_line_without_reading_it_all(tmp_path, db_path):
    """`tuner import /dev/zero` read without end (MemoryError, a traceback), and a gzip bomb
    was inflated whole: now at most settings.MAX_JSON_BYTES + 1 bytes are read."""
    import gzip

    from tuner import settings

    one_line_error(cli("import", "/dev/zero", "--db", db_path), "/dev/zero", "more than 256 MiB")
    # 0.3 MB of gzip members, each a MiB of spaces: 300 MiB of (valid) JSON whitespace
    bomb = tmp_path / "bomb.tunings.json.gz"
    bomb.write_bytes(gzip.compress(b" " * 2**20) * 300)
    assert bomb.stat().st_size < 600_000 and settings.MAX_JSON_BYTES < 300 * 2**20
    one_line_error(cli("import", bomb, "--db", db_path), "bomb.tunings.json.gz", "more than 256 MiB",
                   "decompressed")
    assert not db_path.exists()


@pytest.mark.parametrize("field", ["op", "tuner_version"])
def test_a_lone_surrogate_in_an_imported_text_is_one_line(tmp_path, db_path, tiny_shapes, field):
    """"\\ud800" (a JSON escape of half a UTF-16 pair) has no UTF-8 form: as an op it reached
    the DB's driver and came back as a UnicodeEncodeError traceback."""
    assert sweep(db_path, tiny_shapes).exit_code == 0
    out = tmp_path / "e.json"
    assert cli("export", "--out", out, "--db", db_path).exit_code == 0
    doc = json.loads(out.read_text())
    (doc["records"][0] if field == "op" else doc)[field] = "my_op\ud800"
    out.write_text(json.dumps(doc))
    assert "\\ud800" in out.read_text()
    other = tmp_path / "other.db"
    one_line_error(cli("import", out, "--db", other), field, "UTF-8")
    assert not other.exists()


def test_export_replaces_a_file_only_with_force_and_never_the_db_itself(tmp_path, db_path, tiny_shapes):
    """`tuner export --db t.db --out t.db` wrote the JSON over the DB, every winner lost (a
    helper's review); any other file was replaced silently too, where LightLLM's files already
    needed --force."""
    assert sweep(db_path, tiny_shapes).exit_code == 0
    before = db_path.read_bytes()
    for flags in ((), ("--force",)):
        one_line_error(cli("export", "--out", db_path, "--db", db_path, *flags), "is the tuning DB itself")
    assert db_path.read_bytes() == before
    precious = tmp_path / "notes.txt"
    precious.write_text("precious")
    one_line_error(cli("export", "--out", precious, "--db", db_path), "exists", "--force")
    assert precious.read_text() == "precious"
    assert cli("export", "--out", precious, "--db", db_path, "--force").exit_code == 0
    assert json.loads(precious.read_text())["records"]


def test_an_op_name_with_brackets_is_shown_as_it_is(tmp_path, db_path, tiny_shapes):
    """An op named "row_softmax[/fast]" (a function's name under @tuner.autotune, or an
    imported record's) made `tuner show` print rich's MarkupError traceback, and "attn[fp16]"
    lost its "[fp16]" (a helper's review)."""
    assert sweep(db_path, tiny_shapes).exit_code == 0
    out = tmp_path / "e.json"
    assert cli("export", "--out", out, "--db", db_path).exit_code == 0
    doc = json.loads(out.read_text())
    for record, name in zip(doc["records"], ("row_softmax[/fast]", "attn[fp16]")):
        record["op"] = name
    out.write_text(json.dumps(doc))
    other = tmp_path / "other.db"
    assert cli("import", out, "--db", other).exit_code == 0
    for flags in ((), ("--all",), ("--op", "attn[fp16]")):
        shown = cli("show", "--db", other, *flags)
        assert shown.exit_code == 0 and "Traceback" not in shown.output, shown.output
        assert "attn[fp16]" in shown.output
    assert "row_softmax[/fast]" in cli("show", "--db", other).output


def test_doctors_tables_in_a_log_keep_each_row_on_one_line(db_path, monkeypatch):
    """In a log (not a terminal: rich's 80 columns) doctor's "why not" was folded mid-phrase,
    "made on NVIDIA H200, / is AMD EPYC" (a helper's review), where sweep's tables were
    printed wide already; every command's tables are now."""
    shipped = Path(__file__).resolve().parents[1] / "tuning_cache" / "h200.tunings.json.gz"
    monkeypatch.setenv("TUNER_SHIPPED", str(shipped))
    done = cli("doctor", "--db", db_path)
    rows = [line for line in done.output.splitlines() if "h200.tunings.json.gz" in line]
    assert len(rows) == 1 and "made on NVIDIA H200, this is" in rows[0], done.output


def test_show_without_a_db_says_so_and_what_the_shipped_tunings_give(tmp_path, db_path, tiny_shapes, monkeypatch):
    """On a fresh machine `tuner show` failed, "no tuning DB yet", exit 2, where shipped
    winners applied (a helper's walkthrough): no DB is no winners stored, not an error."""
    assert sweep(db_path, tiny_shapes).exit_code == 0
    shipped = tmp_path / "shipped.json"
    assert cli("export", "--db", db_path, "--out", shipped).exit_code == 0
    monkeypatch.setenv("TUNER_SHIPPED", str(shipped))
    fresh = tmp_path / "fresh.db"
    shown = cli("show", "--db", fresh)
    assert shown.exit_code == 0, shown.output
    assert "no tuning DB at" in shown.output and "2 shipped winners apply here" in shown.output
    assert not fresh.exists()


def test_a_tilde_after_an_equals_sign_is_the_home_directory(tmp_path, db_path, tiny_shapes, monkeypatch):
    """The shell leaves `--out=~/x` as it is: export and report made a directory named "~"
    in the current one (a helper's walkthrough), where --db expanded it."""
    assert sweep(db_path, tiny_shapes).exit_code == 0
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert cli("export", "--db", db_path, "--out=~/e.json").exit_code == 0
    assert cli("report", "--db", db_path, "--out=~/r").exit_code == 0
    assert cli("import", "~/e.json", "--db", tmp_path / "again.db").exit_code == 0
    assert (home / "e.json").is_file() and (home / "r" / "report.md").is_file() and not list(work.iterdir())


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_output_to_a_full_disk_is_one_line_and_exit_2(tmp_path, tiny_shapes):
    """A log on a full disk: every write raised, and the sweep died in tracebacks, its worker
    restarted twice (a helper's walkthrough)."""
    for args in (("sweep", "torch_split_decode", "--shapes", str(tiny_shapes), "--repeats", "2"), ("show",)):
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, "-m", "tuner", *args, "--db", str(tmp_path / "t.db")],
                                  stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.splitlines() == [
            "error: cannot write the output: No space left on device"], done.stderr


def test_a_warning_of_the_command_is_one_line(tmp_path):
    """Python's form printed the warning's source path and line, then that line's code."""
    done = subprocess.run([sys.executable, "-m", "tuner", "show", "--db", str(tmp_path / "t.db")],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, TUNER_MODE="bogus"))
    assert done.returncode == 0 and done.stderr.splitlines() == [
        "warning: TUNER_MODE='bogus' is not one of off, lookup, tune, force; using 'lookup'"], done.stderr


def test_a_message_in_a_log_stays_on_one_line(tmp_path):
    """Where the output is not a terminal rich folds at 80 columns: "exported 10 winners to
    \n/path" broke a grep of the log (a helper's walkthrough)."""
    deep = tmp_path / ("a_directory_name_long_enough_to_pass_eighty_columns_" * 2)
    deep.mkdir()
    shipped = Path(__file__).resolve().parents[1] / "tuning_cache" / "h200.tunings.json.gz"
    done = subprocess.run([sys.executable, "-m", "tuner", "import", str(shipped), "--db", str(deep / "t.db")],
                          capture_output=True, text=True, env=dict(os.environ, COLUMNS=""), timeout=120)
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.startswith("imported")]
    assert str(deep / "t.db") in line and line.endswith("unchanged)"), done.stdout


def test_export_never_writes_through_a_link_planted_at_its_names(tmp_path, db_path, tiny_shapes):
    """export wrote F.tmp by name and renamed it onto F: a link planted at F.tmp made it
    overwrite the link's target, and F ended up a link to it."""
    import stat

    assert sweep(db_path, tiny_shapes).exit_code == 0
    victim, other = tmp_path / "victim", tmp_path / "other"
    victim.write_text("precious")
    other.write_text("also precious")
    for name in ("e.json", "e.json.gz"):
        out = tmp_path / name
        (tmp_path / f"{name}.tmp").symlink_to(victim)
        result = cli("export", "--out", out, "--db", db_path)
        assert result.exit_code == 0, result.output
        assert victim.read_text() == "precious"
        assert out.is_file() and not out.is_symlink()
        out.unlink()
        out.symlink_to(other)  # a link at F itself is replaced (--force), not written through
        assert cli("export", "--out", out, "--db", db_path, "--force").exit_code == 0
        assert other.read_text() == "also precious" and out.is_file() and not out.is_symlink()
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~mask  # as a plain create: readable by others
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_report_never_writes_through_a_link_planted_at_its_files(tmp_path, db_path, tiny_shapes):
    assert sweep(db_path, tiny_shapes).exit_code == 0
    out = tmp_path / "report"
    assert cli("report", "--out", out, "--db", db_path).exit_code == 0
    written = sorted(p.name for p in out.iterdir())
    assert "report.md" in written and any(n.endswith(".png") for n in written)
    victims = {}
    for name in written:  # the same names again, each a link to a file that must stay as it is
        victims[name] = tmp_path / f"victim-{name}"
        victims[name].write_text(f"precious {name}")
        (out / name).unlink()
        (out / name).symlink_to(victims[name])
    result = cli("report", "--out", out, "--db", db_path)
    assert result.exit_code == 0, result.output
    for name, victim in victims.items():
        assert victim.read_text() == f"precious {name}"
        assert (out / name).is_file() and not (out / name).is_symlink()
    assert sorted(p.name for p in out.iterdir()) == written
    assert "## torch_split_decode" in (out / "report.md").read_text()


def test_a_failed_export_leaves_the_file_as_it_was_and_no_temporary_file(tmp_path, db_path, tiny_shapes,
                                                                         monkeypatch):
    assert sweep(db_path, tiny_shapes).exit_code == 0
    out = tmp_path / "out"
    out.mkdir()
    target = out / "e.json"
    target.write_text("before")

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    one_line_error(cli("export", "--out", target, "--db", db_path, "--force"), "cannot write", "e.json", "No space left")
    assert target.read_text() == "before" and [p.name for p in out.iterdir()] == ["e.json"]


def test_a_postgresql_url_without_its_driver_says_how_to_install_it(monkeypatch):
    """`--db postgresql://...` failed with "No module named 'psycopg'" and no hint: the driver
    was in the test extra only."""
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as where it is not installed
    for url in ("postgresql://tuner@127.0.0.1:1/none", "postgresql+psycopg://tuner@127.0.0.1:1/none"):
        one_line_error(cli("show", "--db", url), "tuner-attn[postgres]")


def test_a_plain_postgresql_url_takes_the_driver_the_postgres_extra_installs():
    from tuner.db import resolve_db_url

    assert resolve_db_url("postgresql://u@h/db")[0].drivername == "postgresql+psycopg"
    assert resolve_db_url("postgresql+psycopg2://u@h/db")[0].drivername == "postgresql+psycopg2"  # as given


def test_a_grid_is_swept_at_your_models_heads_for_each_tp_and_layer_kind(tmp_path, db_path):
    """The named grids use one head configuration; --model and --heads sweep them at yours."""
    config = tmp_path / "config.json"  # small heads, so that the CPU sweep is quick
    config.write_text(json.dumps({"model_type": "gemma2", "num_attention_heads": 8, "num_key_value_heads": 4,
                                  "head_dim": 16, "sliding_window": 64, "attn_logit_softcapping": 30.0}))
    shapes = tmp_path / "one.json"
    shapes.write_text(json.dumps([dict(batch=1, kv_len=128, num_q_heads=32, num_kv_heads=8, head_dim=128,
                                       dtype="float32")]))
    done = sweep(db_path, shapes, "--model", config, "--tp", "1,4")
    assert done.exit_code == 0, done.output
    keys = {AttentionStaticKey.from_json(r.problem.static_key) for r in TuningDB(db_path).records()}
    assert {(k.num_q_heads, k.num_kv_heads, k.head_dim_qk, k.window_left, bool(k.softcap)) for k in keys} == {
        (8, 4, 16, -1, True), (8, 4, 16, 63, True), (2, 1, 16, -1, True), (2, 1, 16, 63, True)}
    by_hand = sweep(tmp_path / "other.db", shapes, "--heads", "6/2", "--head-dim", "16", "--sinks")
    assert by_hand.exit_code == 0, by_hand.output
    [record] = TuningDB(tmp_path / "other.db").records()
    key = AttentionStaticKey.from_json(record.problem.static_key)
    assert (key.num_q_heads, key.num_kv_heads, key.head_dim_qk, key.sinks) == (6, 2, 16, True)


@pytest.mark.parametrize("args, says", [
    (("--model", "llama-9-9b"), "unknown model 'llama-9-9b'"),
    (("--model", "qwen2.5-7b", "--tp", "8"), "tp 8 does not divide the 28 query heads"),
    (("--model", "llama-3.1-8b", "--heads", "8/1"), "not both"),
    (("--heads", "8/1", "--tp", "2"), "--tp splits a --model's heads"),
    (("--window", "128",), "go with --heads"),
    (("--heads", "8/3"), "must divide"),
    (("--model", "llama-3.1-8b", "--dtype", "float64"), "--dtype must be"),
    (("--model", "llama-3.1-8b", "--page-size", "3"), "--page-size must be"),
])
def test_bad_model_options_are_one_line(tmp_path, db_path, tiny_shapes, args, says):
    one_line_error(sweep(db_path, tiny_shapes, *args), says)
    assert not db_path.exists()  # nothing started


def test_a_hostile_model_config_is_one_line(tmp_path, db_path, tiny_shapes):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_attention_heads": 2**70, "num_key_value_heads": 8}))
    one_line_error(sweep(db_path, tiny_shapes, "--model", config), "num_attention_heads must be an integer")


def test_a_sweep_logged_to_a_file_prints_progress_lines(db_path, tiny_shapes, monkeypatch):
    """A sweep's log (not a terminal) held only its header line for 480 s: no progress, no
    estimate."""
    from tuner import settings

    monkeypatch.setattr(settings, "PROGRESS_EVERY_S", 0.02)
    done = sweep(db_path, tiny_shapes, "--repeats", 20)
    assert done.exit_code == 0, done.output
    lines = [line for line in done.output.splitlines() if line.startswith("progress: shape ")]
    assert lines, done.output
    assert " measurements, " in lines[-1] and " elapsed" in lines[-1]
    assert any(" left" in line for line in lines)


def test_a_dense_pass_in_the_progress_lines_is_its_shapes_not_the_next(db_path):
    """A log said "shape 2 of 2" during shape 1's dense pass, and again for shape 2 (a
    helper's review): a step that measures nothing counted as a shape."""
    from rich.console import Console

    from tuner.cli.sweep import _ProgressLog

    log = _ProgressLog(2, 6, Console(file=io.StringIO()), enabled=False)
    log.advance(3, "b1")
    log.advance(0, "b1 (dense pass)")
    assert log.line().startswith("progress: shape 1 of 2 (b1 (dense pass)), 3 of 6 measurements")
    assert "left" in log.line()
    log.advance(3, "b2")
    assert log.line().startswith("progress: shape 2 of 2 (b2), 6 of 6 measurements")
    # (a third of a run said "about 0m00s left" while the last second trials and dense pass ran)
    assert "0m00s left" not in log.line() and "confirming the last winners" in log.line()


def test_the_sweep_table_in_a_log_keeps_its_notes_whole_with_long_timings(monkeypatch):
    """Rich lays a table out on 80 columns where the output is not a terminal: with timings
    of 10 ms and more, "already in DB" wrapped, and a resumed run's log no longer said it."""
    from rich.console import Console

    import tuner.cli.base as base_module
    import tuner.cli.sweep as sweep_module
    from tuner.sweep import ShapeResult
    from tuner.workload import DecodeShape

    shape = DecodeShape(batch=16, kv_len=8192, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
    skipped = ShapeResult(shape, "skipped", {"chunk": 128, "block": 123456}, 123456.7, 234567.8, 0, 0, 0, note="")
    log = io.StringIO()  # not a terminal: rich lays it out on 80 columns
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(base_module, "console", Console(file=log))
    base_module.print_table(sweep_module._sweep_table("torch_split_decode", [skipped]))
    assert "already in DB" in log.getvalue()
    assert base_module.console.width == 80  # the console itself is left as it was


def test_plan_says_the_shapes_and_candidates_and_runs_nothing(tmp_path, db_path, tiny_shapes):
    done = sweep(db_path, tiny_shapes, "--plan", "--heads", "8/2", "--head-dim", "16")
    assert done.exit_code == 0, done.output
    assert "h8/2 d16" in done.output and "2 shapes, 6 candidate configs" in done.output
    assert "no time estimate off a GPU" in done.output and "Nothing was run" in done.output
    assert not db_path.exists()


def test_a_plan_says_which_shapes_the_db_already_holds(db_path, tiny_shapes):
    """After a whole sweep the plan still said every shape would be measured (a helper's
    walkthrough): a sweep keeps a stored winner unless forced."""
    assert sweep(db_path, tiny_shapes).exit_code == 0
    again = sweep(db_path, tiny_shapes, "--plan")
    assert again.exit_code == 0, again.output
    assert "Of the shapes, 2 with a winner stored here (kept; --force measures them again)" in \
        " ".join(again.output.split())
    forced = sweep(db_path, tiny_shapes, "--plan", "--force")
    assert forced.exit_code == 0 and "Of the shapes" not in forced.output


def test_a_gpu_sweep_is_planned_from_a_cpu_machine(db_path):
    """`sweep fa3 --plan` on a laptop said fa3 cannot run here (a helper's walkthrough): a
    plan runs nothing, so it is made as on the GPU; a CPU plan of a GPU-sized grid says that
    a CPU interprets the kernels."""
    if torch.cuda.is_available():
        pytest.skip("a CPU machine's plan")
    planned = cli("sweep", "fa3", "--model", "llama-3.1-8b", "--plan", "--db", db_path)
    assert planned.exit_code == 0, planned.output
    text = " ".join(planned.output.split())
    # the pace was measured on decode_attention's sweeps, with Triton compiles on a fresh
    # machine: fa3's plan said "with Triton's cache warm", as if it were its own
    assert "of GPU time at decode_attention's measured pace on an H200 (fa3's own is not measured)" in text
    assert "planned as on an H200" in text and "Triton" not in text and "fresh" not in text
    flashinfer = " ".join(cli("sweep", "flashinfer", "--grid", "decode", "--plan", "--db", db_path).output.split())
    assert "(flashinfer's own is not measured; FlashInfer also compiles each kernel variant" in flashinfer
    one_line_error(cli("sweep", "fa3", "--model", "llama-3.1-8b", "--db", db_path), "cannot run here")
    interpreted = cli("sweep", "decode_attention", "--grid", "serving", "--plan", "--db", db_path)
    assert interpreted.exit_code == 0 and "run interpreted" in " ".join(interpreted.output.split())
    small = cli("sweep", "decode_attention", "--grid", "cpu-tiny", "--plan", "--db", db_path)
    assert small.exit_code == 0 and "interpreted" not in small.output


def test_a_plan_with_no_shapes_is_one_line(tmp_path, db_path):
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    done = sweep(db_path, empty, "--plan")
    one_line_error(done)
    assert not db_path.exists()


def test_the_plans_gpu_estimate_follows_the_search():
    from tuner.ops import get_op
    from tuner.sweep.plan import SweepPlan
    from tuner.workload import DecodeShape

    op = get_op("torch_split_decode")
    shapes = [DecodeShape(batch=1, kv_len=200, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)]
    exhaustive = SweepPlan.of(op, shapes, "exhaustive", "cuda")
    assert exhaustive.candidates == 3 and exhaustive.estimate_s == pytest.approx(3 * 0.0204)
    assert SweepPlan.of(op, shapes, "guided", "cuda").estimate_s < exhaustive.estimate_s
    assert SweepPlan.of(op, shapes, "my_search", "cuda").estimate_s == exhaustive.estimate_s
    assert SweepPlan.of(op, shapes, "guided", "cpu").estimate_s is None
    assert exhaustive.fresh_estimate_s is None  # not measured on a fresh machine
    assert SweepPlan.of(op, shapes, "guided", "cuda").fresh_estimate_s is None  # it compiles nothing
    compiling = get_op("decode_attention")  # (its Triton candidates, on a fresh machine)
    guided = SweepPlan.of(compiling, shapes, "guided", "cuda")
    assert guided.fresh_estimate_s == pytest.approx(guided.candidates * 0.0304)
    assert guided.fresh_estimate_s > guided.estimate_s
    graph = [dataclasses.replace(shapes[0], lengths="graph")]
    assert SweepPlan.of(op, graph, "guided", "cuda").estimate_s is None  # graph replays: not measured yet


def test_a_serving_sweep_defaults_to_guided_search_without_flashinfer_and_others_to_halving():
    runner = CliRunner()
    serving = runner.invoke(app, ["sweep", "decode_attention", "--grid", "cpu-serving", "--plan"])
    assert serving.exit_code == 0, serving.output
    assert "guided search (triton_decode; fa3 cannot run here)," in " ".join(serving.output.split())
    assert "plan: decode_attention (grid cpu-serving)" in " ".join(serving.output.split())
    picked = runner.invoke(app, ["sweep", "decode_attention", "--plan"])  # the plan names the grid it picked
    assert picked.exit_code == 0 and "(grid cpu-tiny)" in " ".join(picked.output.split()), picked.output
    full = runner.invoke(app, ["sweep", "decode_attention", "--grid", "cpu-tiny", "--plan"])
    assert full.exit_code == 0, full.output
    assert "halving search (triton_decode; fa3, flashinfer cannot run here)" in " ".join(full.output.split())
    told = runner.invoke(app, ["sweep", "decode_attention", "--grid", "cpu-serving", "--plan", "--search", "exhaustive",
                               "--backends", "triton_decode,flashinfer"])
    assert told.exit_code == 0, told.output
    assert "exhaustive search (triton_decode; flashinfer cannot run here)" in " ".join(told.output.split())
    one_line_error(runner.invoke(app, ["sweep", "decode_attention", "--grid", "cpu-serving", "--search", "bogus"]),
                   "unknown search strategy")


def test_export_refuses_a_device_or_a_pipe_at_its_name_and_leaves_it(tmp_path, db_path, tiny_shapes):
    """A rename onto /dev/full or a FIFO replaced it with a file, and said it had exported."""
    assert sweep(db_path, tiny_shapes).exit_code == 0
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    one_line_error(cli("export", "--out", pipe, "--db", db_path), "cannot write", "a pipe, not a regular file")
    assert pipe.is_fifo()


def test_export_json_of_no_winners_is_an_error_and_a_gz_name_in_capitals_is_compressed(tmp_path, db_path,
                                                                                       tiny_shapes):
    assert sweep(db_path, tiny_shapes).exit_code == 0
    one_line_error(cli("export", "--op", "fa3", "--out", tmp_path / "e.json", "--db", db_path),
                   "no winners of fa3", "nothing to export")
    assert not (tmp_path / "e.json").exists()
    assert cli("export", "--out", tmp_path / "E.JSON.GZ", "--db", db_path).exit_code == 0
    assert gzip.decompress((tmp_path / "E.JSON.GZ").read_bytes()).startswith(b"{")


def test_a_sweep_into_a_db_file_it_cannot_write_is_refused_before_it_measures(db_path, tiny_shapes, monkeypatch):
    """A read-only DB file in a writable directory was found only at the first store, after
    measuring (a helper's review, as another user). (As root here, the file's mode binds no
    one: os.access answers as it would for that user.)"""
    assert sweep(db_path, tiny_shapes).exit_code == 0
    before = db_path.read_bytes()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == db_path and mode & os.W_OK
                        else access(path, mode, **kw))
    done = sweep(db_path, tiny_shapes, "--force")
    one_line_error(done, "cannot write tuning DB", "read-only for this user")
    assert "measurements" not in done.stdout and db_path.read_bytes() == before


def test_every_command_leaves_its_db_whole_in_one_file(tmp_path, db_path, tiny_shapes):
    """The CLI left its engine to the garbage collector, so SQLite's write-ahead log was merged
    into the file whenever that came: a copy taken after a command lacked its writes, and
    tests comparing the file's bytes failed at random in CI. Each command now closes its DB."""
    wal = db_path.with_name(db_path.name + "-wal")
    for args in (("sweep", "torch_split_decode", "--shapes", tiny_shapes, "--repeats", 3, "--warmup", 1),
                 ("show",), ("export", "--out", tmp_path / "e.json"), ("import", tmp_path / "e.json"),
                 ("doctor",), ("prune",)):
        done = cli(*args, "--db", db_path)
        assert done.exit_code == 0, (args, done.output)
        assert not wal.exists(), args


def test_a_plan_from_misses_creates_no_db(tmp_path):
    """--plan says nothing runs and no DB is written; with --from-misses it made the DB. A
    sweep of the misses of a --db that does not exist (a typo) made an empty one and said
    there were no misses (a helper's review): both are one line, and nothing is made."""
    for plan in (("--plan",), ()):
        one_line_error(cli("sweep", "triton_decode", "--from-misses", *plan, "--db", tmp_path / "new.db"),
                       "no tuning DB")
    assert list(tmp_path.iterdir()) == []


def test_conflicting_or_empty_sweep_options_are_one_line(tmp_path):
    """--halving with another --search, and an empty --tp (a script's unset variable), were
    taken silently (halving's plan; tp 1) (a helper's review)."""
    one_line_error(cli("sweep", "torch_split_decode", "--grid", "cpu-tiny", "--halving", "--search", "exhaustive",
                       "--plan", "--db", tmp_path / "t.db"), "--halving", "not both")
    one_line_error(cli("sweep", "decode_attention", "--grid", "serving", "--model", "llama-3.1-8b", "--tp", "",
                       "--plan", "--db", tmp_path / "t.db"), "--tp")
    assert cli("sweep", "torch_split_decode", "--grid", "cpu-tiny", "--halving", "--search", "halving", "--plan",
               "--db", tmp_path / "t.db").exit_code == 0


def test_the_default_grid_is_one_the_op_has_and_the_plan_names_only_backends_that_run_here(db_path):
    """decode_attention has no cpu-small grid: its default was an error on the CPU; the plan
    named FA3 and FlashInfer, which cannot run there."""
    done = cli("sweep", "decode_attention", "--plan", "--db", db_path)
    assert done.exit_code == 0, done.output
    assert "search (triton_decode; fa3, flashinfer cannot run here), on cpu" in " ".join(done.output.split())
    assert not db_path.exists()


@pytest.mark.parametrize("field, value, says", [("q_dtype", "int1337", "dtype 'int1337' is not one of"),
                                                ("num_q_heads", 7, "kv heads do not divide 7")])
def test_import_refuses_a_static_key_no_kernel_has(tmp_path, db_path, tiny_shapes, field, value, says):
    assert sweep(db_path, tiny_shapes).exit_code == 0
    out = tmp_path / "e.json"
    assert cli("export", "--out", out, "--db", db_path).exit_code == 0
    doc = json.loads(out.read_text())
    doc["records"][0]["static_key"][field] = value
    out.write_text(json.dumps(doc))
    other = tmp_path / "other.db"
    one_line_error(cli("import", out, "--db", other), says)
    assert not other.exists()


def test_export_to_standard_output_pipes_into_import_from_standard_input(tmp_path, db_path, tiny_shapes):
    """`--out -` wrote a file named "-"; now the document alone goes to standard output (the
    count to stderr), and `import -` reads it back. LightLLM's directory cannot be "-"."""
    assert sweep(db_path, tiny_shapes).exit_code == 0
    exported = runner.invoke(app, ["export", "--out", "-", "--db", str(db_path)])
    assert exported.exit_code == 0, exported.output
    assert not Path("-").exists() and json.loads(exported.stdout)["records"]
    assert "exported" in exported.stderr and "standard output" in exported.stderr
    other = tmp_path / "other.db"
    imported = CliRunner().invoke(app, ["import", "-", "--db", str(other)], input=exported.stdout)
    assert imported.exit_code == 0, imported.output
    assert f"imported {len(json.loads(exported.stdout)['records'])}" in imported.output
    one_line_error(CliRunner().invoke(app, ["import", "-", "--db", str(other)], input="{not json"),
                   "tunings file on standard input is not valid JSON")
    one_line_error(cli("export", "--format", "lightllm", "--out", "-", "--db", db_path),
                   "--out - is standard output; --format lightllm writes a directory")
    # a gzip document on standard input (`cat shipped.json.gz |`) was "not UTF-8 text"
    gz = subprocess.run([sys.executable, "-m", "tuner", "import", "-", "--db", str(tmp_path / "gz.db")],
                        input=gzip.compress(exported.stdout.encode()), capture_output=True, timeout=120)
    assert gz.returncode == 0 and b"imported" in gz.stdout, gz.stderr


def test_export_to_a_pipe_its_reader_closes_early_ends_in_one_line(tmp_path, db_path, tiny_shapes):
    """`tuner export --out - | head -c 0`: a traceback of BrokenPipeError before."""
    assert sweep(db_path, tiny_shapes).exit_code == 0
    export = subprocess.Popen([sys.executable, "-m", "tuner", "export", "--out", "-", "--db", str(db_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    export.stdout.close()  # the reader gone before the export writes
    stderr = export.stderr.read().decode()
    assert export.wait(timeout=60) == 1
    assert stderr.strip() == "export: standard output closed before the whole document was written"
