"""On the H200, where SGLang is staged (`bash .gpu/sglang/install`): SGLang's own code, unmodified,
decodes through tuner's backend (issue 38), its graph variants included. benchmarks/sglang_e2e.py's logits worker loads a
two-layer Llama 3.1 8B with SGLang's model runner, prefills a batch, and decodes steps in
SGLang's CUDA graphs (capture, the host step before each replay, replay), once with SGLang's
fa3 backend and once with tuner's; the weights are drawn alike in both processes, at scales
where a wrong attention output shows in the logits."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("sglang")
ROOT = Path(__file__).resolve().parents[2]


def test_sglang_decodes_through_tuners_backend_with_fa3s_logits(tmp_path):
    out = tmp_path / "e2e.json"
    result = subprocess.run(
        [sys.executable, "sglang_e2e.py", "--out", str(out), "--backends", "fa3,tuner", "--layers", "2",
         "--no-latency", "--timeout", "240", "--mem-fraction", "0.5"],
        cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600,
        env=dict(os.environ, TUNER_SHIPPED=str(ROOT / "tuning_cache")))  # (the suite turns them off)
    logs = "".join(p.read_text()[-3000:] for p in tmp_path.glob("e2e.*.log"))
    assert result.returncode == 0, result.stderr[-3000:] + logs
    doc = json.loads(out.read_text())
    assert {b: doc["results"][b]["logits_exit_code"] for b in ("fa3", "tuner")} == {"fa3": 0, "tuner": 0}, logs
    # the same attention in bf16 through another kernel; on the fake SGLang a wrong one moves them by over 0.1
    assert doc["logits_vs_fa3_relative_max_error"]["tuner"] < 0.02
    # SGLang's runner captured tuner's graph variants beside the batch size's graph (the
    # shipped per-call records of this key differ by kv bucket), and replayed only graphs it holds
    graphs = doc["results"]["tuner"]["decode_graphs"]
    labels = {label for _, label in graphs["captured"]}
    assert any(str(label).startswith("tuner-") for label in labels), graphs
    assert set(graphs["replayed"]) <= labels, graphs
    assert not any(label for _, label in doc["results"]["fa3"]["decode_graphs"]["captured"]), doc["results"]["fa3"]


def test_sglangs_flashinfer_as_a_graph_variant_gives_fa3s_logits(tmp_path):
    """TUNER_SGLANG_FLASHINFER=1 (the tuner-flashinfer worker) with no tunings at all: every
    class of lengths runs FA3's default in the base graph, so the FlashInfer variant serves
    them all, and the decode steps replay it (SGLang's FlashInfer backend planned before each
    replay, over tuner's KV pool) with fa3's logits."""
    out = tmp_path / "fi.json"
    result = subprocess.run(
        [sys.executable, "sglang_e2e.py", "--out", str(out), "--backends", "fa3,tuner-flashinfer", "--layers", "2",
         "--no-latency", "--timeout", "300", "--mem-fraction", "0.5"],
        cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600,
        # (no FA3 cap graphs: a step replaying one would pass for a replay of the FlashInfer variant)
        env=dict(os.environ, TUNER_SHIPPED="off", TUNER_REPLAY_JUDGE="0", TUNER_GRAPH_WAVE_CAPS="0"))
    logs = "".join(p.read_text()[-3000:] for p in tmp_path.glob("fi.*.log"))
    assert result.returncode == 0, result.stderr[-3000:] + logs
    doc = json.loads(out.read_text())
    assert doc["results"]["tuner-flashinfer"]["logits_exit_code"] == 0, logs
    assert doc["logits_vs_fa3_relative_max_error"]["tuner-flashinfer"] < 0.02
    graphs = doc["results"]["tuner-flashinfer"]["decode_graphs"]
    assert graphs["flashinfer_labels"] and set(graphs["replayed"]) & set(graphs["flashinfer_labels"]), graphs


def test_tensor_parallel_ranks_plan_and_judge_alike(tmp_path):
    """Two GPUs: SGLang's bench_one_batch with --tp 2 (a process per rank, each with tuner's
    backend registered by the harness) decodes through tuner's backend without a hang; both
    ranks log the same plan for each batch size, and the same verdicts (the slowest rank's
    ratio, agreed by an all-reduce over SGLang's TP CPU group)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    out = tmp_path / "tp.json"
    result = subprocess.run(
        [sys.executable, "sglang_e2e.py", "--out", str(out), "--backends", "tuner", "--tp", "2", "--layers", "2",
         "--no-logits", "--batches", "8", "--input-lens", "4096", "--lengths", "spread", "--rounds", "1",
         "--timeout", "400", "--mem-fraction", "0.5"],
        cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600,
        env=dict(os.environ, TUNER_SHIPPED=str(ROOT / "tuning_cache")))
    log = (tmp_path / "tp.tuner.log").read_text() if (tmp_path / "tp.tuner.log").exists() else ""
    assert result.returncode == 0, result.stderr[-3000:] + log[-3000:]
    latency = json.loads(out.read_text())["results"]["tuner"]["latency"]
    assert latency["exit_codes"] == {"4096": 0}, log[-3000:]
    plans = {rank: sorted(m[2] for m in re.finditer(r"TP(\d+)\] (tuner: batch size \d+: its graph runs [^\n]*)", log)
                          if m[1] == str(rank)) for rank in (0, 1)}
    assert plans[0] and plans[0] == plans[1], plans
    verdicts = latency["judge_verdicts"]["4096"]
    by_rank = {rank: sorted((v["label"], v["batch"], v["ratio"], v["dropped"]) for v in verdicts if v["rank"] == rank)
               for rank in (0, 1)}
    assert by_rank[0] == by_rank[1], verdicts
