"""On the H200: FlashInfer's tuned wrappers against the torch reference, including plans
reused while kv lengths grow, and CUDA-graph replays after new pages. Skipped without CUDA."""

import numpy as np
import pytest
import torch

from tuner.ops import get_op

from tuner.workload import DecodeShape, make_decode_inputs, paged_decode_reference
from tuner.integrations.decode_attention import decode_attention
from tuner.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
from tuner.ops.flashinfer import paged_attention, unavailable
from tuner.ops.flashinfer_plan import paged_metadata

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

TOL = dict(atol=2e-2, rtol=2e-2)

SHAPES = [
    DecodeShape(batch=3, kv_len=700),
    DecodeShape(batch=2, kv_len=1000, num_q_heads=8, num_kv_heads=1),
    DecodeShape(batch=2, kv_len=900, q_len=3),
    DecodeShape(batch=2, kv_len=900, page_size=16),
    DecodeShape(batch=2, kv_len=4000, q_len=2, page_size=16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label())
def test_every_config_matches_the_reference(shape):
    op = get_op("flashinfer")
    inputs = make_decode_inputs(shape, device="cuda")
    ref = inputs.reference()
    configs = op.configs(shape)
    assert op.default(shape) in configs and len(configs) >= 5
    for config in configs:
        torch.testing.assert_close(op.run(inputs, config), ref, **TOL, msg=lambda m: f"{config}: {m}")


def _growing_problem(lens0, page_size, q_len=1, heads=(32, 8), dim=128, steps=300, seed=0):
    """A paged cache with room for every sequence to grow `steps` tokens, pages shuffled."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(lens0)
    max_pages = -(-(max(lens0) + steps) // page_size)
    num_pages = batch * max_pages
    k = torch.randn(num_pages, page_size, heads[1], dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(num_pages, device="cuda", generator=gen).view(batch, max_pages).to(torch.int32)
    q = torch.randn(batch, q_len, heads[0], dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q, k, v, table


def _device_metadata(table, lens, page_size):
    """What a server holds on the device for this step (fresh tensors every step)."""
    indptr, last = paged_metadata(lens, page_size)
    pages = np.diff(indptr)
    indices = torch.cat([table[i, :n] for i, n in enumerate(pages)])
    return torch.from_numpy(indptr).cuda(), indices, torch.from_numpy(last).cuda()


@pytest.mark.parametrize("config", [
    {"use_tensor_cores": False, "flashinfer_backend": "auto", "fixed_split_size": None, "disable_split_kv": False},
    {"use_tensor_cores": True, "flashinfer_backend": "fa2", "fixed_split_size": None, "disable_split_kv": False},
    {"use_tensor_cores": True, "flashinfer_backend": "fa2", "fixed_split_size": 64, "disable_split_kv": False},
    {"use_tensor_cores": True, "flashinfer_backend": "fa3", "fixed_split_size": None, "disable_split_kv": False},
], ids=["cuda-cores", "tc-fa2", "tc-fa2-split64", "tc-fa3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_plan_reuse_stays_exact_while_lengths_grow(config, page_size):
    lens = np.array([130, 517, 1000, 37], dtype=np.int64)
    steps = 300
    q, k, v, table = _growing_problem(lens, page_size, steps=steps)
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, config=config)
    for step in range(steps):
        indptr, indices, last = _device_metadata(table, lens, page_size)
        wrapper.plan(indptr, indices, last, 32, 8, 128, page_size, q_data_type=torch.bfloat16, seq_lens=lens)
        out = wrapper.run(q[:, 0], (k, v))
        ref = paged_decode_reference(q, k, v, table, torch.from_numpy(lens).cuda().int(), causal=True)[:, 0]
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"step {step}: {m}")
        lens = lens + 1
    assert wrapper.plans + wrapper.plans_reused == steps and wrapper.standard_plans == 0
    if config["flashinfer_backend"] != "fa3":  # FA3's scheduler: reused only for identical lengths
        assert wrapper.plans_reused > 0, "no plan was ever reused"


def test_decode_under_cuda_graph_reads_each_steps_pages():
    page_size, steps, batch = 1, 64, 4
    lens = np.array([300, 800, 50, 1200], dtype=np.int64)
    q, k, v, table = _growing_problem(lens, page_size, steps=steps)
    max_pages = table.numel()
    buffers = dict(paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
                   paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device="cuda"),
                   paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device="cuda"))
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, use_cuda_graph=True, **buffers)
    q0 = q[:, 0].contiguous()

    def plan(lens):
        # the server's tensors are new every step, not the captured buffers
        indptr, indices, last = _device_metadata(table, lens, page_size)
        wrapper.plan(indptr, indices, last, 32, 8, 128, page_size, q_data_type=torch.bfloat16, seq_lens=lens)

    plan(lens)
    out = wrapper.run(q0, (k, v))  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wrapper.run(q0, (k, v))
    for step in range(steps):
        lens = lens + 1
        plan(lens)
        graph.replay()
        ref = paged_decode_reference(q, k, v, table, torch.from_numpy(lens).cuda().int(), causal=True)[:, 0]
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"step {step}: {m}")
    assert wrapper.plans_reused > 0


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_prefill_plan_reuse_for_mtp_verify(backend):
    page_size, q_len, steps = 1, 3, 100
    lens = np.array([400, 90, 2000], dtype=np.int64)
    q, k, v, table = _growing_problem(lens, page_size, q_len=q_len, steps=steps)
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    wrapper = BatchPrefillWithPagedKVCacheWrapper(
        workspace, config={"flashinfer_backend": backend, "fixed_split_size": None, "disable_split_kv": False})
    qo_indptr = torch.arange(len(lens) + 1, dtype=torch.int32) * q_len
    for step in range(steps):
        indptr, indices, last = _device_metadata(table, lens, page_size)
        wrapper.plan(qo_indptr, indptr, indices, last, 32, 8, 128, page_size, causal=True,
                     q_data_type=torch.bfloat16, seq_lens=lens)
        out = wrapper.run(q.reshape(-1, 32, 128), (k, v)).view(q.shape)
        ref = paged_decode_reference(q, k, v, table, torch.from_numpy(lens).cuda().int(), causal=True)
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"step {step}: {m}")
        lens = lens + 1
    assert wrapper.plans + wrapper.plans_reused == steps


def test_without_host_lengths_the_standard_plan_runs():
    lens = np.array([100, 700], dtype=np.int64)
    q, k, v, table = _growing_problem(lens, 1, steps=1)
    workspace = torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace)
    indptr, indices, last = _device_metadata(table, lens, 1)
    wrapper.plan(indptr, indices, last, 32, 8, 128, 1, q_data_type=torch.bfloat16)
    assert wrapper.standard_plans == 1
    ref = paged_decode_reference(q, k, v, table, torch.from_numpy(lens).cuda().int(), causal=True)[:, 0]
    torch.testing.assert_close(wrapper.run(q[:, 0], (k, v)), ref, **TOL)


def test_decode_attention_runs_flashinfer_given_host_lengths():
    shape = DecodeShape(batch=3, kv_len=600)
    inputs = make_decode_inputs(shape, device="cuda")
    lens = np.array([600, 250, 17], dtype=np.int64)
    seqlens = torch.from_numpy(lens).int().cuda()
    ref = paged_decode_reference(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, seqlens, causal=True)
    config = {"backend": "flashinfer", "use_tensor_cores": True, "flashinfer_backend": "fa2", "fixed_split_size": None,
              "disable_split_kv": False}
    out = decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, seqlens, 600,
                           seq_lens_host=lens, config=config)
    torch.testing.assert_close(out, ref, **TOL)
    # host lengths missing: the default backend runs instead, same answer
    out = decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, seqlens, 600, config=config)
    torch.testing.assert_close(out, ref, **TOL)
    direct = paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, lens,
                             {k: v for k, v in config.items() if k != "backend"})
    torch.testing.assert_close(direct, ref, **TOL)


def test_a_sweeps_rotation_of_length_draws_replays_each_draws_own_plan():
    """Issue 36: the sweep's timer captures one call per length draw into one CUDA graph.
    FlashInfer cannot plan inside a capture, so each draw must have planned before it, on a
    wrapper of its own (draws sharing one re-planned inside the capture, which failed). Every
    config, replayed twice, matches each draw's reference."""
    op = get_op("flashinfer")
    shape = DecodeShape(batch=4, kv_len=8192, lengths="serving")
    draws = [[8192, 40, 40, 40], [300, 8192, 8000, 5000], [17, 17, 8192, 17]]
    inputs = [make_decode_inputs(shape, device="cuda", seed=i, seq_lens=lens) for i, lens in enumerate(draws)]
    refs = [i.reference() for i in inputs]
    stream = torch.cuda.Stream()
    for config in op.configs(shape):
        for i in inputs:  # warm-up, outside the capture, as the timer's (one draw) or a check's
            op.run(i, config)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin()
            outs = [op.run(i, config) for i in inputs]
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            for lens, out, ref in zip(draws, outs, refs):
                torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"{config}, lengths {lens}: {m}")
        del graph, outs


def test_a_serving_sweep_of_flashinfer_measures_every_config_in_one_process(tmp_path):
    """Issue 36's sweep died with an illegal memory access while FlashInfer was in its space
    on mixed lengths. The sweep's own path: every config checked and timed under CUDA-graph
    replay (none timed eagerly after a failed capture), none fails."""
    from tuner.db import TuningDB, current_fingerprint_id
    from tuner.sweep import MEASURED, sweep

    shape = DecodeShape(batch=4, kv_len=65536, lengths="serving")  # 32/8 heads: every FlashInfer kernel runs
    with TuningDB(tmp_path / "fi.db") as db:
        [result] = sweep(get_op("flashinfer"), [shape], db, strategy="exhaustive")
        torch.cuda.synchronize()  # a fault would surface here, if not before
        assert result.status == MEASURED and result.failures == 0 and result.measured > 1, result
        rows = [m for r in db.records() for m in db.measurements(r.problem, current_fingerprint_id())]
    assert rows and all(r.method.get("timer") == "cuda-graph" and "capture" not in r.method for r in rows), \
        [r.method for r in rows if "capture" in r.method]
