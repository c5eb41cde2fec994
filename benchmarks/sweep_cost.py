"""What a sweep of a static key's serving grid costs, and how well its winners agree with a
long, precise measurement (issue 12, item 4).

    python benchmarks/sweep_cost.py --out $OUT/sweep_cost.json --db $OUT/serving.db \\
        --heads "16/8 hd256 softcap50 window4095" [--heads ...] [--agree 12] [--search guided]

Phase 1, per head configuration given: `tuner.sweep.sweep` of op over the key's serving grid
(every capture batch size x kv 32-128k, mixed-length batches, tuner.workload.traffic; with --mtp
MTP verify too) into --db, with --search; timed as a whole (compilation included: the
sweep builds every shape's Triton candidates ahead, in parallel, before timing them), with
the seconds spent making inputs, compiling and in the timers. Swept one kv length at a time,
longest first (a guided search's anchors are among its own kv length's shapes), none started after
--seconds; resumable (the DB), so a run cut short is finished by the same command.
Phase 2, on --agree shapes of the first head configuration (evenly through its grid): every
candidate timed with the sweep's full timer (exhaustive), then successive halving on the same
trial, each timed; then the exhaustive run's three fastest, halving's winner, the phase-1
winner and the default re-timed side by side with a long timer (30 samples). Agreement of a
search on a shape: the precise time of the fastest of those over that of the search's winner
("sweep": the phase-1 winner; runs before 2026-12-01 15:30 named it after its search).
FlashInfer is left out of decode_attention's space unless --backends names it (its plan is
host work a captured decode graph cannot hold). The JSON is written as it goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from common import heads as head_configs
import torch
from common.run_info import header
from common.stats import geomean

from tuner import settings
from tuner.bench import CudaGraphTimer, boundary_sync, measure_config, timer_for
from tuner.bench.runner import rotation
from tuner.db import Problem, TuningDB, current_environment
from tuner.ops import get_op
from tuner.workload import DecodeShape
from tuner.ops.decode_attention import backends_only
from tuner.workload.traffic import serving_grid
from tuner.sweep.trials import build_trial
from tuner.search.guided import is_anchor
from tuner.search.pipeline import measure
from tuner.sweep import candidate_configs, sweep

# named head configurations: DecodeShape fields besides batch and kv_len
HEADS: dict[str, dict[str, Any]] = {
    "32/8": head_configs.LLAMA_8B_TP1,
    "8/1": head_configs.LLAMA_70B_TP8,
    "28/4": head_configs.QWEN_7B_TP1,
    "16/8 hd256 softcap50 window4095": head_configs.HD256_SOFTCAP_WINDOW,
    "64/8 hd64 sinks window127": head_configs.HD64_SINKS_WINDOW,
    "cpu-tiny": dict(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32"),
    "cpu-tiny window31": dict(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", window=(31, 0)),
}
PRECISE_REPEATS = 30
FINALISTS = 3


def grid_of(spec: dict, mtp: bool, smoke: bool, max_tokens: int, kv_lens: tuple[int, ...] | None = None
            ) -> list[DecodeShape]:
    common = dict(dtype="bfloat16", **spec) if "dtype" not in spec else dict(spec)
    if smoke:
        return serving_grid((1, 2, 3, 4), (64,), **common) if "window" not in spec else \
            serving_grid((1, 2), (64, 128), **common)  # two kv lengths past the window
    shapes = serving_grid(max_tokens=max_tokens, **({"kv_lens": kv_lens} if kv_lens else {}), **common)
    if mtp:
        shapes += [DecodeShape(batch=b, kv_len=n, q_len=q, lengths="serving", **common) for q in (2, 4)
                   for b in (1, 4, 16, 64) for n in (2048, 8192, 32768, 131072) if b * n <= max_tokens]
    return shapes


class Clock:
    """Seconds spent in wrapped callables, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return timed


class TimedTimer:
    """A timer whose calls are counted on a Clock (its quick timer's too)."""

    def __init__(self, timer, clock: Clock) -> None:
        self._timer, self._clock = timer, clock
        if hasattr(timer, "interleaved"):  # the CUDA-graph timer's, which decide() uses where it exists
            self.interleaved = clock.wrap("timer", timer.interleaved)

    def __call__(self, fns):
        return self._clock.wrap("timer", self._timer.__call__)(fns)

    def paired(self, a, b):
        return self._clock.wrap("timer", self._timer.paired)(a, b)

    def quick(self):
        return TimedTimer(self._timer.quick(), self._clock)

    @property
    def method(self):
        return self._timer.method


