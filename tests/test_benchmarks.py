"""The GPU benchmarks run end to end on the CPU at smoke size, so a run on the H200 (whose
time is scarce) does not fail on the script; the shipped-tunings release tools (tools/) do
what they say on small DBs."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from support.fake_events import EventClock

ROOT = Path(__file__).resolve().parents[1]


def script_module(folder: str, name: str) -> ModuleType:
    """FOLDER/NAME.py, imported as its scripts import each other (FOLDER on the path)."""
    sys.path.insert(0, str(ROOT / folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / folder))


def benchmark_module(name: str) -> ModuleType:
    """benchmarks/NAME.py (common.NAME: a helper of benchmarks/common/)."""
    return script_module("benchmarks", name)


def tool_module(name: str) -> ModuleType:
    """tools/NAME.py."""
    return script_module("tools", name)


def test_every_benchmark_and_tool_answers_help_from_the_repository_root():
    """The commands benchmarks/RESULTS.md and tuning_cache/README.md give run from the root:
    each script finds its helpers (benchmarks/common/, tools/shapes/) wherever it lives."""
    scripts = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "tools").glob("*.py"))
    assert {p.name for p in scripts} >= {"serving.py", "roofline.py", "verify_shipped.py", "merge_reship.py",
                                         "shipped_sweeps.py"}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = {p: subprocess.Popen([sys.executable, str(p.relative_to(ROOT)), "--help"], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in scripts}
    for path, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "usage:" in out, f"{path.name}: {err[-2000:]}"


def test_roofline_smoke(tmp_path):
    out = tmp_path / "roofline.json"
    # the kernel itself, loaded a second time, stands in for an earlier one
    before = ROOT / "tuner" / "ops" / "triton_decode.py"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "roofline.py", "--smoke", "--limit", "1", "--backends", "ours",
                             "--before", str(before), "--out", str(out)],
                            cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    [row] = doc["rows"]
    assert doc["backends"] == ["ours_best", "ours_before_best"] and "error" not in row
    assert row["kv_bytes"] > 0 and row["ours_best"]["fraction"] > 0 and row["ours_over_before"] > 0
    assert row["ours_best"]["failed"] == 0 and doc["summary"]["ours_over_before"]["cases"] == 1
    # where the run's time went: the case's, and each backend's search
    assert row["seconds"] >= row["ours_best"]["search_seconds"] + row["ours_before_best"]["search_seconds"] > 0


def test_serving_smoke(tmp_path):
    out = tmp_path / "serving.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "serving.py", "--smoke", "--limit", "1", "--out", str(out)],
                            cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert "error" not in row and row["per_call"]["default_us"] > 0 and row["graph"]["tuner_us"] > 0
    assert row["graph_variants"]["tuner_us"] > 0 and row["graph_variants_judged"]["tuner_us"] > 0


def test_serving_judged_variants_keep_a_faster_variant_and_the_base_graph_over_a_slower_one(monkeypatch):
    """graph_variants_judged: tuner's replay judge times the variant's replays against the base
    graph's, pair by pair (on the CPU with the host's clock; here a fake kernel that takes its
    config's time), and the case runs what its verdict leaves."""
    import time

    serving = benchmark_module("serving")
    monkeypatch.setattr(serving, "decode_attention", lambda *a, config, **k: time.sleep(config["ms"] / 1e3))
    monkeypatch.setattr(serving, "eager_config", lambda config, *a, **k: config)
    calls = [((), {})] * 2  # a rotation of two calls
    base, slow, fast = {"ms": 4}, {"ms": 8}, {"ms": 2}
    config, ratio = serving._judged(calls, base, slow, 8, "cpu")
    assert config == base and ratio > 1.5
    config, ratio = serving._judged(calls, base, fast, 8, "cpu")
    assert config == fast and ratio < 0.75
    assert serving._judged(calls, base, dict(base), 8, "cpu") == (base, None)  # no variant: nothing judged


def test_serving_judges_a_variant_on_another_draw_of_the_cases_class_of_lengths(monkeypatch):
    """A server's verdict on a class comes from its earlier steps, not from the batch being
    measured: graph_variants_judged replays another draw of the case's traffic in the same
    class (kv bucket, dense or not), and the case's own batch only where none is found."""
    serving = benchmark_module("serving")
    spec = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
    case = dict(model="m", batch=8, cap=1024, distribution="uniform")
    lens = serving.draw_lengths("uniform", 8, 1024, 7)
    calls = serving._judge_batch(case, spec, lens, 2, "cpu", seed=7)
    assert len(calls) == 2  # one per copy, at the capture bound
    drawn = [int(n) for n in calls[0][0][4]]  # cache_seqlens
    assert drawn != lens and serving._step_class(drawn) == serving._step_class(lens)
    assert calls[0][0][5] == serving.MAX_CONTEXT and calls[0][0][3].shape[1] == serving.MAX_CONTEXT
    # no draw in the case's class: the case's own batch is judged
    monkeypatch.setattr(serving, "draw_lengths", lambda *a: [10] * 8)
    assert serving._judge_batch(case, spec, lens, 2, "cpu", seed=7) is None


def test_serving_batches_keeps_only_those_batch_sizes_each_case_with_its_seed_of_the_whole_run(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    runs = {}
    for name, extra in (("all", ["--limit", "4"]), ("b3", ["--limit", "4", "--batches", "3"])):
        out = tmp_path / f"{name}.json"
        result = subprocess.run([sys.executable, "serving.py", "--smoke", *extra, "--out", str(out)],
                                cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = json.loads(out.read_text())["rows"]
    assert {r["batch"] for r in runs["all"]} == {1, 3} and {r["batch"] for r in runs["b3"]} == {3}
    # the same case draws the same lengths in both runs: its seed is its index in the whole run
    [row] = runs["b3"]
    [same] = [r for r in runs["all"] if r["batch"] == 3]
    assert (row["distribution"], row["kv_max"], row["kv_mean"]) == (same["distribution"], same["kv_max"],
                                                                  same["kv_mean"])
    result = subprocess.run([sys.executable, "serving.py", "--smoke", "--batches", "5", "--out",
                             str(tmp_path / "none.json")], cwd=ROOT / "benchmarks", env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 2 and "leaves no case" in result.stderr


def test_serving_combine_replaces_a_runs_rows_with_a_later_runs_of_the_same_cases(tmp_path):
    """A rerun of one batch size (--batches) stands beside the rest of a run: each of its rows
    replaces the same case's, the summaries are recomputed, and a run from another
    environment is refused in one line."""
    def row(batch: int, distribution: str, tuner_us: float) -> dict:
        timing = dict(default_us=10.0, tuner_us=tuner_us, oracle_us=5.0, tuner_speedup=10.0 / tuner_us,
                      oracle_speedup=2.0)
        return dict(model="m", batch=batch, cap=1024, distribution=distribution,
                    default={"graph_variants": "d"}, tuner={"graph_variants": "t"}, graph_variants=timing)

    env = {"device": "NVIDIA H200", "torch": "2.11.0"}
    whole = dict(benchmark="serving", command="python serving.py --out whole.json", environment=env,
                 max_context=131072, models={"m": {}}, cases_planned=2, seconds=5.0,
                 rows=[row(1, "uniform", 10.0), row(3, "uniform", 5.0)])
    rerun = dict(whole, command="python serving.py --batches 1 --out rerun.json", cases_planned=1,
                 rows=[row(1, "uniform", 5.0)])
    other = dict(rerun, environment=dict(env, torch="2.12.0"))
    failed = dict(rerun, rows=[dict(model="m", batch=3, cap=1024, distribution="uniform", error="OutOfMemoryError")])
    other_db = dict(rerun, command="python serving.py --batches 1 --db mine.db --out rerun.json")
    other_heads = dict(rerun, models={"m": {"num_q_heads": 48}})
    for name, doc in (("whole", whole), ("rerun", rerun), ("other", other), ("failed", failed),
                      ("other_db", other_db), ("other_heads", other_heads)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    env_vars = dict(os.environ, PYTHONPATH=str(ROOT))

    def combine(*names: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "serving.py", "--combine", *(str(tmp_path / f"{n}.json") for n in names),
                               "--out", str(tmp_path / "combined.json")], cwd=ROOT / "benchmarks", env=env_vars,
                              capture_output=True, text=True, timeout=300)

    result = combine("whole", "rerun")
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads((tmp_path / "combined.json").read_text())
    assert sorted((r["batch"], r["graph_variants"]["tuner_us"]) for r in doc["rows"]) == [(1, 5.0), (3, 5.0)]
    summary = doc["summary"]["graph_variants"]
    assert summary["cases"] == 2 and summary["tuner_over_default_geomean"] == pytest.approx(2.0)
    assert summary["share_of_oracle_gain"] == pytest.approx(1.0)
    assert [c["command"] for c in doc["combined_from"]] == [whole["command"], rerun["command"]]
    assert doc["environment"] == env

    result = combine("whole", "failed")  # a rerun's error does not hide the case's measurement
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads((tmp_path / "combined.json").read_text())
    assert sorted((r["batch"], r["graph_variants"]["tuner_us"]) for r in doc["rows"]) == [(1, 10.0), (3, 5.0)]

    (tmp_path / "combined.json").unlink()
    for name, why in (("other", "environment"), ("other_db", "--db"), ("other_heads", "head configuration")):
        result = combine("whole", name)
        assert result.returncode == 2 and why in result.stderr.strip().splitlines()[-1], result.stderr
        assert not (tmp_path / "combined.json").exists()


def test_decode_step_smoke_runs_every_mode_on_the_same_steps(tmp_path):
    """The stand-in for a server's decode step (issue 38): each mode over the same steps, whose
    outputs agree (no step reads the K/V another wrote)."""
    out = tmp_path / "decode_step.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "decode_step.py", "--smoke", "--limit", "2", "--out", str(out)],
                            cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 2 and not any("error" in r for r in doc["rows"])
    for row in doc["rows"]:
        assert row["fa3_default"]["step_ms"] > 0
        assert all(row[m]["max_error_vs_default"] < 1e-3 and row[m]["relative_error_vs_default"] < 1e-3
                   and row[m]["config"] for m in ("tuner", "tuner_declared", "tuner_variants"))
        assert len(row["tuner_variants"]["variants_replayed"]) == row["steps"]


def test_sweep_cost_sweeps_each_kv_bucket_of_a_windowed_key(tmp_path):
    """Past its window a key's kv lengths are still each their own run key: of mixed batches
    the shorter sequences read less. Swept as one (the window-4095 key's record from caps of
    128k), it ran at 0.48x of FA3's default at caps of 4k-16k; from caps of 4k, it missed
    the oracle's 1.13-1.65x at 16k-128k."""
    out = tmp_path / "sweep_cost.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "sweep_cost.py", "--smoke", "--heads", "cpu-tiny window31",
                             "--agree", "0", "--out", str(out), "--db", str(tmp_path / "serving.db")],
                            cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [sweep] = json.loads(out.read_text())["sweeps"]
    status = {(r["batch"], r["kv_len"]): r["status"] for r in sweep["rows"]}
    assert status == {(1, 128): "measured", (2, 128): "measured", (1, 64): "measured", (2, 64): "measured"}


def test_new_key_cost_times_the_users_sweep_command_on_an_empty_triton_cache(tmp_path):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([dict(batch=1, kv_len=200, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                       page_size=4, dtype="float32")]))
    out, db = tmp_path / "cost.json", tmp_path / "new.db"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "new_key_cost.py", "--out", str(out), "--db", str(db), "--",
                             "torch_split_decode", "--shapes", str(shapes), "--repeats", "3", "--warmup", "1"],
                            cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["exit_code"] == 0 and doc["fresh_triton_cache"] and doc["sweep_seconds"] > 0
    assert doc["sweep_command"].startswith("tuner sweep torch_split_decode --shapes ")
    assert doc["db"]["records_by_op"] == {"torch_split_decode": 1} and doc["db"]["measurements"] >= 1
    assert doc["first_lines"][0].startswith("sweeping torch_split_decode on cpu, halving search: 1 shape,")
    assert (tmp_path / "cost.log").exists()


