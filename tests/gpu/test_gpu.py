"""On the H200: the CUDA-graph timer and FA3, for real. Skipped without a CUDA GPU."""

import pytest
import torch

import tuner
from tuner.bench import CudaGraphTimer
from tuner.db import TuningDB
from tuner.ops import get_op
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.sweep import MEASURED, kv_copies, sweep

pytestmark = pytest.mark.gpu


def test_cuda_graph_timer_captures_and_rotates():
    a = [torch.randn(1024, 1024, device="cuda") for _ in range(4)]
    timer = CudaGraphTimer(warmup=2, repeats=5)
    timing = timer([lambda x=x: x @ x for x in a])
    assert not timer.last_capture_failed
    assert timing.samples == 5 and timing.median_us > 0 and timing.spread_us >= 0
    fast, slow = timer.paired([lambda: a[0] + 1], [lambda: a[0] @ a[0] @ a[0]])
    assert fast.samples == slow.samples == 5


def test_kv_copies_exceed_the_l2_by_the_bytes_a_call_reads():
    inputs = make_decode_inputs(DecodeShape(batch=1, kv_len=512), device="cuda")
    n = kv_copies(inputs, "cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    assert n > 1 and n * inputs.kv_bytes >= min(2 * l2, 64 * inputs.kv_bytes)
    big = make_decode_inputs(DecodeShape(batch=64, kv_len=8192), device="cuda")
    assert kv_copies(big, "cuda") == 1
    # as much allocated, but a window-4095 call reads 1/16 of it: copies again
    windowed = make_decode_inputs(DecodeShape(batch=4, kv_len=65536, window=(4095, 0)), device="cuda")
    assert kv_copies(windowed, "cuda") > 1


FA3_SHAPES = [
    DecodeShape(batch=3, kv_len=700),
    DecodeShape(batch=2, kv_len=1000, num_q_heads=8, num_kv_heads=1),
    DecodeShape(batch=2, kv_len=900, q_len=4),
    DecodeShape(batch=2, kv_len=900, window=(128, 0)),
    DecodeShape(batch=2, kv_len=900, softcap=30.0),
    DecodeShape(batch=2, kv_len=900, sinks=True),
    DecodeShape(batch=2, kv_len=900, page_size=16, dtype="float16"),
]


@pytest.mark.parametrize("shape", FA3_SHAPES, ids=lambda s: s.label())
def test_fa3_every_config_matches_the_reference(shape):
    op = get_op("fa3")
    if op.unavailable():
        pytest.skip(op.unavailable())
    inputs = make_decode_inputs(shape, device="cuda")
    ref = inputs.reference()
    atol, rtol = op.tolerance[shape.dtype]
    for config in op.configs(shape):
        torch.testing.assert_close(op.run(inputs, config), ref, atol=atol, rtol=rtol, msg=lambda m: f"{config}: {m}")


def test_fa3_sweep_then_drop_in_uses_the_winner(tmp_path):
    op = get_op("fa3")
    if op.unavailable():
        pytest.skip(op.unavailable())
    from tuner.integrations import fa3

    shape = DecodeShape(batch=1, kv_len=8192, num_q_heads=8, num_kv_heads=1)
    db_path = tmp_path / "gpu.db"
    [result] = sweep(op, [shape], TuningDB(db_path), timer=CudaGraphTimer(warmup=2, repeats=5))
    assert result.status == MEASURED and result.failures == 0
    tuner.configure(db=db_path, mode="lookup")
    inputs = make_decode_inputs(shape, device="cuda")
    out = fa3.flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, cache_seqlens=inputs.cache_seqlens,
                                      page_table=inputs.page_table, causal=True)
    assert list(fa3.flash_attn_with_kvcache.tuner.memo.values()) == [result.winner]
    torch.testing.assert_close(out, inputs.reference(), atol=1.6e-2, rtol=1.6e-2)