def phase_sweep(op, name: str, shapes: list[DecodeShape], db: TuningDB, search: str, device: str,
                deadline: float, progress) -> dict:
    """Sweep shapes family by family (query length x kv length: a guided search's anchors
    are within a family), stopping between families past the deadline; progress(result)
    after each."""
    clock = Clock()
    timed_op = dataclasses.replace(op, make_inputs=clock.wrap("make_inputs", op.make_inputs),
                                   precompile=op.precompile and clock.wrap("precompile", op.precompile))
    timer = TimedTimer(timer_for("sweep-gpu" if device == "cuda" else "sweep-cpu", device), clock)
    families: dict[tuple[int, int], list[DecodeShape]] = {}
    for shape in shapes:
        families.setdefault((shape.q_len, shape.kv_len), []).append(shape)
    results: list = []
    seconds = 0.0
    result: dict = {}
    # one kv length at a time, longest first; each is its own run key, a windowed key's too
    for _, family in sorted(families.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        if time.perf_counter() > deadline:
            break
        start = time.perf_counter()
        results += sweep(timed_op, family, db, timer=timer, strategy=search)
        seconds += time.perf_counter() - start
        result = _sweep_summary(op, name, shapes, results, search, seconds, clock)
        progress(result)
    return result


def _sweep_summary(op, name, shapes, results, search, seconds, clock) -> dict:
    measured = sum(r.measured for r in results)
    rows = [dict(shape=r.shape.label(), batch=r.shape.batch, kv_len=r.shape.kv_len, q_len=r.shape.q_len,
                 status=r.status, winner=r.winner, speedup=r.speedup, measured=r.measured, resumed=r.resumed,
                 failures=r.failures, note=r.note) for r in results]
    done = [r for r in results if r.status == "measured"]
    return dict(
        heads=name, search=search, shapes=len(shapes), swept_shapes=len(results), measured_shapes=len(done),
        skipped_shapes=sum(r.status == "skipped" for r in results),
        failed_shapes=sum(r.status == "failed" for r in results),
        seconds=round(seconds, 1), measurements=measured,
        exhaustive_candidates=sum(len(candidate_configs(op, r.shape)) for r in done),
        ms_per_measurement=round(1000 * seconds / measured, 2) if measured else None,
        phase_seconds={k: round(v, 1) for k, v in clock.seconds.items()},
        geomean_speedup=geomean([r.speedup for r in done if r.speedup]),
        rows=rows,
    )


def phase_agree(op, shapes: list[DecodeShape], db: TuningDB, device: str, count: int, deadline: float):
    """Yields the rows so far after each shape; stops past the deadline."""
    env = current_environment()
    full_timer = timer_for("sweep-gpu" if device == "cuda" else "sweep-cpu", device)
    precise = CudaGraphTimer(warmup=3, repeats=PRECISE_REPEATS) if device == "cuda" else timer_for("verify-cpu", device)
    picked = [shapes[(i * len(shapes)) // count + len(shapes) // (2 * count)] for i in range(count)] if count else []
    out = []
    for shape in picked:
        if time.perf_counter() > deadline:
            return
        row: dict[str, Any] = dict(shape=shape.label(), batch=shape.batch, kv_len=shape.kv_len,
                                   anchor=is_anchor(shape.batch))
        try:
            boundary_sync()
            trial = build_trial(op, shape, device, seed=0)  # the sweep's seed: the same batches
            configs = candidate_configs(op, shape)
            if trial.precompile is not None:
                trial.precompile(configs)
            start = time.perf_counter()
            outcomes = [measure_config(trial.runs, c, reference=trial.reference, tolerance=trial.tolerance,
                                       timer=full_timer, checks=trial.checks) for c in configs]
            row["exhaustive_s"] = time.perf_counter() - start
            start = time.perf_counter()
            halving = measure(trial, configs, configs[0], full_timer, strategy="halving")
            row["halving_s"] = time.perf_counter() - start
            row["halving_measurements"] = halving.measured
            row["candidates"] = len(configs)
            ok = sorted((o for o in outcomes if o.status == "ok"), key=lambda o: o.timing.median_us)
            stored = db.record(Problem(op.name, shape.static_key().to_json(), shape.run_key()), env.id)
            chosen = {"exhaustive": ok[0].config if ok else None,
                      "halving": halving.winner.config if halving.winner else None,
                      "sweep": stored.config if stored else None, "default": configs[0]}
            finalists: list[dict] = []
            for c in [o.config for o in ok[:FINALISTS]] + [c for c in chosen.values() if c is not None]:
                if c not in finalists:
                    finalists.append(c)
            timings = precise.interleaved([rotation(trial.runs, c) for c in finalists]) \
                if hasattr(precise, "interleaved") else [precise(rotation(trial.runs, c)) for c in finalists]
            us = [t.median_us for t in timings]
            best = min(us)
            row["finalists"] = [dict(config=c, precise_us=u) for c, u in zip(finalists, us)]
            row["agreement"] = {k: (best / us[finalists.index(c)] if c is not None else None) for k, c in chosen.items()}
            row["exhaustive_screen_us"] = {json.dumps(o.config, sort_keys=True): o.timing.median_us for o in ok}
            del trial
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("finalists", "exhaustive_screen_us")},
                         default=str), flush=True)
        yield out


