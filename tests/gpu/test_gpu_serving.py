"""On the H200: the drop-ins as a server drives them (issue 10). FA3 with the scheduler
metadata SGLang precomputes; decode_attention over a persistent page table updated in place,
eagerly and under CUDA-graph replay; a CUDA-graph FlashInfer wrapper whose later plans take
the standard path. Every step is checked against the torch reference. Skipped without CUDA."""

import numpy as np
import pytest
import torch

import tuner
from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
from tuner.keys import attention_run_key
from tuner.workload import DecodeShape, paged_decode_reference
from tuner.integrations.fa3 import flash_attn_with_kvcache
from tuner.ops import fa3 as fa3_op
from tuner.ops import flashinfer as fi
from tuner.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from tuner.integrations.decode_attention import decode_attention
from tuner.ops.decode_attention import by_fill
from tuner.ops.flashinfer_plan import paged_metadata

pytestmark = pytest.mark.gpu
TOL = dict(atol=2e-2, rtol=2e-2)
HEADS, KV_HEADS, DIM = 32, 8, 128


def _cache(num_pages, page_size=1, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(num_pages, page_size, KV_HEADS, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    return k, torch.randn_like(k)


def _query(batch, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(batch, 1, HEADS, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)


def _reference(q, k, v, table, lens):
    return paged_decode_reference(q, k, v, table, lens, causal=True)


def _store_fa3(db_path, batch, width, config):
    key = tuner.keys.static_key_from_parts(
        q_dtype="bfloat16", k_dtype="bfloat16", v_dtype="bfloat16", num_q_heads=HEADS, num_kv_heads=KV_HEADS,
        head_dim_qk=DIM, head_dim_v=DIM, page_size=1, causal=True, window_size=None, softcap=None, sinks=False,
        k_descale=False, v_descale=False)
    db = TuningDB(db_path)
    db.save_record(Problem("fa3", key.to_json(), attention_run_key(batch, 1, width)),
                   (current_fingerprint_id(), current_fingerprint()), config, median_us=1.0, spread_us=0.0, samples=3,
                   default_config=dict(fa3_op.DEFAULT), default_median_us=2.0, default_spread_us=0.0, method={})
    db.close()


def test_fa3_with_scheduler_metadata_keeps_its_plan_and_matches_the_reference(tmp_path):
    if fa3_op.unavailable():
        pytest.skip(fa3_op.unavailable())
    from sgl_kernel.flash_attn import get_scheduler_metadata

    batch, width = 8, 4096
    _store_fa3(tmp_path / "t.db", batch, width, {"num_splits": 16, "pack_gqa": False})  # a winner unlike 0/None
    tuner.configure(db=tmp_path / "t.db", mode="lookup")
    k, v = _cache(batch * width)
    table = torch.randperm(batch * width, device="cuda").view(batch, width).int()
    lens = torch.tensor([4000, 17, 2500, 900, 4096, 1, 3333, 64], dtype=torch.int32, device="cuda")
    q = _query(batch)
    ref = _reference(q, k, v, table, lens)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")

    def call(**kwargs):  # as SGLang's forward_decode: q as [tokens, heads, dim] with cu_seqlens_q
        out = flash_attn_with_kvcache(q.view(batch, HEADS, DIM), k, v, page_table=table, cache_seqlens=lens,
                                             cu_seqlens_q=cu, max_seqlen_q=1, causal=True, **kwargs)
        return out.view(batch, 1, HEADS, DIM)

    for num_splits, pack_gqa in ((0, None), (4, True)):  # SGLang's (0, None); and explicit values in both calls
        meta = get_scheduler_metadata(batch, 1, width, HEADS, KV_HEADS, DIM, lens, qkv_dtype=torch.bfloat16,
                                      cu_seqlens_q=cu, page_size=1, causal=True, num_splits=num_splits,
                                      pack_gqa=pack_gqa)
        torch.testing.assert_close(call(scheduler_metadata=meta, num_splits=num_splits, pack_gqa=pack_gqa), ref,
                                   **TOL)
    # metadata built with sgl-kernel's defaults, the call leaving num_splits and pack_gqa to their
    # defaults too: a tuned (16, False) here would run a plan made for another split count
    meta = get_scheduler_metadata(batch, 1, width, HEADS, KV_HEADS, DIM, lens, qkv_dtype=torch.bfloat16,
                                  cu_seqlens_q=cu, page_size=1, causal=True)
    torch.testing.assert_close(call(scheduler_metadata=meta), ref, **TOL)
    torch.testing.assert_close(call(num_splits=0), ref, **TOL)  # no metadata: the tuned (16, False)
    torch.testing.assert_close(call(), ref, **TOL)
    memo = flash_attn_with_kvcache.tuner.memo  # the caller's values: no key; its choice: tuned
    assert {k[0] is None: c for k, c in memo.items()} == {True: dict(fa3_op.DEFAULT),
                                                          False: {"num_splits": 16, "pack_gqa": False}}


def _decode_steps(batch, width, steps, seed=0):
    """Per step: a new mixed set of lengths in [1, width] and a new page permutation, written
    into the persistent page table and lengths in place, as a server's buffers are."""
    gen = np.random.default_rng(seed)
    lens = np.array([100, 200, 256, 50] if (batch, width) == (4, 256) else gen.integers(1, width + 1, size=batch))
    for step in range(steps):
        if step % 3 == 2:  # the lengths hold for three steps while the pages change under them
            lens = gen.integers(1, width + 1, size=batch)
        pages = torch.from_numpy(gen.permutation(batch * width).astype(np.int32)).view(batch, width)
        yield lens.astype(np.int64), pages


CONFIGS = {
    "flashinfer-tc": {"backend": "flashinfer", "use_tensor_cores": True, "flashinfer_backend": "fa2",
                      "fixed_split_size": None, "disable_split_kv": False},
    "flashinfer-cuda-cores": {"backend": "flashinfer", **fi.DECODE_DEFAULT},
    "fa3": {"backend": "fa3", "num_splits": 0, "pack_gqa": None},
    "triton": {"backend": "triton_decode", "block_n": 32, "num_kv_splits": 4, "num_warps": 4, "num_stages": 2},
    # a dense pass's record: its two configs chosen per call from the host lengths' fill
    "by_fill": by_fill({"backend": "triton_decode", "block_n": 64, "num_kv_splits": 8, "num_warps": 4, "num_stages": 2},
                       {"backend": "triton_decode", "block_n": 32, "num_kv_splits": 4, "num_warps": 4, "num_stages": 2}),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_attention_reads_each_steps_pages_from_a_table_updated_in_place(name):
    """FlashInfer 0.6.15.post1, lengths [100, 200, 256, 50] in a 256-wide table updated in
    place: max error 0.002 at step 1, 1.26 and 1.15 at steps 2 and 3 before the fix."""
    config = CONFIGS[name]
    if config["backend"] == "flashinfer" and fi.unavailable():
        pytest.skip(fi.unavailable())
    if config["backend"] == "fa3" and fa3_op.unavailable():
        pytest.skip(fa3_op.unavailable())
    batch, width = 4, 256
    k, v = _cache(batch * width)
    q = _query(batch)
    table = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    lens_dev = torch.zeros(batch, dtype=torch.int32, device="cuda")
    for step, (lens, pages) in enumerate(_decode_steps(batch, width, 12)):
        table.copy_(pages)
        lens_dev.copy_(torch.from_numpy(lens))
        out = decode_attention(q, k, v, table, lens_dev, width, seq_lens_host=lens, config=config)
        torch.testing.assert_close(out, _reference(q, k, v, table, lens_dev), **TOL, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_attention_under_graph_replay_reads_the_live_table(name):
    """Captured once per batch size and replayed over new pages and lengths: a FlashInfer
    winner is replaced at capture by the default backend, whose kernels read the live tensors."""
    config = CONFIGS[name]
    if config["backend"] == "fa3" and fa3_op.unavailable():
        pytest.skip(fa3_op.unavailable())
    batch, width = 6, 512
    k, v = _cache(batch * width)
    q = _query(batch)
    steps = list(_decode_steps(batch, width, 10, seed=3))
    table = steps[0][1].cuda().contiguous()
    lens_dev = torch.from_numpy(steps[0][0]).int().cuda()
    decode_attention(q, k, v, table, lens_dev, width, seq_lens_host=steps[0][0], config=config)  # warm-up
    decode_attention(q, k, v, table, lens_dev, width)  # the default backend too (what capture falls back to)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, table, lens_dev, width, seq_lens_host=steps[0][0], config=config)
    for step, (lens, pages) in enumerate(steps[1:]):
        table.copy_(pages)
        lens_dev.copy_(torch.from_numpy(lens))
        graph.replay()
        torch.testing.assert_close(out, _reference(q, k, v, table, lens_dev), **TOL, msg=lambda m: f"step {step}: {m}")


def test_a_graph_flashinfer_wrapper_stays_on_its_inner_wrapper_when_a_plan_takes_the_standard_path(tmp_path):
    if fi.unavailable():
        pytest.skip(fi.unavailable())
    batch, page_size, width = 4, 16, 128  # pages per sequence: room for 2048 tokens
    # the DB's winner for the first plan is a tensor-core config; the standard path's default
    # is FlashInfer's CUDA-core one: the plan that switched to it left the graph on a stale plan
    static = DecodeShape(batch=batch, kv_len=1024, num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                         page_size=page_size).static_key().to_json()
    db = TuningDB(tmp_path / "fi.db")
    db.save_record(Problem("flashinfer", static, attention_run_key(batch, 1, 1024)),
                   (current_fingerprint_id(), current_fingerprint()),
                   {k: v for k, v in CONFIGS["flashinfer-tc"].items() if k != "backend"}, median_us=1.0,
                   spread_us=0.0, samples=3, default_config=dict(fi.DECODE_DEFAULT), default_median_us=2.0,
                   default_spread_us=0.0, method={})
    db.close()
    tuner.configure(db=tmp_path / "fi.db", mode="lookup")
    k, v = _cache(batch * width, page_size)
    q = _query(batch)[:, 0].contiguous()
    table = torch.randperm(batch * width, device="cuda").view(batch, width).int()
    buffers = dict(paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
                   paged_kv_indices_buffer=torch.zeros(batch * width, dtype=torch.int32, device="cuda"),
                   paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device="cuda"))
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, use_cuda_graph=True, **buffers)

    def plan(lens, host):
        indptr, last = paged_metadata(lens, page_size)
        indices = torch.cat([table[i, :n] for i, n in enumerate(np.diff(indptr))])
        indptr_d, last_d = torch.from_numpy(indptr).cuda(), torch.from_numpy(last).cuda()
        wrapper.plan(indptr_d, indices, last_d, HEADS, KV_HEADS, DIM, page_size, q_data_type=torch.bfloat16,
                     seq_lens=lens if host else None)

    lens = np.array([300, 800, 50, 1000], dtype=np.int64)
    plan(lens, host=True)
    out = wrapper.run(q, (k, v))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wrapper.run(q, (k, v))
    for step in range(12):
        lens = lens + 7
        plan(lens, host=step % 3 != 1)  # every third plan without host lengths: FlashInfer's standard path
        graph.replay()
        ref = _reference(q[:, None], k, v, table, torch.from_numpy(lens).int().cuda())[:, 0]
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"step {step}: {m}")
    assert len(wrapper._inners) == 1 and wrapper.standard_plans > 0
    assert wrapper.use_tensor_cores  # the DB's config, pinned


def test_the_fingerprint_names_the_kernel_libraries_versions():
    if fa3_op.unavailable() is not None and fi.unavailable() is not None:
        pytest.skip("neither sgl-kernel nor FlashInfer is installed")
    fp = current_fingerprint()
    if fa3_op.unavailable() is None:
        assert fp["sgl_kernel"]
    if fi.unavailable() is None:
        import flashinfer

        assert fp["flashinfer"] == flashinfer.__version__


def test_a_graph_captured_inside_graph_capture_freezes_the_declared_config_and_replays_right(tmp_path):
    """Issue 12: a decode graph captured with the server's max context as the bound, inside
    tuner.graph_capture(lengths), freezes the winner of the declared lengths (here a Triton
    config stored at kv 2048), not the bound's (none: FA3's default); its replays over a
    persistent table and lengths updated in place match the reference at every step."""
    from tuner.keys import static_key_from_parts
    from tuner.ops.triton_decode import TRITON_DECODE

    if TRITON_DECODE.unavailable():
        pytest.skip(TRITON_DECODE.unavailable())
    batch, bound, pool = 4, 131072, 4 * 4096
    winner = {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 8, "num_warps": 4, "num_stages": 2}
    key = static_key_from_parts(
        q_dtype="bfloat16", k_dtype="bfloat16", v_dtype="bfloat16", num_q_heads=HEADS, num_kv_heads=KV_HEADS,
        head_dim_qk=DIM, head_dim_v=DIM, page_size=1, causal=True, window_size=None, softcap=None, sinks=False,
        k_descale=False, v_descale=False)
    db = TuningDB(tmp_path / "t.db")
    db.save_record(Problem("decode_attention", key.to_json(), attention_run_key(batch, 1, 2048)),
                   (current_fingerprint_id(), current_fingerprint()), winner, median_us=1.0, spread_us=0.0,
                   samples=3, default_config={"backend": "fa3", "num_splits": 0, "pack_gqa": None},
                   default_median_us=2.0, default_spread_us=0.0, method={})
    db.close()
    tuner.configure(db=tmp_path / "t.db", shipped="off", mode="lookup")
    k, v = _cache(pool)
    q = _query(batch)
    table = torch.zeros(batch, bound, dtype=torch.int32, device="cuda")  # as wide as the max context
    lens = torch.zeros(batch, dtype=torch.int32, device="cuda")

    def step(seed):  # the server's in-place update of its persistent buffers
        gen = torch.Generator().manual_seed(seed)
        new_lens = torch.randint(1, 4096, (batch,), generator=gen, dtype=torch.int32)
        table.zero_()
        table[:, :4096] = torch.randperm(pool, generator=gen)[: batch * 4096].view(batch, 4096).int().cuda()
        lens.copy_(new_lens.cuda())

    step(0)
    call = (q, k, v, table, lens, bound)
    with tuner.graph_capture([1500, 1800, 2000, 1200]):
        assert decode_attention.tuner.config_for(*call) == winner
        decode_attention(*call)  # warm-up, as a server runs one before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_attention(*call)
    assert decode_attention.tuner.config_for(*call) == {"backend": "fa3", "num_splits": 0, "pack_gqa": None}
    for seed in range(1, 6):
        step(seed)
        graph.replay()
        torch.testing.assert_close(out, _reference(q, k, v, table, lens), **TOL)


def test_a_shapes_triton_candidates_are_built_ahead_and_running_them_builds_nothing_more():
    """Issue 12 item 4: the sweep builds a shape's Triton candidates in parallel before
    timing any; running each afterwards finds its kernels built. Head dim 80 (a shape no
    other test runs) so that they are not built already."""
    from tuner.ops import get_op
    from tuner.workload import make_decode_inputs
    from tuner.ops.triton_decode import _kernels

    op = get_op("triton_decode")
    shape = DecodeShape(batch=3, kv_len=1500, num_q_heads=8, num_kv_heads=2, head_dim=80, dtype="bfloat16")
    inputs = make_decode_inputs(shape, device="cuda", seq_lens=[1500, 700, 40])
    configs = op.configs(shape)
    kernels = _kernels(False)  # every stage-1 kernel and the merge

    def built():
        return sum(len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels)

    before = built()
    op.precompile(inputs, configs)
    after = built()
    assert after > before
    reference = inputs.reference()
    for config in configs:
        torch.testing.assert_close(op.run(inputs, config).float(), reference.float(), **TOL)
    assert built() == after


def test_the_quick_timer_takes_two_samples_of_a_long_call_and_every_sample_of_a_short_one():
    from tuner.bench import CudaGraphTimer

    def long_call():
        torch.cuda._sleep(3_000_000)  # about 1.5 ms at H200 clocks

    # two 1.5 ms samples pass the budget; five ~0.2 ms ones (a short call's) do not
    quick = CudaGraphTimer(warmup=1, repeats=5, budget_us=2000.0)
    assert quick(long_call).samples == 2
    assert CudaGraphTimer(warmup=1, repeats=5)(long_call).samples == 5
    x = torch.zeros(16, device="cuda")
    assert quick(lambda: x.add_(1)).samples == 5


def test_a_capture_that_runs_out_of_memory_is_tried_again_and_one_that_cannot_be_captured_runs_eagerly():
    from tuner.bench import CudaGraphTimer

    x = torch.zeros(16, device="cuda")
    attempts = []

    def flaky():  # the first capture runs out of memory, the next one fits
        if torch.cuda.is_current_stream_capturing():
            attempts.append(1)
            if len(attempts) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (test)")
        x.add_(1)

    timer = CudaGraphTimer(warmup=1, repeats=3)
    timer(flaky)
    assert len(attempts) == 2 and not timer.last_capture_failed

    def host_sync():  # reads the device back: no capture can hold it
        return float(x.sum())

    timer(host_sync)
    assert timer.last_capture_failed and timer.method["capture"] == "failed, timed eagerly"


def test_a_serving_sweep_on_the_gpu_stores_winners_that_hold_on_every_batch_of_the_mix(tmp_path):
    """The serving sweep end to end on the H200: kernels built ahead, CUDA-graph timing of
    the mixed-length trial, the winner confirmed against FA3's default on each batch of the
    mix (tuner.bench.decide's parts); FlashInfer left out, as for graphs."""
    from tuner.db import TuningDB
    from tuner.ops import get_op
    from tuner.ops.decode_attention import BY_FILL, backends_only, fill_parts
    from tuner.sweep import MEASURED, sweep

    shapes = [DecodeShape(batch=b, kv_len=kv, num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                          lengths="serving") for b, kv in ((3, 1024), (24, 4096))]
    db = TuningDB(tmp_path / "serving.db")
    with backends_only(["fa3", "triton_decode"]):
        results = sweep(get_op("decode_attention"), shapes, db)
    assert [r.status for r in results] == [MEASURED, MEASURED]
    for r in results:
        assert r.winner["backend"] in ("fa3", "triton_decode", BY_FILL)
        assert r.speedup is None or r.speedup >= 1.0  # a winner beat the default, or is it
    records = db.records()
    assert len(records) == 2 and all(rec.method.get("lengths") == "serving" for rec in records)
    for rec in records:
        # a by_fill record: the dense pass's config beside the plain winner W ("other")
        dense, plain = fill_parts(rec.config) if rec.config["backend"] == BY_FILL else (None, rec.config)
        # a plain winner other than the default held again on a second trial of other lengths
        again = rec.method.get("second_trial")
        if plain != rec.default_config:
            assert again is not None and again["held"] and again["winner_us"] < again["default_us"]
        else:
            assert again is None or not again["held"]
        if dense is not None:  # and a dense config held by its own rule (it loses nowhere)
            assert rec.method["dense_pass"]["second_trial"]["held"] and not rec.method["dense_pass"]["kept"]


def test_a_plain_capture_after_a_warm_up_call_does_not_freeze_the_bounds_winner(tmp_path):
    """Issue 12: a server's warm-up call at the bound memoises the bound's winner; a plain
    torch.cuda.graph capture after it resolves the call again under the frozen rule (the
    bound's winner alone is not a winner at every length: the default), and the eager calls
    after the capture get the memo's winner again."""
    calls = []

    @tuner.autotune("toy_capture", configs=[{"block": 16}, {"block": 64}], default={"block": 32},
                    static_key=lambda x, kv: "toy", run_key=lambda x, kv: (x.shape[0], 1, kv))
    def toy(x, kv, *, config):
        calls.append(config["block"])
        return x * 2

    db = TuningDB(tmp_path / "t.db")
    db.save_record(Problem("toy_capture", '"toy"', attention_run_key(4, 1, 131072)),
                   (current_fingerprint_id(), current_fingerprint()), {"block": 64}, median_us=1.0,
                   spread_us=0.0, samples=3, default_config={"block": 32}, default_median_us=2.0,
                   default_spread_us=0.0, method={})
    db.close()
    tuner.configure(db=tmp_path / "t.db", shipped="off", mode="lookup")
    x = torch.ones(4, device="cuda")
    toy(x, 131072)  # the warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = toy(x, 131072)
    graph.replay()
    torch.cuda.synchronize()
    toy(x, 131072)
    assert calls == [64, 32, 64] and torch.equal(out, x * 2)


@pytest.mark.parametrize("record", [
    {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 128, "num_warps": 4, "num_stages": 2,
     "tokens_per_split": 256},
    # one item per SM: about 190 keys a split at the first replay's load, more than a block
    {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 128, "num_warps": 4, "num_stages": 2,
     "items_per_sm": 1},
    {"backend": "fa3", "num_splits": 4, "pack_gqa": True},
], ids=["triton_by_length", "triton_by_load", "fa3_cap"])
def test_a_plain_capture_runs_its_graph_record_and_replays_right_over_tables_updated_in_place(tmp_path, record):
    """Issue 37: a graph captured at a bound with no declared lengths (a warm-up call, then a
    plain torch.cuda.graph, as SGLang's runner does) runs decode_attention_graph's record for
    its batch size and bound, and each replay over a table and lengths rewritten in place
    matches the reference."""
    if record["backend"] == "fa3" and fa3_op.unavailable():
        pytest.skip(fa3_op.unavailable())
    batch, width = 6, 512
    shape = DecodeShape(batch=batch, kv_len=width, num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                        lengths="graph")
    db = TuningDB(tmp_path / "g.db")
    db.save_record(Problem("decode_attention_graph", shape.static_key().to_json(), shape.run_key()),
                   (current_fingerprint_id(), current_fingerprint()), record, median_us=1.0, spread_us=0.0,
                   samples=3, default_config={"backend": "fa3", "num_splits": 0, "pack_gqa": None},
                   default_median_us=2.0, default_spread_us=0.0, method={"lengths": "graph"})
    db.close()
    tuner.configure(db=tmp_path / "g.db", shipped="off", mode="lookup")
    k, v = _cache(batch * width)
    q = _query(batch)
    steps = list(_decode_steps(batch, width, 10, seed=5))
    table = steps[0][1].cuda().contiguous()
    lens_dev = torch.from_numpy(steps[0][0]).int().cuda()
    with tuner.graph_capture():
        assert decode_attention.tuner.config_for(q, k, v, table, lens_dev, width) == record
    decode_attention(q, k, v, table, lens_dev, width)  # the warm-up, at the bound
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, table, lens_dev, width)
    for step, (lens, pages) in enumerate(steps[1:]):
        table.copy_(pages)
        lens_dev.copy_(torch.from_numpy(lens))
        graph.replay()
        torch.testing.assert_close(out, _reference(q, k, v, table, lens_dev), **TOL, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("record", ["wave_fit", "none"])
def test_graph_variants_of_a_wave_fit_record_replay_fa3_at_the_steps_cap_right(tmp_path, record):
    """A wave_fit record (FA3 capping its own splits from the host lengths), or no record (FA3's
    default), in CUDA graphs: graph variants capture FA3 at the caps steps mostly need (32/8
    heads at batch 3: 5 and 6) beside the base graph, at a 16k bound; steps whose lengths spill
    FA3's tiles past one wave replay the cap graph, the others the base graph, and every replay
    over the persistent table and lengths, updated in place, matches the reference."""
    from tuner.integrations import graph_variants
    from tuner.integrations.graph_variants import GraphVariants
    from tuner.keys import static_key_from_parts

    if fa3_op.FA3.unavailable():
        pytest.skip(fa3_op.FA3.unavailable())
    if record == "none" and not graph_variants._modelled_fa3_installed():
        pytest.skip("an sgl-kernel whose FA3 scheduler the wave model was not read from")
    batch, bound, pool = 3, 16384, 3 * 16384
    wave = {"backend": "fa3", "num_splits": 0, "pack_gqa": None, "wave_fit": True}
    key = static_key_from_parts(
        q_dtype="bfloat16", k_dtype="bfloat16", v_dtype="bfloat16", num_q_heads=HEADS, num_kv_heads=KV_HEADS,
        head_dim_qk=DIM, head_dim_v=DIM, page_size=1, causal=True, window_size=None, softcap=None, sinks=False,
        k_descale=False, v_descale=False)
    with TuningDB(tmp_path / "t.db") as db:
        if record == "wave_fit":
            db.save_record(Problem("decode_attention", key.to_json(), attention_run_key(batch, 1, bound)),
                           (current_fingerprint_id(), current_fingerprint()), wave, median_us=1.0, spread_us=0.0,
                           samples=3, default_config=dict(fa3_op.DEFAULT, backend="fa3"), default_median_us=1.2,
                           default_spread_us=0.0, method={})
    tuner.configure(db=tmp_path / "t.db", shipped="off", mode="lookup")
    k, v = _cache(pool)
    q = _query(batch)
    table = torch.zeros(batch, bound, dtype=torch.int32, device="cuda")
    lens = torch.ones(batch, dtype=torch.int32, device="cuda")
    call = (q, k, v, table, lens, bound)
    variants = GraphVariants()
    plan = variants.plan(batch, [call])
    assert [v.lengths.fa3_cap for v in plan] == [5, 6]
    graphs, outs = {}, {}
    for label, declared in [(None, None)] + [(v.label, v.lengths) for v in plan]:
        with tuner.graph_capture(declared):
            decode_attention(*call)  # warm-up
            torch.cuda.synchronize()
            graphs[label] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[label]):
                outs[label] = decode_attention(*call)
    steps = [[11049, 10500, 8200], [11049, 11000, 11000], [15000, 300, 300], [16384, 9000, 12000]]
    replayed = []
    for seed, step in enumerate(steps):
        gen = torch.Generator().manual_seed(seed)
        table.copy_(torch.randperm(pool, generator=gen)[: batch * bound].view(batch, bound).int().cuda())
        lens.copy_(torch.tensor(step, dtype=torch.int32).cuda())
        label = variants.label(batch, step)
        replayed.append(label)
        graphs[label].replay()
        torch.testing.assert_close(outs[label], _reference(q, k, v, table, lens), **TOL)
    assert replayed[0] == plan[0].label and replayed[1] is None and replayed[2] is None
