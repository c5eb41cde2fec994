"""The GPU benchmarks run end to end on the CPU at smoke size, so a run on the H200 (whose
time is scarce) does not fail on the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def test_sweep_cost_sweeps_a_windowed_keys_bucket_on_its_longest_shape(tmp_path):
    """Past its window a key's kv lengths are one run key, swept once: on the longest shape,
    whose sequences fill the window as most calls' do (as `tuner sweep` picks), not the
    first the grid lists. Swept shortest first, the window-4095 key's serving record came
    from sequences of at most 4096 keys and missed the oracle's 1.13-1.65x at caps of 16k-128k."""
    out = tmp_path / "sweep_cost.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "sweep_cost.py", "--smoke", "--heads", "cpu-tiny window31",
                             "--agree", "0", "--out", str(out), "--db", str(tmp_path / "serving.db")],
                            cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [sweep] = json.loads(out.read_text())["sweeps"]
    status = {(r["batch"], r["kv_len"]): r["status"] for r in sweep["rows"]}
    assert status == {(1, 128): "measured", (2, 128): "measured", (1, 64): "skipped", (2, 64): "skipped"}
