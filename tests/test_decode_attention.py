"""decode_attention on any machine: the backend choice is part of the config, swept, stored
and dispatched. On a CPU only the Triton backend (interpreted) is installed."""

import torch

import tuner
from tuner.bench import WallClockTimer
from tuner.db import TuningDB
from tuner.ops import DecodeShape, get_op, make_decode_inputs
from tuner.ops.decode_attention import BACKENDS, decode_attention
from tuner.sweep import TUNED, sweep

SHAPE = DecodeShape(batch=2, kv_len=64, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, dtype="float32")


def test_configs_span_every_installed_backend():
    op = get_op("decode_attention")
    configs = op.configs(SHAPE)
    installed = {name for name, backend in BACKENDS.items() if backend.unavailable() is None}
    assert {c["backend"] for c in configs} == installed
    assert op.default(SHAPE)["backend"] == next(iter(installed))
    for c in configs:
        backend = BACKENDS[c["backend"]]
        assert {k: v for k, v in c.items() if k != "backend"} in backend.configs(SHAPE)


def test_sweep_then_the_entry_point_runs_the_stored_backend_and_config(db_path):
    op = get_op("decode_attention")
    [result] = sweep(op, [SHAPE], TuningDB(db_path), timer=WallClockTimer(warmup=0, repeats=2, min_repeats=2))
    assert result.status == TUNED and result.failures == 0
    tuner.configure(db=db_path, mode="lookup")
    inputs = make_decode_inputs(SHAPE, device=op.device())
    out = decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                           SHAPE.kv_len, causal=True)
    assert list(decode_attention.tuner.memo.values()) == [result.winner]
    torch.testing.assert_close(out, inputs.reference(), atol=1e-4, rtol=1e-4)