def test_decode_step_gives_each_table_copy_its_own_slots():
    """Layers read different memory through the copies of a step's page table, as a model's
    layers do; through one table a small case's caches stayed in the L2 across layers."""
    decode_step = benchmark_module("decode_step")
    tables = decode_step._tables([5, 2, 0], width=8, span=10, copies=3, seed=1)
    held = [set(t[0, :5].tolist()) | set(t[1, :2].tolist()) for t in tables]
    for c, slots in enumerate(held):
        assert len(slots) == 7 and all(c * 10 <= s < (c + 1) * 10 for s in slots)
    assert all(torch.equal(tables[c] - tables[0], torch.full_like(tables[0], 10 * c)) for c in range(3))


def test_serving_cases_with_octave_caps_reach_every_kv_bucket_at_large_batches():
    """The issue's caps (1k, 4k, 16k, 64k, 128k) never put a batch of 24 or more at kv 2k, 8k
    or 32k, the keys where shipped grid winners lost most; --caps octaves does."""
    serving = benchmark_module("serving")
    issue, octaves = serving.cases(False), serving.cases(False, caps=serving.CAP_SETS["octaves"])
    assert {c["cap"] for c in issue if c["batch"] == 256} == {1024, 4096}
    assert {c["cap"] for c in octaves if c["batch"] == 256} == {1024, 2048, 4096, 8192}
    assert len({(c["model"], c["batch"], c["cap"], c["distribution"]) for c in octaves}) == len(octaves)
    assert {(c["model"], c["batch"], c["cap"], c["distribution"]) for c in issue} <= \
        {(c["model"], c["batch"], c["cap"], c["distribution"]) for c in octaves}


def test_serving_cases_with_mid_caps_put_a_uniform_batchs_longest_low_or_midway_in_its_kv_bucket():
    """The sweeps' uniform batches (and serving.py's at its issue caps) mostly have their
    longest in the top quarter of its kv bucket; --caps mid draws them mostly below (held-out
    lengths for the records)."""
    from tuner.keys import kv_bucket_low
    from tuner.workload.traffic import draw_lengths

    serving = benchmark_module("serving")

    def low_share(caps: tuple[int, ...]) -> float:
        """Of the uniform cases, the share whose longest is at most 3/4 of its bucket's top
        (each case drawn with its seed in the run: its index)."""
        longest = [max(draw_lengths("uniform", c["batch"], c["cap"], seed=i))
                   for i, c in enumerate(serving.cases(False, caps=caps)) if c["distribution"] == "uniform"]
        top = [2 * (kv_bucket_low(n) - 1) for n in longest]  # the bucket (top/2, top]
        return sum(n <= 3 * t // 4 for n, t in zip(longest, top)) / len(longest)

    assert serving.CAP_SETS["mid"] == (1536, 3072, 6144, 12288, 24576, 49152, 98304)
    assert low_share(serving.CAP_SETS["issue"]) < 0.25 and low_share(serving.CAP_SETS["mid"]) > 0.9


def test_shipped_sweeps_counts_the_winners_a_db_holds_between_its_sweeps(tmp_path):
    """sweeps.jsonl says how far a run cut off by --seconds got: the DB's winners before and
    after each sweep (none before the DB exists)."""
    from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
    from tuner.keys import attention_run_key

    shipped_sweeps = tool_module("shipped_sweeps")
    db = tmp_path / "serving.db"
    assert shipped_sweeps.stored_winners(str(db)) is None and not db.exists()
    with TuningDB(db) as database:
        for batch in (1, 2):
            database.save_record(Problem("op", '{"h":8}', attention_run_key(batch, 1, 1024)),
                                 (current_fingerprint_id(), current_fingerprint()), {"c": 1}, median_us=1.0,
                                 spread_us=0.1, samples=5, default_config={"c": 0}, default_median_us=1.1,
                                 default_spread_us=0.1, method={})
    assert shipped_sweeps.stored_winners(str(db)) == 2


def test_shipped_sweeps_stops_a_sweep_with_sigint_first(tmp_path):
    """A sweep stopped at the deadline gets SIGINT, so it prints the shapes it finished and
    cProfile writes what it did (a KeyboardInterrupt; before, an unprofiled sweep got
    SIGTERM and its log held only its header), also where the run was started in the
    background; one that ignores it still ends, by the next signal."""
    import signal

    shipped_sweeps = tool_module("shipped_sweeps")
    assert shipped_sweeps.STOP_SIGNALS[0] == signal.SIGINT
    waits = ("import signal, sys, time\n"
             "if sys.argv[1] == 'ignore': signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
             "try:\n    print('up', flush=True)\n    time.sleep(60)\n"  # up inside it: no window
             "except KeyboardInterrupt:\n    open(sys.argv[2], 'w').write('x')\n")
    # as in a run started with `nohup ... &` (SIGINT ignored, and so in its children: a sweep
    # then ran to SIGTERM), which pass_sigint_on undoes for the sweeps
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        shipped_sweeps.pass_sigint_on()
        for how in ("interrupt", "ignore"):
            done = tmp_path / f"{how}.interrupted"
            proc = subprocess.Popen([sys.executable, "-c", waits, how, str(done)], stdout=subprocess.PIPE,
                                    start_new_session=True)
            assert proc.stdout.readline() == b"up\n"
            shipped_sweeps.stop(proc, shipped_sweeps.STOP_SIGNALS, grace=10.0 if how == "interrupt" else 0.5)
            proc.stdout.close()
            assert proc.returncode is not None and done.exists() == (how == "interrupt")
    finally:
        signal.signal(signal.SIGINT, previous)
    args = shipped_sweeps.argparse.Namespace(search="guided", db="x.db", set="serving")
    plain = shipped_sweeps.sweep_command("decode_attention", Path("s.json"), args)
    assert plain[1:4] == ["-m", "tuner", "sweep"]
    cmd = shipped_sweeps.sweep_command("decode_attention", Path("s.json"), args, tmp_path / "p.prof")
    assert cmd[3:6] == [str(tmp_path / "p.prof"), "tuner", "sweep"] and cmd[6:] == plain[4:]


def test_a_profiled_sweep_keeps_its_exit_code_and_writes_its_profile(tmp_path):
    """Review: `python -m cProfile` exits 0 whatever its program does, so a profiled sweep
    that failed (or was interrupted, 130) was logged as rc 0."""
    import pstats

    shipped_sweeps = tool_module("shipped_sweeps")
    (tmp_path / "ends_with.py").write_text("import sys\nsum(range(1000))\nsys.exit(int(sys.argv[1]))\n")
    for code in (0, 3, 130):
        out = tmp_path / f"{code}.prof"
        done = subprocess.run([sys.executable, "-c", shipped_sweeps.PROFILED, str(out), "ends_with", str(code)],
                              cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
        assert done.returncode == code
        assert pstats.Stats(str(out)).total_calls > 0


def test_shipped_sweeps_heads_keeps_only_the_named_head_configurations():
    """--heads 32/8,8/1 sweeps those head configurations' shapes of the serving grid and no
    other, every one of theirs (so a later run without --heads resumes the rest)."""
    shipped_sweeps = tool_module("shipped_sweeps")
    shapes = json.loads((ROOT / "tools" / "shapes" / "models_serving.json").read_text())
    picked = shipped_sweeps.only_heads(shapes, "32/8,8/1")
    assert {(s["num_q_heads"], s["num_kv_heads"]) for s in picked} == {(32, 8), (8, 1)}
    assert len(picked) == sum((s["num_q_heads"], s["num_kv_heads"]) in {(32, 8), (8, 1)} for s in shapes)
    assert shipped_sweeps.only_heads(shapes, None) == shapes


def test_merge_reship_takes_the_reships_winners_but_keeps_shipped_flashinfer_ones(tmp_path):
    """A serving re-ship's winner replaces the shipped one at its key, is added where the
    shipped file has none, and leaves a shipped FlashInfer winner alone (the re-ship never
    timed FlashInfer); other ops' records stay as shipped."""
    from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id, export_document
    from tuner.keys import attention_run_key

    merge_reship = tool_module("merge_reship")
    fp = (current_fingerprint_id(), current_fingerprint())
    default = {"backend": "fa3", "num_splits": 0, "pack_gqa": None}

    def document(path: Path, records: dict) -> dict:
        with TuningDB(path) as db:
            for (op, batch), config in records.items():
                db.save_record(Problem(op, '{"h":8}', attention_run_key(batch, 1, 1024)), fp, config, median_us=1.0,
                               spread_us=0.1, samples=5, default_config=default, default_median_us=1.1,
                               default_spread_us=0.1, method={})
            return export_document(db)

    triton = {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 4, "num_stages": 2, "num_warps": 4}
    flashinfer = {"backend": "flashinfer", "use_tensor_cores": True}
    shipped = document(tmp_path / "shipped.db", {("decode_attention", 1): triton, ("decode_attention", 2): flashinfer,
                                                  ("fa3", 1): {"num_splits": 2, "pack_gqa": None}})
    reship = document(tmp_path / "reship.db", {("decode_attention", 1): default, ("decode_attention", 2): default,
                                                ("decode_attention", 4): triton})
    merged, counts = merge_reship.merge(shipped, reship, tmp_path)
    got = {(r["op"], r["run_key"]["batch"]): r["config"] for r in merged["records"]}
    assert got == {("decode_attention", 1): default, ("decode_attention", 2): flashinfer,
                   ("decode_attention", 4): triton, ("fa3", 1): {"num_splits": 2, "pack_gqa": None}}
    assert counts == dict(shipped=3, swept=3, replaced=1, kept_flashinfer=1, added=1, written=4)


def test_merge_reship_replaces_a_shipped_winner_measured_on_another_host_of_the_same_kind(tmp_path):
    """Two hosts of one GPU and stack differ in driver, so in fingerprint id: the re-ship's
    winner still replaces the shipped one rather than standing beside it."""
    from tuner.db import Problem, TuningDB, export_document, fingerprint_id
    from tuner.keys import attention_run_key

    merge_reship = tool_module("merge_reship")
    problem = Problem("decode_attention", '{"h":8}', attention_run_key(1, 1, 1024))
    default = {"backend": "fa3", "num_splits": 0, "pack_gqa": None}
    triton = {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 4, "num_stages": 2, "num_warps": 4}

    def document(path: Path, driver: str, config: dict) -> dict:
        data = {"device": "NVIDIA H200", "driver": driver, "torch": "2.11.0"}
        with TuningDB(path) as db:
            db.save_record(problem, (fingerprint_id(data), data), config, median_us=1.0, spread_us=0.1, samples=5,
                           default_config=default, default_median_us=1.1, default_spread_us=0.1, method={})
            return export_document(db)

    shipped = document(tmp_path / "shipped.db", "580.1", triton)
    reship = document(tmp_path / "reship.db", "580.2", default)
    merged, counts = merge_reship.merge(shipped, reship, tmp_path)
    assert [r["config"] for r in merged["records"]] == [default]
    assert counts["replaced"] == 1 and counts["written"] == 1


def test_merge_reship_takes_only_the_named_heads_records(tmp_path):
    """With heads, a re-ship DB seeded from an older shipped file replaces nothing of the
    other head configurations (their records there predate what the shipped file learnt
    since); without, it replaces every key it holds. A bad --heads stops it with one line."""
    from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id, export_document
    from tuner.keys import attention_run_key

    merge_reship = tool_module("merge_reship")
    fp = (current_fingerprint_id(), current_fingerprint())
    default = {"backend": "fa3", "num_splits": 0, "pack_gqa": None}
    triton = {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 4, "num_stages": 2, "num_warps": 4}

    def document(path: Path, records: dict) -> dict:
        with TuningDB(path) as db:
            for (q, kv), config in records.items():
                static = json.dumps({"num_kv_heads": kv, "num_q_heads": q}, sort_keys=True)
                db.save_record(Problem("decode_attention", static, attention_run_key(1, 1, 1024)), fp, config,
                               median_us=1.0, spread_us=0.1, samples=5, default_config=default,
                               default_median_us=1.1, default_spread_us=0.1, method={})
            return export_document(db)

    shipped = document(tmp_path / "shipped.db", {(32, 8): triton, (16, 4): default})
    reship = document(tmp_path / "reship.db", {(32, 8): default, (16, 4): triton})
    heads = lambda doc: {(r["static_key"]["num_q_heads"], r["static_key"]["num_kv_heads"]): r["config"]
                         for r in doc["records"]}
    (tmp_path / "one").mkdir(), (tmp_path / "all").mkdir()
    merged, counts = merge_reship.merge(shipped, reship, tmp_path / "one", merge_reship.parse_heads("16/4"))
    assert heads(merged) == {(32, 8): triton, (16, 4): triton} and counts["swept"] == 1
    merged, counts = merge_reship.merge(shipped, reship, tmp_path / "all")
    assert heads(merged) == {(32, 8): default, (16, 4): triton} and counts["swept"] == 2
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "merge_reship.py"), "--shipped", "s.json",
                          "--reship", "r.db", "--out", "o.json", "--heads", "16-4"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Q/KV pairs" in bad.stderr  # bad input: exit 2, as argparse's own


@pytest.mark.parametrize("trial, seed, second", [(("--seed", "7"), 7, False), (("--second-trial",), 0, True)])
def test_verify_shipped_re_times_serving_challengers_on_independent_lengths(tmp_path, trial, seed, second):
    """--challengers-only, --heads, --ops, --max-batch and --batches pick the records; --seed builds the
    trials of lengths drawn with that seed, --second-trial the sweep's second trial; the
    verified record says which."""
    from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id, export_document
    from tuner.workload import DecodeShape

    common = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32", lengths="serving")
    fp = (current_fingerprint_id(), current_fingerprint())
    default = {"chunk": 0}
    records = {DecodeShape(batch=2, kv_len=64, **common): {"chunk": 16},  # a challenger: re-timed
               DecodeShape(batch=3, kv_len=64, **common): default,  # the default: left alone
               DecodeShape(batch=4, kv_len=64, **common): {"chunk": 16},  # past --max-batch
               DecodeShape(batch=1, kv_len=64, **common): {"chunk": 16},  # not in --batches
               DecodeShape(batch=2, kv_len=64, **dict(common, num_q_heads=8)): {"chunk": 16}}  # other heads
    with TuningDB(tmp_path / "sweep.db") as db:
        for shape, config in records.items():
            db.save_record(Problem("torch_split_decode", shape.static_key().to_json(), shape.run_key()), fp, config,
                           median_us=1.0, spread_us=0.1, samples=5, default_config=default, default_median_us=1.1,
                           default_spread_us=0.1, method={"lengths": "serving"})
        (tmp_path / "sweep.tunings.json").write_text(json.dumps(export_document(db)))
    out, verified = tmp_path / "verified.json", tmp_path / "verified.db"
    args = ["--tunings", str(tmp_path / "sweep.tunings.json"), "--db", str(verified), "--out", str(out),
            *trial, "--heads", "4/2", "--ops", "torch_split_decode", "--max-batch", "2", "--batches", "2,4",
            "--challengers-only", "--seconds", "120"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "verify_shipped.py", *args], cwd=ROOT / "tools", env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["records_in"] == 1 and [row["run_key"]["batch"] for row in doc["rows"]] == [2]
    [record] = TuningDB(verified).records()
    assert record.method["seed"] == seed and record.method["lengths"] == "serving"
    assert record.method["second_trial"] is second
    [row] = doc["rows"]
    assert record.problem.run_key.batch == 2 and record.config == row["winner"]


def test_verify_shipped_judges_a_dense_pass_record_by_its_rule_and_keeps_each_configs_time(tmp_path):
    """A record the dense pass stored is re-timed by its rule (loses nowhere:
    tuner.search.pipeline.confirm_again with must_gain=False), not the winner rule whose
    gain a mix dilutes; every row keeps both configs' times on the trial. (Timed on the CPU,
    either config may win: the test checks which rule judged it and what was kept.)"""
    from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id, export_document
    from tuner.workload import DecodeShape

    shape = DecodeShape(batch=2, kv_len=64, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                        dtype="float32", lengths="serving")
    with TuningDB(tmp_path / "sweep.db") as db:
        db.save_record(Problem("torch_split_decode", shape.static_key().to_json(), shape.run_key()),
                       (current_fingerprint_id(), current_fingerprint()), {"chunk": 16}, median_us=1.0,
                       spread_us=0.1, samples=5, default_config={"chunk": 0}, default_median_us=1.1,
                       default_spread_us=0.1, method={"lengths": "serving", "dense_pass": {"kept": False}})
        (tmp_path / "sweep.tunings.json").write_text(json.dumps(export_document(db)))
    out = tmp_path / "verified.json"
    args = ["--tunings", str(tmp_path / "sweep.tunings.json"), "--db", str(tmp_path / "verified.db"),
            "--out", str(out), "--second-trial", "--seconds", "120"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "verify_shipped.py", *args], cwd=ROOT / "tools", env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert row["rule"].startswith("loses nowhere")
    assert [o["config"] for o in row["outcomes"]] == [{"chunk": 0}, {"chunk": 16}]
    assert all(o["status"] == "ok" and o["median_us"] > 0 for o in row["outcomes"])
    assert row["default_us"] == row["outcomes"][0]["median_us"]
    # a kept winner keeps its dense pass's info, so a sweep does not run one again
    [record] = TuningDB(tmp_path / "verified.db").records()
    assert record.config == row["winner"]
    assert ("dense_pass" in record.method) is (row["winner"] == {"chunk": 16})


def test_sweep_cost_kv_option_keeps_only_those_kv_buckets_of_the_serving_grid():
    sweep_cost = benchmark_module("sweep_cost")
    spec = sweep_cost.HEADS["16/8 hd256 softcap50 window4095"]
    picked = sweep_cost.grid_of(spec, False, False, 2**21, (1024, 131072))
    every = sweep_cost.grid_of(spec, False, False, 2**21)
    assert {s.kv_len for s in picked} == {1024, 131072}
    assert picked == [s for s in every if s.kv_len in (1024, 131072)]


def test_serving_compare_summarises_each_run_on_the_cases_all_of_them_hold(tmp_path, capsys, monkeypatch):
    compare = benchmark_module("serving_compare")

    def row(model, distribution, tuned, oracle):
        return {"model": model, "batch": 8, "cap": 1024, "distribution": distribution,
                "per_call": {"tuner_speedup": tuned, "oracle_speedup": oracle}}
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"rows": [row("m", "uniform", 1.0, 1.21), row("m", "few_long", 0.9, 1.0),
                                      row("only in a", "uniform", 2.0, 2.0)]}))
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"rows": [row("m", "uniform", 1.21, 1.21), row("m", "few_long", 1.0, 1.0)]}))
    monkeypatch.setattr(sys, "argv", ["serving_compare.py", f"a={a}", f"b={b}", "--modes", "per_call"])
    compare.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "2 cases in all of a, b"
    # a: geomean of 1.0 and 0.9 over an oracle of sqrt(1.21) = 1.1; b: the oracle throughout
    assert "a            all: 0.949x of 1.100x, share -0.553, worst 0.900, 1 slower" in out[1]
    assert "uniform: 1.210x of 1.210x, share 1.000, worst 1.210, 0 slower" in out[-1]