def test_decode_attention_sweeps_across_backends_and_dispatches(tmp_path):
    from tuner.integrations.decode_attention import decode_attention
    from tuner.ops.decode_attention import BACKENDS

    op = get_op("decode_attention")
    shape = DecodeShape(batch=1, kv_len=2048, num_q_heads=8, num_kv_heads=1)
    db_path = tmp_path / "gpu.db"
    [result] = sweep(op, [shape], TuningDB(db_path), timer=CudaGraphTimer(warmup=2, repeats=5))
    assert result.status == MEASURED and result.failures == 0
    backends = {m.config["backend"] for m in TuningDB(db_path).measurements(
        TuningDB(db_path).records()[0].problem, TuningDB(db_path).records()[0].fingerprint_id)}
    assert backends == {name for name, backend in BACKENDS.items() if backend.op.unavailable() is None}
    tuner.configure(db=db_path, mode="lookup")
    inputs = make_decode_inputs(shape, device="cuda")
    out = decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                           shape.kv_len, causal=True, seq_lens_host=inputs.cache_seqlens.cpu())
    assert list(decode_attention.tuner.memo.values()) == [result.winner]
    torch.testing.assert_close(out, inputs.reference(), atol=1.6e-2, rtol=1.6e-2)


def test_decode_attention_writes_into_a_given_out_on_fa3_and_triton():
    """out= (as SGLang hands its FA3 calls a layer's output buffer): FA3 and the Triton kernel
    write the output there, equal to what they return without it."""
    from tuner.integrations.decode_attention import decode_attention

    if get_op("fa3").unavailable():
        pytest.skip(get_op("fa3").unavailable())
    shape = DecodeShape(batch=8, kv_len=4096, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    inputs = make_decode_inputs(shape, device="cuda", seq_lens=[4096, 100, 2000, 3000, 1, 4096, 777, 1500])
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, shape.kv_len)
    for config in ({"backend": "fa3", "num_splits": 0, "pack_gqa": None},
                   {"backend": "fa3", "num_splits": 8, "pack_gqa": True},
                   {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 1, "num_warps": 4, "num_stages": 2},
                   {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 16, "num_warps": 4, "num_stages": 2}):
        plain = decode_attention(*args, config=config)
        buffer = torch.full((shape.batch * shape.num_q_heads * shape.head_dim,), float("nan"), dtype=torch.bfloat16,
                            device="cuda")
        out = buffer.view(shape.batch, 1, shape.num_q_heads, shape.head_dim)
        assert decode_attention(*args, config=config, out=out) is out, config
        torch.cuda.synchronize()
        torch.testing.assert_close(out, plain, atol=0, rtol=0)


