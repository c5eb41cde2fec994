"""Host cost of the FA3 drop-in per call: tuner.integrations.fa3.flash_attn_with_kvcache around a
no-op kernel, called as SGLang's decode backend calls FA3, against the no-op called
directly. The winner is in the DB, so every measured call is a memo hit.

    python benchmarks/dropin_overhead.py [--label NAME] [--out FILE]

Run it from two checkouts (PYTHONPATH naming the other) to compare them in one JSON.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from common.host_cost import arguments, ns_per_call, report

CALLS = 20_000
REPEATS = 15


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    import tuner
    from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
    from tuner.keys import attention_run_key
    from tuner.integrations.fa3 import flash_attn_with_kvcache
    from tuner.ops import fa3

    def noop(q, k_cache, v_cache, **kwargs):
        return q

    fa3.kernel = lambda: noop  # the kernel out of the way: what is left is tuner's own cost
    batch, heads, kv_heads, dim, width = 32, 32, 8, 128, 4096
    q = torch.zeros(batch, heads, dim, dtype=torch.bfloat16)
    k = torch.zeros(batch * width, 1, kv_heads, dim, dtype=torch.bfloat16)
    table = torch.zeros(batch, width, dtype=torch.int32)
    lens = torch.zeros(batch, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    out = torch.empty_like(q)
    key = tuner.keys.static_key_from_parts(
        q_dtype="bfloat16", k_dtype="bfloat16", v_dtype="bfloat16", num_q_heads=heads, num_kv_heads=kv_heads,
        head_dim_qk=dim, head_dim_v=dim, page_size=1, causal=True, window_size=None, softcap=None, sinks=False,
        k_descale=False, v_descale=False)
    with tempfile.TemporaryDirectory() as tmp:
        db_path = Path(tmp) / "t.db"
        db = TuningDB(db_path)
        db.save_record(Problem("fa3", key.to_json(), attention_run_key(batch, 1, width)),
                       (current_fingerprint_id(), current_fingerprint()), {"num_splits": 4, "pack_gqa": True},
                       median_us=1.0, spread_us=0.0, samples=1, default_config={"num_splits": 0, "pack_gqa": None},
                       default_median_us=2.0, default_spread_us=0.0, method={})
        db.close()
        tuner.configure(db=db_path, mode="lookup")
        kwargs = dict(page_table=table, cache_seqlens=lens, cu_seqlens_q=cu, max_seqlen_q=1, softmax_scale=0.1,
                      causal=True, window_size=(-1, -1), softcap=0.0, return_softmax_lse=False, num_splits=0,
                      out=out, ver=3, scheduler_metadata=None)
        dropin = lambda: flash_attn_with_kvcache(q, k, k, **kwargs)  # noqa: E731
        bare = lambda: noop(q, k, k, **kwargs)  # noqa: E731
        dropin()
        results = {}
        for name, fn in (("bare", bare), ("dropin", dropin)):
            results[name] = ns_per_call(fn, CALLS, REPEATS)
    report(args, "dropin_overhead.py", {"calls": CALLS, "repeats": REPEATS, **results,
                                        "overhead_ns": results["dropin"]["median_ns"] - results["bare"]["median_ns"]})

if __name__ == "__main__":
    main()
