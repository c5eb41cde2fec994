"""The Triton split-KV decode against the torch oracle (interpreted on CPU, compiled on CUDA)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tuner.workload import DecodeInputs, make_decode_inputs
from tuner.workload.reference import paged_decode_reference
from tuner.workload.shapes import DecodeShape
from tuner.ops.triton_decode import TRITON_DECODE, triton_paged_decode

# unavailable() also switches the interpreter on (no CUDA) before triton's first import
_WHY = TRITON_DECODE.unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))

ROOT = Path(__file__).resolve().parents[1]
DEVICE = TRITON_DECODE.device()  # interpreted on CPU; compiled on CUDA
# small float32 problems: the interpreter is slow, and float32 makes the comparison tight
BASE = DecodeShape(batch=2, kv_len=80, num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16, dtype="float32")


def _decode(inputs: DecodeInputs, max_kv_len: int | None = None, **kwargs: int) -> torch.Tensor:
    s = inputs.shape
    return triton_paged_decode(
        inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
        max_kv_len=s.kv_len if max_kv_len is None else max_kv_len,
        causal=s.causal, window=s.window, softcap=s.softcap or None, sinks=inputs.sinks, **kwargs,
    )


def _check(inputs: DecodeInputs, out: torch.Tensor, atol: float = 1e-4, rtol: float = 1e-4) -> None:
    ref = inputs.reference()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


CASES = {
    "plain": {},
    "gqa_8_2": dict(num_q_heads=8, num_kv_heads=2),
    "mqa_8_1": dict(num_q_heads=8, num_kv_heads=1),
    "mha_4_4": dict(num_q_heads=4, num_kv_heads=4),
    "mtp_q3_causal": dict(q_len=3),
    "q_len_5_non_causal": dict(q_len=5, causal=False),
    "window_left": dict(window=(20, -1)),
    "window_both_non_causal": dict(window=(12, 5), causal=False, q_len=2),
    # a right bound that hides keys from the earlier queries (the last query sees all)
    "window_right_non_causal": dict(window=(12, 1), causal=False, q_len=4),
    "window_mtp": dict(window=(9, -1), q_len=4),
    "softcap": dict(softcap=0.5),
    "sinks": dict(sinks=True),
    "sinks_window_softcap": dict(sinks=True, window=(16, -1), softcap=2.0, q_len=2),
    "page_size_1": dict(page_size=1),
    "page_size_16_ragged_last_page": dict(page_size=16, kv_len=77),
    "head_dim_40": dict(head_dim=40),
    "head_dim_24_gqa_mtp": dict(head_dim=24, q_len=2, num_q_heads=6, num_kv_heads=3),
    "many_rows": dict(num_q_heads=32, num_kv_heads=1, q_len=3),  # 96 rows: 2 row blocks of 64
    # 2 row blocks whose windows start apart: the merge must find each block's own splits
    "many_rows_window": dict(num_q_heads=32, num_kv_heads=1, q_len=3, window=(15, -1)),  # spans 17, 16
}
# splits over the longest sequence (1, 3), by each sequence's own length (16 keys a split),
# and by the call's load (16 items in all: the interpreter counts one SM)
SPLITS = {"1": dict(num_kv_splits=1), "3": dict(num_kv_splits=3),
          "by_length": dict(num_kv_splits=8, tokens_per_split=16), "by_load": dict(num_kv_splits=8, items_per_sm=16)}


@pytest.mark.parametrize("splits", list(SPLITS))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case: str, splits: str) -> None:
    inputs = make_decode_inputs(dataclasses.replace(BASE, **CASES[case]), device=DEVICE)
    _check(inputs, _decode(inputs, block_n=16, **SPLITS[splits]))


@pytest.mark.parametrize("splits", [dict(num_kv_splits=1), dict(num_kv_splits=4),
                                    dict(num_kv_splits=8, tokens_per_split=16),
                                    dict(num_kv_splits=3, tokens_per_split=16),
                                    dict(num_kv_splits=8, items_per_sm=3), dict(num_kv_splits=8, items_per_sm=40)])
def test_different_lengths_in_one_batch(splits: dict[str, int]) -> None:
    """Each sequence its own length: with tokens_per_split the 150-key one is split in
    (at most) num_kv_splits, the 2-key one not at all, and each writes the right output."""
    shape = dataclasses.replace(BASE, batch=4, kv_len=150, q_len=2, sinks=True, window=(40, -1))
    inputs = make_decode_inputs(shape, device=DEVICE)
    # shorter sequences: the kernel reads their lengths on the device; the page table stays
    inputs.cache_seqlens = torch.tensor([150, 97, 33, 2], dtype=torch.int32, device=DEVICE)
    ref = paged_decode_reference(
        inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
        causal=shape.causal, window=shape.window, sinks=inputs.sinks,
    )
    out = _decode(inputs, max_kv_len=150, block_n=16, **splits)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # the short rows really differ from a full-length run (the lengths were used)
    full = _decode(make_decode_inputs(shape, device=DEVICE), block_n=16, **splits)
    assert (out[1:] - full[1:]).abs().amax() > 1e-2


def test_splits_by_length_over_many_sequences_of_mixed_lengths() -> None:
    """The persistent schedule finds each item's sequence in a prefix sum over every
    sequence: more of them than the smallest such vector (64) holds, one long among short
    ones and some empty, on a few programs that each take many items."""
    shape = dataclasses.replace(BASE, batch=70, kv_len=96, num_q_heads=2, num_kv_heads=1, head_dim=16, sinks=True)
    inputs = make_decode_inputs(shape, device=DEVICE)
    lengths = [96] + [(7 * i) % 41 for i in range(1, 70)]  # 0 to 40, and a 96
    inputs.cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    ref = paged_decode_reference(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                                 causal=shape.causal, window=shape.window, sinks=inputs.sinks)
    for splits in (dict(tokens_per_split=16), dict(items_per_sm=200)):
        out = _decode(inputs, block_n=16, num_kv_splits=8, **splits)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, msg=str(splits))


def _split_size_by_load(monkeypatch: pytest.MonkeyPatch, inputs: DecodeInputs, **kwargs: int) -> tuple[int, int]:
    """The split size a by-load call computed on the device (the slot it leaves the merge
    after the log-sum-exps), and how many splits its partial results hold."""
    empty, held = torch.empty, {}

    def recording_empty(*size, dtype=None, **kw):
        t = empty(*size, dtype=dtype, **kw)
        if dtype == torch.float32:
            held["lse" if len(size) == 1 else "part"] = t
        return t

    monkeypatch.setattr(torch, "empty", recording_empty)
    out = _decode(inputs, **kwargs)
    monkeypatch.undo()
    _check(inputs, out)
    return int(held["lse"][-4:-3].view(torch.int32)), held["part"].shape[3]  # the slot, 16 bytes past the last


def test_splits_by_load_size_the_splits_from_the_batchs_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys over every kv head, shared so that all items come to at most items_per_sm x SMs
    (the interpreter's one SM), after one item per (sequence, kv head) set aside for rounding,
    in whole blocks, one at least: the same config splits a light batch finely and a heavy one
    less, with the lengths read on the device alone."""
    inputs = make_decode_inputs(dataclasses.replace(BASE, sinks=True), device=DEVICE)  # 2 kv heads
    inputs.cache_seqlens = torch.tensor([80, 48], dtype=torch.int32, device=DEVICE)
    # 128 keys x 2 heads over 12 items (16 less 4 set aside): 22 a split (80 keys in 4, 48 in 3:
    # 14 items); room for 8 splits a sequence (16 items over 2 kv heads), more than any load gives
    assert _split_size_by_load(monkeypatch, inputs, block_n=16, num_kv_splits=8, items_per_sm=16) == (22, 5)
    # over 28 items: 10, held to a block of 16
    assert _split_size_by_load(monkeypatch, inputs, block_n=16, num_kv_splits=8, items_per_sm=32)[0] == 16
    # 4 items: the set-aside takes them all, one split each
    assert _split_size_by_load(monkeypatch, inputs, block_n=16, num_kv_splits=8, items_per_sm=4)[0] == 1 << 30
    inputs.cache_seqlens = torch.tensor([80, 80], dtype=torch.int32, device=DEVICE)  # heavier: longer splits
    assert _split_size_by_load(monkeypatch, inputs, block_n=16, num_kv_splits=8, items_per_sm=16)[0] == 27


