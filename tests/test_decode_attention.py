"""decode_attention on any machine: the backend choice is part of the config, swept, stored
and dispatched. On a CPU only the Triton backend (interpreted) is installed."""

import dataclasses

import torch

import tuner
from tuner.bench import WallClockTimer
from tuner.db import TuningDB, current_fingerprint_id
from tuner.ops import get_op
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.integrations.decode_attention import decode_attention
from tuner.ops.decode_attention import BACKENDS
from tuner.sweep import MEASURED, sweep

SHAPE = DecodeShape(batch=2, kv_len=64, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, dtype="float32")


def test_configs_span_every_installed_backend():
    op = get_op("decode_attention")
    configs = op.configs(SHAPE)
    installed = [name for name, backend in BACKENDS.items() if backend.op.unavailable() is None]
    assert {c["backend"] for c in configs} == set(installed)
    assert op.default(SHAPE)["backend"] == installed[0]  # the first installed, in BACKENDS' order
    for c in configs:
        backend = BACKENDS[c["backend"]]
        assert {k: v for k, v in c.items() if k != "backend"} in backend.op.configs(SHAPE)


def test_sweep_then_the_entry_point_runs_the_stored_backend_and_config(db_path):
    op = get_op("decode_attention")
    [result] = sweep(op, [SHAPE], TuningDB(db_path), timer=WallClockTimer(warmup=0, repeats=2, min_repeats=2))
    assert result.status == MEASURED and result.failures == 0
    tuner.configure(db=db_path, mode="lookup")
    inputs = make_decode_inputs(SHAPE, device=op.device())
    out = decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                           SHAPE.kv_len, causal=True)
    assert list(decode_attention.tuner.memo.values()) == [result.winner]
    torch.testing.assert_close(out, inputs.reference(), atol=1e-4, rtol=1e-4)


# -- issue 10: serving traffic through the entry point -----------------------------------------


import numpy as np  # noqa: E402
import pytest  # noqa: E402

from support import fake_flashinfer  # noqa: E402
from support.recorders import recording_triton  # noqa: E402
import tuner.ops.flashinfer as fi  # noqa: E402
import tuner.ops.flashinfer_wrappers as fiw  # noqa: E402
from tuner.db import Problem, current_fingerprint  # noqa: E402
from tuner.keys import attention_run_key  # noqa: E402


def _with_op(backend, **op_fields):
    """The backend record with its op's fields replaced: how tests inject a backend."""
    return dataclasses.replace(backend, op=dataclasses.replace(backend.op, **op_fields))


@pytest.fixture
def with_fake_flashinfer(monkeypatch):
    """FlashInfer "installed": its wrappers replaced by tests/support/fake_flashinfer.py."""
    module = fake_flashinfer.module()
    module.BatchPrefillWithPagedKVCacheWrapper = module.BatchDecodeWithPagedKVCacheWrapper
    monkeypatch.setattr(fiw, "library", lambda: module)
    monkeypatch.setitem(BACKENDS, "flashinfer", _with_op(BACKENDS["flashinfer"], unavailable=lambda: None))
    return module


def _store(db_path, shape, config, gain=3.0):
    db = TuningDB(db_path)
    db.save_record(Problem("decode_attention", shape.static_key().to_json(), shape.run_key()),
                   (current_fingerprint_id(), current_fingerprint()), config, median_us=1.0, spread_us=0.0,
                   samples=3, default_config={"backend": "triton_decode"}, default_median_us=gain,
                   default_spread_us=0.0, method={})
    db.close()


def test_a_q_len_1_call_never_borrows_a_q_len_2_flashinfer_winner(db_path, with_fake_flashinfer):
    """The q_len-2 record is a prefill config (no use_tensor_cores): borrowed by a q_len-1
    call it failed with KeyError 'use_tensor_cores'. A config the call cannot run: the default."""
    mtp = dataclasses.replace(SHAPE, q_len=2)
    _store(db_path, mtp, {"backend": "flashinfer", "flashinfer_backend": "fa2", "fixed_split_size": None,
                          "disable_split_kv": False})
    tuner.configure(db=db_path, mode="lookup")
    inputs = make_decode_inputs(SHAPE)
    out = decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                           SHAPE.kv_len, seq_lens_host=np.full(2, SHAPE.kv_len))
    torch.testing.assert_close(out, inputs.reference(), atol=1e-4, rtol=1e-4)  # the Triton default ran
    assert [c["backend"] for c in decode_attention.tuner.memo.values()] == ["triton_decode"]


