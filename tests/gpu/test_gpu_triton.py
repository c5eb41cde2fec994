"""On the H200: tuner's Triton decode kernel, compiled, over what a static key can name (issue
13: GQA groups 1-16, q_len 1-8 causal, windows, softcap, sinks, head dims 64-256, page sizes
1 and 16, bf16 and fp16), on batches of mixed lengths, in both split modes. The CPU suite
interprets small float32 problems; this checks the compiled kernels at serving sizes."""

import pytest
import torch

from tuner.ops import get_op

from tuner.workload import DecodeShape, make_decode_inputs

pytestmark = pytest.mark.gpu

SHAPES = [
    DecodeShape(batch=5, kv_len=3000, num_q_heads=8, num_kv_heads=8),  # group 1
    DecodeShape(batch=5, kv_len=3000, num_q_heads=28, num_kv_heads=4, dtype="float16"),  # group 7
    DecodeShape(batch=5, kv_len=3000, num_q_heads=64, num_kv_heads=4, q_len=2),  # group 16: 2 row blocks
    DecodeShape(batch=5, kv_len=3000, num_q_heads=32, num_kv_heads=8, q_len=8),
    DecodeShape(batch=5, kv_len=3000, num_q_heads=16, num_kv_heads=8, head_dim=256, softcap=50.0,
                window=(1023, -1)),
    DecodeShape(batch=5, kv_len=3000, num_q_heads=64, num_kv_heads=8, head_dim=64, sinks=True, window=(127, -1),
                q_len=3),
    DecodeShape(batch=5, kv_len=3000, page_size=16, dtype="float16", sinks=True),
    DecodeShape(batch=5, kv_len=3000, num_q_heads=32, num_kv_heads=4, window=(500, 0), q_len=4, page_size=16),
]
LENGTHS = [3000, 8, 1777, 260, 2049]  # one long, one as short as q_len allows, and between


def configs_to_check(shape):
    """The default, the even split's most splits, splits by length of 64 and 256 tokens
    (so that even a 127-key window is split), and by load at 1 and 8 items per SM."""
    op = get_op("triton_decode")
    even = (c for c in op.configs(shape) if not c.get("tokens_per_split") and not c.get("items_per_sm"))
    most = max(even, key=lambda c: c["num_kv_splits"])
    by_length = [{**most, "num_kv_splits": 128, "tokens_per_split": t} for t in (64, 256)]
    by_load = [{**most, "num_kv_splits": 128, "items_per_sm": i} for i in (1, 8)]
    return [op.default(shape), most, *by_length, *by_load]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label())
def test_triton_decode_on_mixed_lengths_in_both_split_modes(shape):
    op = get_op("triton_decode")
    inputs = make_decode_inputs(shape, device="cuda", seq_lens=LENGTHS)
    ref = inputs.reference()
    atol, rtol = op.tolerance[shape.dtype]
    for config in configs_to_check(shape):
        out = op.run(inputs, config)
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=lambda m: f"{config}: {m}")
