"""Graph replays draw by draw: every candidate of decode_attention_graph's space against FA3's
default on each batch a graph captured at a bound replays, so what wins over all replays
(the graph oracle: the best single config over the same replays) and where a config loses
(which draws, how heavy) can be read side by side.

    python benchmarks/graph_replays.py --out $OUT/graph_replays.json --heads 48/8 \\
        [--batches 1,8,64] [--bounds 32768,131072] [--seconds 500] [--full-space]
    python benchmarks/graph_replays.py --out /tmp/graph_replays.json --smoke   # CPU, interpreted

A shape is a capture batch size and bound (DecodeShape lengths "graph"); its draws are
tuner.workload.traffic.graph_draws (one batch of each length distribution at each octave cap),
built and checked against the reference as the graph sweep builds them
(tuner.sweep.trials.build_trial: page table and max length at the bound, no host lengths).
Each draw is timed alone on its part of the trial, a rotation of its own copies, cold in the
L2 by its own bytes read (each draw's copies and rotation bytes are in the JSON). On each draw
every config that ran right is timed in one interleaved run, a CUDA graph captured per config
and draw (nothing on the host sees the lengths: max length and table width are the bound, as
when one graph replays them all; "capture_failed" says where a config was timed eagerly). A
config's mean over the draws is what the sweep ranks. The oracle and the best of each family
are the least of noisy means, so they lean optimistic. The JSON is written after every shape;
a shape that cannot run is an error row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from common import heads as head_configs
from common.run_info import header

from tuner import settings
from tuner.bench import CudaGraphTimer, WallClockTimer
from tuner.bench.runner import check_config, one_line, rotation
from tuner.bench.select import OK
from tuner.ops.decode_attention import DECODE_ATTENTION_GRAPH as OP
from tuner.sweep.trials import build_trial
from tuner.workload import DecodeShape
from tuner.workload.rotation import bytes_read
from tuner.workload.traffic import DISTRIBUTIONS, graph_caps, graph_draws


def family(config: dict) -> str:
    """A config's kind: how it splits (FA3's default, an FA3 cap, Triton's fixed, by length, by load)."""
    if config["backend"] == "fa3":
        return "fa3_default" if config["num_splits"] == 0 and config["pack_gqa"] is None else "fa3"
    if config.get("items_per_sm"):
        return "triton_by_load"
    return "triton_by_length" if config.get("tokens_per_split") else "triton_fixed"


def checked_configs(trial, configs: list[dict]) -> tuple[list[dict], list[dict]]:
    """The configs that ran right on every draw, and the others with why."""
    ok, failed = [], []
    for config in configs:
        try:
            outcome = check_config(rotation(trial.runs, config), config, reference=trial.reference,
                                   tolerance=trial.tolerance, checks=trial.checks)
            if outcome.status == OK:
                ok.append(config)
                continue
            failed.append(dict(config=config, error=outcome.error))
        except Exception as e:  # noqa: BLE001 - a config that cannot run is reported, not fatal
            failed.append(dict(config=config, error=one_line(e)))
    return ok, failed


def timed_side_by_side(timer, rotations: list) -> list[float]:
    """Microseconds of each rotation, in one interleaved run where the timer has one."""
    if hasattr(timer, "interleaved"):
        return [t.median_us for t in timer.interleaved(rotations)]
    return [timer(r).median_us for r in rotations]


def time_draws(trial, configs: list[dict], timer) -> tuple[list, list]:
    """Per draw (the trial's parts): each config's microseconds (in configs' order), and how
    the draw was timed."""
    per_draw, timed = [], []
    for part in trial.parts or [trial.runs]:
        per_draw.append(timed_side_by_side(timer, [rotation(part, c) for c in configs]))
        timed.append(dict(copies=len(part), rotation_bytes=sum(bytes_read(run.args[0]) for run in part),
                          capture_failed=bool(getattr(timer, "last_capture_failed", False))))
    return per_draw, timed