def test_flashinfer_reads_the_page_table_as_it_is_now(with_fake_flashinfer):
    """A persistent page table updated in place with the same lengths: the layout was cached
    by the table's identity, so FlashInfer read the previous step's pages."""
    inputs = make_decode_inputs(dataclasses.replace(SHAPE, batch=4, kv_len=64))
    table = inputs.page_table  # [4, 4] pages of 16
    lens = np.array([60, 20, 64, 5])  # mixed: the indices are a gather, not a view of the table
    config = {"backend": "flashinfer", **fi.DECODE_DEFAULT}
    steps = []
    for step in range(3):
        table.copy_(torch.randperm(table.numel()).view_as(table).int())  # the server's in-place update
        decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, table, inputs.cache_seqlens, 64,
                         seq_lens_host=lens, config=config)
        [inner] = with_fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper.instances
        read = inner.runs[-1]["indices"]
        expected = torch.cat([table[i, : -(-int(n) // 16)] for i, n in enumerate(lens)])
        steps.append(read.tolist() == expected.tolist())
    assert steps == [True, True, True]


def test_a_flashinfer_winner_without_host_lengths_probes_the_backends_once(monkeypatch):
    calls = {name: 0 for name in BACKENDS}

    def counting(name, backend):
        def unavailable():
            calls[name] += 1
            return backend.op.unavailable()
        return _with_op(backend, unavailable=unavailable)

    for name, backend in list(BACKENDS.items()):
        monkeypatch.setitem(BACKENDS, name, counting(name, backend))
    import tuner.integrations.decode_attention as entry

    defaults = []
    real = entry.default_config
    monkeypatch.setattr(entry, "default_config", lambda shape: defaults.append(shape) or real(shape))
    ran = recording_triton(monkeypatch)
    inputs = make_decode_inputs(SHAPE)
    config = {"backend": "flashinfer", **fi.DECODE_DEFAULT}
    for _ in range(5):  # no seq_lens_host: the default backend runs, its config found once
        decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                         SHAPE.kv_len, config=config)
    assert max(calls.values()) <= 1 and len(defaults) == 1
    assert len(ran) == 5  # (FA3 is not on this machine: the default is Triton's)


def test_an_empty_batch_gives_an_empty_output():
    inputs = make_decode_inputs(SHAPE)
    out = decode_attention(inputs.q[:0], inputs.k_cache, inputs.v_cache, inputs.page_table[:0],
                           inputs.cache_seqlens[:0], SHAPE.kv_len)
    assert out.shape == (0, 1, SHAPE.num_q_heads, SHAPE.head_dim)


def test_calls_whose_key_cannot_be_read_get_the_default_of_their_own_shape():
    """All such calls shared one memo key, and the first call's default (cut to its length)."""
    inputs = make_decode_inputs(dataclasses.replace(SHAPE, kv_len=64))
    softcap = torch.tensor(0.0)  # a flag as a tensor: never read to build a key
    configs = [decode_attention.tuner.config_for(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table,
                                                 inputs.cache_seqlens, kv, softcap=softcap) for kv in (64, 20)]
    assert configs[0] != configs[1]


def test_numpy_flags_reach_flashinfer_as_plain_values_so_its_plan_is_reused(with_fake_flashinfer):
    inputs = make_decode_inputs(SHAPE)
    lens = np.array([SHAPE.kv_len] * 2)
    config = {"backend": "flashinfer", **fi.DECODE_DEFAULT}
    for _ in range(3):
        decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                         SHAPE.kv_len, window_size=np.array([-1, -1]), softcap=np.float32(0.0), seq_lens_host=lens,
                         config=config)
    [inner] = with_fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper.instances
    assert len(inner.plan_calls) == 1 and len(inner.runs) == 3  # planned once, reused twice


def test_every_knob_of_a_triton_config_reaches_the_kernel(monkeypatch):
    """tokens_per_split was added to the Triton kernel's configs and not passed on: a
    by-length winner ran as splits over the longest sequence."""
    import tuner.ops.decode_attention as da
    from tuner.ops.triton_decode import TRITON_DECODE
    given = []
    monkeypatch.setattr(da, "triton_paged_decode", lambda q, *a, **knobs: given.append(knobs) or torch.zeros_like(q))
    shape = dataclasses.replace(SHAPE, kv_len=256)
    inputs = make_decode_inputs(shape)
    configs = TRITON_DECODE.configs(shape)
    assert any("tokens_per_split" in c for c in configs)
    for config in configs:
        decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                         shape.kv_len, config={"backend": "triton_decode", **config})
    for config, knobs in zip(configs, given, strict=True):
        assert {name: knobs[name] for name in config} == config
        assert knobs["tokens_per_split"] == config.get("tokens_per_split", 0)


WINDOWED = dataclasses.replace(SHAPE, kv_len=200, window=(15, -1))  # 16 keys a query


def _triton_splits(splits: int) -> dict:
    return {"backend": "triton_decode", "block_n": 16, "num_kv_splits": splits, "num_warps": 4, "num_stages": 2}


def _windowed_call_runs(db_path, monkeypatch) -> list:
    """(block_n, num_kv_splits) that a call of WINDOWED's at kv 200 ran, looked up in db_path."""
    tuner.configure(db=db_path, mode="lookup")
    ran = recording_triton(monkeypatch)
    inputs = make_decode_inputs(WINDOWED)
    decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 200,
                     window_size=(15, -1))
    return ran


def test_a_windowed_call_keys_on_its_longest_sequence_not_on_what_its_window_sees(db_path, monkeypatch):
    """A 15-key window over sequences of up to 200 keys: the record at kv bucket 256 serves it,
    not one at the window's bucket (16). Of a mixed batch past the window the shorter sequences
    read less, so traffic at a longer cap is other work (H200: a window-4095 key's one record
    for every length past its window ran at 0.48x of FA3's default at caps 4k-16k)."""
    assert WINDOWED.run_key().kv_len_bucket == 256
    _store(db_path, dataclasses.replace(WINDOWED, kv_len=16), _triton_splits(2))  # 4 octaves away: not borrowed
    assert _windowed_call_runs(db_path, monkeypatch) == [(16, 1)]  # the default
    _store(db_path, WINDOWED, _triton_splits(3))
    assert _windowed_call_runs(db_path, monkeypatch) == [(16, 3)]


def test_a_users_function_keyed_on_raw_lengths_keeps_its_windowed_records(db_path):
    """An @autotune function of the user's with an attention static key of a window, whose run
    key is the raw kv length: its record at that length still serves it (the records are also
    served at the window's bucket, not moved there)."""
    from tuner.keys import attention_static_key

    q, k = torch.zeros(4, 8, 64), torch.zeros(100, 16, 2, 64)

    def static(q, k, max_kv_len):
        return attention_static_key(q, k, k, causal=True, window_size=(127, -1))

    @tuner.autotune("my_attention", configs=[{"x": 1}, {"x": 2}], default={"x": 1}, static_key=static,
                    run_key=lambda q, k, max_kv_len: (q.shape[0], 1, max_kv_len))
    def my_attention(q, k, max_kv_len, *, config):
        return config

    db = TuningDB(db_path)
    db.save_record(Problem("my_attention", static(q, k, 0).to_json(), attention_run_key(4, 1, 16384)),
                   (current_fingerprint_id(), current_fingerprint()), {"x": 2}, median_us=1.0, spread_us=0.0,
                   samples=3, default_config={"x": 1}, default_median_us=3.0, default_spread_us=0.0, method={})
    db.close()
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    assert my_attention(q, k, 16384) == {"x": 2}


