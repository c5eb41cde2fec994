"""What the torch reference costs per call (every candidate of a sweep is checked against
it, once per shape): paged_decode_reference on a windowed batch of long sequences, on
an unwindowed one and on a serving batch of mixed lengths, median and minimum ms over
repeated runs, on this machine's device.

    python benchmarks/reference_cost.py [--label L] [--out benchmarks/results/issue12/reference_cost_cpu.json]

Run it from two checkouts (PYTHONPATH naming the other) to compare them in one JSON.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_cost import arguments, report  # noqa: E402

from tuner.workload import DecodeShape, make_decode_inputs  # noqa: E402
from tuner.workload.traffic import draw_lengths  # noqa: E402

REPEATS = 5
CASES = {  # hd64 heads with a 127-key window (issue 12's), and the same without a window
    "window 127, 8 x 8k": DecodeShape(batch=8, kv_len=8192, num_q_heads=64, num_kv_heads=8, head_dim=64,
                                      window=(127, 0), sinks=True, dtype="float32"),
    "no window, 8 x 2k": DecodeShape(batch=8, kv_len=2048, num_q_heads=64, num_kv_heads=8, head_dim=64,
                                     dtype="float32"),
    # a serving batch: many sequences, each its own length (long-tailed, median 256)
    "no window, 128 x up to 2k, long_tail": DecodeShape(batch=128, kv_len=2048, num_q_heads=32, num_kv_heads=8,
                                                        head_dim=128, dtype="float32"),
}
SEQ_LENS = {"no window, 128 x up to 2k, long_tail": draw_lengths("long_tail", 128, 2048, seed=0)}


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {}
    for name, shape in CASES.items():
        inputs = make_decode_inputs(shape, device=device, seq_lens=SEQ_LENS.get(name))
        inputs.reference()  # warm-up
        runs = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            inputs.reference()
            if device == "cuda":
                torch.cuda.synchronize()
            runs.append((time.perf_counter() - start) * 1e3)
        results[name] = {"median_ms": statistics.median(runs), "min_ms": min(runs)}
    report(args, "reference_cost.py", {"device": device, "repeats": REPEATS, "cases": results})


if __name__ == "__main__":
    main()
