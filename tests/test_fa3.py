"""The FA3 drop-in's host side, on any machine: keys, DB lookup, explicit arguments.

sgl-kernel's kernel is replaced by a recorder here; tests/test_gpu.py runs the real one.
"""

import dataclasses

import pytest
import torch

import tuner
from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
from tuner.keys import attention_run_key
from tuner.ops import get_op
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.integrations import fa3 as dropin
from tuner.ops import fa3


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []

    def fake_kernel(q, k_cache, v_cache, **kwargs):
        calls.append(kwargs)
        return q

    monkeypatch.setattr(fa3, "kernel", lambda: fake_kernel)
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
    return dropin.flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, cache_seqlens=inputs.cache_seqlens,
                                       page_table=inputs.page_table, causal=s.causal, **kwargs)


def test_the_drop_in_runs_the_swept_winner(db_path, kernel_calls):
    inputs = make_decode_inputs(DecodeShape(batch=4, kv_len=2048, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                            dtype="float32"))
    store(db_path, inputs, {"num_splits": 12, "pack_gqa": True})
    tuner.configure(db=db_path, mode="lookup")
    call(inputs)
    call(inputs, window_size=[-1, -1])  # a list, as callers pass it: same key
    assert [(c["num_splits"], c["pack_gqa"]) for c in kernel_calls] == [(12, True), (12, True)]


def test_a_windowed_call_runs_the_winner_of_its_longest_sequences_bucket(db_path, kernel_calls):
    """A 63-key window over 2048-key sequences keys on kv bucket 2048, not on the window's 64:
    over mixed lengths the two are other work (tuner.keys.visible_kv_len)."""
    shape = DecodeShape(batch=4, kv_len=2048, num_q_heads=8, num_kv_heads=2, head_dim=16, dtype="float32",
                        window=(63, 0))
    store(db_path, make_decode_inputs(dataclasses.replace(shape, kv_len=64)), {"num_splits": 3, "pack_gqa": True})
    store(db_path, make_decode_inputs(shape), {"num_splits": 5, "pack_gqa": False})
    tuner.configure(db=db_path, mode="lookup")
    long = make_decode_inputs(shape)
    call(long)
    call(long, window_size=(-1, -1))  # no window: another static key, with no winner
    assert [(c["num_splits"], c["pack_gqa"]) for c in kernel_calls] == [(5, False), (0, None)]


def test_a_value_the_caller_sets_is_kept_and_the_librarys_choice_is_tuned(db_path, kernel_calls):
    inputs = make_decode_inputs(DecodeShape(batch=4, kv_len=512, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                            dtype="float32"))
    store(db_path, inputs, {"num_splits": 12, "pack_gqa": True})
    tuner.configure(db=db_path, mode="lookup")
    call(inputs, num_splits=3)  # the caller's count; pack_gqa stays FA3's choice (a tuned pair is never split)
    call(inputs, pack_gqa=False)
    call(inputs, num_splits=0, pack_gqa=None)  # sgl-kernel's defaults: "let the library choose"
    call(inputs, config=fa3.DEFAULT)  # the opt-out: FA3's own choice, no lookup
    assert [(c["num_splits"], c["pack_gqa"]) for c in kernel_calls] == [(3, None), (0, False), (12, True), (0, None)]


def _sglang_decode(inputs, **overrides):
    """The decode call as SGLang's FA3 backend makes it (sglang 0.5.23,
    flashattention_backend.forward_decode): q as [tokens, heads, dim] with cu_seqlens_q,
    num_splits=0 always, out= a preallocated buffer, ver=3, scheduler metadata in plain decode."""
    q = inputs.q.reshape(-1, inputs.q.shape[2], inputs.q.shape[3])
    batch = inputs.q.shape[0]
    kwargs = dict(q=q, k_cache=inputs.k_cache, v_cache=inputs.v_cache, page_table=inputs.page_table,
                  cache_seqlens=inputs.cache_seqlens, cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
                  max_seqlen_q=1, softmax_scale=0.25, causal=True, window_size=(-1, -1), softcap=0.0,
                  return_softmax_lse=False, num_splits=0, out=torch.empty_like(q), ver=3, scheduler_metadata=None)
    kwargs.update(overrides)
    return dropin.flash_attn_with_kvcache(**kwargs)