def test_one_bound_many_loads_each_call_sizes_its_own_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a graph captured at a bound replays: the same max length (far above the lengths) and
    config, lengths that differ call to call, each call's split size its own load's."""
    inputs = make_decode_inputs(dataclasses.replace(BASE, batch=3, kv_len=150, sinks=True), device=DEVICE)
    sizes = []
    for lengths in ([150, 150, 150], [150, 2, 0], [40, 40, 40]):
        inputs.cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        sizes.append(_split_size_by_load(monkeypatch, inputs, max_kv_len=4096, block_n=16, num_kv_splits=64,
                                         items_per_sm=12)[0])
    assert sizes == [150, 51, 40]  # keys x 2 kv heads (900, 304, 240) over 12 items less 6 set aside


@pytest.mark.parametrize("splits", [dict(num_kv_splits=8), dict(num_kv_splits=8, tokens_per_split=16),
                                    dict(num_kv_splits=8, items_per_sm=30)])
def test_the_merge_reads_the_splits_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch, splits: dict) -> None:
    """Chunks of 2 splits: several chunks, the last one part full (7 splits of 150 keys)."""
    import tuner.ops.triton_decode as td

    monkeypatch.setattr(td, "MERGE_TILE", 2 * BASE.head_dim)  # 2 splits of head dim 32
    shape = dataclasses.replace(BASE, batch=3, kv_len=150, sinks=True, q_len=2, window=(100, -1))
    inputs = make_decode_inputs(shape, device=DEVICE)
    inputs.cache_seqlens = torch.tensor([150, 97, 40], dtype=torch.int32, device=DEVICE)
    ref = paged_decode_reference(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                                 causal=shape.causal, window=shape.window, sinks=inputs.sinks)
    torch.testing.assert_close(_decode(inputs, block_n=16, **splits), ref, atol=1e-4, rtol=1e-4)


def test_splits_by_length_within_the_partial_results_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Partial results are held to PART_MAX_BYTES: fewer splits (longer ones), same output."""
    import tuner.ops.triton_decode as td

    inputs = make_decode_inputs(dataclasses.replace(BASE, sinks=True), device=DEVICE)
    # one split's partial results of the whole batch: a float32 row of every (sequence, q head),
    # and its log-sum-exp
    one_split = BASE.batch * BASE.q_len * BASE.num_q_heads * BASE.head_dim * 4
    monkeypatch.setattr(td, "PART_MAX_BYTES", 2 * (one_split + one_split // BASE.head_dim))
    empty, held = torch.empty, []

    def recording_empty(*size, dtype=None, **kwargs):
        t = empty(*size, dtype=dtype, **kwargs)
        if dtype == torch.float32:
            held.append(t.nbytes)
        return t

    monkeypatch.setattr(torch, "empty", recording_empty)
    out = _decode(inputs, block_n=16, num_kv_splits=8, tokens_per_split=16)
    monkeypatch.undo()
    _check(inputs, out)
    assert max(held) == 2 * one_split  # 2 splits, not the 5 that 80 keys in 16s would get


def test_the_even_split_keeps_within_the_grids_third_dimension(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its splits are a CUDA grid's z (at most 65535): more are asked for, fewer are run."""
    import tuner.ops.triton_decode as td

    monkeypatch.setattr(td, "MAX_GRID_Z", 2)
    inputs = make_decode_inputs(dataclasses.replace(BASE, sinks=True), device=DEVICE)
    empty, splits = torch.empty, []

    def recording_empty(*size, dtype=None, **kwargs):
        if dtype == torch.float32 and len(size) == 5:  # the partial outputs: (b, q, head, split, d)
            splits.append(size[3])
        return empty(*size, dtype=dtype, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    out = _decode(inputs, block_n=16, num_kv_splits=5)
    monkeypatch.undo()
    _check(inputs, out)
    assert splits == [2]


def test_an_empty_batch_gives_an_empty_output() -> None:
    inputs = make_decode_inputs(BASE, device=DEVICE)
    for splits in (dict(num_kv_splits=1), dict(num_kv_splits=4), dict(num_kv_splits=4, tokens_per_split=16),
                   dict(num_kv_splits=4, items_per_sm=4)):
        out = triton_paged_decode(inputs.q[:0], inputs.k_cache, inputs.v_cache, inputs.page_table[:0],
                                  inputs.cache_seqlens[:0], max_kv_len=BASE.kv_len, block_n=16, **splits)
        assert out.shape == (0, *inputs.q.shape[1:]), splits


@pytest.mark.parametrize("with_sinks", [False, True])
def test_empty_sequence_outputs_zero(with_sinks: bool) -> None:
    inputs = make_decode_inputs(dataclasses.replace(BASE, sinks=with_sinks), device=DEVICE)
    inputs.cache_seqlens = torch.tensor([80, 0], dtype=torch.int32, device=DEVICE)
    for splits in (dict(num_kv_splits=1), dict(num_kv_splits=4), dict(num_kv_splits=8, tokens_per_split=16),
                   dict(num_kv_splits=8, items_per_sm=8)):
        out = _decode(inputs, block_n=16, **splits)
        assert torch.isfinite(out).all()
        assert out[1].abs().amax() == 0
        assert out[0].abs().amax() > 0
        torch.testing.assert_close(out[0], inputs.reference()[0], atol=1e-4, rtol=1e-4)


def test_more_splits_than_needed() -> None:
    inputs = make_decode_inputs(dataclasses.replace(BASE, kv_len=40, sinks=True), device=DEVICE)
    # max_kv_len far above the real length keeps all 8 splits: most of them get no keys
    for max_kv_len in (40, 4096):
        _check(inputs, _decode(inputs, max_kv_len=max_kv_len, block_n=16, num_kv_splits=8))
        _check(inputs, _decode(inputs, max_kv_len=max_kv_len, block_n=16, num_kv_splits=8, tokens_per_split=16))
        _check(inputs, _decode(inputs, max_kv_len=max_kv_len, block_n=16, num_kv_splits=8, items_per_sm=8))
    _check(inputs, _decode(inputs, block_n=64, num_kv_splits=8))
    with pytest.raises(ValueError, match="tokens_per_split"):
        _decode(inputs, block_n=16, num_kv_splits=8, tokens_per_split=-1)
    with pytest.raises(ValueError, match="items_per_sm"):
        _decode(inputs, block_n=16, num_kv_splits=8, items_per_sm=-1)
    with pytest.raises(ValueError, match="give one"):
        _decode(inputs, block_n=16, num_kv_splits=8, tokens_per_split=16, items_per_sm=4)


def test_every_cpu_tiny_config() -> None:
    shape = TRITON_DECODE.grids["cpu-tiny"][-1]  # the largest: batch 2, kv 128
    inputs = TRITON_DECODE.make_inputs(shape, device=TRITON_DECODE.device())
    ref = inputs.reference()
    configs = TRITON_DECODE.configs(dataclasses.replace(shape, lengths="graph"))  # with the by-load ones
    assert len(configs) >= 6 and any("items_per_sm" in c for c in configs)
    atol, rtol = TRITON_DECODE.tolerance[shape.dtype]
    for config in configs:
        torch.testing.assert_close(TRITON_DECODE.run(inputs, config), ref, atol=atol, rtol=rtol, msg=str(config))


def test_op_config_space() -> None:
    op = TRITON_DECODE
    assert op.name == "triton_decode"
    assert op.unavailable() is None
    assert op.device() == ("cuda" if torch.cuda.is_available() else "cpu")
    for name, shapes in op.grids.items():
        assert shapes, name
        for shape in shapes:
            configs = op.configs(shape)
            keys = [tuple(sorted(c.items())) for c in configs]
            assert len(keys) == len(set(keys)), f"duplicate configs for {shape.label()}"
            if not torch.cuda.is_available() or name.startswith("cpu"):
                assert op.default(shape) in configs, shape.label()
    # no split left without keys: kv 64 in blocks of 32 holds 2 splits, not 4
    tiny = DecodeShape(batch=1, kv_len=64, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, dtype="float32")
    pairs = {(c["block_n"], c["num_kv_splits"]) for c in op.configs(tiny)}
    assert (32, 2) in pairs and (32, 4) not in pairs and (64, 1) in pairs and (64, 2) not in pairs
    if not torch.cuda.is_available():  # the brief's CPU space, warps and stages fixed
        long = dataclasses.replace(tiny, kv_len=4096)
        assert len(op.configs(long)) == 13 and {c["num_warps"] for c in op.configs(long)} == {4}
    # splits by each sequence's length where the keys hold two splits of it, else not
    by_length = [c for c in op.configs(dataclasses.replace(tiny, kv_len=4096)) if "tokens_per_split" in c]
    assert by_length and all(c["tokens_per_split"] * 2 <= 4096 for c in by_length)
    assert not [c for c in op.configs(dataclasses.replace(tiny, kv_len=16)) if "tokens_per_split" in c]
    # splits by load for graphs (lengths unknown when captured), where the keys hold two blocks
    graph = dataclasses.replace(tiny, lengths="graph")
    assert [c for c in op.configs(dataclasses.replace(graph, kv_len=32)) if "items_per_sm" in c]
    assert not [c for c in op.configs(dataclasses.replace(graph, kv_len=31)) if "items_per_sm" in c]
    assert not [c for c in op.configs(dataclasses.replace(tiny, kv_len=32)) if "items_per_sm" in c]
    # configs stored before the knob (without it) are still valid; bad values are not
    old = {"block_n": 32, "num_kv_splits": 4, "num_warps": 4, "num_stages": 2}
    assert op.check(old, tiny) is None and op.check({**old, "tokens_per_split": 512}, tiny) is None
    assert "tokens_per_split" in op.check({**old, "tokens_per_split": -1}, tiny)
    assert op.check({**old, "items_per_sm": 4}, tiny) is None
    assert "items_per_sm" in op.check({**old, "items_per_sm": 0.5})
    assert "give one" in op.check({**old, "items_per_sm": 4, "tokens_per_split": 512}, tiny)
    assert "unknown" in op.check({**old, "splits_per_token": 1}, tiny)
    # a sliding window shrinks what is split: 32 visible keys, not 4096
    windowed = dataclasses.replace(tiny, kv_len=4096, window=(31, -1))
    assert all(c["num_kv_splits"] * c["block_n"] <= 32 for c in op.configs(windowed) if "items_per_sm" not in c)
    # (splits by load: num_kv_splits caps them, the call's keys set their number)
    assert op.default(tiny)["num_kv_splits"] == 2


def test_bfloat16() -> None:
    # in the interpreter bfloat16 takes its own dot path (the interpreter's tl.dot mishandles bf16)
    inputs = make_decode_inputs(dataclasses.replace(BASE, dtype="bfloat16", sinks=True, q_len=2), device=DEVICE)
    for splits in (1, 2):
        _check(inputs, _decode(inputs, block_n=16, num_kv_splits=splits), atol=1.6e-2, rtol=1.6e-2)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """Run code in a fresh interpreter with no TRITON_INTERPRET (this process set one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)


def test_import_does_not_import_triton() -> None:
    result = _python("import sys, tuner.ops.triton_decode; assert 'triton' not in sys.modules, 'triton imported'")
    assert result.returncode == 0, result.stderr


_RUN_TINY = """
from tuner.ops.triton_decode import TRITON_DECODE as op
inputs = op.make_inputs(op.grids["cpu-tiny"][0])
out = op.run(inputs, op.default(inputs.shape))
assert (out - inputs.reference()).abs().max() < 1e-4
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without CUDA")
def test_interpreter_switched_on_without_env() -> None:
    result = _python(_RUN_TINY)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
    # triton imported before the op could set TRITON_INTERPRET: a clear error, not a crash
    result = _python("import triton\n" + _RUN_TINY)
    assert result.returncode != 0 and "before TRITON_INTERPRET=1 was set" in result.stderr, result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bfloat16_decode() -> None:
    shape = DecodeShape(batch=4, kv_len=3000, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1,
                        dtype="bfloat16", sinks=True)
    inputs = make_decode_inputs(shape, device="cuda")
    inputs.cache_seqlens = torch.tensor([3000, 1500, 17, 1], dtype=torch.int32, device="cuda")
    ref = inputs.reference()
    for config in [TRITON_DECODE.default(shape), *TRITON_DECODE.configs(shape)[::7]]:
        out = TRITON_DECODE.run(inputs, config)
        assert out.device.type == "cuda" and out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref, atol=1.6e-2, rtol=1.6e-2, msg=str(config))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without CUDA")
@pytest.mark.parametrize("triton_version, numpy_version, refused", [
    ("3.6.0", "2.4.1", True), ("3.6.0", "2.3.5", False), ("3.8.0", "2.4.6", False), ("3.9.0", "2.4.6", False)])
def test_an_interpreter_that_cannot_run_with_this_numpy_is_reported(
        monkeypatch: pytest.MonkeyPatch, triton_version: str, numpy_version: str, refused: bool) -> None:
    """Triton 3.6's interpreter fails every kernel with NumPy 2.4 ("only 0-dimensional arrays
    can be converted to Python scalars"): the op says so, and what to install, instead."""
    import numpy
    import triton

    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    why = TRITON_DECODE.unavailable()
    assert (why is not None and "numpy<2.4" in why and triton_version in why) if refused else why is None


def test_the_gpu_space_leaves_out_the_kernels_that_never_won_unless_the_full_space_is_asked(monkeypatch):
    from tuner import settings
    from tuner.ops import triton_decode as td

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(td, "sm_count", lambda *a: 132)
    shape = DecodeShape(batch=4, kv_len=65536, num_q_heads=48, num_kv_heads=8)

    def kernels(configs, by_length):
        return {(c["block_n"], c["num_warps"], c["num_stages"]) for c in configs
                if bool(c.get("tokens_per_split")) == by_length and not c.get("items_per_sm")}

    monkeypatch.setattr(settings, "FULL_SPACE", False)
    pruned = TRITON_DECODE.configs(shape)
    assert kernels(pruned, False) == set(td.CUDA_KERNEL_SHAPES) - set(td.PRUNED_KERNEL_SHAPES)
    assert kernels(pruned, True) == {(128, 4, 3)}
    monkeypatch.setattr(settings, "FULL_SPACE", True)
    full = TRITON_DECODE.configs(shape)
    assert kernels(full, False) == set(td.CUDA_KERNEL_SHAPES)
    assert kernels(full, True) == set(td.CUDA_TOKEN_KERNEL_SHAPES)
    assert all(c in full for c in pruned) and len(pruned) < len(full)
    by_load = {(c["block_n"], c["num_warps"], c["num_stages"], c["items_per_sm"]) for c in full if "items_per_sm" in c}
    assert by_load == {(*k, i) for k in td.CUDA_LOAD_KERNEL_SHAPES for i in td.CUDA_ITEMS_PER_SM}
    assert not any("items_per_sm" in c for c in pruned)  # per call: only in the full space
    monkeypatch.setattr(settings, "FULL_SPACE", False)
    graph = TRITON_DECODE.configs(dataclasses.replace(shape, lengths="graph"))
    assert {c["items_per_sm"] for c in graph if "items_per_sm" in c} == set(td.CUDA_ITEMS_PER_SM)


def test_every_kernel_of_the_cuda_space_compiles_for_hopper_without_a_gpu(tmp_path: Path) -> None:
    """The interpreter runs what a compiled kernel cannot (Python semantics: a value whose
    type differs between branches, a mask of integers; on bfloat16 it even takes another dot
    path), and the GPU is lent rarely: the compiled kernels
    of the whole CUDA config space of the plain key, and each kind of config (even split, by
    length, by load) for every static-key feature the kernels branch on and the merge's
    chunked reads, launched as the op launches them and built by Triton down to an sm_90
    cubin on this machine, each within the shared memory an sm_90 block may take."""
    out = tmp_path / "hopper.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "compile_for_hopper.py"), str(out)],
                            env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert result.returncode == 0 and not doc["errors"], doc["errors"][:3] or result.stderr[-3000:]
    shapes = {v["shape"] for v in doc["variants"]}
    assert shapes == {"plain", "window_softcap_d256", "sinks_window_d64", "mtp_q4", "page16_fp16", "chunked_merge"}
    kinds = {("items_per_sm" in v["config"], "tokens_per_split" in v["config"]) for v in doc["variants"]}
    assert kinds == {(False, False), (False, True), (True, False)}
    # each feature shape builds kernels of its own (its constexprs differ from the plain key's)
    assert all(sum(v["kernels"] for v in doc["variants"] if v["shape"] == s) > 0 for s in shapes)
    assert doc["compiled"] == sum(v["kernels"] for v in doc["variants"]) > len(shapes)
    assert 0 < doc["max_shared_bytes"] <= 232448
