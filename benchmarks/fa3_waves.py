"""The wave_fit FA3 config on batches no sweep or serving.py case drew: FA3's default against
its cap from tuner.ops.fa3_waves, side by side, per batch (CUDA graphs, cold L2 by the bytes
a call reads), and FA3 at every other cap, to see whether the model's cap is the best one.

    python benchmarks/fa3_waves.py --out $OUT/fa3_waves.json [--batches 1000] [--seconds 300]

Batches: kv heads 1, 2, 4 and 8 (q heads 8 per kv head, head dim 128, bf16, page size 1),
batch sizes up to two waves of tiles, lengths of the serving distributions at random caps
(tuner.workload.traffic), seeded; only batches whose cap is not 0 (the config runs FA3's own
choice elsewhere) are timed, and one in twenty of the others as a check that they are alike.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from common.run_info import header
from common.stats import geomean

from tuner.bench import CudaGraphTimer
from tuner.bench.trial import cold_l2_copies
from tuner.integrations.decode_attention import decode_attention, eager_config
from tuner.ops.fa3_waves import WAVE_FIT
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
                best_cap_speedup=us[0] / min(us[2:] + [us[1]]), max_error=error)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", type=int, default=1000,
                    help="batches drawn (those with a cap, and one in twenty of the rest, are timed)")
    ap.add_argument("--seconds", type=float, default=300.0, help="stop starting batches after this long")
    ap.add_argument("--seed", type=int, default=20261205)
    args = ap.parse_args()
    started, rng = time.perf_counter(), random.Random(args.seed)
    timer = CudaGraphTimer(warmup=2, repeats=15)
    rows = []
    for i in range(args.batches):
        if time.perf_counter() - started > args.seconds:
            break
        kv_heads, lengths, name = draw(rng)
        lengths_only = eager_config(WAVE, *_probe(kv_heads, lengths), seq_lens_host=lengths)
        if lengths_only["num_splits"] == 0 and i % 20:
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
            "uncapped_worst": min((r["fit_speedup"] for r in rows if not r["cap"]), default=None)}}
        args.out.write_text(json.dumps(doc, indent=1))
        torch.cuda.empty_cache()
    print(json.dumps(doc["summary"]))


def _probe(kv_heads: int, lengths: list[int]) -> tuple:
    """Call arguments with the batch's shapes and no device memory to speak of: the cap
    depends only on them and the host lengths (the page table as wide as the longest)."""
    q = torch.empty(len(lengths), 1, 8 * kv_heads, 128, dtype=torch.bfloat16, device="meta")
    cache = torch.empty(1, 1, kv_heads, 128, dtype=torch.bfloat16, device="meta")
    table = torch.empty(len(lengths), max(lengths), dtype=torch.int32, device="meta")
    return q, cache, cache, table, None, max(lengths)


if __name__ == "__main__":
    main()
