"""One shipped decode_attention record's configs on each batch that judged it, every batch
alone and the configs side by side: the batches of the sweep's trial, its second trial and
(batch > 1) its dense trial, and serving.py's batches of the same key (its cases of this
head configuration and batch whose longest sequence falls in the record's kv bucket, drawn
as serving.py draws them). Each is timed twice, with the sweep's timer and with
serving.py's. For a record that won its trials and loses on serving.py's batches: which
batch, and which timer, tells them apart.

    python benchmarks/record_parts.py --heads 28/4 --batch 8 --kv 131072 --out $OUT/parts.json
        [--tunings tuning_cache/h200.tunings.json.gz] [--models "(shipped)"]

Configs: the library default, the record's config (a by_fill record: its dense and its
other config). Per batch: its lengths (sum, longest, fill), and each config's median us
under both timers.

--draws N: N more batches of each distribution of the record's key (lengths as a sweep
draws them, with seeds no trial or serving.py case uses), timed alike, and a summary: the
record as it runs each batch (a by_fill record: the part of the batch's fill) over the
default, in geomean, worst and best, per distribution, under the sweep's timer. One draw
judges a record by luck where the default's time varies from batch to batch of the same
bytes (FA3's default at batch 8 x kv 128k: 365-553 us for 1.5-1.7 GB, ea3ec29).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import serving
import torch
from run_info import header
from stats import geomean

from tuner import settings
from tuner.bench import CudaGraphTimer, WallClockTimer, timer_for
from tuner.bench.runner import rotation
from tuner.db.jsonio import load_document
from tuner.keys import AttentionRunKey, canonical_json, kv_len_bucket
from tuner.ops import get_op
from tuner.workload import DecodeShape
from tuner.ops.decode_attention import BY_FILL, fill_parts
from tuner.workload.shapes import shape_from_keys
from tuner.workload.traffic import DISTRIBUTIONS, dense_draws, draw_lengths, is_dense
from tuner.workload.traffic import serving_draws as sweep_draws
from tuner.sweep.trials import build_trial


def find_record(tunings: Path, heads: tuple[int, int], batch: int, kv: int) -> dict:
    """The decode_attention record of those heads at (batch, q_len 1, kv's bucket)."""
    bucket = kv_len_bucket(kv)
    for record in load_document(tunings)["records"]:
        key, run = record["static_key"], record["run_key"]
        if (record["op"] == "decode_attention" and (key["num_q_heads"], key["num_kv_heads"]) == heads
                and run["batch"] == batch and run["max_q_len"] == 1 and run["kv_len_bucket"] == bucket):
            return record
    raise SystemExit(f"no decode_attention record for heads {heads[0]}/{heads[1]}, batch {batch}, kv bucket {bucket}")


def named_configs(record: dict) -> dict[str, dict]:
    config = record["config"]
    parts = dict(zip(("dense", "other"), fill_parts(config))) if config["backend"] == BY_FILL else {"record": config}
    return {"default": record["default"]["config"], **parts}


def serving_draws(models: str, shape: DecodeShape) -> list[tuple[str, list[int]]]:
    """serving.py's batches of the shape's static key and batch whose longest falls in its kv
    bucket: (case name, lengths), each drawn with the case's index in the run of --models as
    its seed, as serving.py draws them."""
    heads = {name: s for name, s in serving.MODELS.items() if models in name}
    bucket = kv_len_bucket(shape.kv_len)
    out = []
    for index, case in enumerate(serving.cases(False, heads, serving.CAPS)):
        spec = heads[case["model"]]
        if case["batch"] != shape.batch or DecodeShape(batch=1, kv_len=1, **spec).static_key() != shape.static_key():
            continue
        lens = draw_lengths(case["distribution"], shape.batch, case["cap"], index)
        if kv_len_bucket(max(lens)) == bucket:
            out.append((f"serving {case['model']} L{case['cap']} {case['distribution']}", lens))
    return out


EXTRA_SEED = 10**7  # the --draws batches' seeds: above any trial's (tuner.settings) and serving.py's


def runs_part(configs: dict[str, dict], lens: list[int]) -> str:
    """The name of the config the record runs on these lengths (by_fill: the fill's part)."""
    if "record" in configs:
        return "record"
    return "dense" if is_dense(sum(lens), len(lens), max(lens)) else "other"


def draws_summary(rows: list[dict]) -> dict:
    """Of the --draws rows: default / the record as it runs, per distribution and in all."""
    def of(group: list[dict]) -> dict:
        ratios = [r["sweep"]["default"] / r["sweep"][r["runs"]] for r in group]
        return dict(batches=len(ratios), geomean=geomean(ratios),
                    worst=min(ratios), best=max(ratios),
                    slower_by_2pct=sum(x < 1 / 1.02 for x in ratios)) if ratios else dict(batches=0)
    return {"all": of(rows), **{d: of([r for r in rows if r["distribution"] == d]) for d in DISTRIBUTIONS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", required=True, help="Q/KV, e.g. 28/4")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--kv", type=int, required=True, help="a kv length of the record's bucket")
    ap.add_argument("--tunings", type=Path, default=serving.SHIPPED / "h200.tunings.json.gz")
    ap.add_argument("--models", default="(shipped)", help="the serving.py run whose cases to draw (--models there)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--draws", type=int, default=0, help="this many more batches per distribution (see above)")
    ap.add_argument("--smoke", action="store_true", help="on the CPU, the trials' batches only (Triton interpreted)")
    args = ap.parse_args()
    heads = tuple(int(n) for n in args.heads.split("/"))
    record = find_record(args.tunings, heads, args.batch, args.kv)
    run = AttentionRunKey(**record["run_key"])
    shape = shape_from_keys(canonical_json(record["static_key"]), run)
    configs = named_configs(record)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    op = get_op("decode_attention")
    started = time.perf_counter()
    if device == "cuda":  # serving.py's final timer beside the sweep's
        timers = {"sweep": timer_for("sweep-gpu", device), "serving": CudaGraphTimer(warmup=2, repeats=15)}
    else:  # a smoke run: the wall clock, briefly
        timers = {name: WallClockTimer(warmup=1, repeats=2, min_repeats=2) for name in ("sweep", "serving")}
    # each batch its own trial: (which batches, lengths)
    batches = [("trial", lens) for lens in sweep_draws(shape.batch, shape.kv_len, 0)]
    batches += [("second trial", lens)
                for lens in sweep_draws(shape.batch, shape.kv_len, settings.SECOND_TRIAL_SEED, reach_top=True)]
    if shape.batch > 1:
        batches += [("dense trial", lens) for lens in dense_draws(shape.batch, shape.kv_len, settings.DENSE_TRIAL_SEED)]
    if not args.smoke:
        batches += serving_draws(args.models, shape)
    for i in range(args.draws):  # each the first round of its seed's draws (one per distribution)
        first_round = sweep_draws(shape.batch, shape.kv_len, EXTRA_SEED + i)[:len(DISTRIBUTIONS)]
        batches += [(f"draw {d}", lens) for d, lens in zip(DISTRIBUTIONS, first_round, strict=True)]
    rows = []
    for name, lens in batches:
        trial = build_trial(op, shape, device, draws=[lens])
        calls = list(trial.runs)
        row = dict(batches=name, sum=sum(lens), longest=max(lens), fill=round(sum(lens) / (len(lens) * max(lens)), 3),
                   runs=runs_part(configs, lens))
        if name.startswith("draw "):
            row["distribution"] = name.split()[1]
        for timer_name, timer in timers.items():
            rotations = [rotation(calls, c) for c in configs.values()]
            timings = timer.interleaved(rotations) if hasattr(timer, "interleaved") else [timer(r) for r in rotations]
            row[timer_name] = {n: round(t.median_us, 3) for n, t in zip(configs, timings)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del trial, calls
    doc = dict(header("record_parts", started), record=record, configs=configs, rows=rows)
    if args.draws:
        doc["draws"] = draws_summary([r for r in rows if "distribution" in r])
        print(json.dumps(doc["draws"]))
    args.out.write_text(json.dumps(doc, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