def test_sglangs_call_with_num_splits_0_runs_the_tuned_config(db_path, kernel_calls):
    inputs = make_decode_inputs(DecodeShape(batch=4, kv_len=512, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                            dtype="float32"))
    store(db_path, inputs, {"num_splits": 12, "pack_gqa": True})
    tuner.configure(db=db_path, mode="lookup")
    _sglang_decode(inputs)
    _sglang_decode(inputs, num_splits=1)  # SGLang under deterministic inference: kept
    assert [(c["num_splits"], c["pack_gqa"]) for c in kernel_calls] == [(12, True), (1, None)]


def test_with_scheduler_metadata_the_callers_values_are_kept(db_path, kernel_calls):
    """FA3 skips its scheduler for metadata built for the caller's num_splits and pack_gqa,
    but sizes its split accumulators from the call's num_splits: a tuned value there would
    mix two plans. SGLang builds it with num_splits=0 for plain decode layers."""
    inputs = make_decode_inputs(DecodeShape(batch=4, kv_len=512, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                            dtype="float32"))
    store(db_path, inputs, {"num_splits": 12, "pack_gqa": True})
    tuner.configure(db=db_path, mode="lookup")
    metadata = torch.zeros(17, dtype=torch.int32)
    _sglang_decode(inputs, scheduler_metadata=metadata)
    _sglang_decode(inputs, scheduler_metadata=metadata, num_splits=4, pack_gqa=False)
    q = inputs.q.reshape(-1, 8, 16)  # num_splits and pack_gqa left to sgl-kernel's defaults
    dropin.flash_attn_with_kvcache(q, inputs.k_cache, inputs.v_cache, page_table=inputs.page_table,
                                cache_seqlens=inputs.cache_seqlens, cu_seqlens_q=torch.arange(5, dtype=torch.int32),
                                max_seqlen_q=1, causal=True, scheduler_metadata=metadata)
    assert [(c["num_splits"], c["pack_gqa"]) for c in kernel_calls] == [(0, None), (4, False), (0, None)]
    assert all(c["scheduler_metadata"] is metadata for c in kernel_calls)


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
    static, batch, q_len, kv_len = dropin._call_key(inputs.q, inputs.k_cache, inputs.v_cache,
                                                 page_table=inputs.page_table, causal=True)
    assert (batch, q_len, kv_len) == (3, 1, 112)  # the page table's capacity bounds every length
    assert attention_run_key(batch, q_len, kv_len) == attention_run_key(3, 1, 100)  # same bucket
    assert dropin._static_json(static) == inputs.static_key().to_json()
    # varlen q: batch from cu_seqlens_q, q len from max_seqlen_q
    cu = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    _, batch, q_len, _ = dropin._call_key(torch.zeros(6, 8, 16), inputs.k_cache, inputs.v_cache,
                                       page_table=inputs.page_table, cu_seqlens_q=cu, max_seqlen_q=2, causal=True)
    assert (batch, q_len) == (3, 2)


def test_config_space_and_op():
    assert {c["pack_gqa"] for c in fa3.config_space(32, 8)} == {None, False, True}
    assert {c["pack_gqa"] for c in fa3.config_space(8, 8)} == {None}
    op = get_op("fa3")
    assert op.default(op.grids["decode"][0]) == {"num_splits": 0, "pack_gqa": None}
    if not torch.cuda.is_available():
        assert op.unavailable() == "needs a CUDA GPU"


