"""The FlashInfer wrappers' host-side logic on the CPU: when a plan may be reused, which
tensors a run reads, where configs come from. FlashInfer itself is replaced by
tests/support/fake_flashinfer.py; tests/gpu/test_gpu_flashinfer.py checks the real one on the H200."""

import numpy as np
import pytest
import torch

from support import fake_flashinfer
import tuner
import tuner.ops.flashinfer as fi
import tuner.ops.flashinfer_wrappers as fiw
from tuner.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
from tuner.bench import Timing
from tuner.keys import attention_run_key
from tuner.workload import DecodeShape
from tuner.ops.decode_attention import BACKENDS
from tuner.ops.flashinfer_plan import (
    PlanCoverage, coverage_from_plan, host_seq_lens, paged_metadata, valid_bounds,
)

CUDA_CORES = {"use_tensor_cores": False, "flashinfer_backend": "auto", "fixed_split_size": None,
              "disable_split_kv": False}


# -- the validity rule ---------------------------------------------------------------------


def test_a_split_plan_covers_lengths_that_keep_every_chunk_count():
    cov = PlanCoverage(split=True, chunk_tokens=100, chunks=np.array([3, 1, 2]))
    assert cov.covers(np.array([201, 1, 101])) and cov.covers(np.array([300, 100, 200]))
    assert not cov.covers(np.array([301, 50, 150]))  # a fourth chunk would go unread
    assert not cov.covers(np.array([200, 50, 150]))  # chunk 3 would start past the end
    assert not cov.covers(np.array([250, 50]))  # another batch


def test_an_unsplit_plan_covers_any_lengths_of_the_same_batch():
    cov = PlanCoverage(split=False, chunk_tokens=0, chunks=np.array([1, 1]))
    assert cov.covers(np.array([1, 10**9])) and not cov.covers(np.array([5]))


def test_bounds_are_capped_at_the_kv_bucket_and_exact_without_coverage():
    cov = PlanCoverage(split=True, chunk_tokens=512, chunks=np.array([2, 4]))
    lo, hi = valid_bounds(cov, np.array([600, 1800]), kv_upper=2048)
    assert lo.tolist() == [512, 1536] and hi.tolist() == [1024, 2048]
    lo, hi = valid_bounds(None, np.array([600, 1800]), kv_upper=2048)
    assert lo.tolist() == [599, 1799] and hi.tolist() == [600, 1800]


def _plan_buffer(layout_size, split, o_indptr, chunk_tokens, o_at, chunk_at, split_at):
    raw = np.zeros(1024, dtype=np.uint8)
    raw[128:128 + 4 * len(o_indptr)] = np.asarray(o_indptr, dtype=np.int32).view(np.uint8)
    raw[64:68] = np.array([chunk_tokens], dtype=np.int32).view(np.uint8)
    info = [0] * layout_size
    info[o_at], info[chunk_at], info[split_at] = 128, 64, int(split)
    return info, raw


def test_coverage_is_read_from_flashinfer_decode_and_fa2_prefill_plans():
    info, raw = _plan_buffer(10, True, [0, 3, 4, 6], 256, o_at=5, chunk_at=7, split_at=9)
    cov = coverage_from_plan(info, raw, batch=3)
    assert cov.split and cov.chunk_tokens == 256 and cov.chunks.tolist() == [3, 1, 2]
    # prefill: o_indptr counts chunks times query rows
    info, raw = _plan_buffer(15, True, [0, 6, 8], 128, o_at=8, chunk_at=9, split_at=14)
    cov = coverage_from_plan(info, raw, batch=2, qo_lens=np.array([2, 2]))
    assert cov.chunks.tolist() == [3, 1] and cov.chunk_tokens == 128


