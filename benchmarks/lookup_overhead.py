"""Hot-path cost of @tuner.autotune: decorated vs bare call, median ns per call.

    python benchmarks/lookup_overhead.py --out $OUT/lookup_overhead.json

FA3-style keys (q dtype, q heads, kv heads, head dim; batch, q len, kv len) on a no-op
kernel whose winner is in the DB, so every measured call is a memo hit; the winner is one
a CUDA-graph capture must not freeze, so on a GPU machine each hit checks whether a capture
is counted (tuner.runtime.capture_watch; none is here), except for
autotune_combined_key_frozen_safe, whose winner wins at every kv bucket. Also the
hand-written key tuple + dict lookup (the same keys, inline): the floor any lookup pays.
The project aims at under 1 us per lookup (figures: benchmarks/RESULTS.md, "Host cost").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import timeit
from datetime import datetime, timezone
from pathlib import Path

import torch

import tuner
from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
from tuner.keys import attention_run_key, canonical_json

CALLS = 50_000
REPEATS = 21


def kernel(q, k_cache, v_cache, cache_seqlens, max_kv_len, *, config):
    return None


def star_kernel(*args, config):
    return None


# key functions as the README advises: attribute reads only, each tensor's shape read once
def static_key(q, k_cache, v_cache, cache_seqlens, max_kv_len):
    q_shape = q.shape
    return (q.dtype, q_shape[2], k_cache.shape[2], q_shape[3])


def run_key(q, k_cache, v_cache, cache_seqlens, max_kv_len):
    q_shape = q.shape
    return (q_shape[0], q_shape[1], max_kv_len)


def combined_key(q, k_cache, v_cache, cache_seqlens, max_kv_len):
    q_shape = q.shape
    return (q.dtype, q_shape[2], k_cache.shape[2], q_shape[3]), q_shape[0], q_shape[1], max_kv_len


def hand_written(table):
    """The floor: one function that builds the same keys inline and looks them up."""

    def call(q, k_cache, v_cache, cache_seqlens, max_kv_len):
        q_shape = q.shape
        config = table[(q.dtype, q_shape[2], k_cache.shape[2], q_shape[3])][(q_shape[0], q_shape[1], max_kv_len)]
        return kernel(q, k_cache, v_cache, cache_seqlens, max_kv_len, config=config)

    return call


def per_call_ns(stmts: dict[str, str], globals_: dict) -> dict[str, list[float]]:
    """Round-robin over the statements, so drift in the machine's speed hits all alike."""
    timers = {name: timeit.Timer(stmt, globals=globals_) for name, stmt in stmts.items()}
    samples: dict[str, list[float]] = {name: [] for name in stmts}
    for _ in range(REPEATS):
        for name, timer in timers.items():
            samples[name].append(timer.timeit(number=CALLS) / CALLS * 1e9)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = parser.parse_args()

    q = torch.empty(64, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.empty(1024, 1, 8, 128, dtype=torch.bfloat16)
    seqlens = torch.full((64,), 2048, dtype=torch.int32)
    with tempfile.TemporaryDirectory() as tmp:
        db_path = Path(tmp) / "bench.db"
        db = TuningDB(db_path)
        # "bench": a winner at kv 2k only, which a capture must not freeze (the frozen rule
        # picks the default), so its memo hit checks for a capture; "bench_frozen": the
        # same winner at 1k and 2k, frozen as it is, so its hit checks nothing
        for op, kvs in (("bench", (2048,)), ("bench_frozen", (1024, 2048))):
            for kv in kvs:
                db.save_record(
                    Problem(op, canonical_json(static_key(q, k, k, seqlens, 2048)), attention_run_key(64, 1, kv)),
                    (current_fingerprint_id(), current_fingerprint()), {"num_splits": 4},
                    median_us=1.0, spread_us=0.0, samples=1, default_config={"num_splits": 0},
                    default_median_us=1.0, default_spread_us=0.0, method={"timer": "none"},
                )
        db.close()
        tuner.configure(db=db_path, mode="lookup")
        configs = [{"num_splits": n} for n in (0, 1, 2, 4, 8)]
        common = dict(configs=configs, default={"num_splits": 0})
        variants = {
            "autotune_static_and_run_key": tuner.autotune("bench", static_key=static_key, run_key=run_key, **common)(kernel),
            "autotune_combined_key": tuner.autotune("bench", key=combined_key, **common)(kernel),
            # a kernel taking *args: the generic wrapper packs and unpacks them
            "autotune_star_args_kernel": tuner.autotune("bench", key=combined_key, **common)(star_kernel),
            "autotune_combined_key_frozen_safe": tuner.autotune("bench_frozen", key=combined_key, **common)(kernel),
        }
        for name, fn in variants.items():
            fn(q, k, k, seqlens, 2048)
            memo = fn.tuner.memo
            assert list(memo.values()) == [{"num_splits": 4}], f"{name}: the DB winner must be in the memo"

        table = {static_key(q, k, k, seqlens, 2048): {(64, 1, 2048): {"num_splits": 4}}}
        env = dict(q=q, k=k, seqlens=seqlens, kernel=kernel, hand=hand_written(table), cfg={"num_splits": 4},
                   **variants)
        stmts = {
            "bare_call": "kernel(q, k, k, seqlens, 2048, config=cfg)",
            "hand_written_key_and_dict_lookup": "hand(q, k, k, seqlens, 2048)",
            **{name: f"{name}(q, k, k, seqlens, 2048)" for name in variants},
        }
        samples = per_call_ns(stmts, env)

    med = statistics.median
    bare = med(samples["bare_call"])
    result = {
        "benchmark": "lookup_overhead",
        "command": "python " + " ".join(sys.argv),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": current_fingerprint()["device"], "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "calls_per_repeat": CALLS,
        "repeats": REPEATS,
        "median_ns_per_call": {name: med(v) for name, v in samples.items()},
        "overhead_ns_over_bare_call": {name: med(v) - bare for name, v in samples.items() if name != "bare_call"},
        "samples_ns": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, ns in result["overhead_ns_over_bare_call"].items():
        print(f"{name:36s} overhead {ns:8.1f} ns/call")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