def test_a_fallback_runs_the_default_of_the_kv_buckets_top(monkeypatch):
    """A FlashInfer winner without host lengths (or under capture) falls back to the default
    backend. Its config came from the call's exact kv length, so one key ran (and a graph
    captured) a different config for each length in its bucket."""
    from tuner.keys import kv_len_bucket
    from tuner.ops.triton_decode import TRITON_DECODE
    ran = recording_triton(monkeypatch)
    inputs = make_decode_inputs(dataclasses.replace(SHAPE, kv_len=256))
    config = {"backend": "flashinfer", **fi.DECODE_DEFAULT}
    lengths = (20, 17, 32, 130, 200)
    for kv in lengths:
        decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, kv,
                         config=config)
    expected = []
    for kv in lengths:
        default = TRITON_DECODE.default(dataclasses.replace(SHAPE, kv_len=kv_len_bucket(kv)))
        expected.append((default["block_n"], default["num_kv_splits"]))
    assert ran == expected
    assert ran[0] == ran[1] == ran[2] and ran[3] == ran[4]  # one config per bucket


def test_host_lengths_are_read_only_by_the_backend_that_plans_from_them(monkeypatch):
    """seq_lens_host was converted on every call, whatever the backend: a cost on each FA3 or
    Triton call, and lengths FlashInfer could not read failed calls that never use them."""
    ran = recording_triton(monkeypatch)

    class Unreadable:
        def __array__(self, *args, **kwargs):
            raise AssertionError("seq_lens_host was read")

        def __len__(self):
            raise AssertionError("seq_lens_host was read")

    inputs = make_decode_inputs(SHAPE)
    config = {"backend": "triton_decode", **get_op("triton_decode").default(SHAPE)}
    decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, SHAPE.kv_len,
                     config=config, seq_lens_host=Unreadable())
    assert ran == [(config["block_n"], config["num_kv_splits"])]


def test_a_miss_records_the_lengths_a_call_had_on_the_host_and_sweeps_them_as_serving(db_path):
    from tuner.sweep import shape_from_miss

    TuningDB(db_path).close()
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    inputs = make_decode_inputs(SHAPE, seq_lens=[64, 8])
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 64)
    decode_attention.tuner.config_for(*args, seq_lens_host=inputs.seq_lens_host)  # resolved: a miss
    batch4 = make_decode_inputs(dataclasses.replace(SHAPE, batch=4))
    on_device = torch.full((4,), 64, device="meta")  # never read back: no lengths recorded
    decode_attention.tuner.config_for(batch4.q, batch4.k_cache, batch4.v_cache, batch4.page_table,
                                      batch4.cache_seqlens, 64, seq_lens_host=on_device)
    assert tuner.flush_misses() == 2
    misses = {m.problem.run_key.batch: m for m in TuningDB(db_path).misses(current_fingerprint_id())}
    assert misses[2].lengths == (1, 36.0, 64.0, 28.0) and misses[4].lengths is None
    assert shape_from_miss(misses[2]).lengths == "serving" and shape_from_miss(misses[4]).lengths == "full"
    assert shape_from_miss(misses[2]).kv_len == 64 and shape_from_miss(misses[2]).batch == 2


def test_a_windowed_miss_records_the_lengths_its_window_sees(db_path):
    """Each sequence's queries see at most the window (15) + 1 keys: the miss's statistics are of
    those (lengths of 200 and 100 read 16 keys each: full, not mixed), its run key of the
    longest sequence; `--from-misses` then sweeps full batches at that bucket's top."""
    from tuner.sweep import shape_from_miss

    TuningDB(db_path).close()
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    shape = dataclasses.replace(SHAPE, kv_len=200, window=(15, -1))
    inputs = make_decode_inputs(shape, seq_lens=[200, 100])
    decode_attention.tuner.config_for(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table,
                                      inputs.cache_seqlens, 200, window_size=(15, -1),
                                      seq_lens_host=inputs.seq_lens_host)
    assert tuner.flush_misses() == 1
    [miss] = TuningDB(db_path).misses(current_fingerprint_id())
    assert miss.problem.run_key.kv_len_bucket == 256 and miss.lengths == (1, 16.0, 16.0, 0.0)
    swept = shape_from_miss(miss)
    assert swept.lengths == "full" and swept.kv_len == 256 and swept.window == (15, -1)


def _triton(block_n: int, splits: int) -> dict:
    return {"backend": "triton_decode", "block_n": block_n, "num_kv_splits": splits, "num_warps": 4, "num_stages": 2}


DENSE, OTHER = _triton(64, 8), _triton(16, 2)  # neither is the default (32, 4)


def _in_capture(monkeypatch):
    """A CUDA-graph capture on, as the entry point and run_call see one (a counted capture
    whose stream captures)."""
    import tuner.integrations.decode_attention as entry
    import tuner.ops.decode_attention as da
    monkeypatch.setattr(da, "_capturing", lambda: True)
    monkeypatch.setattr(entry, "CAPTURES", [1])
    monkeypatch.setattr(entry, "stream_capturing", lambda: True)