def test_an_unknown_or_inconsistent_plan_layout_gives_no_coverage():
    assert coverage_from_plan([0] * 12, np.zeros(64, dtype=np.uint8), batch=2) is None
    info, raw = _plan_buffer(10, True, [0, 2, 3], 0, o_at=5, chunk_at=7, split_at=9)
    assert coverage_from_plan(info, raw, batch=2) is None  # a split plan with no chunk length
    info, raw = _plan_buffer(10, True, [0, 2, 3], 64, o_at=5, chunk_at=7, split_at=9)
    info[5] = 10**6
    assert coverage_from_plan(info, raw, batch=2) is None  # offsets outside the buffer


def test_host_lengths_come_from_host_tensors_only():
    assert host_seq_lens(np.array([5, 7]), None, None, 1).tolist() == [5, 7]
    assert host_seq_lens(torch.tensor([5, 7], dtype=torch.int32), None, None, 1).tolist() == [5, 7]
    indptr, last = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([3, 16], dtype=torch.int32)
    assert host_seq_lens(None, indptr, last, 16).tolist() == [19, 48]
    on_device = torch.empty(3, device="meta")
    assert host_seq_lens(on_device, None, None, 1) is None
    assert host_seq_lens(None, on_device, last, 16) is None


def test_paged_metadata():
    indptr, last = paged_metadata(np.array([1, 16, 17]), 16)
    assert indptr.tolist() == [0, 1, 2, 4] and last.tolist() == [1, 16, 1]


# -- the wrappers (on the fake FlashInfer) ---------------------------------------------------


@pytest.fixture
def fake(monkeypatch):
    module = fake_flashinfer.module()
    monkeypatch.setattr(fiw, "library", lambda: module)
    return module.BatchDecodeWithPagedKVCacheWrapper


def _step(wrapper, lens, page_size=1, host_metadata="seq_lens"):
    indptr, last = paged_metadata(lens, page_size)
    indptr_t, last_t = torch.from_numpy(indptr), torch.from_numpy(last)
    indices = torch.arange(int(indptr[-1]), dtype=torch.int32) + 1000 * int(lens[0])  # new every step
    if host_metadata == "seq_lens":
        wrapper.plan(indptr_t, indices, last_t, 4, 2, 8, page_size, seq_lens=lens)
    elif host_metadata == "indptr":
        wrapper.plan(indptr_t, indices, last_t, 4, 2, 8, page_size)
    else:  # only device tensors: here, the meta device stands in for the GPU
        wrapper.plan(indptr_t.to("meta"), indices.to("meta"), last_t.to("meta"), 4, 2, 8, page_size)
    return indptr_t, indices, last_t


def test_a_plan_is_reused_exactly_while_every_chunk_count_holds(fake):
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    lens = np.array([10, 3, 7])  # the fake splits kv into 4-page chunks: 3, 1, 2 chunks
    history = []
    for _ in range(8):
        _step(wrapper, lens)
        history.append((wrapper.plans, wrapper.plans_reused))
        lens = lens + 1
    # re-planned exactly when some request crossed a chunk boundary (4 -> 5, 8 -> 9, 12 -> 13)
    assert history == [(1, 0), (1, 1), (2, 1), (3, 1), (3, 2), (3, 3), (4, 3), (5, 3)]
    # the last plan's lengths were 17, 10, 14: one request a chunk shorter, the longest still in
    # its kv bucket: that chunk would start past the request's end
    _step(wrapper, np.array([17, 8, 14]))
    assert wrapper.plans == 6
    _step(wrapper, np.array([1, 1, 1]))  # a shorter bucket's lengths: its own record, its own plan
    assert wrapper.plans == 7
    [inner] = fake.instances
    assert all(call["indptr"].device.type == "cpu" for call in inner.plan_calls)  # no device reads


def test_reused_plans_run_on_the_callers_latest_tensors(fake):
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    _step(wrapper, np.array([17, 20]), page_size=16)
    indptr, indices, last = _step(wrapper, np.array([18, 21]), page_size=16)
    assert wrapper.plans_reused == 1
    seen = wrapper.run(None, None)
    assert seen["indptr"] is indptr and seen["indices"] is indices and seen["last_page_len"] is last


