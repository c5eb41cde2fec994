"""How close decode attention comes to the HBM roofline on batches as servers make them.

    python benchmarks/roofline.py --out $OUT/roofline.json [--seconds 540] [--before FILE]

For each case, the roofline is the KV bytes the call must read (each sequence's visible
keys, every kv head, K and V) over HBM_BYTES_PER_S; a backend's fraction is the roofline
time over its time. Backends, each where it can run here: FA3's default and FA3's best
config, FlashInfer's best, and ours (tuner's Triton kernel) at its best config; with
--before FILE (an earlier tuner/ops/triton_decode.py: `git show REV:tuner/ops/triton_decode.py
> FILE`), the earlier kernel and its config space at their best too, so one run gives our
kernel before and after side by side.

Cases (--set): serving, serving.py's, per call (head configurations x capture-list batch
sizes x length caps 1k-128k x length distributions; max_kv_len and the page table the
batch's own); grid, the shipped grid (every shape of tuning_cache/h200.tunings.json.gz's
decode_attention records: full lengths at the top of the kv bucket, MTP's q_len). Each
backend's configs are searched by successive halving on the case's batch (every output
checked against the torch reference), then every backend's best is re-timed side by side
in one interleaved run (CUDA graphs, cold L2 by the bytes a call reads). Issue 13's targets
for ours: >= TARGET_FRACTION of the roofline where a call reads >= TARGET_BYTES, else at
most the roofline time + TARGET_SLACK_US. The JSON is written after every case.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import time
from pathlib import Path

import torch
from common.case_runs import add_run_options, cases_of_this_run, done_rows, run_cases
from common.run_info import header
from common.stats import geomean
from serving import MODELS, cases, shipped_heads

from tuner.bench import OK, CudaGraphTimer, WallClockTimer
from tuner.bench.trial import Trial, cold_l2_copies
from tuner.db.jsonio import load_document
from tuner.keys import AttentionRunKey, visible_kv_len
from tuner.ops import get_op
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.workload.rotation import bytes_read, fresh_page_copies
from tuner.workload.shapes import shape_from_keys
from tuner.workload.traffic import draw_lengths
from tuner.search.pipeline import measure

HBM_BYTES_PER_S = 4.4e12  # the H200's HBM bandwidth as issue 13 takes it (KV bytes / 4.4 TB/s)
TARGET_BYTES = 64 * 2**20
TARGET_FRACTION = 0.85
TARGET_SLACK_US = 5.0
BACKENDS = ("fa3", "flashinfer", "ours")
SHIPPED = Path(__file__).resolve().parents[1] / "tuning_cache" / "h200.tunings.json.gz"


def kv_bytes_needed(shape: DecodeShape, lengths: list[int]) -> int:
    """The KV bytes a call cannot avoid reading: each sequence's visible keys, all kv heads (K
    and V, each head_dim wide)."""
    left = shape.window[0]
    per_token = shape.num_kv_heads * 2 * shape.head_dim \
        * torch.empty(0, dtype=getattr(torch, shape.dtype)).element_size()
    return sum(visible_kv_len(n, shape.q_len, left) for n in lengths) * per_token


def load_before(path: Path):
    """The TRITON_DECODE op of an earlier triton_decode module, under a name of its own."""
    spec = importlib.util.spec_from_file_location("triton_decode_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TRITON_DECODE


def contenders(wanted: set[str], before) -> dict[str, tuple]:
    """name -> (op, configs of a shape or None for the default alone): what can run here."""
    out: dict[str, tuple] = {}
    for name in ("fa3", "flashinfer"):
        if name in wanted:
            op = get_op(name)
            if op.unavailable() is None:
                out[f"{name}_default"] = (op, None)
                out[f"{name}_best"] = (op, op.configs)
    if "ours" in wanted:
        op = get_op("triton_decode")
        if op.unavailable() is None:
            out["ours_best"] = (op, op.configs)
            if before is not None:
                out["ours_before_best"] = (before, before.configs)
    return out


def serving_set(smoke: bool, heads: dict[str, dict]) -> list[tuple[dict, DecodeShape, list[int]]]:
    """serving.py's cases, each with its shape and its batch's lengths (seeded by its index)."""
    out = []
    for i, case in enumerate(cases(smoke, heads)):
        lens = draw_lengths(case["distribution"], case["batch"], case["cap"], seed=i)
        out.append((case, DecodeShape(batch=case["batch"], kv_len=max(lens), **heads[case["model"]]), lens))
    return out


def only_sizes(ap: argparse.ArgumentParser, chosen: list, batches: str | None, caps: str | None) -> list:
    """The serving set's cases of these batch sizes and caps (each a comma-separated list, or
    None: all), each keeping its lengths; none left, or a value that is not a number, is a
    usage error."""
    try:
        wanted = [None if v is None else {int(x) for x in v.split(",")} for v in (batches, caps)]
    except ValueError:
        ap.error(f"--batches and --caps take comma-separated numbers, got {batches!r} and {caps!r}")
    kept = [c for c in chosen if all(w is None or c[0][k] in w for w, k in zip(wanted, ("batch", "cap")))]
    if not kept:
        ap.error(f"--batches {batches} --caps {caps}: no case of the set")
    return kept


def grid_set(tunings: Path) -> list[tuple[dict, DecodeShape, list[int]]]:
    """Every shape of the shipped decode_attention records, full lengths, in a stride through
    them (a run cut short still spans the head configurations and sizes)."""
    shapes = {}
    for r in load_document(tunings)["records"]:
        if r["op"] == "decode_attention":
            shape = shape_from_keys(json.dumps(r["static_key"]), AttentionRunKey(**r["run_key"]))
            if shape is not None:
                shapes[shape] = r["static_key"]
    ordered = sorted(shapes, key=lambda s: (s.label(), s.batch, s.kv_len))
    stride = next(k for k in range(len(ordered) // 3 or 1, len(ordered) + 1) if math.gcd(k, len(ordered)) == 1)
    out = []
    for i in range(len(ordered)):
        shape = ordered[(i * stride) % len(ordered)]
        case = dict(model=f"h{shape.num_q_heads}/{shape.num_kv_heads} d{shape.head_dim} q{shape.q_len}"
                          f"{' window' if shape.window[0] >= 0 else ''}{' sinks' if shape.sinks else ''}",
                    batch=shape.batch, cap=shape.kv_len, distribution="full", q_len=shape.q_len)
        out.append((case, shape, [shape.kv_len] * shape.batch))
    return out


def run_case(case: dict, shape: DecodeShape, lens: list[int], device: str, final, backends: dict[str, tuple],
             seed: int) -> dict:
    inputs = make_decode_inputs(shape, device=device, seed=seed, seq_lens=lens)
    reference = inputs.reference()
    copies = fresh_page_copies(inputs, cold_l2_copies(bytes_read(inputs), device))
    del inputs
    needed = kv_bytes_needed(shape, lens)
    row = dict(case, kv_max=max(lens), kv_mean=sum(lens) / len(lens), kv_bytes=needed,
               roofline_us=needed / HBM_BYTES_PER_S * 1e6, copies=len(copies))
    best: dict[str, tuple] = {}  # name -> (op, config)
    for name, (op, configs) in backends.items():
        trial = Trial(runs=[functools.partial(op.run, c) for c in copies], reference=reference,
                      tolerance=op.tolerance[shape.dtype], kv_len=shape.kv_len,
                      precompile=functools.partial(op.precompile, copies[0]) if op.precompile else None)
        default = op.default(shape)
        space = [default] if configs is None else configs(shape)
        searched = time.perf_counter()
        try:
            m = measure(trial, space, default, final, strategy="halving", min_gain=0.0)
        except Exception as e:  # noqa: BLE001 - this backend cannot run the case
            row[name] = dict(error=f"{type(e).__name__}: {e}"[:200])
            continue
        seconds = round(time.perf_counter() - searched, 2)  # the search's, compilation included
        ran = [o for o in m.outcomes if o.status == OK]
        if m.winner is None or not ran:
            row[name] = dict(error="no config ran right", configs=len(space), search_seconds=seconds)
            continue
        best[name] = (op, m.winner.config)
        row[name] = dict(config=m.winner.config, configs=len(space), failed=m.failures, search_seconds=seconds)
    # every backend's best side by side, in one interleaved run
    names = list(best)
    rotations = [[functools.partial(best[n][0].run, c, best[n][1]) for c in copies] for n in names]
    timings = final.interleaved(rotations) if hasattr(final, "interleaved") else [final(r) for r in rotations]
    for name, timing in zip(names, timings):
        us = timing.median_us
        row[name].update(us=us, fraction=row["roofline_us"] / us)
    ours = row.get("ours_best", {})
    if "us" in ours:
        ours["meets_target"] = (ours["fraction"] >= TARGET_FRACTION if needed >= TARGET_BYTES
                                else ours["us"] <= row["roofline_us"] + TARGET_SLACK_US)
    before = row.get("ours_before_best", {})
    if "us" in ours and "us" in before:
        row["ours_over_before"] = before["us"] / ours["us"]
    return row


def summary(rows: list[dict], names: list[str]) -> dict:
    out: dict = {}
    for name in names:
        fractions = [r[name]["fraction"] for r in rows if "fraction" in r.get(name, {})]
        out[name] = {"cases": len(fractions), "fraction_geomean": geomean(fractions),
                     "fraction_worst": min(fractions, default=None)}
    for name in ("ours_best", "ours_before_best"):
        done = [r for r in rows if "fraction" in r.get(name, {})]
        big = [r for r in done if r["kv_bytes"] >= TARGET_BYTES]
        small = [r for r in done if r["kv_bytes"] < TARGET_BYTES]
        out.setdefault(name, {}).update(
            big_cases=len(big), big_meeting_fraction=sum(r[name]["fraction"] >= TARGET_FRACTION for r in big),
            small_cases=len(small),
            small_within_slack=sum(r[name]["us"] <= r["roofline_us"] + TARGET_SLACK_US for r in small),
            small_worst_excess_us=max((r[name]["us"] - r["roofline_us"] for r in small), default=None))
    ratios = [r["ours_over_before"] for r in rows if "ours_over_before" in r]
    out["ours_over_before"] = {"cases": len(ratios), "geomean": geomean(ratios), "worst": min(ratios, default=None),
                               "slower_by_2pct": sum(x < 1 / 1.02 for x in ratios)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(ap)
    ap.add_argument("--set", choices=("serving", "grid"), default="serving",
                    help="serving: serving.py's cases; grid: the shipped grid's shapes (full lengths)")
    ap.add_argument("--heads", choices=("issue", "shipped"), default="issue",
                    help="serving set: serving.py's MODELS (issue), or every shipped head configuration and the "
                         "others (shipped)")
    ap.add_argument("--models", help="only the head configurations whose name holds this text")
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, of {', '.join(BACKENDS)}")
    ap.add_argument("--batches", help="serving set: only these batch sizes, comma-separated (of serving.py's)")
    ap.add_argument("--caps", help="serving set: only these length caps, comma-separated (of serving.py's)")
    ap.add_argument("--before", type=Path, help="an earlier tuner/ops/triton_decode.py, timed beside ours")
    args = ap.parse_args()
    wanted = set(args.backends.split(","))
    if not wanted <= set(BACKENDS):
        ap.error(f"--backends: unknown {', '.join(sorted(wanted - set(BACKENDS)))}")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    final = CudaGraphTimer(warmup=2, repeats=15) if device == "cuda" else WallClockTimer(
        warmup=1, repeats=2, min_repeats=2)
    if args.smoke:
        heads = {"smoke": dict(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")}
    else:
        heads = MODELS if args.heads == "issue" else shipped_heads()
    backends = contenders(wanted, load_before(args.before) if args.before else None)
    names = list(backends)
    chosen = grid_set(SHIPPED) if args.set == "grid" and not args.smoke else serving_set(args.smoke, heads)
    if args.models:  # a head configuration's name (serving) or a shape's label (grid) holding it
        chosen = [c for c in chosen if args.models in c[0]["model"]]
        if not chosen:
            ap.error(f"--models {args.models!r} names no case")
    chosen = only_sizes(ap, chosen, args.batches, args.caps) if args.set == "serving" or args.smoke else chosen
    todo = cases_of_this_run(ap, args, chosen)
    started = time.perf_counter()

    def write(rows: list[dict]) -> dict:
        doc = {**header("roofline", started), "hbm_bytes_per_s": HBM_BYTES_PER_S, "set": args.set,
               "cases_planned": len(todo), "backends": names, "models": heads if args.set == "serving" else None,
               "targets": dict(bytes=TARGET_BYTES, fraction=TARGET_FRACTION, slack_us=TARGET_SLACK_US),
               "summary": summary(rows, names), "rows": rows}
        args.out.write_text(json.dumps(doc, indent=1, default=str))
        return doc

    rows = run_cases(todo, args.seconds, device,
                     run=lambda i, c: run_case(*c, device, final, backends, seed=i), fields=lambda c: c[0],
                     describe=lambda row: "".join(f" {n} {row[n]['fraction']:.2f}" for n in names
                                                  if "fraction" in row.get(n, {})),
                     write=write, done=done_rows(args))
    doc = write(rows)
    print(json.dumps(doc["summary"], default=str))


if __name__ == "__main__":
    main()
