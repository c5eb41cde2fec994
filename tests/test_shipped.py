"""Shipped tunings: a read-only layer of reviewed JSON beneath the user's DB."""

import json
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import tuner
from tuner.cli import app
from tuner.db import Problem, TuningDB, current_fingerprint, export_document, fingerprint_id
from tuner.keys import AttentionRunKey, AttentionStaticKey, attention_run_key, canonical_json
from tuner.ops import get_op
from tuner.ops.decode_attention import BACKENDS, BY_FILL, fill_parts
from tuner.ops.triton_decode import OPTIONAL_RULES as TRITON_OPTIONAL_RULES
from tuner.workload.shapes import shape_from_keys

STATIC = ("float32", 8, 2)
REPO = Path(__file__).resolve().parents[1]
SHIPPED_FILES = sorted([*(REPO / "tuning_cache").glob("*.tunings.json"),
                        *(REPO / "tuning_cache").glob("*.tunings.json.gz")])


def make_fn(calls):
    @tuner.autotune(
        "toy",
        configs=[{"block": 16}, {"block": 32}, {"block": 64}],
        static_key=lambda x, batch, kv: STATIC,
        run_key=lambda x, batch, kv: (batch, 1, kv),
        default={"block": 32},
    )
    def fn(x, batch, kv, *, config):
        calls.append(config["block"])
        return x

    return fn


def call(fn, calls, batch, kv):
    calls.clear()
    fn(torch.ones(1), batch, kv)
    return calls[-1]


def environment(**changes):
    data = dict(current_fingerprint(), **changes)
    return fingerprint_id(data), data


def write_tunings(path, winners, fp=None):
    """A tunings document (tuner's export schema) holding {(batch, kv): block} for "toy"."""
    scratch = path.with_suffix(".scratch.db")
    db = TuningDB(scratch)
    for (batch, kv), block in winners.items():
        db.save_record(Problem("toy", canonical_json(STATIC), attention_run_key(batch, 1, kv)), fp or environment(),
                       {"block": block}, median_us=1.0, spread_us=0.1, samples=5, default_config={"block": 32},
                       default_median_us=2.0, default_spread_us=0.1, method={"timer": "test"})
    path.write_text(json.dumps(export_document(db)))
    db.close()
    return path


def test_shipped_winners_serve_lookups_when_the_user_db_has_none(tmp_path):
    shipped = write_tunings(tmp_path / "gpu.tunings.json", {(16, 2048): 64})
    tuner.configure(db=tmp_path / "absent.db", shipped=shipped)
    calls = []
    fn = make_fn(calls)
    assert call(fn, calls, 16, 2048) == 64  # exact
    assert call(fn, calls, 8, 4096) == 64  # nearest, as for the user's own winners
    assert call(fn, calls, 1, 2**20) == 32  # too far: the default
    assert not (tmp_path / "absent.db").exists()  # read-only: nothing was created


def test_an_unreadable_user_db_says_the_shipped_tunings_still_serve(tmp_path):
    """The warning said "running with library defaults" while the shipped winners served (a
    helper's review)."""
    shipped = write_tunings(tmp_path / "gpu.tunings.json", {(16, 2048): 64})
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not sqlite" * 100)
    tuner.configure(db=garbage, shipped=shipped)
    calls = []
    with pytest.warns(UserWarning, match="garbage.db.*; running with the shipped tunings and library defaults$"):
        assert call(make_fn(calls), calls, 16, 2048) == 64


def test_the_user_db_wins_a_key_both_hold_and_the_layer_fills_the_rest(tmp_path):
    shipped = write_tunings(tmp_path / "gpu.tunings.json", {(16, 2048): 64, (256, 131072): 16})
    user = TuningDB(tmp_path / "user.db")
    user.save_record(Problem("toy", canonical_json(STATIC), attention_run_key(16, 1, 2048)), environment(),
                     {"block": 16}, median_us=1.0, spread_us=0.1, samples=5, default_config={"block": 32},
                     default_median_us=2.0, default_spread_us=0.1, method={"timer": "test"})
    user.close()
    tuner.configure(db=tmp_path / "user.db", shipped=shipped)
    calls = []
    fn = make_fn(calls)
    assert call(fn, calls, 16, 2048) == 16  # the user's
    assert call(fn, calls, 256, 131072) == 16  # shipped (exact there)
    assert call(fn, calls, 256, 100000) == 16