def test_under_cuda_graph_reuse_copies_into_the_captured_buffers(fake):
    buffers = dict(paged_kv_indptr_buffer=torch.zeros(3, dtype=torch.int32),
                   paged_kv_indices_buffer=torch.zeros(64, dtype=torch.int32),
                   paged_kv_last_page_len_buffer=torch.zeros(2, dtype=torch.int32))
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8), use_cuda_graph=True, **buffers)
    _step(wrapper, np.array([17, 20]), page_size=16)
    indptr, indices, last = _step(wrapper, np.array([18, 21]), page_size=16)
    assert wrapper.plans_reused == 1
    seen = wrapper.run(None, None)
    assert seen["indptr"] is buffers["paged_kv_indptr_buffer"]  # the captured tensors, updated
    assert seen["last_page_len"].tolist() == last.tolist() == [2, 5]
    assert seen["indices"][: len(indices)].tolist() == indices.tolist()


def test_without_host_lengths_the_standard_plan_runs_with_flashinfers_defaults(fake):
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    _step(wrapper, np.array([9, 4]), host_metadata="device")
    _step(wrapper, np.array([9, 4]), host_metadata="device")
    assert wrapper.standard_plans == wrapper.plans == 2 and wrapper.plans_reused == 0
    [inner] = fake.instances
    assert not inner.use_tensor_cores and inner.plan_calls[0]["indptr"].device.type == "meta"


def test_indptr_and_last_page_len_on_the_host_count_as_host_lengths(fake):
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    _step(wrapper, np.array([17, 20]), page_size=16, host_metadata="indptr")
    indptr, _, last = _step(wrapper, np.array([18, 21]), page_size=16, host_metadata="indptr")
    assert wrapper.plans == 1 and wrapper.plans_reused == 1 and wrapper.standard_plans == 0
    assert wrapper.run(None, None)["last_page_len"].tolist() == [2, 5]


def _static_json(page_size):
    """The static key _step's plans make: fp16 (FlashInfer's default), 4 q / 2 kv heads, dim 8."""
    return DecodeShape(batch=1, kv_len=1, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=page_size,
                       dtype="float16").static_key().to_json()


def _store(db_path, static_json, run_key, config):
    db = TuningDB(db_path)
    db.save_winner(Problem("flashinfer", static_json, run_key), (current_fingerprint_id(), current_fingerprint()),
                   config, Timing(10.0, 0.1, 5), dict(fi.DECODE_DEFAULT), Timing(20.0, 0.1, 5), method={})
    db.close()


def test_the_db_chooses_the_plan_config_and_an_explicit_argument_wins(fake, db_path):
    static = _static_json(page_size=1)
    tc = {"use_tensor_cores": True, "flashinfer_backend": "fa2", "fixed_split_size": 4, "disable_split_kv": False}
    _store(db_path, static, attention_run_key(2, 1, 16), tc)
    tuner.configure(db=db_path, mode="lookup")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    _step(wrapper, np.array([12, 16]))
    inner = fake.instances[-1]
    assert inner.use_tensor_cores and inner.plan_calls[-1]["fixed_split_size"] == 4
    explicit = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8), use_tensor_cores=False)
    indptr, last = paged_metadata(np.array([12, 16]), 1)
    explicit.plan(torch.from_numpy(indptr), torch.arange(28, dtype=torch.int32), torch.from_numpy(last), 4, 2, 8, 1,
                  seq_lens=np.array([12, 16]))
    inner = fake.instances[-1]
    assert not inner.use_tensor_cores and "fixed_split_size" not in inner.plan_calls[-1]
    tuner.configure(mode="off")
    off = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    _step(off, np.array([12, 16]))
    assert not fake.instances[-1].use_tensor_cores


