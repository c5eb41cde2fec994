"""Host time FlashInfer decode planning costs per decode step: its plan() with the server's
device tensors, plan() given host metadata, flashinfer.decode.fast_decode_plan, and
tuner's wrapper (host lengths, plan reused while valid).

    python benchmarks/flashinfer_plan_cost.py --out $OUT/flashinfer_plan_cost.json

A trace is `steps` decode steps in which every sequence grows by one token; lengths start
at 4096 (uniform) or 4096 + a spread of 0..4095 (staggered). Between steps the "server"
writes new device indptr/indices/last_page_len (untimed); the timed region is the plan
call only, with the GPU idle before it (a lower bound for plans that synchronise), and
each step also runs the kernel so the plans are the real thing. Same config in all four.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from tuner.db import current_fingerprint
from tuner.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from tuner.ops.flashinfer_wrappers import library
from tuner.ops.flashinfer_plan import paged_metadata

HEADS, KV_HEADS, DIM = 32, 8, 128
CONFIGS = {
    "cuda_cores": {"use_tensor_cores": False, "flashinfer_backend": "auto", "fixed_split_size": None, "disable_split_kv": False},
    "tensor_cores": {"use_tensor_cores": True, "flashinfer_backend": "fa2", "fixed_split_size": None, "disable_split_kv": False},
}


def trace(batch: int, spread: bool, steps: int, page_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lens0 = np.full(batch, 4096, dtype=np.int64) + (rng.integers(0, 4096, batch) if spread else 0)
    max_pages = -(-(int(lens0.max()) + steps) // page_size)
    table = torch.randperm(batch * max_pages, device="cuda").view(batch, max_pages).int()
    for step in range(steps):
        lens = lens0 + step
        indptr, last = paged_metadata(lens, page_size)
        pages = np.diff(indptr)
        width = int(pages.max())
        mask = torch.arange(width, device="cuda")[None, :] < torch.from_numpy(pages).cuda()[:, None]
        indices = table[:, :width][mask]
        yield lens, torch.from_numpy(indptr), torch.from_numpy(last), indptr, last, indices


def time_plans(method: str, config: dict, batch: int, spread: bool, steps: int, page_size: int) -> dict:
    fi = library()
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    k = torch.randn(batch * (-(-(8192 + steps) // page_size)), page_size, KV_HEADS, DIM, device="cuda",
                    dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    tc = config["use_tensor_cores"]
    split_args = {"fixed_split_size": None, "disable_split_kv": False} if tc else {}
    if method == "tuner":
        wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, config=config)
    else:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tc, backend=config["flashinfer_backend"])
    fast_plan = fi.decode.fast_decode_plan
    times = []
    for step, (lens, indptr_h, last_h, indptr_np, last_np, indices) in enumerate(trace(batch, spread, steps, page_size)):
        indptr_d, last_d = indptr_h.cuda(), last_h.cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if method == "plan":
            wrapper.plan(indptr_d, indices, last_d, HEADS, KV_HEADS, DIM, page_size, q_data_type=torch.bfloat16,
                         **split_args)
        elif method == "plan_host_metadata":
            wrapper.plan(indptr_h, indices, last_h, HEADS, KV_HEADS, DIM, page_size, q_data_type=torch.bfloat16,
                         seq_lens=torch.from_numpy(lens.astype(np.int32)), **split_args)
        elif method == "fast_decode_plan":
            if step == 0:  # fast_decode_plan needs a first plan() to have built the module
                wrapper.plan(indptr_h, indices, last_h, HEADS, KV_HEADS, DIM, page_size,
                             q_data_type=torch.bfloat16, **split_args)
            else:
                fast_plan(wrapper, indptr_d, indices, last_d, HEADS, KV_HEADS, DIM, page_size,
                          q_data_type=torch.bfloat16, global_override_indptr_cpu=indptr_h, **split_args)
        else:
            wrapper.plan(indptr_d, indices, last_d, HEADS, KV_HEADS, DIM, page_size, q_data_type=torch.bfloat16,
                         seq_lens=lens)
        times.append((time.perf_counter() - t0) * 1e6)
        wrapper.run(q, (k, v))
    steady = times[1:]  # step 0 builds the module and first plan everywhere
    row = {"method": method, "median_us": statistics.median(steady), "mean_us": statistics.fmean(steady),
           "p90_us": float(np.percentile(steady, 90)), "first_step_us": times[0]}
    if method == "tuner":
        row["plans"], row["plans_reused"] = wrapper.plans, wrapper.plans_reused
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    rows = []
    for page_size in (1, 16):
        for config_name, config in CONFIGS.items():
            for spread in (False, True):
                for batch in (1, 8, 64, 256):
                    for method in ("plan", "plan_host_metadata", "fast_decode_plan", "tuner"):
                        row = dict(page_size=page_size, config=config_name, lengths="staggered" if spread else "uniform",
                                   batch=batch, **time_plans(method, config, batch, spread, args.steps, page_size))
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    result = {
        "benchmark": "flashinfer_plan_cost",
        "command": "python benchmarks/flashinfer_plan_cost.py " + " ".join(sys.argv[1:]),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": current_fingerprint(),
        "steps": args.steps,
        "target_us_per_step_while_valid": 10.0,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