def test_a_flashinfer_config_under_capture_runs_the_default_a_graph_can_hold(monkeypatch, with_fake_flashinfer):
    """FlashInfer's plan is host work per call, which a captured graph cannot hold: a
    FlashInfer config called inside a capture, host lengths and all, runs the default."""
    ran = recording_triton(monkeypatch)
    inputs = make_decode_inputs(SHAPE)
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, SHAPE.kv_len)
    config = {"backend": "flashinfer", **fi.DECODE_DEFAULT}
    decode_attention(*args, seq_lens_host=[SHAPE.kv_len] * SHAPE.batch, config=config)
    [wrapper] = with_fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper.instances  # (outside a capture: it runs)
    assert len(wrapper.runs) == 1 and not ran
    _in_capture(monkeypatch)
    decode_attention(*args, seq_lens_host=[SHAPE.kv_len] * SHAPE.batch, config=config)
    assert len(wrapper.runs) == 1 and len(ran) == 1


def test_a_by_fill_config_runs_its_dense_config_on_dense_calls_only(monkeypatch):
    """An even-split config won dense batches and lost skewed ones of the same key on the H200
    (docs/decisions.md, "Dense pass"): a by_fill record runs it only where the host lengths sum to
    at least half of batch x the longest, and the other config everywhere else."""
    import numpy as np

    from tuner.ops.decode_attention import by_fill
    ran = recording_triton(monkeypatch)
    shape = dataclasses.replace(SHAPE, batch=4, kv_len=256)
    inputs = make_decode_inputs(shape)
    config = by_fill(DENSE, OTHER)
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 200)
    cases = [
        (torch.tensor([200, 150, 100, 60], dtype=torch.int32), DENSE),  # 510 of 800: dense
        (torch.tensor([200, 100, 60, 30], dtype=torch.int32), OTHER),  # 390 of 800
        ([200, 200, 0, 0], DENSE),  # exactly half
        (np.array([200, 199, 0, 0]), OTHER),
        ((200, 200, 200, 200), DENSE),
        (None, OTHER),  # lengths not on the host
        (torch.tensor([200, 200, 200, 200], dtype=torch.int32, device="meta"), OTHER),  # not on the host
    ]
    for lengths, expected in cases:
        decode_attention(*args, config=config, seq_lens_host=lengths)
        assert ran.pop() == (expected["block_n"], expected["num_kv_splits"]), lengths
    # a max_kv_len that is not a plain int says nothing of the fill
    decode_attention(*args[:5], torch.tensor(200), config=config, seq_lens_host=[200] * 4)
    assert ran.pop() == (OTHER["block_n"], OTHER["num_kv_splits"])


def test_a_stored_by_fill_record_is_served_and_runs_by_each_calls_fill(db_path, monkeypatch):
    """The dense pass stored by_fill records and every lookup refused them (no backend is
    named "by_fill"), so the serving benchmark ran FA3's default on 20 more cases than before
    it; a record whose part cannot run here (FlashInfer not installed) still serves the default."""
    from tuner.ops.decode_attention import by_fill
    ran = recording_triton(monkeypatch)
    shape = dataclasses.replace(SHAPE, batch=4, kv_len=256)
    _store(db_path, shape, by_fill(DENSE, OTHER))
    other_shape = dataclasses.replace(shape, batch=3)
    _store(db_path, other_shape, by_fill({"backend": "flashinfer", **fi.DECODE_DEFAULT}, OTHER))
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    inputs = make_decode_inputs(shape)
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 256)
    decode_attention(*args, seq_lens_host=torch.tensor([256, 200, 180, 150], dtype=torch.int32))
    decode_attention(*args, seq_lens_host=torch.tensor([256, 20, 18, 15], dtype=torch.int32))
    decode_attention(*args)
    assert ran == [(b["block_n"], b["num_kv_splits"]) for b in (DENSE, OTHER, OTHER)]
    small = make_decode_inputs(other_shape)
    ran.clear()
    decode_attention(small.q, small.k_cache, small.v_cache, small.page_table, small.cache_seqlens, 256,
                     seq_lens_host=torch.tensor([256, 1, 1], dtype=torch.int32))  # sparse: served, OTHER would run
    default = BACKENDS["triton_decode"].op.default(other_shape)
    assert default != OTHER and ran == [(default["block_n"], default["num_kv_splits"])]


def test_inside_graph_capture_a_by_fill_record_runs_the_config_of_the_declared_lengths(db_path, monkeypatch):
    """A graph captured inside graph_capture(lengths) replays the declared traffic: dense
    declared lengths (uniform in [L/2, L]) capture the dense config, skewed ones (a few long
    among many short) and an int declaration (a batch's longest only) the other, whatever
    the capture call's own lengths; a real capture without a declaration, the other."""
    import random

    from tuner.ops.decode_attention import by_fill
    ran = recording_triton(monkeypatch)
    shape = dataclasses.replace(SHAPE, batch=16, kv_len=256)
    _store(db_path, shape, by_fill(DENSE, OTHER))
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    inputs = make_decode_inputs(shape)
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 256)
    rng = random.Random(0)
    dense = [rng.randint(129, 256) for _ in range(500)]
    skewed = [rng.randint(1, 20) for _ in range(450)] + [256] * 50  # a batch of 16: mostly one or two long
    sparse_call = torch.tensor([256] + [1] * 15, dtype=torch.int32)
    for declared, expected in ((dense, DENSE), (skewed, OTHER), (256, OTHER)):
        with tuner.graph_capture(declared):
            decode_attention(*args, seq_lens_host=sparse_call)
        assert ran.pop() == (expected["block_n"], expected["num_kv_splits"]), declared
    _in_capture(monkeypatch)
    decode_attention(*args, seq_lens_host=torch.full((16,), 256, dtype=torch.int32))
    assert ran.pop() == (OTHER["block_n"], OTHER["num_kv_splits"])