def test_a_windowed_plan_takes_the_record_of_its_longest_sequences_bucket(fake, db_path):
    """window_left 15 over sequences of 300 and 400 keys keys on 400's bucket, 512, not on the
    window's 16 (a record there, 5 octaves away, is not borrowed)."""
    static = DecodeShape(batch=1, kv_len=1, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=1,
                         dtype="float16", window=(15, 0)).static_key().to_json()
    tc = {"use_tensor_cores": True, "flashinfer_backend": "fa2", "fixed_split_size": 4, "disable_split_kv": False}
    _store(db_path, static, attention_run_key(2, 1, 16), dict(tc, fixed_split_size=2))
    _store(db_path, static, attention_run_key(2, 1, 512), tc)
    tuner.configure(db=db_path, mode="lookup")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    lens = np.array([300, 400])
    indptr, last = paged_metadata(lens, 1)
    wrapper.plan(torch.from_numpy(indptr), torch.arange(int(indptr[-1]), dtype=torch.int32), torch.from_numpy(last),
                 4, 2, 8, 1, seq_lens=lens, window_left=15)
    inner = fake.instances[-1]
    assert inner.use_tensor_cores and inner.plan_calls[-1]["fixed_split_size"] == 4


def test_a_prefill_record_never_configures_the_decode_wrapper(fake, db_path):
    _store(db_path, _static_json(page_size=1), attention_run_key(2, 2, 16),
           {"flashinfer_backend": "fa3", "fixed_split_size": None, "disable_split_kv": False})
    tuner.configure(db=db_path, mode="lookup")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    _step(wrapper, np.array([12, 16]))  # q len 1 is one octave from the record's 2: nearest
    assert not fake.instances[-1].use_tensor_cores and wrapper.plans == 1


# -- the op's config space -------------------------------------------------------------------


def test_config_spaces():
    decode, mtp = DecodeShape(batch=4, kv_len=8192), DecodeShape(batch=4, kv_len=2048, q_len=2)
    assert fi.config_space(decode)[0] == fi.default_config(decode) == fi.DECODE_DEFAULT
    assert fi.config_space(mtp)[0] == fi.default_config(mtp) == fi.PREFILL_DEFAULT
    splits = [c["fixed_split_size"] for c in fi.config_space(decode) if c["fixed_split_size"]]
    assert splits == sorted(set(splits)) and all(0 < s < 8192 for s in splits)
    assert fi.config_space(DecodeShape(batch=4, kv_len=8192, sinks=True)) == []
    assert fi.config_space(DecodeShape(batch=4, kv_len=2048, q_len=2, causal=False)) == []


@pytest.mark.parametrize("shape", [DecodeShape(batch=4, kv_len=8192), DecodeShape(batch=4, kv_len=2048, q_len=2)])
def test_no_backend_config_names_a_backend_key(shape):
    """decode_attention's configs are {"backend": library, **that library's config}: a
    library config with its own "backend" key would overwrite the library's name (FlashInfer
    once did, and every FlashInfer config of decode_attention failed)."""
    for name, backend in BACKENDS.items():
        assert all("backend" not in c for c in backend.op.configs(shape)), name


# -- issue 10: the wrappers as a server drives them ------------------------------------------


def _graph_wrapper():
    buffers = dict(paged_kv_indptr_buffer=torch.zeros(3, dtype=torch.int32),
                   paged_kv_indices_buffer=torch.zeros(64, dtype=torch.int32),
                   paged_kv_last_page_len_buffer=torch.zeros(2, dtype=torch.int32))
    return BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8), use_cuda_graph=True, **buffers)


