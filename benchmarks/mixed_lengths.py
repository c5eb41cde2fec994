"""The shipped tunings on batches they were not swept on: decode_attention through its public
entry point, per-sequence kv lengths drawn between half the maximum and the maximum, batch
sizes between the grid's, against FA3's default config, under CUDA graphs with a cold L2.

    python benchmarks/mixed_lengths.py --out $OUT/mixed_lengths.json

The sweeps time uniform batches at the grid's batch sizes and kv bucket tops; a serving
batch is neither. A call between grid keys borrows a neighbour's winner only under the
runtime's rule (tuner.settings.BORROW_MIN_GAIN); "served" says which way each was found. The tuned config is what tuner's lookup picks for the call (exact or
nearest run key, from tuning_cache/); both configs are checked against the torch reference.
FlashInfer winners need host-side lengths (seq_lens_host), which this passes, but a CUDA
graph cannot capture FlashInfer's planning: such cases are reported, not timed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from common.run_info import header

import tuner
from tuner.bench import CudaGraphTimer
from tuner.db import current_fingerprint
from tuner.integrations.decode_attention import decode_attention
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.workload.reference import paged_decode_reference
from tuner.keys import attention_run_key
from tuner.runtime import lookup
from tuner.settings import BORROW_MIN_GAIN
from tuner.sweep import kv_copies

SHIPPED = Path(__file__).resolve().parents[1] / "tuning_cache"
HEADS = {"Llama-3.1-8B tp1": (32, 8), "Llama-3.1-70B tp8": (8, 1), "Qwen2.5-7B tp1": (28, 4)}
# (set, batches, max kv lengths): "first" is the first run's cases (batches between the
# grid's, kv at its bucket tops); "grid" the sweeps' own batch sizes (exact run keys, only
# the lengths are mixed); "held-out" batches and lengths in neither, chosen after the
# borrowing rule was set from the first run
SETS = (
    ("first", (1, 8, 32, 128), (2048, 8192, 32768)),
    ("grid", (4, 16, 64), (2048, 32768)),
    ("held-out", (2, 12, 48, 96), (3000, 24000)),
)
MAX_TOKENS = 4 * 2**20


def case(label: str, q_heads: int, kv_heads: int, batch: int, kv: int, timer: CudaGraphTimer, seed: int) -> dict:
    shape = DecodeShape(batch=batch, kv_len=kv, num_q_heads=q_heads, num_kv_heads=kv_heads)
    inputs = make_decode_inputs(shape, device="cuda", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    lens_host = torch.randint(kv // 2, kv + 1, (batch,), generator=gen, dtype=torch.int32)
    lens_host[0] = kv  # the call's max_kv_len is a true maximum
    lens = lens_host.to("cuda")
    copies = [(inputs.k_cache, inputs.v_cache)] + [
        (inputs.k_cache.clone(), inputs.v_cache.clone()) for _ in range(kv_copies(inputs, "cuda") - 1)]
    args = lambda k, v: (inputs.q, k, v, inputs.page_table, lens, kv)  # noqa: E731

    decode_attention.tuner.memo.clear()
    decode_attention(*args(*copies[0]), seq_lens_host=lens_host)
    [tuned] = decode_attention.tuner.memo.values()
    run_key = attention_run_key(batch, 1, kv)
    served = lookup("decode_attention", decode_attention.tuner.static_json(
        next(iter(decode_attention.tuner.memo))[0]), run_key)[1]
    default = decode_attention.tuner.default(args(*copies[0]), {})
    row = {"model": label, "batch": batch, "kv_max": kv, "kv_mean": float(lens_host.float().mean()),
           "default": default, "tuned": tuned, "served": served}
    reference = paged_decode_reference(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, lens)
    for name, config in (("default", default), ("tuned", tuned)):
        out = decode_attention(*args(*copies[0]), seq_lens_host=lens_host, config=config)
        row[f"{name}_max_error"] = float((out.float() - reference.float()).abs().max())
        torch.testing.assert_close(out, reference, atol=1.6e-2, rtol=1.6e-2)
    if tuned["backend"] == "flashinfer":
        row["note"] = "FlashInfer winner: planning cannot be captured in a CUDA graph; not timed"
        return row
    if tuned == default:
        row["note"] = "the lookup kept the default"
    rotations = [[lambda k=k, v=v, c=c: decode_attention(*args(k, v), config=c) for k, v in copies]
                 for c in (default, tuned)]
    t_default, t_tuned = timer.paired(*rotations)
    row.update(default_us=t_default.median_us, tuned_us=t_tuned.median_us,
               default_spread_us=t_default.spread_us, tuned_spread_us=t_tuned.spread_us,
               speedup=t_default.median_us / t_tuned.median_us)
    return row


def write(out: Path, rows: list[dict], started: float) -> dict:
    """The JSON so far (written after every case, so a run cut short keeps what it measured)."""
    def summary(subset: list[dict]) -> dict:
        timed = [r["speedup"] for r in subset if "speedup" in r]
        return {
            "cases": len(subset), "timed": len(timed),
            "geomean_speedup": math.exp(sum(map(math.log, timed)) / len(timed)) if timed else None,
            "max": max(timed, default=None), "min": min(timed, default=None),
            "slower_than_default_by_2pct": sum(s < 1 / 1.02 for s in timed),
            "borrowed": sum(r.get("served") == "nearest" for r in subset),
        }

    doc = {
        **header("mixed_lengths", started),
        "borrow_min_gain": BORROW_MIN_GAIN,
        "summary": dict(summary(rows), sets={name: summary([r for r in rows if r.get("set") == name])
                                             for name, _, _ in SETS}),
        "rows": rows,
    }
    out.write_text(json.dumps(doc, indent=1))
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    from tuner.db.shipped import load_shipped

    layer = load_shipped(current_fingerprint(), SHIPPED)
    if not layer.applied:
        sys.exit("the shipped tunings do not apply here: " + "; ".join(
            why for f in layer.files for why in f.mismatches.values()))
    # no DB of our own: every tuned config comes from the shipped tunings
    tuner.configure(db=Path(tempfile.mkdtemp()) / "none.db", shipped=SHIPPED, mode="lookup")
    timer = CudaGraphTimer(warmup=3, repeats=30)
    rows, started = [], time.perf_counter()
    for set_name, batches, kv_maxes in SETS:
      for label, (hq, hk) in HEADS.items():
        for b in batches:
            for kv in kv_maxes:
                if b * kv > MAX_TOKENS:
                    continue
                try:
                    rows.append(dict(set=set_name, **case(label, hq, hk, b, kv, timer, seed=len(rows))))
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    rows.append({"set": set_name, "model": label, "batch": b, "kv_max": kv,
                                 "error": f"{type(e).__name__}: {e}"[:300]})
                torch.cuda.empty_cache()
                r = rows[-1]
                print(f"{set_name:8} {label:18} b{b:<4} kv<={kv:<6} " + (f"{r['default_us']:8.1f} -> {r['tuned_us']:8.1f} us "
                      f"{r['speedup']:.2f}x {r['tuned']['backend']}" if "speedup" in r else r.get("note", r.get("error", ""))),
                      flush=True)
                write(args.out, rows, started)
    print(json.dumps(write(args.out, rows, started)["summary"]))


if __name__ == "__main__":
    main()