def test_features_that_select_another_kernel_run_fa3s_default(db_path, kernel_calls):
    """attention_chunk, sm_margin, cache_leftpad, cache_batch_idx, q_descale, ver: each is in
    the static key (as an extra), so a winner swept without it is never applied to it."""
    inputs = make_decode_inputs(DecodeShape(batch=4, kv_len=512, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                            dtype="float32"))
    store(db_path, inputs, {"num_splits": 12, "pack_gqa": True})
    tuner.configure(db=db_path, mode="lookup")
    idx = torch.arange(4, dtype=torch.int32)
    for extra in (dict(attention_chunk=128), dict(sm_margin=8), dict(cache_leftpad=idx), dict(cache_batch_idx=idx),
                  dict(q_descale=torch.ones(4, 2)), dict(ver=4)):
        call(inputs, **extra)
    call(inputs)
    assert [(c["num_splits"], c["pack_gqa"]) for c in kernel_calls] == [(0, None)] * 6 + [(12, True)]


def test_only_qv_with_q_or_k_cache_none_runs_the_default(db_path, kernel_calls):
    inputs = make_decode_inputs(DecodeShape(batch=2, kv_len=64, num_q_heads=4, num_kv_heads=4, head_dim=16,
                                            dtype="float32"))
    tuner.configure(db=db_path, mode="lookup")
    qv = torch.zeros(2, 1, 4, 16)
    dropin.flash_attn_with_kvcache(None, inputs.k_cache, inputs.v_cache, qv=qv, only_qv=True,
                                cache_seqlens=inputs.cache_seqlens, page_table=inputs.page_table)
    dropin.flash_attn_with_kvcache(inputs.q, None, inputs.v_cache, qv=qv, only_qv=True,
                                cache_seqlens=inputs.cache_seqlens, page_table=inputs.page_table)
    assert [(c["num_splits"], c["pack_gqa"]) for c in kernel_calls] == [(0, None), (0, None)]


def test_an_empty_batch_reaches_fa3_with_its_default(db_path, kernel_calls):
    inputs = make_decode_inputs(DecodeShape(batch=4, kv_len=512, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                            dtype="float32"))
    store(db_path, inputs, {"num_splits": 12, "pack_gqa": True})
    tuner.configure(db=db_path, mode="lookup")
    empty = inputs.q[:0]
    out = dropin.flash_attn_with_kvcache(empty, inputs.k_cache, inputs.v_cache, cache_seqlens=inputs.cache_seqlens[:0],
                                      page_table=inputs.page_table[:0], causal=True)
    assert out.shape[0] == 0 and (kernel_calls[0]["num_splits"], kernel_calls[0]["pack_gqa"]) == (0, None)


def test_numpy_and_tensor_key_values_never_grow_the_memo(db_path, kernel_calls):
    """A numpy softcap or window, or a flag given as a tensor, made a new memo key per call
    (or an unhashable one)."""
    import numpy as np

    inputs = make_decode_inputs(DecodeShape(batch=4, kv_len=512, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                            dtype="float32", window=(64, 0)))
    store(db_path, inputs, {"num_splits": 12, "pack_gqa": True})
    tuner.configure(db=db_path, mode="lookup")
    memo = dropin.flash_attn_with_kvcache.tuner.memo
    for _ in range(20):
        call(inputs, window_size=np.array([64, 0]))
        call(inputs, window_size=(np.int64(64), np.int64(0)), softcap=np.float32(0.0))
        call(inputs, window_size=[64, 0])
    assert len(memo) == 1 and {(c["num_splits"], c["pack_gqa"]) for c in kernel_calls} == {(12, True)}
    for _ in range(5):
        call(inputs, softcap=torch.tensor(0.0))  # never read back to build a key: the default
    assert len(memo) == 2 and kernel_calls[-1]["num_splits"] == 0