def test_under_cuda_graphs_every_plan_stays_on_the_captured_inner_wrapper(fake, db_path):
    """A plan on the standard path (no host lengths, or a keyword tuner once did not forward)
    switched to another inner wrapper, and the captured graph replayed a stale plan."""
    tc = {"use_tensor_cores": True, "flashinfer_backend": "fa2", "fixed_split_size": None, "disable_split_kv": False}
    _store(db_path, _static_json(page_size=16), attention_run_key(2, 1, 32), tc)
    tuner.configure(db=db_path, mode="lookup")
    wrapper = _graph_wrapper()
    _step(wrapper, np.array([17, 20]), page_size=16)  # host lengths: the DB's tensor-core config
    _step(wrapper, np.array([18, 21]), page_size=16, host_metadata="device")  # the standard path
    indptr, last = paged_metadata(np.array([19, 22]), 16)
    wrapper.plan(torch.from_numpy(indptr), torch.arange(4, dtype=torch.int32), torch.from_numpy(last), 4, 2, 8, 16,
                 seq_lens=np.array([19, 22]), pos_encoding_mode="ROPE_LLAMA", rope_theta=1e4)  # unmeasured keywords
    [inner] = fake.instances  # one inner wrapper for the wrapper's life
    assert inner.use_tensor_cores and wrapper.plans == 3
    assert inner.plan_calls[-1]["pos_encoding_mode"] == "ROPE_LLAMA" and inner.plan_calls[-1]["rope_theta"] == 1e4


def test_every_flashinfer_plan_keyword_is_forwarded_on_both_paths(fake):
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    extra = dict(pos_encoding_mode="NONE", window_left=-1, o_data_type=torch.float16, data_type=torch.float16,
                 non_blocking=False, is_causal=False)
    indptr, last = paged_metadata(np.array([5, 9]), 1)
    for lens in (np.array([5, 9]), None):
        wrapper.plan(torch.from_numpy(indptr), torch.arange(14, dtype=torch.int32), torch.from_numpy(last), 4, 2, 8,
                     1, seq_lens=lens, **extra)
        sent = fake.instances[-1].plan_calls[-1]
        assert all(sent[k] == v for k, v in extra.items()), sent
    # FlashInfer's deprecated positional optionals bind by its order
    wrapper.plan(torch.from_numpy(indptr), torch.arange(14, dtype=torch.int32), torch.from_numpy(last), 4, 2, 8, 1,
                 "NONE", -1, 30.0)
    assert fake.instances[-1].plan_calls[-1]["logits_soft_cap"] == 30.0


def test_the_wrapper_methods_a_server_calls(fake):
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="plan"):
        wrapper.run(None, None)
    indptr, last = paged_metadata(np.array([5, 9]), 1)
    wrapper.begin_forward(torch.from_numpy(indptr), torch.arange(14, dtype=torch.int32), torch.from_numpy(last),
                          4, 2, 8, 1, seq_lens=np.array([5, 9]))
    assert wrapper.plans == 1
    assert wrapper.run_return_lse(None, None)["return_lse"] is True
    wrapper.forward(None, None, pos_encoding_mode="NONE")
    wrapper.end_forward()
    [inner] = fake.instances
    assert inner.forwards == ["NONE"] and len(inner.runs) == 2
    wrapper.reset_workspace_buffer(torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8))
    assert inner.workspace_resets == 1 and wrapper.is_cuda_graph_enabled is False
    wrapper.begin_forward(torch.from_numpy(indptr), torch.arange(14, dtype=torch.int32), torch.from_numpy(last),
                          4, 2, 8, 1, seq_lens=np.array([5, 9]))
    assert wrapper.plans == 2 and wrapper.plans_reused == 0  # the old plan lived in the old workspace
    with pytest.raises(AttributeError, match="does not offer FlashInfer's 'no_such_method'"):
        wrapper.no_such_method()


def test_plan_reuse_reads_a_plan_info_that_is_a_sequence_not_a_list():
    """FlashInfer 0.7 returns plan_info as a tvm_ffi.Array (a Sequence); its DecodePlanInfo
    and FA2 PrefillPlanInfo keep 0.6's 10 and 15 fields (scheduler.cuh of both wheels)."""
    class Array(tuple):  # stands in for tvm_ffi.Array: indexable, sized, not a list
        pass

    info, raw = _plan_buffer(10, True, [0, 3, 4, 6], 256, o_at=5, chunk_at=7, split_at=9)
    cov = coverage_from_plan(Array(info), raw, batch=3)
    assert cov is not None and cov.chunks.tolist() == [3, 1, 2]
    assert coverage_from_plan(Array([0] * 16), raw, batch=3) is None  # another layout: exact re-planning