def test_a_capture_without_lengths_freezes_the_config_a_by_fill_record_captures(db_path, monkeypatch):
    """The frozen rule keeps one config only if it won every kv bucket up to the bound; a
    by_fill(D, W) record at one bucket and W at the other captured the default, though a
    capture runs W of either (8/1 heads, batch 64, a 2k bound, in the shipped file)."""
    from tuner.ops.decode_attention import by_fill
    ran = recording_triton(monkeypatch)
    shape = dataclasses.replace(SHAPE, batch=4, kv_len=2048)
    _store(db_path, dataclasses.replace(shape, kv_len=1024), by_fill(DENSE, OTHER))
    _store(db_path, shape, OTHER)
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    inputs = make_decode_inputs(dataclasses.replace(shape, kv_len=64))
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 2048)
    with tuner.graph_capture():  # lengths unknown: the frozen rule
        decode_attention(*args, seq_lens_host=torch.full((4,), 64, dtype=torch.int32))
    assert ran == [(OTHER["block_n"], OTHER["num_kv_splits"])]


def test_a_by_fill_record_reads_a_numpy_integer_bound_and_leaves_a_tensor_one_unknown(db_path, monkeypatch):
    """max_kv_len = seq_lens_np.max() is a NumPy integer: the dense config ran nowhere for it."""
    import numpy as np

    from tuner.ops.decode_attention import by_fill
    ran = recording_triton(monkeypatch)
    shape = dataclasses.replace(SHAPE, batch=4, kv_len=256)
    inputs = make_decode_inputs(shape)
    lengths = np.array([256, 200, 180, 150], dtype=np.int32)
    for bound, expected in ((lengths.max(), DENSE), (np.int64(256), DENSE), (torch.tensor(256), OTHER)):
        decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, bound,
                         config=by_fill(DENSE, OTHER), seq_lens_host=lengths)
        assert ran.pop() == (expected["block_n"], expected["num_kv_splits"]), type(bound)


def test_a_by_fill_call_runs_its_other_config_while_torch_compile_traces(monkeypatch):
    """A traced graph would keep the branch of the call it traced for every later call."""
    from tuner.ops.decode_attention import by_fill
    ran = recording_triton(monkeypatch)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    inputs = make_decode_inputs(dataclasses.replace(SHAPE, batch=4, kv_len=256))
    decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 256,
                     config=by_fill(DENSE, OTHER), seq_lens_host=[256] * 4)
    assert ran == [(OTHER["block_n"], OTHER["num_kv_splits"])]


def test_inside_graph_capture_a_dense_config_that_cannot_be_captured_gives_way_to_the_other(
        db_path, monkeypatch, with_fake_flashinfer):
    """A FlashInfer dense config under declared dense lengths: run_call found its plan could
    not be captured and ran the library default, not the record's other config."""
    import random

    from tuner.ops.decode_attention import by_fill
    ran = recording_triton(monkeypatch)
    shape = dataclasses.replace(SHAPE, batch=4, kv_len=256)
    _store(db_path, shape, by_fill({"backend": "flashinfer", **fi.DECODE_DEFAULT}, OTHER))
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    inputs = make_decode_inputs(shape)
    rng = random.Random(0)
    with tuner.graph_capture([rng.randint(129, 256) for _ in range(500)]):
        decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 256,
                         seq_lens_host=torch.full((4,), 256, dtype=torch.int32))
    assert ran == [(OTHER["block_n"], OTHER["num_kv_splits"])]


def test_a_by_fill_call_sums_a_lengths_tensor_again_once_it_changes(monkeypatch):
    """The sum of a CPU lengths tensor is kept for the next call with the same tensor (every
    layer of a decode step passes one), so it must be taken again once the tensor is
    written in place, as a server's reused buffer is; an inference tensor has no version
    counter and is summed each call."""
    from tuner.ops.decode_attention import by_fill
    ran = recording_triton(monkeypatch)
    shape = dataclasses.replace(SHAPE, batch=4, kv_len=256)
    inputs = make_decode_inputs(shape)
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 200)
    config = by_fill(DENSE, OTHER)
    lengths = torch.tensor([200, 150, 100, 60], dtype=torch.int32)
    decode_attention(*args, config=config, seq_lens_host=lengths)
    decode_attention(*args, config=config, seq_lens_host=lengths)
    lengths.copy_(torch.tensor([200, 1, 1, 1]))
    decode_attention(*args, config=config, seq_lens_host=lengths)
    lengths[1:] = 200
    decode_attention(*args, config=config, seq_lens_host=lengths)
    with torch.inference_mode():
        frozen = torch.tensor([200, 1, 1, 1], dtype=torch.int32)
        decode_attention(*args, config=config, seq_lens_host=frozen)
        frozen[1:] = 200
        decode_attention(*args, config=config, seq_lens_host=frozen)
    picked = [DENSE if r == (DENSE["block_n"], DENSE["num_kv_splits"]) else OTHER for r in ran]
    assert picked == [DENSE, DENSE, OTHER, DENSE, OTHER, DENSE]


def test_a_by_fill_config_under_capture_runs_its_config_for_any_batch(monkeypatch):
    """A graph captured with dense lengths replays whatever lengths come: the dense config
    would be frozen for skewed batches too."""
    import tuner.ops.decode_attention as da
    ran = recording_triton(monkeypatch)
    _in_capture(monkeypatch)
    inputs = make_decode_inputs(SHAPE)
    decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                     SHAPE.kv_len, config=da.by_fill(DENSE, OTHER), seq_lens_host=[SHAPE.kv_len] * SHAPE.batch)
    assert ran == [(OTHER["block_n"], OTHER["num_kv_splits"])]