def measure_shape(shape: DecodeShape, timer, device: str) -> dict:
    trial = build_trial(OP, shape, device, seed=0)
    default = OP.default(shape)
    configs, failed = checked_configs(trial, OP.configs(shape))
    if default not in configs:
        return dict(batch=shape.batch, bound=shape.kv_len, error="the default did not run right", failed=failed)
    lens = graph_draws(shape.batch, shape.kv_len, 0)
    labels = [(cap, name) for cap in graph_caps(shape.batch, shape.kv_len) for name in DISTRIBUTIONS]
    per_draw, timed = time_draws(trial, configs, timer)
    d = configs.index(default)
    means = [sum(row[i] for row in per_draw) / len(per_draw) for i in range(len(configs))]
    rows = []
    for i, config in enumerate(configs):
        ratios = [row[d] / row[i] for row in per_draw]  # speedup over the default, per draw
        rows.append(dict(config=config, family=family(config), mean_us=means[i], speedup=means[d] / means[i],
                         worst_draw=min(ratios), best_draw=max(ratios), per_draw_us=[r[i] for r in per_draw]))
    oracle = min(range(len(configs)), key=lambda i: means[i])
    best = {}
    for row in rows:
        if row["family"] not in best or row["mean_us"] < best[row["family"]]["mean_us"]:
            best[row["family"]] = row
    return dict(batch=shape.batch, bound=shape.kv_len,
                draws=[dict(cap=cap, distribution=name, longest=max(x), keys=sum(x), **how)
                       for (cap, name), x, how in zip(labels, lens, timed, strict=True)],
                default_us=means[d], oracle=configs[oracle], oracle_speedup=means[d] / means[oracle],
                best_of_family={k: dict(config=v["config"], speedup=v["speedup"], worst_draw=v["worst_draw"],
                                        best_draw=v["best_draw"]) for k, v in best.items()},
                per_draw_best_speedup=[row[d] / min(row) for row in per_draw],
                configs=rows, failed=failed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", default="32/8", help='one head configuration, as serving.py takes it ("48/8")')
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--bounds", default="32768,131072")
    ap.add_argument("--seconds", type=float, default=500.0, help="start no shape after this long")
    ap.add_argument("--full-space", action="store_true", help="every candidate, unpruned (settings.FULL_SPACE)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreted)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("graph_replays.py: needs a CUDA GPU (or --smoke)")
    settings.FULL_SPACE = args.full_space
    heads = head_configs.parse_spec(args.heads)
    if args.smoke:
        heads = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
        args.batches, args.bounds = "1", "64"
    shapes = [DecodeShape(batch=int(b), kv_len=int(bound), lengths="graph", **heads)
              for b in args.batches.split(",") for bound in args.bounds.split(",")]
    start = time.perf_counter()
    out = dict(header("graph_replays", start), heads=args.heads, full_space=args.full_space, shapes=[])
    timer = CudaGraphTimer() if device == "cuda" else WallClockTimer(warmup=1, repeats=3, min_repeats=3)
    for shape in shapes:
        if time.perf_counter() - start > args.seconds:
            print(f"stopped before batch {shape.batch} bound {shape.kv_len}: --seconds", flush=True)
            break
        t0 = time.perf_counter()
        try:
            row = measure_shape(shape, timer, device)
        except (MemoryError, RuntimeError) as e:  # too big, or the reference failed: the next shape runs
            row = dict(batch=shape.batch, bound=shape.kv_len, error=one_line(e))
        row["seconds"] = time.perf_counter() - t0
        out["shapes"].append(row)
        out["seconds"] = round(time.perf_counter() - start, 1)
        Path(args.out).write_text(json.dumps(out, indent=1))
        fams = " ".join(f"{k} {v['speedup']:.3f} (worst {v['worst_draw']:.3f})"
                        for k, v in sorted(row.get("best_of_family", {}).items()))
        print(f"batch {shape.batch} bound {shape.kv_len}: oracle {row.get('oracle_speedup', 0):.3f}x; {fams}; "
              f"{row['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