def test_a_plan_is_not_reused_once_the_longest_sequence_falls_into_another_bucket(fake, db_path):
    """Reuse capped a plan's lengths at its bucket's top only: an unsplit plan (valid for any
    shorter lengths) chosen for bucket 16 went on serving calls of bucket 8, whose own record
    never ran."""
    static = _static_json(page_size=1)
    fa2 = {"use_tensor_cores": True, "flashinfer_backend": "fa2"}
    # the fake splits only requests longer than one chunk: 16-page chunks leave 12 and 16 unsplit
    _store(db_path, static, attention_run_key(2, 1, 16), dict(fa2, fixed_split_size=16, disable_split_kv=False))
    _store(db_path, static, attention_run_key(2, 1, 8), dict(fa2, fixed_split_size=2, disable_split_kv=False))
    tuner.configure(db=db_path, mode="lookup")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    _step(wrapper, np.array([12, 16]))
    assert fake.instances[-1].plan_calls[-1]["fixed_split_size"] == 16
    _step(wrapper, np.array([10, 13]))  # the same bucket: the unsplit plan holds
    assert (wrapper.plans, wrapper.plans_reused) == (1, 1)
    _step(wrapper, np.array([5, 8]))  # bucket 8: its own record
    assert wrapper.plans == 2 and fake.instances[-1].plan_calls[-1]["fixed_split_size"] == 2


def test_a_sweeps_calls_of_other_lengths_never_share_a_plan_but_copies_of_one_do(fake):
    """Issue 36's fault: a timer captures a rotation of length draws into one CUDA graph, and
    FlashInfer's plan reaches the device through a copy from its wrapper's host buffer, which
    a replay reads again. Draws planned on one wrapper would all replay its last plan."""
    from tuner.workload import make_decode_inputs

    shape = DecodeShape(batch=3, kv_len=40, num_q_heads=4, num_kv_heads=2, head_dim=8, dtype="float32",
                        lengths="serving")
    draws = [[40, 3, 7], [12, 40, 30], [40, 3, 7]]  # the third: another copy of the first
    config = dict(CUDA_CORES)
    for lens in draws:
        fi.FLASHINFER.run(make_decode_inputs(shape, seq_lens=lens), config)
    planned = [inner for inner in fake.instances if inner.plan_calls]
    # one wrapper per distinct draw, each planned once: no plan was ever replaced by another
    assert len(planned) == 2 and all(len(inner.plan_calls) == 1 for inner in planned)
    assert sorted(inner.plan_calls[0]["indptr"][-1].item() for inner in planned) == [50, 82]
    assert len(planned[0].runs) == 2  # the copy ran on the first draw's plan


def test_a_servers_eager_calls_of_one_config_share_one_wrapper(fake):
    """decode_attention's FlashInfer calls (never captured) re-plan one wrapper per config,
    rather than making one per set of lengths."""
    q = torch.zeros(2, 1, 4, 8)
    cache = torch.zeros(64, 1, 2, 8)
    table = torch.arange(64, dtype=torch.int32).view(2, 32)
    for lens in ([30, 3], [9, 31], [2, 2]):
        fi.paged_attention(q, cache, cache, table, np.array(lens), dict(CUDA_CORES))
    [inner] = [inner for inner in fake.instances if inner.plan_calls]
    assert len(inner.runs) == 3


