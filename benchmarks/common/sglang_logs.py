"""What a bench_one_batch worker of sglang_e2e.py leaves behind, read into its results: the
lines of its log (tuner's graph plans and replay-judge verdicts, the batches SGLang skipped, the
decode graphs' capture, each decode step's latency) and its profile traces."""

from __future__ import annotations

import re
from pathlib import Path

# the line tuner.integrations.sglang logs (info) per captured batch size: what its graph runs
PLAN_LINE = re.compile(r"tuner: batch size (?P<batch>\d+): its graph runs (?P<base>the default|tuned configs); "
                       r"(?P<variants>\d+) graph variant(?:[^\n]*?(?P<flashinfer>tuner-\d+) \(flashinfer\))?[^\n]*$",
                       re.MULTILINE)
# the line bench_one_batch prints for a batch past the KV cache (it runs the worker's other batches)
SKIPPED_LINE = re.compile(r"skipping \((?P<batch>\d+), (?P<input_len>\d+), \d+\) due to max batch size limit")
# what SGLang 0.5.17's model runner logs of its decode graphs' capture (a worker's startup cost)
CAPTURE_LINE = re.compile(r"Capture target decode CUDA graph (?:begin\..*?bs=\[(?P<sizes>[^\]]*)\]"
                          r"|end\. elapsed=(?P<seconds>-?[\d.]+) s, mem usage=(?P<gb>-?[\d.]+) GB)")
# the lines tuner.integrations.replay_judge logs (logger "tuner"): a drop (warning) or a kept verdict (info)
JUDGE_LINE = re.compile(r"(?:TP(?P<rank>\d+)\] )?"  # SGLang's prefix of a rank's line
                        r"tuner: graph variant (?P<label>\S+) of batch size (?P<batch>\d+) ran (?P<ratio>[\d.]+)x"
                        r"(?: the time of variant (?P<against>\S+))?[^;(\n]*"
                        r"(?:\((?P<replays>[\d.]+)x by its replays, (?:(?P<whole>[\d.]+)x|not counted) by its whole "
                        r"steps\))?[^;\n]*; "
                        r"(?P<steps>[^\n]*?) (?P<verdict>replay that graph|keep it)")
# the line bench_one_batch prints per decode step (all of them with --log-decode-step 1)
STEP_LINE = re.compile(r"Decode (?P<step>\d+)\. Batch size: (?P<batch>\d+), latency: (?P<seconds>[\d.]+) s")
# the trace bench_one_batch's --profile writes per batch size (its decode stage)
TRACE_NAME = re.compile(r"_batch(?P<batch>\d+)_input\d+_output\d+_decode\.trace\.json(?:\.gz)?$")


def graph_plans(log_text: str) -> dict[str, dict]:
    """Per captured batch size (the last capture of it in a tuner worker's log): whether its
    graph runs the default, how many graph variants were planned beside it, and the label of
    the one that runs SGLang's FlashInfer, where there is one (flashinfer)."""
    return {m["batch"]: dict(base_default=m["base"] == "the default", variants=int(m["variants"]),
                             **({} if m["flashinfer"] is None else dict(flashinfer=m["flashinfer"])))
            for m in PLAN_LINE.finditer(log_text)}


def skipped_batches(log_text: str) -> list[int]:
    """The batch sizes a worker's bench_one_batch skipped (past the KV cache SGLang keeps)."""
    return [int(m["batch"]) for m in SKIPPED_LINE.finditer(log_text)]


def step_latencies(log_text: str) -> dict[str, list[float]]:
    """A worker's measured decode steps (after its warm-up), per batch size: milliseconds in
    step order, as many as its log shows (all of them with --step-latencies)."""
    measured = log_text.split("Benchmark ...", 1)[-1] if "Benchmark ..." in log_text else ""
    steps: dict[str, list[float]] = {}
    for m in STEP_LINE.finditer(measured):
        steps.setdefault(m["batch"], []).append(round(float(m["seconds"]) * 1e3, 4))
    return steps


def profile_summaries(folder: Path, steps: int) -> dict[str, dict]:
    """Each decode trace a worker wrote in folder, summarized per batch size
    (common.decode_trace); the traces deleted after (tens of MB each)."""
    from common.decode_trace import read_trace, summarize_trace

    found = {}
    for path in sorted(folder.glob("*")) if folder.is_dir() else []:
        m = TRACE_NAME.search(path.name)
        if m:
            try:
                found[m["batch"]] = summarize_trace(read_trace(path), steps)
            except (OSError, ValueError, EOFError) as e:  # a worker killed while writing it, say
                found[m["batch"]] = dict(error=f"{type(e).__name__}: {e}")
        path.unlink()
    if folder.is_dir():
        folder.rmdir()
    return found


def capture_cost(log_text: str) -> dict | None:
    """The decode graphs' captures as a worker's log tells them, each end paired with the
    begin before it: how many, their batch sizes, seconds and GB in all (None where no capture
    finished)."""
    captures, sizes = [], None
    for line in CAPTURE_LINE.finditer(log_text):
        if line["sizes"] is not None:
            sizes = [s for s in line["sizes"].split(",") if s.strip()]
        elif sizes is not None:
            captures.append((len(sizes), float(line["seconds"]), float(line["gb"])))
            sizes = None
    if not captures:
        return None
    return dict(captures=len(captures), batch_sizes=sum(c[0] for c in captures),
                seconds=round(sum(c[1] for c in captures), 3), mem_gb=round(sum(c[2] for c in captures), 3))


def judge_verdicts(log_text: str) -> list[dict]:
    """The verdicts tuner's replay judge logged in a worker: label, batch size, the variant's
    time over the base graph's, the steps it holds for (a class of lengths), and whether they
    were dropped (kept ones are logged at info level); the tensor-parallel rank that logged it
    (each logs its verdicts, the same on every rank), where SGLang's prefix names one; where
    the line gives them, the replays' and the whole steps' ratios (None: not counted); and for
    a challenger (SGLang's FlashInfer graph against a variant kept), `against`, the variant's
    label: its ratio is over that variant's time, not the base graph's."""
    return [dict(label=m["label"], batch=int(m["batch"]), ratio=float(m["ratio"]), steps=m["steps"],
                 dropped=m["verdict"] == "replay that graph", rank=None if m["rank"] is None else int(m["rank"]),
                 **({} if m["replays"] is None else dict(
                     replays_ratio=float(m["replays"]), whole_steps_ratio=m["whole"] and float(m["whole"]))),
                 **({} if m["against"] is None else dict(against=m["against"])))
            for m in JUDGE_LINE.finditer(log_text)]
