"""Host cost of decode_attention's dispatch per call: the entry point with an explicit
config around a no-op Triton kernel (the only backend on a CPU), for the paths a server
takes: a FlashInfer winner that falls back to the default backend (no host lengths, or
CUDA-graph capture), at one kv length and at lengths growing through their buckets; a
Triton config with and without seq_lens_host (which only FlashInfer reads); and a by_fill
config (two Triton configs, chosen per call from the host lengths' sum), on a dense and a
sparse batch, from a CPU tensor (also one made under torch.inference_mode, which has no
version counter to keep its sum by), a NumPy array, a list, and without host lengths; a call
with no config (the lookup's memo hit, then the same dispatch); a Triton config writing
into out= (not run where decode_attention has no out); and FA3's wave_fit config (a no-op
FA3 kernel), its cap kept for a CPU tensor that comes again unchanged, and computed on every
call from a list: lengths that end the model early (one wave already), and lengths whose
tiles spill and get a cap (the whole model), at batch 3 with 8 kv heads and at batch 128
with one (the largest batches it computes for: two waves of tiles).

    python benchmarks/decode_attention_dispatch.py [--label NAME] [--out FILE]

Run it from two checkouts (PYTHONPATH naming the other) to compare them in one JSON.
"""

from __future__ import annotations

import numpy as np
import torch
from common.host_cost import arguments, ns_per_call, report

CALLS = 5_000
REPEATS = 9


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    import tuner.ops.decode_attention as da
    from tuner.integrations.decode_attention import decode_attention

    # the kernels out of the way (they write into out=, where given): tuner's own cost is left
    da.triton_paged_decode = lambda q, *a, out=None, **k: q if out is None else out
    da.fa3_op.kernel = lambda: (lambda q, *a, out=None, **k: q if out is None else out)
    wave = {"backend": "fa3", "num_splits": 0, "pack_gqa": None, "wave_fit": True}
    plain_fa3 = {"backend": "fa3", "num_splits": 0, "pack_gqa": None}
    spills = _spilling_batches()
    flashinfer = {"backend": "flashinfer", "use_tensor_cores": True, "flashinfer_backend": "fa2",
                  "fixed_split_size": None, "disable_split_kv": False}
    triton = {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 4, "num_warps": 4, "num_stages": 2}
    batch, heads, kv_heads, dim, page = 4, 8, 2, 64, 16
    q = torch.zeros(batch, 1, heads, dim, dtype=torch.float16)
    k = torch.zeros(64, page, kv_heads, dim, dtype=torch.float16)
    table = torch.zeros(batch, 16, dtype=torch.int32)
    lens = torch.full((batch,), 40, dtype=torch.int32)
    host_tensor, host_array = lens.clone(), np.full(batch, 40, dtype=np.int32)
    by_fill = da.by_fill(triton, dict(triton, num_kv_splits=8))
    sparse_tensor = torch.tensor([100, 1, 1, 1], dtype=torch.int32)  # sum 103 < 1/2 x 4 x 100
    with torch.inference_mode():
        inference_tensor = lens.clone()
    host_list = [40] * batch
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
        "by_fill_no_host_lengths": lambda: decode_attention(q, k, k, table, lens, 40, config=by_fill),
        "by_fill_dense_cpu_int32_tensor": lambda: decode_attention(
            q, k, k, table, lens, 40, config=by_fill, seq_lens_host=host_tensor),
        "by_fill_sparse_cpu_int32_tensor": lambda: decode_attention(
            q, k, k, table, lens, 100, config=by_fill, seq_lens_host=sparse_tensor),
        "by_fill_dense_numpy_int32": lambda: decode_attention(
            q, k, k, table, lens, 40, config=by_fill, seq_lens_host=host_array),
        "by_fill_dense_inference_tensor": lambda: decode_attention(
            q, k, k, table, lens, 40, config=by_fill, seq_lens_host=inference_tensor),
        "by_fill_dense_list": lambda: decode_attention(q, k, k, table, lens, 40, config=by_fill, seq_lens_host=host_list),
        # no config: the lookup's memo hit (the default here) before the same dispatch
        "looked_up_no_host_lengths": lambda: decode_attention(q, k, k, table, lens, 100),
        "triton_config_out": lambda: decode_attention(q, k, k, table, lens, 100, config=triton, out=out),
        "fa3_config_host_lengths_cpu_int32_tensor": lambda: decode_attention(
            q, k, k, table, lens, 40, config=plain_fa3, seq_lens_host=host_tensor),
        "wave_fit_cpu_int32_tensor_kept": lambda: decode_attention(
            q, k, k, table, lens, 40, config=wave, seq_lens_host=host_tensor),
        "wave_fit_list_computed_one_wave_already": lambda: decode_attention(
            q, k, k, table, lens, 40, config=wave, seq_lens_host=host_list),
        **{f"wave_fit_list_computed_capped_b{len(lengths)}_kv_heads_{call[1].shape[2]}": (
            lambda call=call, lengths=lengths: decode_attention(*call, config=wave, seq_lens_host=lengths))
           for call, lengths in spills},
    }
    out = torch.zeros_like(q)
    results = {}
    for name, fn in cases.items():
        try:
            fn()
        except TypeError as e:  # a checkout whose decode_attention has no such argument
            results[name] = {"not run": str(e)}
            continue
        results[name] = ns_per_call(fn, CALLS, REPEATS)
    report(args, "decode_attention_dispatch.py", {"calls": CALLS, "repeats": REPEATS, **results})

def _spilling_batches() -> list[tuple[tuple, list[int]]]:
    """(call arguments, lengths) whose FA3 tiles spill past one wave and get a cap: batch 3 with
    8 kv heads, and batch 128 with one (lengths drawn until one spills)."""
    import random

    from tuner.integrations.decode_attention import eager_config

    out = []
    for batch, kv_heads, draw in ((3, 8, lambda rng: [11049, 10500, 8200]),
                                  (128, 1, lambda rng: [rng.randint(3000, 4500) for _ in range(128)])):
        rng = random.Random(0)
        for _ in range(10_000):
            lengths = draw(rng)
            width = -(-max(lengths) // 16)
            call = (torch.zeros(batch, 1, 8 * kv_heads, 64, dtype=torch.float16),
                    torch.zeros(64, 16, kv_heads, 64, dtype=torch.float16),
                    torch.zeros(64, 16, kv_heads, 64, dtype=torch.float16),
                    torch.zeros(batch, width, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32), max(lengths))
            wave = {"backend": "fa3", "num_splits": 0, "pack_gqa": None, "wave_fit": True}
            if eager_config(wave, *call, seq_lens_host=lengths)["num_splits"]:
                out.append((call, lengths))
                break
    return out


if __name__ == "__main__":
    main()