@pytest.mark.parametrize("field, applies", [
    ("driver", True), ("tuner", True),  # neither changes which kernel code runs
    ("triton", False), ("sgl_kernel", False), ("flashinfer", False), ("torch", False), ("cuda", False),
    ("device", False), ("sm_count", False),
    ("torch+tag", True),  # torch "X+cu130" (PyTorch's index) is torch "X": the cuda field says which CUDA
])
def test_fingerprint_checks_still_apply(tmp_path, field, applies):
    change = {"torch": current_fingerprint()["torch"].split("+")[0] + "+cu130"} if field == "torch+tag" \
        else {field: "other"}
    shipped = write_tunings(tmp_path / "gpu.tunings.json", {(16, 2048): 64}, fp=environment(**change))
    tuner.configure(db=tmp_path / "absent.db", shipped=shipped)
    calls = []
    assert call(make_fn(calls), calls, 16, 2048) == (64 if applies else 32)


def test_shipped_off_and_a_directory(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir()
    write_tunings(folder / "a.tunings.json", {(16, 2048): 64})
    (folder / "notes.json").write_text("not tunings, and not read")
    tuner.configure(db=tmp_path / "absent.db", shipped=folder)
    calls = []
    assert call(make_fn(calls), calls, 16, 2048) == 64
    tuner.configure(db=tmp_path / "absent.db", shipped="off")
    assert call(make_fn(calls), calls, 16, 2048) == 32
    monkeypatch.setenv("TUNER_SHIPPED", str(folder))  # the environment, when configure says None
    tuner.configure(db=tmp_path / "absent.db", shipped=None)
    assert call(make_fn(calls), calls, 16, 2048) == 64


def test_a_broken_shipped_file_warns_once_and_the_defaults_run(tmp_path):
    shipped = tmp_path / "gpu.tunings.json"
    shipped.write_text('{"schema": "tuner.tunings", "version": 1, "fingerprints": {}, "records": [{}]}')
    tuner.configure(db=tmp_path / "absent.db", shipped=shipped)
    calls = []
    fn = make_fn(calls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert call(fn, calls, 16, 2048) == 32
        assert call(fn, calls, 8, 2048) == 32
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "gpu.tunings.json" in messages[0] and "\n" not in messages[0]


def test_one_broken_file_leaves_the_others_in_use(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    write_tunings(folder / "a.tunings.json", {(16, 2048): 64})
    (folder / "b.tunings.json").write_text("{not json")
    tuner.configure(db=tmp_path / "absent.db", shipped=folder)
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert call(make_fn(calls), calls, 16, 2048) == 64
    [message] = [str(w.message) for w in caught]
    assert "b.tunings.json" in message and message.count("b.tunings.json") == 1 and "not used" in message


def test_a_gzip_compressed_shipped_file_serves_like_a_plain_one(tmp_path, monkeypatch):
    import gzip

    from tuner.db import shipped

    folder = tmp_path / "tuning_cache"
    folder.mkdir()
    plain = write_tunings(tmp_path / "gpu.tunings.json", {(16, 2048): 64, (4, 512): 16})
    packed = folder / "gpu.tunings.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert shipped.shipped_paths(folder) == [packed]
    calls = []
    fn = make_fn(calls)
    for source in (folder, packed):  # found in a folder, or named
        tuner.configure(db=tmp_path / "absent.db", shipped=source)
        assert call(fn, calls, 16, 2048) == 64 and call(fn, calls, 4, 512) == 16


def test_where_shipped_tunings_are_found(tmp_path, monkeypatch):
    from tuner.db import shipped

    checkout = tmp_path / "tuning_cache"
    checkout.mkdir()
    write_tunings(checkout / "gpu.tunings.json", {(16, 2048): 64})
    monkeypatch.delenv("TUNER_SHIPPED")
    monkeypatch.setattr(shipped, "default_db_path", lambda: checkout / "tuner.db")  # a source checkout
    assert shipped.shipped_paths() == [checkout / "gpu.tunings.json"]
    assert shipped.shipped_paths("") == [checkout / "gpu.tunings.json"]  # "" is the default, as for --db
    installed = tmp_path / "home" / ".cache" / "tuner" / "tuner.db"  # installed: the wheel's tuner/shipped/
    monkeypatch.setattr(shipped, "default_db_path", lambda: installed)
    package = Path(shipped.__file__).resolve().parents[1] / "shipped"
    assert shipped.shipped_paths() == sorted([*package.glob("*.tunings.json"), *package.glob("*.tunings.json.gz")])
    with pytest.raises(tuner.TunerError, match="^shipped tunings: no such file or directory"):
        shipped.shipped_paths(tmp_path / "nowhere")
    monkeypatch.setenv("TUNER_SHIPPED", str(tmp_path / "nowhere"))
    with pytest.raises(tuner.TunerError, match="^TUNER_SHIPPED: no such file or directory"):
        shipped.shipped_paths()
    tuner.configure(db=tmp_path / "absent.db")  # the runtime: one warning, the defaults run
    calls = []
    with pytest.warns(UserWarning, match="TUNER_SHIPPED: no such file"):
        assert call(make_fn(calls), calls, 16, 2048) == 32


def test_files_of_other_environments_are_counted_not_validated(tmp_path):
    """Start-up reads no record of a file that cannot apply here (every CPU machine, say)."""
    from tuner.db.shipped import load_shipped

    path = write_tunings(tmp_path / "gpu.tunings.json", {(16, 2048): 64}, fp=environment(device="Another GPU"))
    doc = json.loads(path.read_text())
    doc["records"].append({"op": 5})  # would fail validation
    path.write_text(json.dumps(doc))
    layer = load_shipped(current_fingerprint(), path)
    assert not layer.errors and layer.files[0].records == 2 and layer.files[0].applied == 0
    assert "made on Another GPU" in next(iter(layer.files[0].mismatches.values()))
    doc["fingerprints"] = {k: dict(v, device=current_fingerprint()["device"]) for k, v in doc["fingerprints"].items()}
    path.write_text(json.dumps(doc))  # now it could apply: validated, and refused
    assert load_shipped(current_fingerprint(), path).errors


def test_tune_mode_counts_a_shipped_winner_as_a_hit(tmp_path):
    """Like a DB winner: tune mode tunes only keys with no winner in either (force tunes all)."""
    shipped = write_tunings(tmp_path / "gpu.tunings.json", {(16, 2048): 64})
    tuner.configure(db=tmp_path / "user.db", shipped=shipped, mode="tune")
    calls = []
    assert call(make_fn(calls), calls, 16, 2048) == 64
    assert calls == [64]  # one call, no candidates measured
    assert not (tmp_path / "user.db").exists()


def _doctor_over(folder, tmp_path, monkeypatch, columns):
    """`tuner doctor` with the shipped tunings of folder over an empty DB, in a wide terminal."""
    monkeypatch.setenv("TUNER_SHIPPED", str(folder))
    monkeypatch.setenv("COLUMNS", str(columns))
    db = tmp_path / "user.db"
    TuningDB(db).close()
    return CliRunner().invoke(app, ["doctor", "--db", str(db)])


def test_doctor_lists_the_layer_and_why_it_does_not_apply(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir()
    write_tunings(folder / "here.tunings.json", {(16, 2048): 64, (4, 512): 16})
    write_tunings(folder / "there.tunings.json", {(16, 2048): 64}, fp=environment(triton="0.0.1"))
    result = _doctor_over(folder, tmp_path, monkeypatch, columns=200)
    db = tmp_path / "user.db"
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    here = next(line for line in lines if "here.tunings.json" in line)
    assert "│       2 │         2 │" in here
    there = next(line for line in lines if "there.tunings.json" in line)
    assert "│       1 │         0 │" in there and "triton 0.0.1 there" in there
    shown = CliRunner().invoke(app, ["show", "--db", str(db)])
    assert "2 shipped winners apply here" in shown.output
    no_db = CliRunner().invoke(app, ["doctor", "--db", str(tmp_path / "none.db")])  # shipped ones apply without one
    assert no_db.exit_code == 0 and "here.tunings.json" in no_db.output and "no tuning DB" in no_db.output
    (folder / "there.tunings.json").write_text("{")
    broken = CliRunner().invoke(app, ["doctor", "--db", str(db)])
    assert broken.exit_code == 1 and "there.tunings.json" in broken.output


# -- the tunings this repository ships ---------------------------------------------------


def _config_keys(op_name: str, config: dict, shape) -> set:
    """The config keys the op's own default has for this shape (decode_attention: the
    named backend's, plus "backend" and the optional knobs it holds (Triton's
    tokens_per_split); a by_fill config: each part's, prefixed by its name)."""
    if op_name == "decode_attention" and config["backend"] == BY_FILL:
        return {"backend"} | {f"{name}.{k}" for name, part in zip(("dense", "other"), fill_parts(config))
                              for k in _config_keys(op_name, part, shape)}
    if op_name == "decode_attention":
        backend = config["backend"]
        optional = set(config) & set(TRITON_OPTIONAL_RULES) if backend == "triton_decode" else set()
        return {"backend"} | set(BACKENDS[backend].op.default(shape)) | optional
    return set(get_op(op_name).default(shape))


@pytest.mark.skipif(not SHIPPED_FILES, reason="no shipped tunings in tuning_cache/")
@pytest.mark.parametrize("path", SHIPPED_FILES, ids=lambda p: p.name)
def test_shipped_files_are_valid_and_every_config_fits_its_op(path):
    """Every record parses, names an op tuner has, keys a shape a sweep can build, and holds
    exactly the config keys that op runs with (a renamed knob would fail here, not at run time)."""
    from tuner.db.jsonio import load_document, parse_document
    from tuner.ops import check_record

    rows = parse_document(load_document(path))
    assert rows
    for problem, _, fields in rows:
        shape = shape_from_keys(problem.static_key, problem.run_key)
        assert shape is not None, problem
        assert AttentionStaticKey.from_json(problem.static_key) == shape.static_key()
        assert isinstance(problem.run_key, AttentionRunKey)
        config = fields["config"]
        assert set(config) == _config_keys(problem.op, config, shape), (problem.op, config)
        assert check_record(problem.op, problem.static_key, problem.run_key, config) is None, (problem.op, config)
        assert fields["default_config"] == get_op(problem.op).default(shape) or problem.op == "decode_attention"


@pytest.mark.skipif(not SHIPPED_FILES, reason="no shipped tunings in tuning_cache/")
def test_shipped_tunings_stay_under_the_size_a_tracked_file_may_be():
    """2 MiB a file, as for everything tracked: a serving grid's records run to about 5 MB of
    JSON, and go out gzip-compressed (`tuner export --out NAME.tunings.json.gz`); and a key
    in both a plain and a compressed file would be read twice."""
    assert all(p.stat().st_size < 2 * 2**20 for p in SHIPPED_FILES), [(p.name, p.stat().st_size) for p in SHIPPED_FILES]
    stems = [p.name.removesuffix(".gz") for p in SHIPPED_FILES]
    assert len(stems) == len(set(stems)), stems


def _decode_attention_tunings(path, configs):
    """A tunings document of decode_attention records of this environment: {shape: config}."""
    scratch = path.with_suffix(".scratch.db")
    db = TuningDB(scratch)
    for shape, config in configs.items():
        db.save_record(Problem("decode_attention", shape.static_key().to_json(), shape.run_key()), environment(),
                       config, median_us=1.0, spread_us=0.1, samples=5, default_config={"backend": "triton_decode"},
                       default_median_us=3.0, default_spread_us=0.1, method={"timer": "test"})
    path.write_text(json.dumps(export_document(db)))
    db.close()
    return path


def test_shipped_records_the_op_cannot_run_are_left_out_counted_and_shown_by_doctor(tmp_path, monkeypatch):
    """doctor counted a record whose config breaks its op's rules as used, and the runtime
    dropped it silently; now both check each record by the op's rules (tuner.ops.check_record)."""
    from tuner.workload import DecodeShape, make_decode_inputs
    from tuner.integrations.decode_attention import decode_attention

    good_shape = DecodeShape(batch=2, kv_len=64, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16,
                             dtype="float32")
    bad_shape = DecodeShape(**dict(vars(good_shape), batch=16))
    op = get_op("decode_attention")
    good = next(c for c in op.configs(good_shape) if c["backend"] == "triton_decode" and c != op.default(good_shape))
    bad = dict(good, num_kv_splits=0)  # no split count of zero: the op cannot run it
    assert op.check(good, good_shape) is None and op.check(bad, bad_shape) is not None
    folder = tmp_path / "cache"
    folder.mkdir()
    _decode_attention_tunings(folder / "gpu.tunings.json", {good_shape: good, bad_shape: bad})

    tuner.configure(db=tmp_path / "absent.db", shipped=folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for shape, served in ((good_shape, good), (bad_shape, op.default(bad_shape))):
            inputs = make_decode_inputs(shape)
            assert decode_attention.tuner.config_for(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table,
                                                     inputs.cache_seqlens, shape.kv_len) == served
    [message] = [str(w.message) for w in caught]
    assert "gpu.tunings.json: 1 records left out" in message and "num_kv_splits" in message

    result = _doctor_over(folder, tmp_path, monkeypatch, columns=300)
    assert result.exit_code == 1, result.output
    row = next(line for line in result.output.splitlines() if "gpu.tunings.json" in line and "│" in line)
    assert "│       2 │         1 │" in row  # two records, one used here
    problem = " ".join(result.stderr.split())
    assert "problem: shipped tunings" in problem and "1 records left out, their ops cannot run their configs" in problem
    assert "decode_attention at" in problem and "num_kv_splits" in problem
    shown = CliRunner().invoke(app, ["show", "--db", str(tmp_path / "user.db")])
    assert shown.exit_code == 0 and "1 shipped winners apply here" in shown.output  # as doctor counts them


def test_a_file_of_two_environments_applies_only_the_matching_ones_records(tmp_path):
    shipped = tmp_path / "gpu.tunings.json"
    scratch = TuningDB(tmp_path / "scratch.db")
    for fp, kv, block in ((environment(), 2048, 64), (environment(triton="other"), 4096, 16)):
        scratch.save_record(Problem("toy", canonical_json(STATIC), attention_run_key(16, 1, kv)), fp,
                            {"block": block}, median_us=1.0, spread_us=0.1, samples=5, default_config={"block": 32},
                            default_median_us=2.0, default_spread_us=0.1, method={"timer": "test"})
    shipped.write_text(json.dumps(export_document(scratch)))
    tuner.configure(db=tmp_path / "absent.db", shipped=shipped)
    calls = []
    fn = make_fn(calls)
    assert call(fn, calls, 16, 2048) == 64
    assert call(fn, calls, 16, 4096) != 16  # (its neighbour's, or the default: never the other machine's)


def test_of_two_shipped_files_holding_one_key_the_newest_winner_serves(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    write_tunings(folder / "b.tunings.json", {(16, 2048): 16})  # measured first, read last
    write_tunings(folder / "a.tunings.json", {(16, 2048): 64})
    tuner.configure(db=tmp_path / "absent.db", shipped=folder)
    calls = []
    assert call(make_fn(calls), calls, 16, 2048) == 64