def test_a_sweeps_batch_runs_a_by_fill_config_by_its_own_lengths(monkeypatch):
    """The dense pass times by_fill configs on dense and skewed batches; each runs the
    config its calls would (tuner.ops.decode_attention.fill_branch)."""
    from tuner.ops.decode_attention import DECODE_ATTENTION, by_fill
    ran = []

    def record(inputs, config):
        ran.append((config["block_n"], config["num_kv_splits"]))
        return torch.zeros_like(inputs.q)
    monkeypatch.setitem(BACKENDS, "triton_decode", _with_op(BACKENDS["triton_decode"], run=record))
    shape = dataclasses.replace(SHAPE, batch=4, kv_len=200)
    config = by_fill(DENSE, OTHER)
    DECODE_ATTENTION.run(make_decode_inputs(shape), config)  # every sequence at kv_len
    DECODE_ATTENTION.run(make_decode_inputs(shape, seq_lens=[200, 20, 20, 20]), config)
    assert ran == [(DENSE["block_n"], DENSE["num_kv_splits"]), (OTHER["block_n"], OTHER["num_kv_splits"])]


def test_by_fill_configs_are_checked_part_by_part():
    from tuner.ops.decode_attention import by_fill, check_config
    assert check_config(by_fill(DENSE, OTHER), SHAPE) is None
    assert check_config(by_fill(DENSE, DENSE), SHAPE) is None  # a dense pass's baseline
    assert "cannot nest" in check_config(by_fill(by_fill(DENSE, OTHER), OTHER), SHAPE)
    assert check_config({"backend": "by_fill", "dense.block_n": 32, "block_n": 16}, SHAPE).startswith(
        "a by_fill config holds dense.* and other.* knobs, got block_n")
    bad = check_config(by_fill(DENSE, {"backend": "nope"}), SHAPE)
    assert bad.startswith("other: backend='nope'")


def test_a_q_strided_over_its_batch_reaches_triton_and_fa3_as_it_is_and_flashinfer_contiguous(
        monkeypatch, with_fake_flashinfer):
    """A server's q is a slice of its qkv projection's rows: Triton and FA3 read its strides
    (no copy kernel in a server's graph), FlashInfer gets a copy; each attends as over the copy."""
    import tuner.ops.fa3 as fa3_op
    import tuner.ops.triton_decode as triton_decode

    inputs = make_decode_inputs(dataclasses.replace(SHAPE, batch=3))
    rows = torch.randn(3, 1, 2 * SHAPE.num_q_heads, SHAPE.head_dim)
    strided = rows[:, :, :SHAPE.num_q_heads]
    strided.copy_(inputs.q)
    assert not strided.is_contiguous()
    rest = (inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, SHAPE.kv_len)
    handed, triton_run = [], triton_decode.triton_paged_decode

    def seen(q, *args, **kwargs):
        handed.append(q)
        return triton_run(q, *args, **kwargs)
    monkeypatch.setattr("tuner.ops.decode_attention.triton_paged_decode", seen)
    torch.testing.assert_close(decode_attention(strided, *rest, config=_triton_splits(2)),
                               decode_attention(inputs.q, *rest, config=_triton_splits(2)))
    assert handed[0] is strided
    lens = inputs.cache_seqlens.numpy()
    config = {"backend": "flashinfer", **fi.DECODE_DEFAULT}
    planned = fi.paged_attention

    def flashinfer_seen(q, *args, **kwargs):
        handed.append(q)
        return planned(q, *args, **kwargs)
    monkeypatch.setattr("tuner.ops.decode_attention.paged_attention", flashinfer_seen)
    from_strided = decode_attention(strided, *rest, seq_lens_host=lens, config=config)
    assert handed[-1].is_contiguous() and torch.equal(handed[-1], strided)
    torch.testing.assert_close(from_strided, decode_attention(inputs.q, *rest, seq_lens_host=lens, config=config))

    def fa3_kernel(q, k_cache, v_cache, **kwargs):
        handed.append(q)
        return torch.zeros_like(q)
    monkeypatch.setattr(fa3_op, "kernel", lambda: fa3_kernel)
    decode_attention(strided, *rest, config={"backend": "fa3", "num_splits": 0, "pack_gqa": None})
    assert handed[-1] is strided


def test_an_out_tensor_receives_the_output_with_no_copy_where_the_backend_writes_there(monkeypatch,
                                                                                      with_fake_flashinfer):
    """decode_attention(out=) as FA3's out=, for a server's own output buffer: the Triton kernel
    writes into it (in stage 1 with one split, in the merge with more) and FA3's kernel is handed
    it; FlashInfer's output is copied in. Either way out is what comes back. An out of another
    shape, dtype or layout is refused in one line."""
    import tuner.ops.fa3 as fa3_op

    inputs = make_decode_inputs(dataclasses.replace(SHAPE, batch=3))
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, SHAPE.kv_len)
    from tuner.ops.triton_decode import triton_paged_decode

    for splits in (1, 4):
        plain = decode_attention(*args, config=_triton_splits(splits))
        out = torch.full_like(plain, float("nan"))
        assert decode_attention(*args, config=_triton_splits(splits), out=out) is out
        torch.testing.assert_close(out, plain)
        into = torch.full_like(plain, float("nan"))  # the kernel's own writes, no copy after
        assert triton_paged_decode(*args[:5], max_kv_len=SHAPE.kv_len, block_n=16, num_kv_splits=splits,
                                   out=into) is into
        torch.testing.assert_close(into, plain)
    looked_up = torch.full_like(plain, float("nan"))  # no config given: the lookup ignores out
    assert decode_attention(*args, out=looked_up) is looked_up and not looked_up.isnan().any()
    handed = []

    def fa3_kernel(q, k_cache, v_cache, *, out=None, **kwargs):
        handed.append(out)
        return out.fill_(2.0)
    monkeypatch.setattr(fa3_op, "kernel", lambda: fa3_kernel)
    out = torch.zeros_like(plain)
    assert decode_attention(*args, config={"backend": "fa3", "num_splits": 0, "pack_gqa": None}, out=out) is out
    assert handed == [out] and bool((out == 2.0).all())
    lens = inputs.cache_seqlens.numpy()
    config = {"backend": "flashinfer", **fi.DECODE_DEFAULT}
    plain = decode_attention(*args, seq_lens_host=lens, config=config)
    out = torch.full_like(plain, float("nan"))
    assert decode_attention(*args, seq_lens_host=lens, config=config, out=out) is out
    torch.testing.assert_close(out, plain)
    wide = torch.empty(*plain.shape[:3], plain.shape[3] * 2)[..., ::2]  # a last dim of stride 2
    for bad in (plain[:2], plain.double(), wide):
        with pytest.raises(ValueError, match="out must be"):
            decode_attention(*args, config=_triton_splits(4), out=bad)