def test_decode_attention_on_a_q_strided_over_its_batch_matches_its_contiguous_copy():
    """SGLang's q is a slice of its qkv projection's rows: the Triton kernel (the split kernel
    and the length-adaptive one) and FA3 read it in place; outputs as over a contiguous copy."""
    from tuner.integrations.decode_attention import decode_attention

    shape = DecodeShape(batch=8, kv_len=4096, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    inputs = make_decode_inputs(shape, device="cuda", seq_lens=[4096, 100, 2000, 3000, 1, 4096, 777, 1500])
    qkv = torch.randn(shape.batch, 1, 48, shape.head_dim, dtype=torch.bfloat16, device="cuda")
    strided = qkv[:, :, :shape.num_q_heads]
    strided.copy_(inputs.q)
    rest = (inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, shape.kv_len)
    configs = [{"backend": "triton_decode", "block_n": 64, "num_kv_splits": 16, "num_warps": 4, "num_stages": 2},
               {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 16, "num_warps": 4, "num_stages": 2,
                "tokens_per_split": 512}]
    if not get_op("fa3").unavailable():
        configs += [{"backend": "fa3", "num_splits": 8, "pack_gqa": True},
                    {"backend": "fa3", "num_splits": 0, "pack_gqa": None}, {"backend": "fa3", "num_splits": 1,
                                                                          "pack_gqa": False}]
    for config in configs:
        torch.testing.assert_close(decode_attention(strided, *rest, config=config),
                                   decode_attention(inputs.q, *rest, config=config), atol=0, rtol=0)


def test_decode_attention_wave_fit_caps_fa3_on_a_spilling_batch_and_matches_the_reference():
    """A batch whose FA3 tiles spill past one wave (3 sequences of 8.2k-11k keys, 8 kv heads:
    136 tiles on 132 SMs): the wave_fit config runs FA3 capped at 5 splits, with the same output."""
    from tuner.integrations.decode_attention import decode_attention, eager_config

    if get_op("fa3").unavailable():
        pytest.skip(get_op("fa3").unavailable())
    lengths = [11049, 10500, 8200]
    shape = DecodeShape(batch=3, kv_len=11049, num_q_heads=48, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    inputs = make_decode_inputs(shape, device="cuda", seq_lens=lengths, table_width=11056)
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, shape.kv_len)
    wave = {"backend": "fa3", "num_splits": 0, "pack_gqa": None, "wave_fit": True}
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert eager_config(wave, *args, seq_lens_host=lengths)["num_splits"] == 5
    out = decode_attention(*args, seq_lens_host=lengths, config=wave)
    torch.testing.assert_close(out.float(), inputs.reference().float(), atol=2e-2, rtol=2e-2)


def test_the_wave_fit_model_gives_the_split_counts_fa3s_own_scheduler_computes():
    """tuner.ops.fa3_waves models FA3's varlen scheduler on the host. FA3's scheduler metadata
    (sgl-kernel's get_scheduler_metadata) holds each sequence's split count as the device
    computes it, in batch order or in the order of a batch-index array beside it (FA3 may sort
    its batches: virtual batch index -> batch index). The model's counts must be found there in
    one of those orders (on the H200, batch 3 held them shortest first; on the H100, batch 5
    held 5, 2, 6, 2, 2 for the model's 5, 6, 2, 2, 2)."""
    import numpy as np

    from tuner.ops.fa3_waves import block_n, dynamic_splits, static_splits

    if get_op("fa3").unavailable():
        pytest.skip(get_op("fa3").unavailable())
    from sgl_kernel.flash_attn import get_scheduler_metadata

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rng = np.random.default_rng(0)
    checked = 0
    for batch in (3, 5, 7, 9, 12):
        lengths = rng.integers(2000, 40000, size=batch)
        width = int(-(-lengths.max() // 16) * 16)
        n_blocks = -(-lengths // block_n(128))
        expected = dynamic_splits(n_blocks, 1, 8, static_splits(8, width, 128, sms), sms).tolist()
        if len(set(expected)) < 2:
            continue  # a vector of one value could be found anywhere
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        meta = get_scheduler_metadata(batch, 1, width, 48, 8, 128, lens, qkv_dtype=torch.bfloat16,
                                      cu_seqlens_q=cu, page_size=1, causal=True).tolist()
        windows = [tuple(meta[i:i + batch]) for i in range(len(meta) - batch + 1)]
        # batch order, and the order of every window that is a permutation of the batch's indices
        orders = {tuple(expected)} | {tuple(expected[j] for j in w) for w in windows
                                      if sorted(w) == list(range(batch))}
        longest_first = tuple(s for _, s in sorted(zip(-lengths, expected), key=lambda t: t[0]))
        orders |= {longest_first, longest_first[::-1]}  # where no index array is kept beside them
        assert orders & set(windows), (batch, expected, meta[:64])
        checked += 1
    assert checked >= 3


def test_the_replay_judge_times_real_graph_replays_and_drops_the_slower_one():
    """tuner.integrations.replay_judge with CUDA events around real graph replays, as SGLang's
    hooks drive it: a variant doing twice the base graph's work is dropped, one doing half is
    kept, and no event is read before it is done (elapsed_time would raise). Graphs are given
    as (batch size 1, label); None from the judge is the base graph."""
    from tuner.integrations.replay_judge import ReplayJudge

    a = torch.randn(2048, 2048, device="cuda")
    graphs = {}
    for label, matmuls in (("base", 4), ("slow", 8), ("fast", 2)):
        for _ in range(2):  # warm-up, as before a capture
            for _ in range(matmuls):
                a @ a
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(matmuls):
                a @ a
        graphs[label] = graph
    dropped = []
    judge = ReplayJudge(8, 0.01, on_drop=lambda batch, label, ratio: dropped.append((label, ratio)))
    for label in ("slow", "fast"):
        for _ in range(200):  # as a server's steps: the README's pattern
            with judge.replaying(1, label) as chosen:
                graphs[chosen or "base"].replay()
            if not judge.judging(1, label):
                break
        torch.cuda.synchronize()
        judge.tick()  # the next step reads what is done (the host may have run ahead of the GPU)
    assert [label for label, _ in dropped] == ["slow"] and dropped[0][1] > 1.5, dropped
    assert set(judge.verdicts) == {(1, "slow"), (1, "fast")} and judge.verdicts[(1, "fast")] < 0.8, judge.verdicts