def test_a_resumed_run_keeps_the_rows_it_has_and_runs_only_the_cases_it_lacks(tmp_path):
    """serving.py's 420 s cut a run off 8 cases short, and there was no way to finish it."""
    import argparse

    runs = benchmark_module("common.case_runs")
    cases = [dict(model="m", batch=b, cap=1024, distribution="uniform") for b in (1, 3, 8)]
    out = tmp_path / "run.json"
    out.write_text(json.dumps({"rows": [dict(cases[1], seconds=1.0, kept=True),
                                        dict(cases[2], error="RuntimeError: out of memory")]}))
    args = argparse.Namespace(out=out, resume=True)
    ran = []
    rows = runs.run_cases(list(enumerate(cases)), 60.0, "cpu", run=lambda i, c: ran.append(i) or dict(c),
                          fields=lambda c: c, describe=lambda row: "", write=lambda rows: None,
                          done=runs.done_rows(args))
    assert ran == [0, 2]  # the row with an error runs again
    assert sorted(r["batch"] for r in rows) == [1, 3, 8] and [r for r in rows if r.get("kept")] == [
        dict(cases[1], seconds=1.0, kept=True)]
    assert runs.done_rows(argparse.Namespace(out=out, resume=False)) == []


# one device call carries at most 64 MiB: the working tree and a staging part of the GPU
# packages (../shared/gpu/prepare: sgl-kernel in three parts of 48.5 MB each)
DEVICE_CALL_BYTES, STAGING_PART_BYTES = 64 * 2**20, 48_600_000


def test_the_tracked_tree_travels_with_a_staging_part_in_one_device_call():
    """Result files add up: a tree over the budget makes the first staging call on the H200
    fail (its time is scarce). Keep DBs trimmed to one head configuration and xz'd, or in git
    history only."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / name for name in listed.decode().split("\0") if name]
    tree = sum(p.stat().st_size for p in files if p.is_file())
    assert tree + STAGING_PART_BYTES < DEVICE_CALL_BYTES, f"tracked tree {tree / 1e6:.2f} MB"


def test_graph_replays_smoke_times_every_config_on_every_replayed_draw(tmp_path):
    """Issue 37's draw-by-draw view of a graph's replays: each config's time on each draw,
    its mean (what the graph sweep ranks) and the graph oracle (the least mean)."""
    out = tmp_path / "graph_replays.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "graph_replays.py", "--smoke", "--out", str(out)],
                            cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [shape] = json.loads(out.read_text())["shapes"]
    assert shape["failed"] == [] and len(shape["configs"]) > 3
    draws = len(shape["draws"])
    assert draws > 1 and all(len(c["per_draw_us"]) == draws for c in shape["configs"])
    means = [c["mean_us"] for c in shape["configs"]]
    assert shape["oracle"] == shape["configs"][means.index(min(means))]["config"]
    assert shape["oracle_speedup"] == max(c["speedup"] for c in shape["configs"])
    assert {"triton_by_load", "triton_by_length", "triton_fixed"} <= set(shape["best_of_family"])


def test_graph_dispatch_runs_the_branch_of_the_longest_sequences_kv_bucket(tmp_path):
    """Issue 37's per-replay dispatch probe: the device step (its Triton kernel, interpreted)
    flags exactly the branch the host rule names (the kv bucket of the batch's longest
    sequence, and whether the batch is dense), and that branch's output is the one returned."""
    gd = benchmark_module("graph_dispatch")
    table = {False: [0, 0, 1, 2], True: [0, 0, 3, 2]}
    assert gd.expected_branch([1, 2, 4, 8], table, [3, 1, 0]) == 1  # longest 3: bucket 4; 4 of 9, not dense
    assert gd.expected_branch([1, 2, 4, 8], table, [3, 2, 0]) == 3  # 5 of 9: dense
    assert gd.expected_branch([1, 2, 4, 8], table, [5]) == 2
    # the device step itself, on lengths the host rule sorts into each column
    tops = [1 << e for e in range(8)]
    other, dense = [0, 0, 0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 3, 1, 2]
    step = gd.GraphDispatch(tops, {False: other, True: dense}, [{}] * 4, "cpu")
    for lens in ([20, 30, 10], [20, 3, 1], [128], [100, 1, 1, 1], [0, 0], [33, 33]):
        step.choose(torch.tensor(lens, dtype=torch.int32))
        assert step.flags.nonzero().flatten().tolist() == [gd.expected_branch(tops, {False: other, True: dense}, lens)]
    out = tmp_path / "graph_dispatch.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "graph_dispatch.py", "--smoke", "--out", str(out)],
                            cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert len(rows) == 6 and doc["summary"]["wrong_branch"] == 0
    for row in rows:
        assert row["branch_ran"] == [row["expected_branch"]] and row["max_error_vs_expected"] == 0.0
    # the smoke cases reach more than one branch, so the rule is exercised, not one flag
    assert len({r["expected_branch"] for r in rows}) > 1 and all(len(r["branches"]) > 1 for r in rows)


