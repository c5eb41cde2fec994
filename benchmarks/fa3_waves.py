"""The wave_fit FA3 config on batches no sweep or serving.py case drew: FA3's default against
its cap from tuner.ops.fa3_waves, side by side, per batch (CUDA graphs, cold L2 by the bytes
a call reads), and FA3 at every other cap, to see whether the model's cap is the best one.

    python benchmarks/fa3_waves.py --out $OUT/fa3_waves.json [--batches 1000] [--seconds 300]
    python benchmarks/fa3_waves.py --score results/h200/wave_fit/FILE.json   # on the CPU

(--score: each rule for the cap, scored on a run's stored timings: wave_fit's own, and
least_time, the cap of least modelled time, a candidate; docs/decisions.md, "FA3's wave overflow")

Batches: kv heads 1, 2, 4 and 8 (q heads 8 per kv head, head dim 128, bf16, page size 1),
batch sizes up to two waves of tiles, lengths of the serving distributions at random caps
(tuner.workload.traffic), seeded. Timed: every batch whose FA3 tiles spill past one wave where
a cap could fit them in one (whether wave_fit caps it or not; _spills), and one in twenty of the
others as a check that they are alike. Each row keeps the lengths and every cap's time, so
another rule for choosing the cap can be scored on the same timings.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from common.run_info import header
from common.stats import geomean

from tuner.bench import CudaGraphTimer
from tuner.bench.trial import cold_l2_copies
from tuner.integrations.decode_attention import decode_attention, eager_config
from tuner import settings
from tuner.ops.fa3_waves import WAVE_FIT, fa3_splits, kernel_time, wave_cap
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.workload.rotation import bytes_read, fresh_page_copies
from tuner.workload.traffic import DISTRIBUTIONS, draw_lengths

DEFAULT = {"backend": "fa3", "num_splits": 0, "pack_gqa": None}
WAVE = dict(DEFAULT, **{WAVE_FIT: True})
CAPS = (1, 2, 3, 4, 5, 6, 8)


def draw(rng: random.Random) -> tuple[int, list[int], str]:
    kv_heads = rng.choice((1, 2, 4, 8))
    batch = rng.randint(1, max(1, 264 // kv_heads))
    cap = int(2 ** rng.uniform(10, 17))
    name = rng.choice(tuple(DISTRIBUTIONS))
    return kv_heads, draw_lengths(name, batch, cap, rng.randrange(10**6)), name


def run_batch(kv_heads: int, lengths: list[int], timer: CudaGraphTimer) -> dict:
    shape = DecodeShape(batch=len(lengths), kv_len=max(lengths), num_q_heads=8 * kv_heads, num_kv_heads=kv_heads,
                        head_dim=128, dtype="bfloat16")
    inputs = make_decode_inputs(shape, device="cuda", seq_lens=lengths)
    host = inputs.seq_lens_host
    copies = fresh_page_copies(inputs, cold_l2_copies(bytes_read(inputs), "cuda"))
    calls = [(c.q, c.k_cache, c.v_cache, c.page_table, c.cache_seqlens, shape.kv_len) for c in copies]
    fit = eager_config(WAVE, *calls[0], seq_lens_host=host)
    configs = [DEFAULT, fit] + [dict(DEFAULT, num_splits=n) for n in CAPS if n != fit["num_splits"]]
    rotations = [[lambda a=a, c=c: decode_attention(*a, seq_lens_host=host, config=c) for a in calls]
                 for c in configs]
    us = [t.median_us for t in timer.interleaved(rotations)]
    reference = decode_attention(*calls[0], config=DEFAULT)
    error = float((decode_attention(*calls[0], config=fit).float() - reference.float()).abs().max())
    return dict(kv_heads=kv_heads, batch=len(lengths), longest=max(lengths), mean=sum(lengths) / len(lengths),
                cap=fit["num_splits"], default_us=us[0], fit_us=us[1], fit_speedup=us[0] / us[1],
                best_cap=min(zip(us[2:], configs[2:]), key=lambda t: t[0])[1]["num_splits"],
                best_cap_speedup=us[0] / min(us[2:] + [us[1]]), max_error=error,
                cap_us={str(c["num_splits"]): t for c, t in zip(configs[1:], us[1:])} | {"0": us[0]},
                lengths=list(lengths))


def _least_time_cap(kv_heads: int, lengths: list[int], sms: int) -> int:
    """The candidate rule: the cap of least modelled time (tuner.ops.fa3_waves.kernel_time),
    where it gains settings.FA3_WAVE_MIN_GAIN; 0 elsewhere."""
    found = fa3_splits(lengths, num_kv_heads=kv_heads, q_per_kv=8, q_len=1, head_dim=128,
                       table_keys=max(lengths), sms=sms)
    if found is None or found[1].max() <= 1:
        return 0
    n_blocks, splits, tiles = found
    own = kernel_time(n_blocks, splits, tiles, sms)
    if own is None:
        return 0
    times = {c: kernel_time(n_blocks, np.minimum(splits, c), tiles, sms) for c in range(1, int(splits.max()))}
    best = min((t, c) for c, t in times.items() if t is not None)
    return best[1] if best[0] * (1 + settings.FA3_WAVE_MIN_GAIN) <= own else 0


def score(path: Path, sms: int = 132) -> dict:
    """Each rule's speedup over FA3's default on a run's rows that kept every cap's time; a
    rule's cap that was not timed is counted apart."""
    rows = [r for r in json.loads(path.read_text())["rows"] if "cap_us" in r]
    rules = {"wave_fit": lambda r: wave_cap(r["lengths"], num_kv_heads=r["kv_heads"], q_per_kv=8, q_len=1,
                                            head_dim=128, table_keys=max(r["lengths"]), sms=sms),
             "least_time": lambda r: _least_time_cap(r["kv_heads"], r["lengths"], sms)}
    out = {}
    for name, rule in rules.items():
        caps = [(r, rule(r)) for r in rows]
        timed = [r["cap_us"]["0"] / r["cap_us"][str(c)] for r, c in caps if c and str(c) in r["cap_us"]]
        out[name] = dict(rows=len(rows), capped=sum(1 for _, c in caps if c), scored=len(timed),
                         geomean_where_capped=geomean(timed), slower_by_2pct=sum(t < 1 / 1.02 for t in timed),
                         worst=min(timed, default=None), summed_log=sum(math.log(t) for t in timed))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--score", type=Path, help="score each rule for the cap on this run's JSON, and stop")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--batches", type=int, default=1000,
                    help="batches drawn (those with a cap, and one in twenty of the rest, are timed)")
    ap.add_argument("--seconds", type=float, default=300.0, help="stop starting batches after this long")
    ap.add_argument("--seed", type=int, default=20261205)
    args = ap.parse_args()
    if args.score:
        print(json.dumps(score(args.score), indent=1))
        return
    if args.out is None:
        ap.error("--out is required (or --score FILE)")
    started, rng = time.perf_counter(), random.Random(args.seed)
    doc: dict = {"summary": {}}
    timer = CudaGraphTimer(warmup=2, repeats=15)
    rows = []
    for i in range(args.batches):
        if time.perf_counter() - started > args.seconds:
            break
        kv_heads, lengths, name = draw(rng)
        if not _spills(kv_heads, lengths) and i % 20:
            continue
        row = dict(run_batch(kv_heads, lengths, timer), distribution=name, index=i)
        rows.append(row)
        print(f"{i} h{kv_heads} b{row['batch']} longest {row['longest']} cap {row['cap']}: "
              f"{row['fit_speedup']:.3f} (best cap {row['best_cap']}: {row['best_cap_speedup']:.3f})", flush=True)
        capped = [r for r in rows if r["cap"]]
        doc = {**header("fa3_waves", started), "rows": rows, "summary": {
            "capped": len(capped),
            "fit_over_default_geomean": geomean([r["fit_speedup"] for r in capped]),
            "best_cap_over_default_geomean": geomean([r["best_cap_speedup"] for r in capped]),
            "fit_slower_by_2pct": sum(r["fit_speedup"] < 1 / 1.02 for r in capped),
            "fit_worst": min((r["fit_speedup"] for r in capped), default=None),
            "uncapped": len(rows) - len(capped),
            "uncapped_worst": min((r["fit_speedup"] for r in rows if not r["cap"]), default=None),
            "spilling_uncapped": sum(1 for r in rows if not r["cap"] and _spills(r["kv_heads"], r["lengths"])),
            "spilling_uncapped_best_cap_geomean": geomean([
                r["best_cap_speedup"] for r in rows if not r["cap"] and _spills(r["kv_heads"], r["lengths"])])}}
        args.out.write_text(json.dumps(doc, indent=1))
        torch.cuda.empty_cache()
    print(json.dumps(doc["summary"]))


def _spills(kv_heads: int, lengths: list[int]) -> bool:
    """Whether FA3's own split counts make more work tiles than the GPU has SMs, at most two
    waves of them, where one split each would fit one wave (so a cap can: the batches a rule
    for the cap may take)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    found = fa3_splits(lengths, num_kv_heads=kv_heads, q_per_kv=8, q_len=1, head_dim=128,
                       table_keys=max(lengths), sms=sms)
    return found is not None and len(lengths) * found[2] <= sms < found[2] * int(found[1].sum()) <= 2 * sms


if __name__ == "__main__":
    main()