def test_an_sgl_kernel_without_only_qv_is_called_without_it(monkeypatch, db_path):
    """sgl-kernel 0.4.2.post1 (LightLLM's pin) has no only_qv: passing it always was a TypeError."""
    import sys
    import types

    seen = []

    def old_fa3(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                cache_batch_idx=None, cache_leftpad=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
                max_seqlen_q=None, rotary_seqlens=None, q_descale=None, k_descale=None, v_descale=None,
                softmax_scale=None, causal=False, window_size=(-1, -1), attention_chunk=None, softcap=0.0,
                rotary_interleaved=True, scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                return_softmax_lse=False, sinks=None, score_mod=None, aux_tensors=None, ver=3, out=None):
        seen.append(num_splits)
        return q

    package = types.ModuleType("sgl_kernel")
    module = types.ModuleType("sgl_kernel.flash_attn")
    module.flash_attn_with_kvcache = old_fa3
    package.flash_attn = module
    monkeypatch.setitem(sys.modules, "sgl_kernel", package)
    monkeypatch.setitem(sys.modules, "sgl_kernel.flash_attn", module)
    fa3.kernel.cache_clear()
    try:
        inputs = make_decode_inputs(DecodeShape(batch=2, kv_len=64, num_q_heads=4, num_kv_heads=4, head_dim=16,
                                                dtype="float32"))
        tuner.configure(db=db_path, mode="lookup")
        call(inputs)
        assert seen == [0]
        with pytest.raises(TypeError, match="no only_qv"):
            call(inputs, only_qv=True, qv=torch.zeros(2, 1, 4, 16))
    finally:
        fa3.kernel.cache_clear()


@pytest.mark.parametrize("fixed", [dict(num_splits=3), dict(pack_gqa=False),
                                   dict(scheduler_metadata=torch.zeros(17, dtype=torch.int32))])
def test_tune_mode_never_tunes_a_call_whose_values_the_caller_decided(db_path, kernel_calls, fixed):
    """Such a call runs the caller's values whatever the config: tune mode timed it once per
    config, stored the default as a "winner", and that record then kept the library's-choice
    calls of the key from being tuned."""
    inputs = make_decode_inputs(DecodeShape(batch=4, kv_len=512, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                            dtype="float32"))
    tuner.configure(db=db_path, mode="tune")
    call(inputs, **fixed)
    assert len(kernel_calls) == 1 and not db_path.exists()  # one call, nothing measured or stored
    call(inputs)  # the library's choice: tuned
    assert len(kernel_calls) > 2 and len(TuningDB(db_path).records()) == 1


def test_a_graph_captured_at_a_wide_page_table_inside_graph_capture_runs_the_declared_winner(db_path, kernel_calls):
    """The drop-in keys on the page table's width (FA3 takes no max length); a graph's table
    is as wide as the max context, so without declared lengths it keys on that bound."""
    shape = DecodeShape(batch=4, kv_len=2048, num_q_heads=8, num_kv_heads=2, head_dim=16, dtype="float32")
    inputs = make_decode_inputs(shape)
    store(db_path, inputs, {"num_splits": 12, "pack_gqa": True})  # measured at kv 2048
    tuner.configure(db=db_path, mode="lookup")
    wide = make_decode_inputs(shape, seq_lens=[2000, 100, 1500, 7], table_width=2**17)
    call(wide)
    with tuner.graph_capture(2048):
        call(wide)
    call(wide)
    assert [(c["num_splits"], c["pack_gqa"]) for c in kernel_calls] == [(0, None), (12, True), (0, None)]


def test_split_counts_past_eight_work_items_per_sm_leave_the_space_unless_the_full_space_is_asked(monkeypatch):
    from tuner import settings

    monkeypatch.setattr(settings, "FULL_SPACE", False)
    monkeypatch.setattr(fa3, "sm_count", lambda *a: 132)  # an H200's, whatever GPU runs the test
    assert fa3.split_counts(None, 8) == fa3.NUM_SPLITS  # no batch: the whole list
    # 132 SMs x 8 = 1056 work items: batch 64 x 8 kv heads holds 2 splits; 0 and 1 always stay
    assert fa3.split_counts(64, 8) == (0, 1, 2)
    assert fa3.split_counts(256, 8) == (0, 1)
    assert fa3.split_counts(1, 1) == fa3.NUM_SPLITS
    space = fa3.config_space(32, 8, batch=64)
    assert {c["num_splits"] for c in space} == {0, 1, 2} and len(space) == 9
    assert get_op("fa3").configs(DecodeShape(batch=64, kv_len=4096)) == space
    monkeypatch.setattr(settings, "FULL_SPACE", True)
    assert fa3.split_counts(64, 8) == fa3.NUM_SPLITS