def test_eager_config_names_the_plain_config_an_eager_call_runs():
    """A benchmark timing calls inside CUDA graphs resolves each config first, as the eager
    call would (inside a capture a by_fill record runs its other config): the dense part for
    dense host lengths, the other part without them, a plain config as it is."""
    from tuner.integrations.decode_attention import eager_config
    from tuner.ops.decode_attention import by_fill

    inputs = make_decode_inputs(dataclasses.replace(SHAPE, batch=4, kv_len=256))
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 200)
    config = by_fill(DENSE, OTHER)
    assert eager_config(config, *args, seq_lens_host=[200, 150, 100, 60]) == DENSE
    assert eager_config(config, *args, seq_lens_host=[200, 10, 10, 10]) == OTHER
    assert eager_config(config, *args) == OTHER
    assert eager_config(DENSE, *args, seq_lens_host=[200, 150, 100, 60]) is DENSE


# -- a helper's review of the runtime path (2026-12-07) --------------------------------------------


def _call(inputs, **kwargs):
    return decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table,
                            kwargs.pop("cache_seqlens", inputs.cache_seqlens), SHAPE.kv_len, causal=True, **kwargs)


def test_every_window_form_the_keys_take_the_triton_backend_runs(db_path):
    """None, one int and numpy values are keyed (host_window), and crashed Triton's launch."""
    tuner.configure(db=db_path, mode="lookup")
    inputs = make_decode_inputs(SHAPE, device="cpu")
    plain = _call(inputs, window_size=(8, -1))
    for form in (np.array([8, -1]), (np.int64(8), np.int64(-1)), [8, -1]):
        torch.testing.assert_close(_call(inputs, window_size=form), plain)
    torch.testing.assert_close(_call(inputs, window_size=None), _call(inputs, window_size=(-1, -1)))
    torch.testing.assert_close(_call(inputs, window_size=8), _call(inputs, window_size=(8, 8)))


def test_lengths_strided_in_memory_are_refused_not_misread(db_path):
    """The Triton kernels read cache_seqlens as a packed vector: a column of a metadata
    buffer gave a wrong output (error 1.2), silently."""
    tuner.configure(db=db_path, mode="lookup")
    inputs = make_decode_inputs(SHAPE, device="cpu")
    column = torch.stack([inputs.cache_seqlens, torch.zeros_like(inputs.cache_seqlens)], dim=1)[:, 0]
    with pytest.raises(ValueError, match="cache_seqlens must be contiguous"):
        _call(inputs, cache_seqlens=column)
    torch.testing.assert_close(_call(inputs, cache_seqlens=column.contiguous()), inputs.reference(),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("malformed", [
    "head_dims_differ", "v_pages_differ", "short_page_table", "short_lengths", "float_page_table",
    "float_lengths", "sinks_per_kv_head", "three_dim_q", "caches_of_another_dtype", "window_as_a_tensor",
    "softcap_as_a_tensor",
])
def test_inputs_that_do_not_fit_q_are_refused_in_one_line(db_path, malformed):
    """The Triton kernels index the caches, the page table and the lengths by q's shape: a
    table or lengths vector shorter than the batch, or caches that disagree, were read out of
    bounds (garbage on the CPU, a fault on a GPU) instead of refused."""
    tuner.configure(db=db_path, mode="lookup")
    inputs = make_decode_inputs(dataclasses.replace(SHAPE, sinks=True), device="cpu")
    args = dict(q=inputs.q, k_cache=inputs.k_cache, v_cache=inputs.v_cache, page_table=inputs.page_table,
                cache_seqlens=inputs.cache_seqlens, sinks=inputs.sinks)
    bad = {
        "head_dims_differ": dict(k_cache=inputs.k_cache[..., :16], v_cache=inputs.v_cache[..., :16]),
        "v_pages_differ": dict(v_cache=inputs.v_cache[:1]),
        "short_page_table": dict(page_table=inputs.page_table[:1]),
        "short_lengths": dict(cache_seqlens=inputs.cache_seqlens[:1]),
        "float_page_table": dict(page_table=inputs.page_table.float()),
        "float_lengths": dict(cache_seqlens=inputs.cache_seqlens.float()),
        "sinks_per_kv_head": dict(sinks=inputs.sinks[:SHAPE.num_kv_heads]),
        "three_dim_q": dict(q=inputs.q[:, 0]),
        "caches_of_another_dtype": dict(k_cache=inputs.k_cache.half(), v_cache=inputs.v_cache.half()),
        "window_as_a_tensor": dict(window_size=torch.tensor([8, 0])),  # (crashed in the kernel's build)
        "softcap_as_a_tensor": dict(softcap=torch.tensor(0.0)),  # (read back: a sync on a GPU)
    }[malformed]

    def run(**given):
        a = {**args, **given}
        return decode_attention(a["q"], a["k_cache"], a["v_cache"], a["page_table"], a["cache_seqlens"],
                                SHAPE.kv_len, sinks=a["sinks"], window_size=a.get("window_size", (-1, -1)),
                                softcap=a.get("softcap", 0.0))

    with pytest.raises((ValueError, IndexError)) as refused:
        run(**bad)
    assert "\n" not in str(refused.value)
    torch.testing.assert_close(run(), inputs.reference(), atol=1e-4, rtol=1e-4)


@pytest.fixture
def fa3_dtypes(monkeypatch):
    """FA3 "installed": the dtype of each call its backend runs (outputs zeros)."""
    ran = []

    def fa3_call(config, q, *rest, out=None):
        ran.append(q.dtype)
        return torch.zeros(*q.shape[:3], rest[1].shape[-1], dtype=q.dtype)

    monkeypatch.setitem(BACKENDS, "fa3", dataclasses.replace(
        _with_op(BACKENDS["fa3"], unavailable=lambda: None), call=fa3_call))
    return ran


def test_the_default_is_a_backend_that_runs_the_call(db_path, fa3_dtypes):
    """FA3 runs no float32 and no head dim past 256: with FA3 installed, such a call's
    default was FA3's, which raises; it is now the next installed backend's (Triton)."""
    ran = fa3_dtypes
    op = get_op("decode_attention")
    assert op.default(SHAPE)["backend"] == "triton_decode"
    assert {c["backend"] for c in op.configs(SHAPE)} == {"triton_decode"}
    assert op.default(dataclasses.replace(SHAPE, dtype="bfloat16"))["backend"] == "fa3"
    assert op.default(dataclasses.replace(SHAPE, dtype="bfloat16", head_dim=512))["backend"] == "triton_decode"
    tuner.configure(db=db_path, mode="lookup")
    inputs = make_decode_inputs(SHAPE, device="cpu")
    out = decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                           SHAPE.kv_len)
    torch.testing.assert_close(out, inputs.reference(), atol=1e-4, rtol=1e-4)
    assert ran == []
    # a stored FA3 winner for the float32 key is a config the call cannot run: the default runs
    _store(db_path, SHAPE, {"backend": "fa3", "num_splits": 2, "pack_gqa": None})
    tuner.configure(db=db_path, mode="lookup")
    decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, SHAPE.kv_len)
    assert ran == []


