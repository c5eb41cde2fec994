"""Host cost of decode_attention's dispatch per call: the entry point with an explicit
config around a no-op Triton kernel (the only backend on a CPU), for the paths a server
takes: a FlashInfer winner that falls back to the default backend (no host lengths, or
CUDA-graph capture), at one kv length and at lengths growing through their buckets; and a
Triton config with and without seq_lens_host (which only FlashInfer reads).

    python benchmarks/decode_attention_dispatch.py [--label NAME] [--out FILE]

Run it from two checkouts (PYTHONPATH naming the other) to compare them in one JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import timeit
from pathlib import Path

import numpy as np
import torch

CALLS = 5_000
REPEATS = 9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--out")
    args = parser.parse_args()
    import tuner
    import tuner.ops.decode_attention as da
    from tuner.ops.decode_attention import decode_attention

    da.triton_paged_decode = lambda q, *a, **k: q  # the kernel out of the way: tuner's own cost is left
    flashinfer = {"backend": "flashinfer", "use_tensor_cores": True, "flashinfer_backend": "fa2",
                  "fixed_split_size": None, "disable_split_kv": False}
    triton = {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 4, "num_warps": 4, "num_stages": 2}
    batch, heads, kv_heads, dim, page = 4, 8, 2, 64, 16
    q = torch.zeros(batch, 1, heads, dim, dtype=torch.float16)
    k = torch.zeros(64, page, kv_heads, dim, dtype=torch.float16)
    table = torch.zeros(batch, 16, dtype=torch.int32)
    lens = torch.full((batch,), 40, dtype=torch.int32)
    host_tensor, host_array = lens.clone(), np.full(batch, 40, dtype=np.int32)
    step = iter(range(10**9))
    cases = {
        "flashinfer_config_fallback_fixed_kv": lambda: decode_attention(q, k, k, table, lens, 100, config=flashinfer),
        "flashinfer_config_fallback_growing_kv": lambda: decode_attention(
            q, k, k, table, lens, 100 + next(step) % 150, config=flashinfer),
        "triton_config_no_host_lengths": lambda: decode_attention(q, k, k, table, lens, 100, config=triton),
        "triton_config_host_lengths_cpu_int32_tensor": lambda: decode_attention(
            q, k, k, table, lens, 100, config=triton, seq_lens_host=host_tensor),
        "triton_config_host_lengths_numpy_int32": lambda: decode_attention(
            q, k, k, table, lens, 100, config=triton, seq_lens_host=host_array),
    }
    results = {}
    for name, fn in cases.items():
        fn()
        runs = [timeit.timeit(fn, number=CALLS) / CALLS * 1e9 for _ in range(REPEATS)]
        results[name] = {"median_ns": statistics.median(runs), "min_ns": min(runs)}
    result = {"label": args.label, "tuner": tuner.__file__, "calls": CALLS, "repeats": REPEATS, **results,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "python": sys.version.split()[0], "torch": torch.__version__,
              "command": "python benchmarks/decode_attention_dispatch.py " + " ".join(sys.argv[1:])}
    print(json.dumps(result, indent=1))
    if args.out:
        path = Path(args.out)
        previous = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(previous + [result], indent=1) + "\n")


if __name__ == "__main__":
    main()