def test_a_plan_made_under_capture_is_not_reused_after_it(fake, monkeypatch):
    """A plan made while a CUDA graph is captured reaches the device only when the graph
    replays; had the capture failed, reusing it would read a workspace never written."""
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(8), "NHD", config=dict(CUDA_CORES))
    lens = np.array([10, 3, 7])
    monkeypatch.setattr(fiw, "_capturing", lambda: True)
    _step(wrapper, lens)
    _step(wrapper, lens)
    assert wrapper.plans == 2 and wrapper.plans_reused == 0
    monkeypatch.setattr(fiw, "_capturing", lambda: False)
    _step(wrapper, lens)
    _step(wrapper, lens)
    assert wrapper.plans == 3 and wrapper.plans_reused == 1


def test_a_plan_given_a_tensor_argument_is_made_again_every_time(fake):
    """A tensor (block_tables, a mask) may have changed in place: it is never compared by
    identity, so such a plan is not reused."""
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    lens = np.array([10, 3, 7])
    indptr, last = paged_metadata(lens, 1)
    table = torch.zeros(3, 4, dtype=torch.int32)
    for _ in range(2):
        wrapper.plan(torch.from_numpy(indptr), torch.arange(20, dtype=torch.int32), torch.from_numpy(last), 4, 2, 8,
                     1, seq_lens=lens, block_tables=table)
    assert wrapper.plans == 2 and wrapper.plans_reused == 0
    for _ in range(2):
        _step(wrapper, lens)
    assert wrapper.plans == 3 and wrapper.plans_reused == 1  # (the same call without it is reused)


# -- the prefill wrapper (few query tokens a request: speculative verification) -------------


def _verify_step(wrapper, lens, qo_lens, page_size=1, **plan_kwargs):
    indptr, last = paged_metadata(np.asarray(lens), page_size)
    qo_indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32))
    indices = torch.arange(int(indptr[-1]), dtype=torch.int32) + 1000 * int(lens[0])  # new every step
    wrapper.plan(qo_indptr, torch.from_numpy(indptr), indices, torch.from_numpy(last), 4, 2, 8, page_size,
                 seq_lens=np.asarray(lens), causal=True, **plan_kwargs)
    return indices


def test_a_prefill_plan_is_reused_exactly_while_every_chunk_count_and_query_length_holds(fake):
    wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    lens = np.array([10, 3, 7])  # 4-page chunks: 3, 1, 2 chunks, read from FA2's 15-field plan info
    history = []
    for _ in range(6):
        indices = _verify_step(wrapper, lens, [2, 2, 2])
        history.append((wrapper.plans, wrapper.plans_reused))
        lens = lens + 1
    # re-planned exactly when a request crossed a chunk boundary (4 -> 5, 8 -> 9, 12 -> 13)
    assert history == [(1, 0), (1, 1), (2, 1), (3, 1), (3, 2), (3, 3)]
    assert wrapper.run(None, None)["indices"] is indices  # a reused plan reads the caller's latest pages
    _verify_step(wrapper, lens - 1, [2, 3, 2])  # the same kv lengths, another query length: a new plan
    assert (wrapper.plans, wrapper.plans_reused) == (4, 3)
    [inner] = fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper.instances
    assert inner._backend == "fa2" and all(call["indptr"].device.type == "cpu" for call in inner.plan_calls)


def test_a_prefill_plan_takes_its_q_len_record_and_an_explicit_argument_wins(fake, db_path):
    static = DecodeShape(batch=1, kv_len=1, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=1,
                         dtype="float16", q_len=2).static_key().to_json()
    _store(db_path, static, attention_run_key(2, 2, 16),
           {"flashinfer_backend": "fa2", "fixed_split_size": 2, "disable_split_kv": False})
    tuner.configure(db=db_path, mode="lookup")
    wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    _verify_step(wrapper, [12, 16], [2, 2])
    assert fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper.instances[-1].plan_calls[-1]["fixed_split_size"] == 2
    explicit = BatchPrefillWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8))
    _verify_step(explicit, [12, 16], [2, 2], fixed_split_size=8)  # the caller's own value wins
    assert fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper.instances[-1].plan_calls[-1]["fixed_split_size"] == 8
