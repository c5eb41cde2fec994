"""On the H200: every backend decode_attention routes to reads a KV pool past 2^31 elements
right, its pages at the top (issue 36 asked whether 32-bit offsets caused an illegal memory
access there; FA3 read such a pool right on 2026-12-05). Each config runs in its own process,
so a fault fails its case, not the run. Needs about 9 GB of GPU memory."""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

PROBE = r"""
import json, sys, torch
from tuner.integrations.decode_attention import decode_attention
from tuner.workload import paged_decode_reference
config = json.loads(sys.argv[1])
heads, kv_heads, dim, batch, n = 48, 8, 128, 4, 4096
pages = 2**31 // (kv_heads * dim) + batch * n + 64  # one-token pages, just past 2^31 elements
k = torch.empty(pages, 1, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
v = torch.empty_like(k)
first = pages - batch * n  # every page read lies past 2^31 elements
gen = torch.Generator(device="cuda").manual_seed(0)
k[first:].normal_(generator=gen)
v[first:].normal_(generator=gen)
table = torch.arange(first, pages, device="cuda", dtype=torch.int32).view(batch, n)
q = torch.randn(batch, 1, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
out = decode_attention(q, k, v, table, lens, n, config=config)
ref = paged_decode_reference(q, k, v, table, lens)
print(json.dumps(dict(pool_elements=k.numel(), max_error=float((out.float() - ref.float()).abs().max()))))
"""

CONFIGS = {
    "fa3_default": {"backend": "fa3", "num_splits": 0, "pack_gqa": None},
    "fa3_splits": {"backend": "fa3", "num_splits": 8, "pack_gqa": True},
    "triton_even": {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 8, "num_warps": 4, "num_stages": 2},
    "triton_by_length": {"backend": "triton_decode", "block_n": 128, "num_kv_splits": 128, "num_warps": 4,
                         "num_stages": 3, "tokens_per_split": 512},
    "triton_by_load": {"backend": "triton_decode", "block_n": 128, "num_kv_splits": 128, "num_warps": 4,
                       "num_stages": 3, "items_per_sm": 4},
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CONFIGS)
def test_a_pool_past_2_31_elements_is_read_right(name):
    if name.startswith("fa3"):
        from tuner.ops import fa3

        if fa3.unavailable():
            pytest.skip(fa3.unavailable())
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(CONFIGS[name])], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["pool_elements"] > 2**31 and result["max_error"] < 2e-2, result
