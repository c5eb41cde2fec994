"""The FA3 drop-in's host side, on any machine: keys, DB lookup, explicit arguments.

sgl-kernel's kernel is replaced by a recorder here; tests/test_gpu.py runs the real one.
"""

import pytest
import torch

import tuner
from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
from tuner.keys import attention_run_key
from tuner.ops import DecodeShape, get_op, make_decode_inputs
from tuner.ops import fa3


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []

    def fake_kernel(q, k_cache, v_cache, **kwargs):
        calls.append(kwargs)
        return q

    monkeypatch.setattr(fa3, "_kernel", lambda: fake_kernel)
    return calls


def store(db_path, inputs, config):
    db = TuningDB(db_path)
    db.save_record(Problem("fa3", inputs.static_key().to_json(), inputs.run_key()),
                   (current_fingerprint_id(), current_fingerprint()), config, median_us=1.0, spread_us=0.0,
                   samples=3, default_config=fa3.DEFAULT, default_median_us=2.0, default_spread_us=0.0,
                   method={"timer": "test"})
    db.close()


def call(inputs, **kwargs):
    s = inputs.shape
    kwargs.setdefault("window_size", s.window)
    return fa3.flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, cache_seqlens=inputs.cache_seqlens,
                                       page_table=inputs.page_table, causal=s.causal, **kwargs)


def test_the_drop_in_runs_the_swept_winner(db_path, kernel_calls):
    inputs = make_decode_inputs(DecodeShape(batch=4, kv_len=2048, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                            dtype="float32"))
    store(db_path, inputs, {"num_splits": 12, "pack_gqa": True})
    tuner.configure(db=db_path, mode="lookup")
    call(inputs)
    call(inputs, window_size=[-1, -1])  # a list, as callers pass it: same key
    assert [(c["num_splits"], c["pack_gqa"]) for c in kernel_calls] == [(12, True), (12, True)]


def test_explicit_arguments_win(db_path, kernel_calls):
    inputs = make_decode_inputs(DecodeShape(batch=4, kv_len=512, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                            dtype="float32"))
    store(db_path, inputs, {"num_splits": 12, "pack_gqa": True})
    tuner.configure(db=db_path, mode="lookup")
    call(inputs, num_splits=3)
    call(inputs, pack_gqa=False)
    call(inputs, num_splits=0, pack_gqa=None)
    assert [(c["num_splits"], c["pack_gqa"]) for c in kernel_calls] == [(3, None), (0, False), (0, None)]


def test_without_a_winner_fa3_keeps_its_own_default(db_path, kernel_calls):
    inputs = make_decode_inputs(DecodeShape(batch=2, kv_len=64, num_q_heads=4, num_kv_heads=4, head_dim=16,
                                            dtype="float32"))
    tuner.configure(db=db_path, mode="lookup")
    call(inputs)
    assert (kernel_calls[0]["num_splits"], kernel_calls[0]["pack_gqa"]) == (0, None)


def test_features_no_sweep_measures_do_not_take_a_swept_winner(db_path, kernel_calls):
    inputs = make_decode_inputs(DecodeShape(batch=4, kv_len=512, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                            dtype="float32"))
    store(db_path, inputs, {"num_splits": 12, "pack_gqa": True})
    tuner.configure(db=db_path, mode="lookup")
    k_new = torch.zeros(4, 1, 2, 16)
    call(inputs, k=k_new, v=k_new)  # appending new k/v is another kernel
    assert (kernel_calls[0]["num_splits"], kernel_calls[0]["pack_gqa"]) == (0, None)


def test_keys_come_from_host_side_values_only():
    inputs = make_decode_inputs(DecodeShape(batch=3, kv_len=100, page_size=16, num_q_heads=8, num_kv_heads=2,
                                            head_dim=16, dtype="float32"))
    static, batch, q_len, kv_len = fa3._call_key(inputs.q, inputs.k_cache, inputs.v_cache,
                                                 page_table=inputs.page_table, causal=True)
    assert (batch, q_len, kv_len) == (3, 1, 112)  # the page table's capacity bounds every length
    assert attention_run_key(batch, q_len, kv_len) == attention_run_key(3, 1, 100)  # same bucket
    assert fa3._static_json(static) == inputs.static_key().to_json()
    # varlen q: batch from cu_seqlens_q, q len from max_seqlen_q
    cu = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    _, batch, q_len, _ = fa3._call_key(torch.zeros(6, 8, 16), inputs.k_cache, inputs.v_cache,
                                       page_table=inputs.page_table, cu_seqlens_q=cu, max_seqlen_q=2, causal=True)
    assert (batch, q_len) == (3, 2)


def test_config_space_and_op():
    assert {c["pack_gqa"] for c in fa3.config_space(32, 8)} == {None, False, True}
    assert {c["pack_gqa"] for c in fa3.config_space(8, 8)} == {None}
    op = get_op("fa3")
    assert op.default(op.grids["decode"][0]) == {"num_splits": 0, "pack_gqa": None}
    if not torch.cuda.is_available():
        assert op.unavailable() == "needs a CUDA GPU"