def test_a_max_kv_len_given_as_a_tensor_is_never_read_back(db_path):
    """A server may hold its longest length as a device tensor: the Triton backend did
    arithmetic on it (a sync per call, an error under capture). It is bounded by the page
    table's capacity instead; a meta tensor stands for one whose value cannot be read."""
    tuner.configure(db=db_path, mode="lookup")
    inputs = make_decode_inputs(SHAPE, device="cpu")
    for max_kv_len in (torch.tensor(SHAPE.kv_len, device="meta"), np.int64(SHAPE.kv_len)):
        out = decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                               max_kv_len)
        torch.testing.assert_close(out, inputs.reference(), atol=1e-4, rtol=1e-4)


def test_calls_whose_key_cannot_be_read_each_get_their_own_shapes_default(db_path, fa3_dtypes):
    """A max_kv_len or flag given as a tensor leaves the key unreadable; every such call
    shared one memo entry (static key None), so a bfloat16 call's default (FA3) then served a
    float32 call, which FA3 cannot run."""
    ran = fa3_dtypes
    tuner.configure(db=db_path, mode="lookup")
    for dtype in ("bfloat16", "float32"):
        inputs = make_decode_inputs(dataclasses.replace(SHAPE, dtype=dtype), device="cpu")
        out = decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                               torch.tensor(SHAPE.kv_len))
        if dtype == "float32":  # Triton's default ran it
            torch.testing.assert_close(out, inputs.reference(), atol=1e-4, rtol=1e-4)
        runs = decode_attention.tuner.config_for(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table,
                                                 inputs.cache_seqlens, SHAPE.kv_len, softcap=torch.tensor(0.0))
        assert runs["backend"] == ("fa3" if dtype == "bfloat16" else "triton_decode")
    assert ran == [torch.bfloat16]


@pytest.mark.parametrize("lengths, why", [
    ([80, 64], "capacity"),  # 80 keys in a row of 4 pages of 16: the next row's pages were read
    ([-5, 20], "capacity"),
    ([64, 64, 64], "one length per sequence"),
    ([64], "one length per sequence"),
    (np.array([63.9, 20.0]), "integer"),  # truncated to 63, silently
])
def test_flashinfer_refuses_host_lengths_that_do_not_fit_the_call(with_fake_flashinfer, lengths, why):
    inputs = make_decode_inputs(SHAPE)
    config = {"backend": "flashinfer", **fi.DECODE_DEFAULT}
    with pytest.raises(ValueError, match=why) as refused:
        decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                         SHAPE.kv_len, seq_lens_host=lengths, config=config)
    assert "\n" not in str(refused.value)


def test_a_flashinfer_config_given_for_a_call_with_sinks_runs_the_default(with_fake_flashinfer):
    """FlashInfer's wrappers take no sinks: a FlashInfer config given for such a call ran
    on FlashInfer and dropped them, silently."""
    shape = dataclasses.replace(SHAPE, sinks=True)
    inputs = make_decode_inputs(shape)
    out = decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                           SHAPE.kv_len, sinks=inputs.sinks, seq_lens_host=np.full(2, SHAPE.kv_len),
                           config={"backend": "flashinfer", **fi.DECODE_DEFAULT})
    torch.testing.assert_close(out, inputs.reference(), atol=1e-4, rtol=1e-4)
    assert with_fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper.instances == []