def summarize_agreement(rows: list[dict]) -> dict:
    out = {}
    for k in ("exhaustive", "halving", "sweep"):
        vals = [r["agreement"][k] for r in rows if "agreement" in r and r["agreement"].get(k)]
        if vals:
            out[k] = dict(shapes=len(vals), geomean=geomean(vals), worst=min(vals),
                          within_2pct=sum(v >= 0.98 for v in vals) / len(vals))
    exh = [r for r in rows if "exhaustive_s" in r]
    if exh:
        n = sum(r["candidates"] for r in exh)
        out["exhaustive_ms_per_measurement"] = 1000 * sum(r["exhaustive_s"] for r in exh) / n
        out["halving_ms_per_measurement"] = 1000 * sum(r["halving_s"] for r in exh) / n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--db", required=True, help="the DB the sweeps write (resumable)")
    ap.add_argument("--heads", action="append", choices=sorted(HEADS), help="head configurations, in order")
    ap.add_argument("--op", default="decode_attention")
    ap.add_argument("--search", default="guided", help="the sweep's search strategy (tuner.search)")
    ap.add_argument("--agree", type=int, default=12, help="shapes of the first head configuration to check")
    ap.add_argument("--mtp", action="store_true", help="add MTP verify shapes (2 and 4 query tokens)")
    ap.add_argument("--max-tokens", type=int, default=4 * 2**20, help="batch x kv at most, in the grid")
    ap.add_argument("--backends", default="fa3,triton_decode", help="decode_attention's backends to search")
    ap.add_argument("--kv", default=None,
                    help="only these kv buckets of the serving grid, comma-separated (e.g. serving.py's caps)")
    ap.add_argument("--smoke", action="store_true", help="a tiny grid on the CPU (Triton interpreted)")
    ap.add_argument("--seconds", type=float, default=540.0,
                    help="start no kv length's sweep nor agreement shape after this long")
    ap.add_argument("--agree-seconds", type=float, default=120.0,
                    help="start no agreement shape after this long past the sweeps")
    args = ap.parse_args()
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    with backends_only(args.backends.split(",")):
        run(args, started, device)


def run(args: argparse.Namespace, started: float, device: str) -> None:
    op = get_op(args.op)
    heads = args.heads or (["cpu-tiny"] if args.smoke else ["16/8 hd256 softcap50 window4095"])
    db = TuningDB(args.db)
    doc: dict[str, Any] = dict(settings={"search": args.search, "guided_keep": settings.GUIDED_KEEP,
                                         "halving_keep": settings.HALVING_KEEP,
                                         "quick_repeats": settings.QUICK_REPEATS_GPU,
                                         "quick_budget_us": settings.QUICK_BUDGET_US_GPU,
                                         "compile_workers": settings.COMPILE_WORKERS,
                                         "backends": args.backends},
                               sweeps=[], agreement=[])

    def write() -> None:
        doc.update(header("sweep_cost", started))
        args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    kv_lens = tuple(int(n) for n in args.kv.split(",")) if args.kv else None
    grids = {name: grid_of(HEADS[name], args.mtp, args.smoke, args.max_tokens, kv_lens) for name in heads}
    deadline = started + args.seconds
    for name in heads:
        doc["sweeps"].append({})

        def progress(result: dict) -> None:
            doc["sweeps"][-1] = result
            print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
            write()

        phase_sweep(op, name, grids[name], db, args.search, device, deadline, progress)
    agree_deadline = max(deadline, time.perf_counter()) + args.agree_seconds
    for rows in phase_agree(op, grids[heads[0]], db, device, args.agree, agree_deadline):
        doc["agreement"] = rows
        doc["agreement_summary"] = summarize_agreement(rows)
        write()
    write()
    print(json.dumps(doc.get("agreement_summary", {})), flush=True)


if __name__ == "__main__":
    main()