def fake_sglang_e2e(out: Path, backends: str, *flags: str, crash: str = "", **env: str) -> dict:
    """benchmarks/sglang_e2e.py on the stand-in of SGLang (tests/support/fake_sglang_bench), one
    round unless flags say otherwise; env: the stand-in's FAKE_SGLANG_* variables."""
    fake = ROOT / "tests" / "support" / "fake_sglang_bench"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), str(ROOT)]), FAKE_SGLANG_CRASH=crash, **env)
    result = subprocess.run([sys.executable, "sglang_e2e.py", "--out", str(out), "--backends", backends,
                             "--batches", "1,8,64", "--input-lens", "1024,4096", "--output-len", "4", "--rounds", "1",
                             *flags], cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_sglang_e2e_spread_lengths_give_every_backend_the_same_mixed_prompts_through_bench_one_batchs_file(
        tmp_path):
    """--lengths spread: each request its own prompt length (uniform in [L/2, L]), handed to
    bench_one_batch as its --prompt-filename, the same for every backend and round; the JSON
    says which lengths its batches held, and runs of different lengths do not merge."""
    e2e = benchmark_module("sglang_e2e")
    spread = fake_sglang_e2e(tmp_path / "s.json", "fa3,tuner", "--lengths", "spread", "--no-logits")
    assert spread["lengths"] == "spread"
    for backend in ("fa3", "tuner"):
        rows = spread["results"][backend]["latency"]["rows"]
        assert {(r["batch_size"], r["input_len"]) for r in rows} == {(b, n) for b in (1, 8, 64) for n in (1024, 4096)}
        for r in rows:
            assert r["prompt_lens"] == e2e.spread_lengths(64, r["input_len"])[:r["batch_size"]]
            assert all(r["input_len"] // 2 <= n <= r["input_len"] for n in r["prompt_lens"])
    assert len(set(e2e.spread_lengths(64, 4096))) > 1  # mixed, not one length
    assert e2e.spread_lengths(8, 4096) == e2e.spread_lengths(64, 4096)[:8]  # a point's prompts, whatever the run
    equal = fake_sglang_e2e(tmp_path / "e.json", "fa3", "--no-logits")
    assert equal["lengths"] == "equal" and all(r["prompt_lens"] is None
                                               for r in equal["results"]["fa3"]["latency"]["rows"])
    refused = subprocess.run([sys.executable, "sglang_e2e.py", "--merge", str(tmp_path / "s.json"),
                              str(tmp_path / "e.json"), "--out", str(tmp_path / "m.json")], cwd=ROOT / "benchmarks",
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "different lengths" in refused.stderr


def test_sglang_e2e_diagnoses_a_step_tuner_under_other_settings_every_steps_latency_and_a_profile(tmp_path):
    """A diagnosis of where a step's time goes, in one run: tuner's workers without graph
    variants and without the replay judge beside the plain one (each "tuner" to SGLang, its
    setting in its environment), each measured step's latency (not the warm-up's), and a
    profile of a few steps per batch size, summarized and its traces deleted."""
    doc = fake_sglang_e2e(tmp_path / "d.json", "fa3,tuner,tuner-novariants,tuner-nojudge", "--no-logits",
                          "--batches", "1,8", "--input-lens", "1024", "--step-latencies", "--profile-steps", "2")
    results = doc["results"]
    for label, setting in (("tuner", None), ("tuner-novariants", ("TUNER_GRAPH_VARIANTS", "0")),
                           ("tuner-nojudge", ("TUNER_REPLAY_JUDGE", "0"))):
        for row in results[label]["latency"]["rows"]:
            assert row["rank_setup"]["tuner_registered"] and row["run_name"] == label
            assert {k: v for k, v in row["tuner_env"].items()
                    if k in ("TUNER_GRAPH_VARIANTS", "TUNER_REPLAY_JUDGE")} == dict([setting] if setting else [])
    fa3_rows = results["fa3"]["latency"]["rows"]
    assert not fa3_rows[0]["rank_setup"]["tuner_registered"]
    steps = results["fa3"]["latency"]["steps"]["1024"]
    scale = {str(r["batch_size"]): 1000.0 / r["median_decode_throughput"] for r in fa3_rows}
    assert set(steps) == {"1", "8"}  # the warm-up's batch-1 step is not among them
    for batch, ms in steps.items():
        assert ms == pytest.approx([scale[batch] * (1 + i / 10) for i in range(3)], abs=1e-2)
    profile = results["tuner-nojudge"]["latency"]["profile"]["1024"]
    assert set(profile) == {"1", "8"}
    p = profile["8"]
    assert (p["steps"], p["gpu_busy_us"], p["gpu_ops"], p["graph_launches"], p["graph_launch_host_us"]) == (
        2, 30.0, 2.0, 1.0, 4.0)
    assert p["gpu_idle_us"] == pytest.approx((1035.0 - 60.0) / 2)  # the span holds the host's time between steps
    assert [(k["name"], k["count"], k["us"]) for k in p["top"]] == [("mlp", 1.0, 20.0), ("attention_tuner", 1.0, 10.0)]
    assert not list((tmp_path / "d.work").glob("profile*"))  # the traces: summarized, then deleted
    entry, = [e for e in doc["summary"] if e["batch"] == 8]
    assert entry["best_built_in"] == "fa3"
    for label in ("tuner", "tuner-novariants", "tuner-nojudge"):
        assert entry[f"{label}_over_best"] == pytest.approx(1.1)  # the stand-in's tuner speed, whatever its setting


class _ForwardBatch:
    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size


def _timed_runner():
    """A decode graph runner whose load_batch takes 30 us of the host's clock, and execute 50 us
    more and 7 ms of the GPU's; and a StepTimer on those clocks, its lines collected."""
    timing = benchmark_module("common.sglang_step_timing")
    events, host_ns, lines = EventClock(), [0], []

    class Runner:
        def load_batch(self, forward_batch, pp_proxy_tensors=None):
            host_ns[0] += 30_000

        def execute(self, forward_batch, pp_proxy_tensors=None):
            self.load_batch(forward_batch)
            host_ns[0] += 50_000
            events.now += 7.0  # the replay's GPU time, ms
    timer = timing.StepTimer(event=events, clock=lambda: host_ns[0], emit=lambda line, flush: lines.append(line))
    return timing, Runner, timer, host_ns, lines


def test_a_decode_steps_timing_line_comes_when_the_next_step_starts_and_splits_host_from_gpu():
    """--step-timing: no step waits for its own CUDA events; load_batch's host time (SGLang's
    copies, tuner's hooks) is told apart from execute's (with the replay's launch)."""
    timing, Runner, timer, _, lines = _timed_runner()
    timer.wrap(Runner)
    Runner().execute(_ForwardBatch(8))
    assert lines == []
    Runner().execute(_ForwardBatch(1))
    assert lines == ["tuner-e2e step: bs=8 load_us=30.0 host_us=80.0 gpu_us=7000.0"]
    timer.flush()
    assert lines[1] == "tuner-e2e step: bs=1 load_us=30.0 host_us=80.0 gpu_us=7000.0"
    group_up = [True]  # another TP rank, whose rank reads 0 once bench_one_batch has ended the group
    quiet = timing.StepTimer(emit=lambda line, flush: lines.append(line), rank=lambda: 1 if group_up[0] else 0)
    quiet.wrap(Runner)
    Runner().execute(_ForwardBatch(8))
    group_up[0] = False
    quiet.flush()  # (at exit)
    assert len(lines) == 2


def test_sglangs_own_load_batch_is_timed_apart_from_tuners_hooks_around_it():
    """Wrapped before tuner's hooks go on (wrap_own), SGLang's load_batch is timed alone: the
    rest of load_us is the hooks'."""
    _, Runner, timer, host_ns, lines = _timed_runner()
    timer.wrap_own(Runner)
    sglang_load = Runner.load_batch

    def tuners_hook(runner, forward_batch, pp_proxy_tensors=None):
        sglang_load(runner, forward_batch)
        host_ns[0] += 12_000  # tuner's pick and judge
    Runner.load_batch = tuners_hook
    timer.wrap(Runner)
    Runner().execute(_ForwardBatch(8))
    Runner().execute(_ForwardBatch(8))
    timer.flush()
    assert lines == ["tuner-e2e step: bs=8 load_us=42.0 sglang_us=30.0 host_us=92.0 gpu_us=7000.0"] * 2


def test_step_timings_keep_each_batch_sizes_measured_steps_only():
    """A step's line comes at the next step's launch: the warm-up's last one after the marker,
    before the first measured step's own line; a run's last one at the next run's launch."""
    timing = benchmark_module("common.sglang_step_timing")
    step = "Decode {}. Batch size: {}, latency: 0.01000 s, throughput: 100.00 token/s"
    log = "\n".join([
        step.format(0, 1), "tuner-e2e step: bs=1 load_us=1.0 host_us=2.0 gpu_us=3.0", step.format(1, 1),
        "Benchmark ...",
        "tuner-e2e step: bs=1 load_us=9.0 host_us=9.0 gpu_us=9.0",  # the warm-up's last step
        step.format(0, 1), "tuner-e2e step: bs=1 load_us=3.0 host_us=4.0 gpu_us=5.0",
        step.format(1, 1), "tuner-e2e step: bs=1 load_us=3.5 host_us=4.5 gpu_us=5.5",  # at b8's launch
        step.format(0, 8), "tuner-e2e step: bs=8 load_us=6.0 sglang_us=5.0 host_us=7.0",  # at exit; no GPU
    ])
    expected = {"1": dict(load_us=[3.0, 3.5], host_us=[4.0, 4.5], gpu_us=[5.0, 5.5]),
                "8": dict(load_us=[6.0], host_us=[7.0], sglang_us=[5.0])}
    assert timing.step_timings(log) == expected
    eager_warm_up = log.replace("tuner-e2e step: bs=1 load_us=1.0 host_us=2.0 gpu_us=3.0\n", "").replace(
        "tuner-e2e step: bs=1 load_us=9.0 host_us=9.0 gpu_us=9.0\n", "")  # no warm-up step timed
    assert timing.step_timings(eager_warm_up) == expected
    killed = log.rsplit("\n", 1)[0] + "\n" + step.format(1, 8)  # the worker killed before its exit
    assert timing.step_timings(killed)["8"] == dict(load_us=[], host_us=[], missing=2)
    assert timing.medians_text(dict(load_us=[3.0, 3.5], host_us=[4.0, 5.0], missing=1)) == (
        "load 3 us, host 4 us (medians of 2 steps, 1 not timed)")


def test_sglang_e2e_times_each_decode_graph_step_of_every_backend(tmp_path):
    doc = fake_sglang_e2e(tmp_path / "t.json", "fa3,tuner", "--no-logits", "--batches", "1,8", "--input-lens", "1024",
                          "--step-timing")
    for backend in ("fa3", "tuner"):
        timed = doc["results"][backend]["latency"]["step_timing"]["1024"]
        assert set(timed) == {"1", "8"}
        for t in timed.values():
            assert set(t) == {"load_us", "sglang_us", "host_us"}  # (no GPU here)
            assert len(t["host_us"]) == 3  # every measured decode step (--output-len 4)
            assert all(0 <= own <= load <= host for own, load, host in zip(t["sglang_us"], t["load_us"],
                                                                          t["host_us"]))


def test_a_decode_trace_summary_counts_overlapping_gpu_work_once():
    trace = benchmark_module("common.decode_trace")
    events = [dict(ph="X", cat="kernel", name="a", ts=0, dur=10), dict(ph="X", cat="kernel", name="b", ts=5, dur=10),
              dict(ph="X", cat="gpu_memcpy", name="copy", ts=30, dur=2), dict(ph="X", cat="cpu_op", name="x", ts=0,
                                                                             dur=500),
              dict(ph="i", cat="kernel", name="instant", ts=40)]
    summary = trace.summarize_trace(events, steps=1)
    assert (summary["gpu_busy_us"], summary["gpu_span_us"], summary["gpu_idle_us"], summary["gpu_ops"]) == (
        17.0, 32.0, 15.0, 3.0)
    assert [k["name"] for k in summary["top"]] == ["a", "b", "copy"]
    assert summary["attention_us"] == 0.0 and summary["attention_kernels"] == []
    assert trace.summarize_trace([], steps=2)["gpu_busy_us"] == 0.0


def test_a_decode_trace_summary_times_each_backends_attention_kernels_apart_from_the_rest():
    """attention_us: the kernels of FA3, FlashInfer, tuner's Triton kernel and SGLang's Triton
    backend (names as the profiler gives them), over the steps; not the GEMMs, norms or the
    KV cache's store."""
    trace = benchmark_module("common.decode_trace")
    names = ["void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::Collective",
             "void cutlass::device_kernel<flash::FlashAttnFwdCombine<cute::tuple<cute::C<8>", "_decode_split_kernel",
             "_decode_merge_kernel", "void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits",
             "void flashinfer::PersistentVariableLengthMergeStatesKernel<8u, 16u", "_fwd_grouped_kernel_stage1",
             "_fwd_kernel_stage2", "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT",
             "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>",
             "void (anonymous namespace)::store_kvcache<2048l, 2048l, 4, true, long>"]
    events = [dict(ph="X", cat="kernel", name=name, ts=100 * i, dur=10 + i) for i, name in enumerate(names)]
    summary = trace.summarize_trace(events, steps=2)
    assert summary["attention_us"] == sum(10 + i for i in range(8)) / 2
    counted = summary["attention_kernels"]
    assert len(counted) == 8 and not any("store_kvcache" in name for name in counted)


def test_a_profile_trace_cut_short_is_reported_and_removed_not_a_crash(tmp_path):
    import gzip

    e2e = benchmark_module("sglang_e2e")
    folder = tmp_path / "profile.tuner.4096"
    folder.mkdir()
    (folder / "profile_batch8_input4096_output128_decode.trace.json.gz").write_bytes(
        gzip.compress(b'{"traceEvents": [{"ph": "X"')[:-6])  # a worker killed while writing it
    found = e2e.profile_summaries(folder, 3)
    assert list(found) == ["8"] and "error" in found["8"] and not folder.exists()


def test_sglang_e2e_sets_up_each_tensor_parallel_rank_that_bench_one_batch_spawns(tmp_path):
    """--tp 2: bench_one_batch runs each rank's latency test in a process it spawns, which
    knows nothing of the worker's set-up; each rank registers the tuner backend and prefills
    in parts as the worker does (else tuner's backend is unknown there), and runs of another
    --tp do not merge."""
    e2e = benchmark_module("sglang_e2e")
    doc = fake_sglang_e2e(tmp_path / "tp.json", "fa3,tuner", "--no-logits", "--batches", "8", "--input-lens", "1024",
                          "--tp", "2")
    assert doc["tp"] == 2
    setups = {b: [r["rank_setup"] for r in doc["results"][b]["latency"]["rows"]] for b in ("fa3", "tuner")}
    assert setups == {"fa3": [dict(tuner_registered=False, extend_in_parts=True)],
                      "tuner": [dict(tuner_registered=True, extend_in_parts=True)]}
    one = fake_sglang_e2e(tmp_path / "one.json", "fa3", "--no-logits", "--batches", "8", "--input-lens", "1024")
    assert one["tp"] == 1
    with pytest.raises(e2e.UsageError, match="different GPUs"):
        e2e.merge([str(tmp_path / "tp.json"), str(tmp_path / "one.json")], tmp_path / "m.json", argparse.Namespace())


def test_sglang_e2e_runs_each_backend_and_compares_their_logits_on_a_fake_sglang(tmp_path):
    """Issue 38's harness end to end on a stand-in of SGLang's bench_one_batch
    (tests/support/fake_sglang_bench): a worker per backend and input length, so a run that
    dies costs that length only; the decode graphs' batch sizes handed over; the tuner backend
    registered before SGLang parses its name; each step's logits copied out of the buffer the
    next step overwrites; weights drawn again alike in every process, so equal attention gives
    equal logits and a broken one does not; a failed logits worker never scored on an older
    file; and runs split by backend and by part joined by --merge."""
    e2e = benchmark_module("sglang_e2e")

    def run(out, backends, *flags, crash="triton:4096"):
        return fake_sglang_e2e(out, backends, *flags, crash=crash)

    first = run(tmp_path / "a.json", "fa3,triton")
    logits_only = run(tmp_path / "b.json", "tuner,broken", "--no-latency")
    run(tmp_path / "c.json", "tuner", "--no-logits")
    latency = first["results"]["triton"]["latency"]
    assert latency["exit_codes"]["1024"] == 0 and latency["exit_codes"]["4096"] != 0  # the crash took 4096 only
    assert {(r["batch_size"], r["input_len"]) for r in latency["rows"]} == {(1, 1024), (8, 1024), (64, 1024)}
    fa3_rows = first["results"]["fa3"]["latency"]["rows"]
    # each run's decode graphs are its batch sizes (64 x 4096 too: prefilled in parts)
    assert {(r["batch_size"], r["input_len"], tuple(r["graph_bs"])) for r in fa3_rows} == {
        (b, n, (1, 8, 64)) for b in (1, 8, 64) for n in (1024, 4096)}
    steps = torch.load(tmp_path / "a.fa3.logits.pt")
    assert steps.shape[0] == e2e.LOGITS_STEPS + 1 and not torch.equal(steps[1], steps[2])
    assert first["logits_vs_fa3_relative_max_error"] == {"triton": 0.0}
    assert "latency" not in logits_only["results"]["tuner"]
    # a logits worker that fails leaves no file to score, even where an older one lay
    stale = tmp_path / "d.broken.logits.pt"
    stale.write_bytes((tmp_path / "a.fa3.logits.pt").read_bytes())
    failed = run(tmp_path / "d.json", "broken", "--no-latency", crash="broken:logits")
    assert failed["results"]["broken"]["logits_exit_code"] != 0 and failed["logits_files"] == {}
    assert not stale.exists()
    merged = tmp_path / "all.json"
    subprocess.run([sys.executable, "sglang_e2e.py", "--merge", *(str(tmp_path / f"{n}.json") for n in "abcd"),
                    "--out", str(merged)], cwd=ROOT / "benchmarks", check=True, timeout=300,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))
    doc = json.loads(merged.read_text())
    assert set(doc["results"]) == {"fa3", "triton", "tuner", "broken"}
    assert doc["results"]["tuner"]["logits_exit_code"] == 0 and doc["results"]["tuner"]["latency"]["rows"]
    assert doc["results"]["broken"]["logits_exit_code"] == 0  # the run that finished
    errors = doc["logits_vs_fa3_relative_max_error"]
    assert errors["triton"] == errors["tuner"] == 0.0 and errors["broken"] > 0.1  # a wrong attention shows
    row = next(r for r in doc["summary"] if (r["batch"], r["input_len"]) == (8, 4096))
    assert row["best_built_in"] == "fa3" and abs(row["tuner_over_best"] - 1.1) < 1e-9
    # a merged file merges again (its logits paths stay relative to it)
    again = tmp_path / "again.json"
    subprocess.run([sys.executable, "sglang_e2e.py", "--merge", str(merged), "--out", str(again)],
                   cwd=ROOT / "benchmarks", check=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert json.loads(again.read_text())["logits_vs_fa3_relative_max_error"] == errors


def test_sglang_e2e_rounds_rotate_the_backends_and_resume_and_merge_round_by_round(tmp_path):
    """--rounds: each round runs every backend once, the order rotated a backend per round (so
    no backend always follows the same one); round 0 is stored as before rounds existed (its
    length's exit code, its result file's rows, its file's name) and round R under LEN#R;
    --resume runs only the (length, round) workers that have not run, --merge takes each
    (length, round) from a run where it ran, and the summary gives the median over the rounds
    and tuner's ratio to the best built-in backend within each round."""
    starts = tmp_path / "starts.log"
    speed = json.dumps({"tuner": [1.0, 0.9, 1.2], "triton": [1.0, 1.05, 1.0]})
    base = 8 * 1000.0 / (1 + 1024 / 8192)  # the stand-in's fa3 at 8 x 1024

    def run(out, backends, *flags, crash=""):
        starts.unlink(missing_ok=True)
        doc = fake_sglang_e2e(out, backends, "--no-logits", "--batches", "8", "--input-lens", "1024", *flags,
                              crash=crash, FAKE_SGLANG_STARTS=str(starts), FAKE_SGLANG_ROUND_SPEED=speed)
        return doc, [tuple(line.split()) for line in starts.read_text().splitlines()] if starts.exists() else []

    first, order = run(tmp_path / "a.json", "fa3,tuner,triton", "--rounds", "2", crash="triton:1024:r1")
    assert order == [("fa3", "0"), ("tuner", "0"), ("triton", "0"), ("tuner", "1"), ("triton", "1"), ("fa3", "1")]
    results = first["results"]
    assert results["fa3"]["latency"]["exit_codes"] == {"1024": 0, "1024#1": 0}
    triton = results["triton"]["latency"]
    assert triton["exit_codes"]["1024"] == 0 != triton["exit_codes"]["1024#1"]
    assert [r["round"] for r in triton["rows"]] == [0]  # its round 1 crashed
    work = tmp_path / "a.work"
    assert results["fa3"]["latency"]["rows"] == [
        dict(json.loads((work / "fa3.1024.jsonl").read_text()), round=0),
        dict(json.loads((work / "fa3.1024.r1.jsonl").read_text()), round=1)]
    # resumed with a third round: the crashed worker again, then round 2 from the third backend on
    (tmp_path / "b.json").write_text((tmp_path / "a.json").read_text())
    resumed, order = run(tmp_path / "b.json", "fa3,tuner,triton", "--rounds", "3", "--resume")
    assert order == [("triton", "1"), ("triton", "2"), ("fa3", "2"), ("tuner", "2")]
    assert resumed["results"]["triton"]["latency"]["exit_codes"] == {"1024": 0, "1024#1": 0, "1024#2": 0}
    (row,) = resumed["summary"]
    assert row["tuner_rounds"] == pytest.approx([1.1 * base, 0.99 * base, 1.32 * base])
    assert row["fa3"] == base and row["triton"] == pytest.approx(0.9 * base)  # medians
    assert row["best_built_in"] == "fa3" and row["tuner_over_best"] == pytest.approx(1.1)
    assert row["tuner_over_best_by_round"] == pytest.approx({"0": 1.1, "1": 0.99, "2": 1.32})
    assert row["spread"] == pytest.approx({"fa3": 1.0, "tuner": 1.32 / 0.99, "triton": 1.05})
    # a run whose round 0 crashed where the first run's round 1 did: merged, each round from where it ran
    run(tmp_path / "c.json", "triton", "--rounds", "2", crash="triton:1024:r0")
    e2e = benchmark_module("sglang_e2e")  # merged and run past --deadline here: a process each costs seconds
    merged = e2e.merge([str(tmp_path / "a.json"), str(tmp_path / "c.json")], tmp_path / "merged.json",
                       argparse.Namespace())
    triton = merged["results"]["triton"]["latency"]
    assert triton["exit_codes"] == {"1024": 0, "1024#1": 0}
    assert [r["round"] for r in triton["rows"]] == [0, 1]
    assert [r["median_decode_throughput"] for r in triton["rows"]] == pytest.approx([0.9 * base, 0.945 * base])
    assert merged["summary"][0]["triton_rounds"] == pytest.approx([0.9 * base, 0.945 * base])
    # past --deadline no worker starts, and each (length, round) says so
    args = argparse.Namespace(resume=False, deadline=0.0, model="llama-3.1-8b", batches="8", input_lens="1024",
                              output_len=4, rounds=2)
    late = e2e.Run(args, tmp_path / "d.json")
    e2e.run_rounds(late, ["fa3"], tmp_path / "no-model", tmp_path)
    assert late.results["fa3"]["latency"]["exit_codes"] == {"1024": "not run: --deadline",
                                                           "1024#1": "not run: --deadline"}
    late.args.layers = None  # the document names the model's depth
    e2e.run_logits(late, "fa3", tmp_path / "no-model", tmp_path)  # nor a logits worker
    assert late.results["fa3"]["logits_exit_code"] == "not run: --deadline"
    assert json.loads((tmp_path / "d.json").read_text())["results"]["fa3"]["logits_exit_code"] == "not run: --deadline"


def _e2e_args(e2e: ModuleType, out: Path, *flags: str) -> argparse.Namespace:
    """sglang_e2e.py's arguments for one batch size and input length, one round, as parsed."""
    return e2e.harness_parser().parse_args(["--out", str(out), "--batches", "8", "--input-lens", "1024",
                                            "--output-len", "4", "--rounds", "1", *flags])


def test_sglang_e2e_starts_no_worker_the_deadline_would_stop_and_says_which_it_stopped(tmp_path, monkeypatch):
    """--deadline ends a run (a device call must end): a worker still running then is stopped and
    recorded as stopped there, not as past its --timeout (an H100 run's tuner worker, stopped by
    the deadline well before its timeout, read "exit 124"); no worker starts with less time left than the
    longest worker so far took, --resume included; --resume runs a stopped one again."""
    e2e = benchmark_module("sglang_e2e")
    started = []

    def fake_worker(mode, backend, argv, logits_out, db, log, timeout_s, extra_env=None):
        log.touch()
        started.append((backend, round(timeout_s)))
        return e2e.TIMED_OUT  # as if it ran until its timeout

    monkeypatch.setattr(e2e, "run_worker", fake_worker)
    monkeypatch.setattr(e2e, "MIN_WORKER_S", 0)

    def run(out, deadline, timeout, *flags):
        r = e2e.Run(_e2e_args(e2e, out, "--deadline", str(deadline), "--timeout", str(timeout), *flags), out)
        e2e.run_rounds(r, ["fa3"], tmp_path / "no-model", tmp_path)
        return r

    stopped = run(tmp_path / "a.json", 60, 300)  # its timeout was the deadline's 60 s
    assert started == [("fa3", 60)]
    assert stopped.results["fa3"]["latency"]["exit_codes"] == {"1024": "stopped at --deadline"}
    assert set(stopped.results["fa3"]["latency"]["worker_seconds"]) == {"1024"}
    timed_out = run(tmp_path / "b.json", 600, 100)  # its own timeout came first
    assert started[-1] == ("fa3", 100)
    assert timed_out.results["fa3"]["latency"]["exit_codes"] == {"1024": 124}
    # a run whose worker took 100 s: with 60 s left none starts, on --resume too
    doc = json.loads((tmp_path / "a.json").read_text())
    doc["results"]["fa3"]["latency"]["worker_seconds"]["1024"] = 100.0
    (tmp_path / "a.json").write_text(json.dumps(doc))
    calls = len(started)
    late = run(tmp_path / "a.json", 60, 300, "--resume")
    assert len(started) == calls
    assert late.results["fa3"]["latency"]["exit_codes"] == {"1024": "not run: --deadline"}
    again = run(tmp_path / "a.json", 200, 300, "--resume")  # time enough: it runs again
    assert started[-1] == ("fa3", 200)
    assert again.results["fa3"]["latency"]["exit_codes"] == {"1024": "stopped at --deadline"}


def test_sglang_e2e_merge_keeps_each_workers_step_timing_and_seconds(tmp_path):
    """--merge joins each (length, round)'s own diagnostics: its step timing and its seconds
    came from the worker that ran it (a merge had dropped --step-timing's medians)."""
    e2e = benchmark_module("sglang_e2e")

    def write(out, code, timing, seconds):
        args = _e2e_args(e2e, out, "--no-logits")
        args.layers = None  # (the document names the model's depth)
        run = e2e.Run(args, out)
        run.results["tuner"] = dict(latency=dict(exit_codes={"1024": code}, rows=[], step_timing={"1024": timing},
                                                 worker_seconds={"1024": seconds}))
        run.save()

    write(tmp_path / "a.json", "stopped at --deadline", {"8": {"load_us": 1.0}}, 50.0)
    write(tmp_path / "b.json", 0, {"8": {"load_us": 2.0}}, 61.5)
    merged = e2e.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")], tmp_path / "m.json",
                       argparse.Namespace())["results"]["tuner"]["latency"]
    assert merged["exit_codes"] == {"1024": 0}
    assert merged["step_timing"] == {"1024": {"8": {"load_us": 2.0}}}
    assert merged["worker_seconds"] == {"1024": 61.5}


def test_sglang_e2e_records_each_workers_graph_capture_and_captures_sglangs_default_list_when_asked(tmp_path):
    """A worker's startup cost as SGLang logs it: each (length, round) keeps its own worker's
    capture (not an earlier worker's lines in the backend's shared log); --capture-bs default
    leaves the batch sizes to SGLang (36 on its default list), as a server's startup has them."""
    doc = fake_sglang_e2e(tmp_path / "a.json", "fa3,tuner", "--no-logits", "--batches", "8", "--input-lens",
                          "1024", "--rounds", "2")
    for backend, speed in (("fa3", 1.0), ("tuner", 1.1)):
        capture = doc["results"][backend]["latency"]["capture"]
        assert capture == {key: dict(captures=1, batch_sizes=1, seconds=round(0.05 / speed, 2), mem_gb=0.01)
                           for key in ("1024", "1024#1")}
        assert [r["graph_bs"] for r in doc["results"][backend]["latency"]["rows"]] == [[8], [8]]
    default = fake_sglang_e2e(tmp_path / "b.json", "fa3", "--no-logits", "--batches", "8", "--input-lens", "1024",
                              "--rounds", "1", "--capture-bs", "default")
    latency = default["results"]["fa3"]["latency"]
    assert latency["capture"]["1024"] == dict(captures=1, batch_sizes=36, seconds=1.8, mem_gb=0.36)
    assert latency["rows"][0]["graph_bs"] is None  # no --cuda-graph-bs-decode given
    assert doc["capture_seconds_median"] == {"fa3": 0.05, "tuner": 0.05} and default["capture_seconds_median"] == {
        "fa3": 1.8}
    e2e = benchmark_module("sglang_e2e")
    # runs that captured other batch sizes do not mix: neither merged nor resumed into one another
    with pytest.raises(e2e.UsageError, match="different batch sizes"):
        e2e.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")], tmp_path / "m.json", argparse.Namespace())
    with pytest.raises(e2e.UsageError, match="--capture-bs default, not run"):
        e2e.Run(argparse.Namespace(resume=True, capture_bs="run"), tmp_path / "b.json")
    (tmp_path / "c.json").write_text((tmp_path / "a.json").read_text())
    merged = e2e.merge([str(tmp_path / "a.json"), str(tmp_path / "c.json")], tmp_path / "m.json",
                       argparse.Namespace())
    assert merged["capture_bs"] == "run"
    assert merged["results"]["fa3"]["latency"]["capture"] == doc["results"]["fa3"]["latency"]["capture"]


def test_sglang_e2e_reads_tuners_replay_judge_verdicts_from_a_workers_log(caplog):
    """The lines tuner's replay judge logs, as a worker's log holds them, read back: the run's
    JSON says which variants ran slower than the base graph (dropped) and which were kept, on
    which steps."""
    import logging
    import types

    from tuner.integrations.graph_variants import Pick
    from tuner.integrations.replay_judge import ReplayJudge, drop_variant

    e2e = benchmark_module("sglang_e2e")
    dropped = []
    drop_variant(types.SimpleNamespace(drop_pick=lambda *a: dropped.append(a)), 8, Pick("tuner-3", (65536, True)),
                 1.0437, "0.990x by its replays, 1.044x by its whole steps")
    assert dropped == [(8, Pick("tuner-3", (65536, True)))]
    caplog.set_level(logging.INFO, logger="tuner")
    from support.fake_events import EventClock

    clock = EventClock()  # CUDA events on a fake clock
    judge = ReplayJudge(1, 0.01, on_drop=lambda *a: None, event=clock)
    kept = Pick("tuner-1", (32768, True))
    for cost in (1.0, 0.9123):  # a base replay, then the variant's: one pair, and a kept verdict
        with judge.replaying(8, kept):
            clock.now += cost
    judge.tick()
    form = logging.Formatter("[%(asctime)s TP0] %(message)s")
    log = "Decode 1. Batch size: 8\n" + "\n".join(form.format(r) for r in caplog.records) + "\nDecode 2."
    assert e2e.judge_verdicts(log) == [
        dict(label="tuner-3", batch=8, ratio=1.044, steps="its steps at kv bucket 65536, dense", dropped=True, rank=0,
             replays_ratio=0.99, whole_steps_ratio=1.044),
        dict(label="tuner-1", batch=8, ratio=0.912, steps="its steps at kv bucket 32768, dense", dropped=False,
             rank=0, replays_ratio=0.912, whole_steps_ratio=0.912)]
    # a line logged before the judge timed whole steps (the committed runs' logs) reads as it did
    old = ("[x TP0] tuner: graph variant tuner-1 of batch size 1 ran 0.994x the time of the batch size's graph over "
           "its first replays here; its steps at kv bucket 8192, dense keep it")
    assert e2e.judge_verdicts(old) == [dict(label="tuner-1", batch=1, ratio=0.994, steps="its steps at kv bucket 8192, "
                                            "dense", dropped=False, rank=0)]
    # a challenger's verdict: its ratio is over the variant it challenged
    drop_variant(types.SimpleNamespace(drop_pick=lambda *a: None), 8, Pick("tuner-9", (32768, True), "tuner-1"),
                 1.01, "1.010x by its replays, 1.006x by its whole steps")
    challenged = e2e.judge_verdicts(form.format(caplog.records[-1]))
    assert challenged == [dict(label="tuner-9", batch=8, ratio=1.01, steps="its steps at kv bucket 32768, dense",
                               dropped=True, rank=0, replays_ratio=1.01, whole_steps_ratio=1.006, against="tuner-1")]
    assert e2e.judge_verdicts(log.replace("TP0]", "TP1]"))[0]["rank"] == 1
    assert e2e.judge_verdicts(log.replace(" TP0]", "]"))[0]["rank"] is None
    assert e2e.judge_verdicts("no verdicts") == []


def test_sglang_e2e_merge_keeps_each_workers_judge_verdicts_and_capture_beside_its_rows():
    e2e = benchmark_module("sglang_e2e")
    verdict = dict(label="tuner-1", batch=8, ratio=0.96, steps="its steps at kv bucket 32768, dense", dropped=False)
    ran = {"latency": {"exit_codes": {"1024": 0, "1024#1": 1}, "rows": [{"input_len": 1024, "round": 0}],
                       "capture": {"1024": {"captures": 1}}, "judge_verdicts": {"1024": [verdict], "1024#1": []}}}
    into: dict = {}
    e2e.merge_result(into, ran)
    assert into["latency"]["judge_verdicts"] == {"1024": [verdict], "1024#1": []}
    assert into["latency"]["capture"] == {"1024": {"captures": 1}}
    e2e.merge_result(into, {"latency": {"exit_codes": {"1024": 1}, "rows": []}})  # a failed worker: kept out
    assert into["latency"]["judge_verdicts"]["1024"] == [verdict]


def test_sglang_e2e_leaves_each_models_prefill_its_headroom_beside_sglangs_static_memory():
    """Llama 3.1 8B: 0.85 of an H200's memory ran its 131072-token prefill, 0.85 of an H100's ran
    out of memory there, 0.7 ran; Qwen 2.5 7B (a wider MLP): 0.75 of an H100's ran out of
    memory, 0.6 ran. The default stays under what ran and below what did not."""
    e2e = benchmark_module("common.sglang_models")
    llama, qwen = e2e.CONFIGS["llama-3.1-8b"], e2e.CONFIGS["qwen2.5-7b"]
    h100, h200 = 79.2, 139.8  # GiB, as nvidia-smi reports them
    assert e2e.prefill_activation_gb(qwen) > e2e.prefill_activation_gb(llama)
    assert e2e.mem_fraction(h100, llama) <= 0.7 and e2e.mem_fraction(h200, llama) <= 0.85
    assert e2e.mem_fraction(h100, qwen) < 0.75 and abs(e2e.mem_fraction(h100, qwen) - 0.6) <= 0.05
    assert e2e.mem_fraction(h200, llama) > e2e.mem_fraction(h100, llama)  # the same GiB left on a larger GPU
    assert e2e.mem_fraction(24.0, llama) == 0.5 and e2e.mem_fraction(None, qwen) == 0.85


def test_sglang_e2e_says_where_tuners_graphs_ran_only_the_default():
    """Qwen 2.5 7B at b8 and b32 x 16k on an H100: no record there named anything but FA3's
    default, so tuner's 0.986x and 0.993x of fa3 compared the same kernels (the noise). The
    summary says so from the tuner worker's log."""
    e2e = benchmark_module("sglang_e2e")
    log = ("[TP0] tuner: batch size 32: its graph runs the default; 0 graph variant(s) beside it\n"
           "[TP0] tuner: batch size 8: its graph runs the default; 1 graph variant(s) beside it, tuner-1\n")
    plans = e2e.graph_plans(log)
    assert plans == {"32": dict(base_default=True, variants=0), "8": dict(base_default=True, variants=1)}
    results = {"tuner": {"latency": {"graph_plans": {"16384": plans, "16384#1": plans, "4096": {}}}}}
    summary = e2e.with_tuner_graphs([{"batch": 8, "input_len": 16384}, {"batch": 32, "input_len": 16384},
                                     {"batch": 8, "input_len": 4096}], results)
    assert summary[0]["tuner_graphs_default"] is False and summary[0]["tuner_graph_variants"] == 1
    assert summary[1]["tuner_graphs_default"] is True and summary[1]["tuner_graph_variants"] == 0
    assert "tuner_graphs_default" not in summary[2]  # its log said nothing: no claim either way
    assert e2e.graph_plans("tuner: batch size 8: its graph runs tuned configs; 0 graph variant(s) beside it") == {
        "8": dict(base_default=False, variants=0)}


def test_sglang_e2e_gathers_the_judges_verdicts_on_flashinfers_graph_per_point():
    """A tuner-flashinfer worker's log: its plan names FlashInfer's variant, and the judge's
    verdicts on that label (against the base graph, or challenging a variant kept) go to the
    point's summary entry; other variants' verdicts and other points' do not."""
    e2e = benchmark_module("sglang_e2e")
    log = ("[TP0] tuner: batch size 8: its graph runs the default; 3 graph variant(s) beside it, tuner-1, "
           "tuner-2 (flashinfer), tuner-3\n"
           "[TP0] tuner: graph variant tuner-1 of batch size 8 ran 0.957x the time of the batch size's graph over its "
           "first replays here (0.957x by its replays, 0.953x by its whole steps); its steps at kv bucket 32768, "
           "dense keep it\n"
           "[TP0] tuner: graph variant tuner-2 of batch size 8 ran 1.010x the time of variant tuner-1 over its first "
           "replays here (1.010x by its replays, 1.006x by its whole steps); its steps at kv bucket 32768, dense "
           "replay that graph\n"
           "[TP0] tuner: graph variant tuner-2 of batch size 8 ran 0.990x the time of the batch size's graph over its "
           "first replays here (0.990x by its replays, 0.992x by its whole steps); its steps at kv bucket 131072, "
           "dense keep it\n")
    plans = e2e.graph_plans(log)
    assert plans == {"8": dict(base_default=True, variants=3, flashinfer="tuner-2")}
    results = {"tuner-flashinfer": {"latency": {"graph_plans": {"32768": plans},
                                                "judge_verdicts": {"32768": e2e.judge_verdicts(log)}}}}
    summary = e2e.with_flashinfer_verdicts([{"batch": 8, "input_len": 32768}, {"batch": 8, "input_len": 4096}],
                                           results)
    assert summary[0]["flashinfer_graph_verdicts"] == [
        dict(steps="its steps at kv bucket 32768, dense", over="tuner-1", ratio=1.01, dropped=True),
        dict(steps="its steps at kv bucket 131072, dense", over="base graph", ratio=0.99, dropped=False)]
    assert "flashinfer_graph_verdicts" not in summary[1]


def test_sglang_e2e_names_the_points_a_worker_skipped_past_its_kv_cache():
    """bench_one_batch skips a batch whose tokens the KV cache cannot hold and runs the rest: the
    summary then lacks that point, and the document says which and for which backends."""
    e2e = benchmark_module("sglang_e2e")
    log = ("Decode.  median latency: 0.01220 s\nskipping (32, 16384, 128) due to max batch size limit\n"
           "skipping (128, 16384, 128) due to max batch size limit\n")
    assert e2e.skipped_batches(log) == [32, 128] and e2e.skipped_batches("no skips") == []
    results = {"tuner": {"latency": {"skipped": {"16384": [32, 128], "16384#1": [32]}}},
               "fa3": {"latency": {"skipped": {"16384": [32], "4096": []}}}}
    assert e2e.skipped_points(results) == [dict(batch=32, input_len=16384, backends=["fa3", "tuner"]),
                                           dict(batch=128, input_len=16384, backends=["tuner"])]
    into: dict = {}
    e2e.merge_result(into, {"latency": {"exit_codes": {"16384": 0}, "rows": [], "skipped": {"16384": [32]}}})
    assert into["latency"]["skipped"] == {"16384": [32]}


def test_sglang_e2e_reads_each_decode_capture_of_a_workers_log_paired_with_its_start():
    """SGLang logs its prefill graphs' capture too, a capture's memory may read negative, and a
    worker may capture decode graphs twice: each decode end is paired with the begin before it."""
    e2e = benchmark_module("sglang_e2e")
    begin = "[TP0] Capture target {} CUDA graph begin. backend=full, num_tokens_per_req=1, bs=[{}], avail mem=17.72 GB\n"
    end = "[TP0] Capture target {} CUDA graph end. elapsed={} s, mem usage={} GB, avail mem=17.66 GB.\n"
    assert e2e.capture_cost("no capture here") is None
    assert e2e.capture_cost(end.format("decode", 2.0, 0.1)) is None  # an end without its begin
    assert e2e.capture_cost(begin.format("decode", "1, 8")) is None  # a capture cut short
    log = (begin.format("prefill", "4, 8, 12") + end.format("prefill", 9.18, 1.37) + begin.format("decode", "1, 8")
           + end.format("decode", 2.25, -0.02) + begin.format("decode", "32") + end.format("decode", 1.5, 0.5))
    assert e2e.capture_cost(log) == dict(captures=2, batch_sizes=3, seconds=3.75, mem_gb=0.48)
    # a worker that replaces a failed one keeps its own capture, or none: never the failed one's
    into = dict(latency=dict(exit_codes={"1024": 1}, rows=[], capture={"1024": dict(seconds=9.0)}))
    e2e.merge_result(into, dict(latency=dict(exit_codes={"1024": 0}, rows=[])))
    assert into["latency"]["exit_codes"] == {"1024": 0} and into["latency"]["capture"] == {}


def test_sglang_e2e_summary_takes_the_median_of_the_rounds_and_pairs_tuner_with_the_best_within_each():
    """The best built-in backend by its median over rounds, not by its luckiest round; tuner
    over it within each round both ran (a round tuner crashed in has no pair); rows in any
    order give their values in round order."""
    e2e = benchmark_module("sglang_e2e")

    def rows(values):
        return [dict(batch_size=8, input_len=4096, round=r, median_decode_throughput=v) for r, v in values]

    summary = e2e.summarize({"fa3": rows([(0, 1000.0), (1, 1100.0), (2, 950.0)]),
                             "triton": rows([(0, 980.0), (1, 990.0), (2, 1200.0)]),
                             "tuner": rows([(1, 1210.0), (0, 1080.0)])})
    assert summary == [{
        "batch": 8, "input_len": 4096, "fa3": 1000.0, "fa3_rounds": [1000.0, 1100.0, 950.0],
        "triton": 990.0, "triton_rounds": [980.0, 990.0, 1200.0], "tuner": 1145.0, "tuner_rounds": [1080.0, 1210.0],
        "best_built_in": "fa3", "tuner_over_best": 1.145, "tuner_over_best_by_round": {"0": 1.08, "1": 1.1},
        "spread": {"fa3": 1100.0 / 950.0, "triton": 1200.0 / 980.0, "tuner": 1210.0 / 1080.0}}]


def test_sglang_e2e_refuses_an_input_length_the_model_cannot_hold_in_one_line(tmp_path):
    out = tmp_path / "run.json"
    result = subprocess.run([sys.executable, "benchmarks/sglang_e2e.py", "--model", "qwen2.5-7b", "--input-lens",
                             "4096,32768", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and not out.exists() and not list(tmp_path.iterdir())
    assert result.stderr.strip().splitlines()[-1] == (
        "sglang_e2e.py: error: --input-lens 32768: with --output-len 128 past qwen2.5-7b's context of 32768 "
        "tokens (--model qwen2.5-7b-128k has the same heads and a longer one)")


def test_sglang_e2e_runs_only_what_fits_the_model_and_a_prefill():
    e2e = benchmark_module("sglang_e2e")
    assert e2e.latency_points("qwen2.5-7b", [1, 8], [16384, 32768], 32) == [(16384, [1, 8])]  # context 32768
    # a command that asks for it is told why, before any GPU time
    assert e2e.unfit_input_lens("qwen2.5-7b", [16384, 32768], 32) == (
        "--input-lens 32768: with --output-len 32 past qwen2.5-7b's context of 32768 tokens "
        "(--model qwen2.5-7b-128k has the same heads and a longer one)")
    assert e2e.unfit_input_lens("qwen2.5-7b", [16384], 32) is None
    assert e2e.unfit_input_lens("llama-3.1-8b", [262144], 32).startswith("--input-lens 262144: one request past")
    # its model card's YaRN context: the same heads, 128k
    assert e2e.latency_points("qwen2.5-7b-128k", [8], [32768, 65536], 32) == [(32768, [8]), (65536, [8])]
    long, short = e2e.CONFIGS["qwen2.5-7b-128k"], e2e.CONFIGS["qwen2.5-7b"]
    scaling = ("max_position_embeddings", "rope_scaling")
    assert {k: v for k, v in long.items() if k not in scaling} == {k: v for k, v in short.items() if k not in scaling}
    assert e2e.latency_points("llama-3.1-8b", [1, 4, 8, 128], [1024, 32768, 131040, 262144], 32) == [
        (1024, [1, 4, 8, 128]), (32768, [1, 4, 8, 128]), (131040, [1, 4, 8, 128])]  # one request past a prefill: no
    # a batch past one prefill: consecutive parts of whole requests, a longer request alone
    assert e2e.prefill_parts([4, 4, 4, 4, 4], 8) == [range(0, 2), range(2, 4), range(4, 5)]
    assert e2e.prefill_parts([3, 9, 2, 2], 8) == [range(0, 1), range(1, 2), range(2, 4)]
    assert e2e.prefill_parts([5], 8) == [range(0, 1)] and e2e.prefill_parts([], 8) == []


def test_sglang_e2e_prefills_a_batch_past_one_forward_in_parts_and_decodes_them_as_one(tmp_path):
    """A batch of 64 x 4096 tokens (past MAX_PREFILL_TOKENS) is prefilled through the benchmark's
    own extend() in two parts of 32 requests, merged, and decoded as one batch of 64; smaller
    batches in one forward, as bench_one_batch does."""
    extends = tmp_path / "extends.jsonl"
    doc = fake_sglang_e2e(tmp_path / "e.json", "fa3", "--no-logits", FAKE_SGLANG_EXTENDS=str(extends))
    calls = [json.loads(line) for line in extends.read_text().splitlines()]
    assert [len(c) for c in calls] == [1, 8, 64, 1, 8, 32, 32]  # 1024 (64 x 1024 fits one), then 4096
    assert all(sum(c) <= 131072 for c in calls)
    rows = doc["results"]["fa3"]["latency"]["rows"]
    assert {(r["batch_size"], r["input_len"]): r["decode_batch"] for r in rows} == {
        (b, n): b for b in (1, 8, 64) for n in (1024, 4096)}


def test_sglang_e2e_builds_the_model_tuner_tunes_and_compares_with_the_best_built_in_backend(tmp_path):
    """Issue 38's end-to-end harness, without SGLang: its model directories read as the same
    attention key as tuner's model table (so a graph sweep of `--model M` covers the run), and
    its summary puts tuner beside the fastest of SGLang's own backends."""
    from tuner.workload.models import attention_from_config, known_model

    e2e = benchmark_module("sglang_e2e")
    for model in e2e.CONFIGS:
        path = e2e.write_model_dir(model, tmp_path / model)
        config = json.loads((path / "config.json").read_text())
        # (qwen2.5-7b-128k: Qwen 2.5 7B's attention, its context extended)
        assert attention_from_config(config, model) == known_model(model.removesuffix("-128k"))
        assert json.loads((path / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
    short = json.loads((e2e.write_model_dir("llama-3.1-8b", tmp_path / "short", layers=2) / "config.json").read_text())
    assert short == dict(e2e.CONFIGS["llama-3.1-8b"], num_hidden_layers=2)  # --layers: only the depth changes
    rows = {"fa3": [dict(batch_size=8, input_len=4096, median_decode_throughput=1000.0)],
            "triton": [dict(batch_size=8, input_len=4096, median_decode_throughput=1100.0),
                       dict(batch_size=1, input_len=1024, median_decode_throughput=200.0)],
            "tuner": [dict(batch_size=8, input_len=4096, median_decode_throughput=1210.0)]}
    summary = e2e.summarize(rows)  # rows as written before rounds existed (no "round"): round 0
    assert summary == [
        {"batch": 1, "input_len": 1024, "triton": 200.0, "triton_rounds": [200.0]},
        {"batch": 8, "input_len": 4096, "fa3": 1000.0, "fa3_rounds": [1000.0], "triton": 1100.0,
         "triton_rounds": [1100.0], "tuner": 1210.0, "tuner_rounds": [1210.0], "best_built_in": "triton",
         "tuner_over_best": pytest.approx(1.1), "tuner_over_best_by_round": {"0": pytest.approx(1.1)}}]


def test_serving_times_the_graph_variant_a_batchs_host_lengths_pick(db_path):
    """serving.py's graph_variants mode: the config of the variant GraphVariants.label picks
    for the batch, as a server captured it at the bound; the base graph's where none."""
    import dataclasses

    import tuner
    from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
    from tuner.integrations.decode_attention import decode_attention
    from tuner.workload import DecodeShape, make_decode_inputs

    serving = benchmark_module("serving")
    shape = DecodeShape(batch=4, kv_len=2048, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16,
                        dtype="float32")
    winner = {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 8, "num_warps": 4, "num_stages": 2}
    with TuningDB(db_path) as db:
        db.save_record(Problem("decode_attention", shape.static_key().to_json(), shape.run_key()),
                       (current_fingerprint_id(), current_fingerprint()), winner, median_us=1.0, spread_us=0.0,
                       samples=3, default_config={"backend": "triton_decode"}, default_median_us=2.0,
                       default_spread_us=0.0, method={})
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    inputs = make_decode_inputs(dataclasses.replace(shape, kv_len=64), seq_lens=[17] * 4)
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 2048)
    base = {"backend": "base"}
    assert serving._variant_replayed(decode_attention.tuner, args, {}, 4, [2000, 10, 10, 10], base) == (winner, winner)
    assert serving._variant_replayed(decode_attention.tuner, args, {}, 4, [100] * 4, base) == (base, base)


def test_fa3_waves_scores_each_cap_rule_on_a_runs_stored_timings(tmp_path):
    """fa3_waves.py --score reads every cap's time a run kept and gives each rule's speedup
    where it caps: a batch that spills (8 kv heads, 6, 6, 5 splits: 136 tiles) and one that
    fits one wave already (no cap by either rule)."""
    waves = benchmark_module("fa3_waves")
    spilling = dict(kv_heads=8, lengths=[11049, 10500, 8200],
                    cap_us={"0": 66.0, "1": 130.0, "2": 68.0, "3": 57.5, "4": 55.0, "5": 55.0, "6": 66.0, "8": 66.5})
    one_wave = dict(kv_heads=8, lengths=[11049, 11000, 11000], cap_us={"0": 60.0, "4": 50.0})
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"rows": [spilling, one_wave, {"kv_heads": 8, "lengths": [5]}]}))
    scores = waves.score(run)
    fit = scores["wave_fit"]
    assert (fit["rows"], fit["capped"], fit["scored"]) == (2, 1, 1)
    assert fit["geomean_where_capped"] == pytest.approx(66.0 / 55.0)  # its cap, 5
    assert scores["least_time"]["capped"] >= 1 and scores["least_time"]["rows"] == 2


def test_page_layout_cases_put_each_batchs_longest_in_the_kv_bucket_of_one_more_than_a_power_of_two():
    from tuner.keys import kv_len_bucket

    page_layout = benchmark_module("page_layout")
    found = page_layout.cases([8, 32], seed=0)
    assert len(found) == len(page_layout.TOPS) * 2 * len(page_layout.KINDS)
    assert [t for _, _, t, _ in found][0] == max(page_layout.TOPS)  # the longest contexts first
    for batch, kind, top, lengths in found:
        assert len(lengths) == batch and min(lengths) >= 1
        assert kv_len_bucket(max(lengths)) == kv_len_bucket(top + 1), (batch, kind, top)
        if kind == "equal":
            assert lengths == [top + 1] * batch


def test_page_layout_summary_counts_only_the_cases_whose_pick_is_not_the_default():
    page_layout = benchmark_module("page_layout")
    timed = lambda s: {f"{lay}/{w}": {"speedup": s} for lay in ("shuffled", "contiguous")
                       for w in page_layout.WIDTHS}
    rows = [dict(pick=page_layout.DEFAULT, kind="equal", timed=timed(0.5)),
            dict(pick={"backend": "triton_decode"}, kind="uniform", timed=timed(1.2)),
            dict(pick={"backend": "triton_decode"}, kind="equal", timed=timed(0.9))]
    summary = page_layout.summarize(rows)
    assert summary["cases"] == 3 and summary["pick_not_default"] == 2
    assert summary["contiguous/bound"]["slower_by_2pct"] == 1
    assert summary["shuffled/as_called"]["geomean"] == pytest.approx((1.2 * 0.9) ** 0.5)
    assert summary["shuffled/as_called"]["worst"] == 0.9
    # per kind of lengths: the equal-length loss apart from the spread batch's gain
    by_kind = summary["contiguous/as_called"]["by_kind"]
    assert by_kind["equal"] == dict(cases=1, geomean=pytest.approx(0.9), slower_by_2pct=1, worst=0.9)
    assert by_kind["uniform"]["slower_by_2pct"] == 0 and by_kind["few_long"]["cases"] == 0


TRACKED_TREE_MAX_MIB = 17  # a GPU call carries at most 64 MiB: the tree beside one 47 MiB staging part


def test_the_tracked_tree_leaves_room_for_a_gpu_staging_part():
    """Every GPU call carries the working tree, and the staging calls one ~47 MiB part of the
    GPU packages beside it (../shared/gpu/README.md): results that push the tree past the
    rest stop every staging call. Compress large result files with xz."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    paths = [ROOT / p for p in listed.stdout.decode().split("\0") if p]
    size = sum(p.stat().st_size for p in paths if p.is_file())
    largest = sorted(paths, key=lambda p: p.stat().st_size if p.is_file() else 0)[-3:]
    assert size <= TRACKED_TREE_MAX_MIB * 2**20, (
        f"the tracked tree holds {size / 2**20:.1f} MiB; largest: {[str(p.relative_to(ROOT)) for p in largest]}")


def test_a_decode_steps_floor_counts_llama_8bs_published_weights_and_its_kv_per_token():
    """The floor's bytes: Llama 3.1 8B's 8,030,261,248 parameters less its embedding table
    (only the batch's rows are read) and its 65 norms; 128 KiB of KV a token (32 layers x 8
    kv heads x 128 x K and V x 2 bytes)."""
    floor = benchmark_module("common.step_floor")
    llama = benchmark_module("common.sglang_models").CONFIGS["llama-3.1-8b"]
    assert floor.weight_bytes(llama) == 2 * (8_030_261_248 - 128256 * 4096 - 65 * 4096)
    assert floor.kv_bytes(llama, [1000, 24]) == 1024 * 128 * 1024
    at = floor.step_floor(llama, [65536] * 8, "NVIDIA H200")
    assert at["floor_ms"] == pytest.approx((floor.weight_bytes(llama) + 8 * 65536 * 131072) / 4.8e12 * 1e3)
    assert 0.5 < at["attention_share"] < 1
    assert floor.step_floor(llama, [65536] * 8, "NVIDIA H200", ranks=2)["floor_ms"] == pytest.approx(at["floor_ms"] / 2)
    assert floor.step_floor(llama, [65536] * 8, "NVIDIA A100-SXM4-80GB") is None  # no nominal bandwidth: no floor


def test_sglang_e2e_gives_each_point_its_steps_floor_and_each_backends_share_of_it():
    """Each summary entry: the floor of the median measured step (the prompts plus half the
    output) and each backend's floor over its median step, from its decode throughput."""
    e2e = benchmark_module("sglang_e2e")
    floor = benchmark_module("common.step_floor")
    config = e2e.CONFIGS["qwen2.5-7b-128k"]
    doc = {"config": config, "output_len": 128, "environment": {"device": "NVIDIA H100 80GB HBM3"},
           "summary": [{"batch": 8, "input_len": 65536, "fa3": 500.0, "tuner": 600.0, "flashinfer": None}]}
    args = argparse.Namespace(lengths="spread", tp=1)
    entry = e2e.with_step_floors(doc, args)["summary"][0]["step_floor"]
    lens = [n + 64 for n in e2e.spread_lengths(8, 65536)]
    assert entry["floor_ms"] == pytest.approx(floor.step_floor(config, lens, "H100 80GB HBM3")["floor_ms"])
    assert set(entry["of_floor"]) == {"fa3", "tuner"}
    assert entry["of_floor"]["fa3"] == pytest.approx(entry["floor_ms"] / 16.0)  # 8 tokens at 500/s: 16 ms a step
    assert entry["of_floor"]["tuner"] / entry["of_floor"]["fa3"] == pytest.approx(1.2)
    equal = e2e.with_step_floors(dict(doc, summary=[{"batch": 8, "input_len": 65536, "fa3": 500.0}]),
                                 argparse.Namespace(lengths="equal", tp=1))
    assert equal["summary"][0]["step_floor"]["kv_gb"] == pytest.approx(floor.kv_bytes(config, [65536 + 64] * 8) / 1e9)
    cpu = e2e.with_step_floors(dict(doc, environment={"device": "cpu"}, summary=[{"batch": 8, "input_len": 1024}]), args)
    assert "step_floor" not in cpu["summary"][0]


def test_sglang_e2e_says_how_much_any_attention_kernel_could_raise_the_best_built_in_backend():
    """Where the steps were traced: each backend's attention ms per step (the median over its
    workers), its KV bytes per second and share of the step; attention_bound: the best
    built-in backend's step over the same step with its attention at the nominal bandwidth."""
    e2e = benchmark_module("sglang_e2e")
    profile = lambda *us: {f"65536{'#' + str(r) if r else ''}": {"8": {"attention_us": a}} for r, a in enumerate(us)}
    doc = {"summary": [{"batch": 8, "input_len": 65536, "fa3": 500.0, "flashinfer": 400.0, "tuner": 480.0,
                        "best_built_in": "fa3",
                        "step_floor": {"kv_gb": 48.0, "hbm_tb_per_s": 4.8}},  # 10 ms of KV at 4.8 TB/s
                       {"batch": 1, "input_len": 1024, "fa3": 100.0, "best_built_in": "fa3"}],  # no floor: left
           "results": {"fa3": {"latency": {"profile": profile(12000.0, 13000.0, 15000.0)}},
                       "flashinfer": {"latency": {"profile": {"65536": {"1": {"attention_us": 1.0}}}}},
                       "tuner": {"latency": {"profile": profile(11000.0)}}}}
    floor = e2e.with_attention_times(doc)["summary"][0]["step_floor"]
    assert set(floor["attention"]) == {"fa3", "tuner"}  # (flashinfer's trace is of another batch size)
    fa3 = floor["attention"]["fa3"]
    assert fa3["ms"] == pytest.approx(13.0) and fa3["kv_tb_per_s"] == pytest.approx(48.0 / 13.0)
    assert fa3["of_step"] == pytest.approx(13.0 / 16.0)  # 8 tokens at 500/s: a 16 ms step
    assert floor["attention_bound"] == pytest.approx(16.0 / (16.0 - 13.0 + 10.0))
    assert "step_floor" not in doc["summary"][1]


def test_roofline_keeps_only_the_serving_cases_of_the_batch_sizes_and_caps_asked_for():
    roofline = benchmark_module("roofline")
    ap = argparse.ArgumentParser()
    chosen = roofline.serving_set(False, {"llama": dict(num_q_heads=32, num_kv_heads=8)})
    kept = roofline.only_sizes(ap, chosen, "8,24", "65536")
    assert {(c[0]["batch"], c[0]["cap"]) for c in kept} == {(8, 65536), (24, 65536)}
    assert len(kept) == 2 * 3  # every distribution
    assert all(max(c[2]) <= 65536 for c in kept) and kept[0] in chosen  # each with its own lengths
    assert roofline.only_sizes(ap, chosen, None, None) == chosen
    for batches, caps in (("8,x", None), ("5", None)):  # not a number; no such case
        with pytest.raises(SystemExit) as e:
            roofline.only_sizes(ap, chosen, batches, caps)
        assert e.value.code == 2


@pytest.mark.parametrize("sglang_knows_the_flag", [True, False])
def test_sglang_e2e_leaves_out_sglangs_prefill_graphs_unless_asked_and_where_sglang_has_them(
        tmp_path, sglang_knows_the_flag):
    """bench_one_batch's decode steps never replay SGLang's 58 prefill graphs, whose capture
    took 9-65 s of each worker: they are left out by default, captured with --prefill-graphs,
    and an SGLang whose parser lacks the flag is not handed it (it would refuse it)."""
    env = {"FAKE_SGLANG_PREFILL_GRAPHS": "1"} if sglang_knows_the_flag else {}
    for flags, captured in (((), not sglang_knows_the_flag), (("--prefill-graphs",), True)):
        doc = fake_sglang_e2e(tmp_path / f"p{len(flags)}.json", "fa3,tuner", "--no-logits", "--batches", "1",
                              "--input-lens", "1024", *flags, **env)
        assert doc["prefill_graphs"] is bool(flags)
        rows = [r for b in ("fa3", "tuner") for r in doc["results"][b]["latency"]["rows"]]
        assert len(rows) == 2 and all(r["prefill_graphs"] is captured for r in rows)
