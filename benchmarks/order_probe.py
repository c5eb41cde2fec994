"""Does the order of a batch's sequences change how FA3's one-split kernel compares with FA3's
default? On 40/8 a batch-64 x kv-4k record of FA3 with one split ran 0.906x-0.968x of the
default on serving.py's few-long batch, which holds long sequences near the end of the batch,
while its sweep's trials passed. FA3's varlen scheduler hands out tiles in batch order, so a
long sequence's unsplit tile taken last may finish last.

    python benchmarks/order_probe.py --out $OUT/order_probe.json [--heads 40/8] [--seconds 120]

Per (batch, cap, seed): the same lengths as drawn, longest first, longest last and in two more
shuffles, each config against FA3's default side by side in one interleaved CUDA-graph timing
(cold L2 by bytes read).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from common.heads import parse_spec
from common.run_info import header

from tuner.bench import CudaGraphTimer
from tuner.bench.trial import cold_l2_copies
from tuner.integrations.decode_attention import decode_attention
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.workload.rotation import bytes_read, fresh_page_copies
from tuner.workload.traffic import draw_lengths

DEFAULT = {"backend": "fa3", "num_splits": 0, "pack_gqa": None}
CONFIGS = [{"backend": "fa3", "num_splits": 1, "pack_gqa": None},
           {"backend": "fa3", "num_splits": 2, "pack_gqa": None}]
CASES = [(64, 4096, 55), (64, 4096, 0), (64, 4096, 1000003), (32, 4096, 55), (128, 4096, 55), (64, 16384, 55)]


def orders(lengths: list[int], seed: int) -> dict[str, list[int]]:
    """The same lengths in several orders."""
    shuffled = {f"shuffle{i}": random.Random(f"order/{seed}/{i}").sample(lengths, len(lengths)) for i in range(2)}
    return {"as_drawn": lengths, "long_first": sorted(lengths, reverse=True),
            "long_last": sorted(lengths), **shuffled}


def _calls(heads: dict, lengths: list[int], seed: int) -> list[tuple]:
    shape = DecodeShape(batch=len(lengths), kv_len=max(lengths), dtype="bfloat16", **heads)
    inputs = make_decode_inputs(shape, device="cuda", seed=seed, seq_lens=lengths)
    copies = fresh_page_copies(inputs, cold_l2_copies(bytes_read(inputs), "cuda"))
    s = shape
    return [(c.q, c.k_cache, c.v_cache, c.page_table, c.cache_seqlens, s.kv_len, s.causal, s.window,
             s.softcap or 0.0, c.sinks) for c in copies]


def run_order(heads: dict, lengths: list[int], timer: CudaGraphTimer, seed: int) -> dict:
    host = torch.tensor(lengths, dtype=torch.int32)
    calls = _calls(heads, lengths, seed)
    rotations = [[lambda a=a, c=c: decode_attention(*a, config=c, seq_lens_host=host) for a in calls]
                 for c in [DEFAULT, *CONFIGS]]
    us = [t.median_us for t in timer.interleaved(rotations)]
    del calls, rotations
    torch.cuda.empty_cache()
    return {"default_us": us[0], **{json.dumps(c, sort_keys=True): {"us": u, "speedup": us[0] / u}
                                    for c, u in zip(CONFIGS, us[1:])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--heads", default="40/8")
    ap.add_argument("--seconds", type=float, default=120.0)
    args = ap.parse_args()
    heads = parse_spec(args.heads)
    timer = CudaGraphTimer(warmup=2, repeats=15)
    started, rows = time.perf_counter(), []
    for batch, cap, seed in CASES:
        lengths = draw_lengths("few_long", batch, cap, seed)
        for name, ordered in orders(lengths, seed).items():
            if time.perf_counter() - started > args.seconds:
                break
            row = dict(heads=args.heads, batch=batch, cap=cap, seed=seed, order=name, lengths=ordered,
                       **run_order(heads, ordered, timer, seed))
            rows.append(row)
            print(f"b{batch} cap {cap} seed {seed} {name}: " + ", ".join(
                f"{k} {v['speedup']:.3f}" for k, v in row.items() if isinstance(v, dict)), flush=True)
            args.out.write_text(json.dumps({**header("order_probe", started), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
