"""tuner's SGLang attention backend (issue 38), against a stand-in of SGLang's modules: SGLang's
decode call pattern (write the new token's K and V, attend over the backend's page table and
cache lengths), eager and under capture, and what it leaves to SGLang's FA3 code."""

import importlib.metadata
import logging
import sys
import types
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support import fake_sglang
from support.fake_events import EventClock
from tuner.db import current_fingerprint
from tuner.integrations import sglang as integration
from tuner.integrations.graph_variants import Pick
from tuner.ops.decode_attention import installed
from tuner.runtime.capture_watch import CAPTURES
from tuner.workload.reference import paged_decode_reference

HEADS, KV_HEADS, DIM = 4, 2, 16


@pytest.fixture
def sgl(monkeypatch):
    installed = fake_sglang.install(monkeypatch)
    monkeypatch.setattr(integration, "_hooks_registered", False)
    integration.backend_class.cache_clear()
    yield installed
    integration.backend_class.cache_clear()


def _backend(lengths, slots=256):
    """A backend over a pool whose sequences hold `lengths` tokens (the newest one among them),
    each in its own shuffled slots; and the batch of that decode step."""
    pool = fake_sglang.KVPool(layers=1, slots=slots, kv_heads=KV_HEADS, head_dim=DIM)
    runner = types.SimpleNamespace(token_to_kv_pool=pool, page_size=1)
    backend = integration.create_backend(runner)
    width = max(lengths) + 5  # SGLang slices the table past the longest (and captures it at the max context)
    order = torch.randperm(slots - 1, generator=torch.Generator().manual_seed(1)) + 1  # slot 0: padding
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(lengths):
        table[i, :n] = order[taken:taken + n]
        taken += n
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    backend.forward_metadata = fake_sglang.Metadata(page_table=table, cache_seqlens_int32=seqlens,
                                                    max_seq_len_k=max(lengths))
    newest = table[torch.arange(len(lengths)), seqlens.long() - 1].long()
    batch = fake_sglang.ForwardBatch(out_cache_loc=newest, seq_lens_cpu=seqlens.clone())
    return backend, pool, batch


def _step(backend, batch, **layer_fields):
    gen = torch.Generator().manual_seed(2)
    rows = batch.out_cache_loc.numel()
    q = torch.randn(rows, HEADS * DIM, generator=gen)
    k, v = torch.randn(rows, KV_HEADS, DIM, generator=gen), torch.randn(rows, KV_HEADS, DIM, generator=gen)
    layer = fake_sglang.Layer(tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, head_dim=DIM, **layer_fields)
    return q, k, v, layer


def test_register_adds_the_backend_and_its_command_line_name_once(sgl):
    integration.register()
    integration.register()
    assert sgl.registry == {"tuner": integration.create_backend}
    assert sgl.choices.count("tuner") == 1


def test_register_lists_the_backend_wherever_sglang_lists_fa3_for_a_feature(sgl):
    """Deterministic inference (where FA3's num_splits is 1 and every decode runs FA3's code)
    refused the name at start-up, and MLA models lost the chunked prefix cache (a helper's
    review of SGLang 0.5.17's server_args)."""
    integration.register()
    integration.register()
    assert all(names.count("tuner") == 1 for names in sgl.lists.values()), sgl.lists


def test_the_backend_is_refused_in_one_line_where_sglangs_fa3_cannot_serve(sgl):
    """SGLang's fa3 factory checks the GPU, and SGLang switches fa3 with an FP8 e5m2 cache to
    triton; neither looks at tuner's name, so FA3 was built anyway and failed later."""
    from tuner.errors import TunerError

    runner = types.SimpleNamespace(token_to_kv_pool=None, page_size=1,
                                   server_args=types.SimpleNamespace(kv_cache_dtype="fp8_e5m2"))
    with pytest.raises(TunerError, match="fp8_e4m3 only"):
        integration.create_backend(runner)
    plain = types.SimpleNamespace(server_args=types.SimpleNamespace(kv_cache_dtype="auto"), use_mla_backend=False)
    mla = types.SimpleNamespace(server_args=plain.server_args, use_mla_backend=True)
    assert integration.fa3_problem(plain, (9, 0)) is None and integration.fa3_problem(plain, (8, 0)) is None
    assert integration.fa3_problem(mla, (9, 0)) is None and integration.fa3_problem(plain, None) is None
    assert "SM 8.0" in integration.fa3_problem(mla, (8, 0))
    assert "SM 10.0" in integration.fa3_problem(plain, (10, 0))


def test_register_works_where_sglang_lists_no_choices(monkeypatch):
    installed = fake_sglang.install(monkeypatch, with_choices=False)
    integration.register()
    assert "tuner" in installed.registry


def test_the_plugin_entry_point_names_register():
    points = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert [p.value for p in points if p.name == "tuner"] == ["tuner.integrations.sglang:register"]


def test_a_decode_step_writes_the_new_token_and_attends_as_fa3_would(sgl):
    backend, pool, batch = _backend([40, 17, 3])
    q, k, v, layer = _step(backend, batch)
    out = backend.forward_decode(q, k, v, layer, batch)
    assert not backend.fa3_decodes and out.shape == (3, HEADS * DIM)
    assert torch.equal(pool.k[0][batch.out_cache_loc], k) and torch.equal(pool.v[0][batch.out_cache_loc], v)
    md = backend.forward_metadata
    expected = paged_decode_reference(q.view(3, 1, HEADS, DIM), pool.k[0].view(-1, 1, KV_HEADS, DIM),
                                      pool.v[0].view(-1, 1, KV_HEADS, DIM), md.page_table, md.cache_seqlens_int32)
    torch.testing.assert_close(out, expected.view(3, -1), atol=2e-4, rtol=2e-4)


def test_an_output_buffer_sglang_gives_receives_the_result(sgl):
    backend, _, batch = _backend([9, 30])
    q, k, v, layer = _step(backend, batch)
    plain = backend.forward_decode(q, k, v, layer, batch)
    batch._attn_output = torch.full((2, HEADS * DIM), float("nan"))
    out = backend.forward_decode(q, k, v, layer, batch, save_kv_cache=False)
    assert out.data_ptr() == batch._attn_output.data_ptr()
    torch.testing.assert_close(out, plain)


def test_only_a_decodes_graph_step_is_kept_as_the_replay_view(sgl):
    """SGLang's prefill graphs call the same metadata step: a FlashInfer variant planned on
    their batch would plan on the wrong lengths."""
    backend, _, batch = _backend([9, 30])
    backend.tuner_flashinfer = object()
    batch.forward_mode = types.SimpleNamespace(is_decode_or_idle=lambda: False)
    backend.init_forward_metadata_out_graph(batch)
    assert backend.tuner_replay_view is None
    batch.forward_mode = types.SimpleNamespace(is_decode_or_idle=lambda: True)
    backend.init_forward_metadata_out_graph(batch)
    assert backend.tuner_replay_view is batch


def test_a_keyword_at_its_no_op_value_still_decodes_through_tuner(sgl):
    """SGLang 0.5.23's forward_decode takes return_lse; given as False, every call had gone
    to FA3's code (a keyword not None), and tuner would have stopped running unseen."""
    backend, _, batch = _backend([9, 30])
    q, k, v, layer = _step(backend, batch)
    backend.forward_decode(q, k, v, layer, batch, return_lse=False)
    assert not backend.fa3_decodes


def test_save_kv_cache_false_writes_nothing_to_the_pool(sgl):
    backend, pool, batch = _backend([9, 30])
    q, k, v, layer = _step(backend, batch)
    backend.forward_decode(q, k, v, layer, batch, save_kv_cache=False)
    assert not pool.writes and not backend.fa3_decodes


TRITON = {"backend": "triton_decode", "block_n": 32, "num_kv_splits": 4, "num_warps": 4, "num_stages": 2}


def _recorded(monkeypatch, config=TRITON):
    """decode_attention replaced by a recorder of its calls, resolving every call to config."""
    calls = []

    def record(*call, config, out=None):
        calls.append((call, config))
        return call[0].view(call[0].shape[0], -1)
    monkeypatch.setattr(integration, "decode_attention", record)
    monkeypatch.setattr(integration, "resolve_config", lambda call: config)
    return calls


def test_a_graphs_capture_and_warm_ups_are_bounded_by_the_tables_width_with_no_host_lengths(sgl, monkeypatch):
    """A captured launch is replayed over every later step: bounded by the capture batch's own
    (padding, length-1) lengths, a split plan would cut longer sequences short. The warm-ups
    SGLang runs before capturing, on the graph's own buffers, are bounded alike: else the
    capture's config is first compiled and loaded inside the capture."""
    backend, _, batch = _backend([1, 1])
    calls = _recorded(monkeypatch)
    q, k, v, layer = _step(backend, batch)
    backend.forward_decode(q, k, v, layer, batch)
    width = backend.forward_metadata.page_table.shape[1]
    (call, config), = calls
    assert call[5] == 1 and call[10] is batch.seq_lens_cpu and config == TRITON  # eager: the true max, host lengths
    backend.decode_cuda_graph_metadata = {2: backend.forward_metadata}  # a warm-up on the graph's buffers
    backend.forward_decode(q, k, v, layer, batch)
    assert calls[-1][0][5] == width and calls[-1][0][10] is None
    backend.decode_cuda_graph_metadata = {}
    backend.tuner_on_cuda = True
    monkeypatch.setattr(integration, "stream_capturing", lambda: True)  # the capture itself
    backend.forward_decode(q, k, v, layer, batch)
    assert calls[-1][0][5] == width and calls[-1][0][10] is None
    assert calls[-1][0][7] == (-1, -1) and calls[-1][0][8] == 0.0


def test_a_call_resolved_to_fa3s_default_runs_sglangs_fa3_code(sgl, monkeypatch):
    """That keeps the scheduler metadata SGLang precomputes for FA3's default."""
    backend, pool, batch = _backend([12, 7])
    calls = _recorded(monkeypatch, config={"backend": "fa3", "num_splits": 0, "pack_gqa": None})
    assert backend.forward_decode(*_step(backend, batch), batch) == "fa3"
    assert not calls and not pool.writes and len(backend.fa3_decodes) == 1


def test_fa3_at_a_cap_runs_through_decode_attention_where_sglangs_fa3_code_would_drop_it(sgl, monkeypatch):
    """SGLang's FA3 code passes no cap. A cap graph (tuner.integrations.graph_variants) of FA3's
    default, and an eager call of a wave_fit record whose step needs a cap, run FA3 at that
    cap through decode_attention; the base graph and a step that needs none keep SGLang's code."""
    import tuner
    import tuner.integrations.decode_attention as entry
    from tuner.integrations.graph_variants import StepLengths

    backend, pool, batch = _backend([12, 7])
    fa3_default = {"backend": "fa3", "num_splits": 0, "pack_gqa": None}
    calls = _recorded(monkeypatch, config=fa3_default)
    step = _step(backend, batch)
    backend.decode_cuda_graph_metadata = {2: backend.forward_metadata}  # a warm-up on the graph's buffers
    with tuner.graph_capture(StepLengths(16384, True, fa3_cap=5, default_capped=True)):
        backend.forward_decode(*step, batch)
    with tuner.graph_capture(StepLengths(16384, True, fa3_cap=5)):  # a cap graph of wave_fit records only
        backend.forward_decode(*step, batch)
    with tuner.graph_capture():  # the base graph
        backend.forward_decode(*step, batch)
    assert [config for _, config in calls] == [dict(fa3_default, num_splits=5)]
    assert len(backend.fa3_decodes) == 2
    backend.decode_cuda_graph_metadata = {}
    monkeypatch.setattr(integration, "resolve_config", lambda call: dict(fa3_default, wave_fit=True))
    monkeypatch.setattr(entry, "wave_cap", lambda lengths, **shape: 4)  # the step's lengths need cap 4
    backend.forward_decode(*step, batch)
    monkeypatch.setattr(entry, "wave_cap", lambda lengths, **shape: 0)
    batch.seq_lens_cpu = batch.seq_lens_cpu.clone()  # the next step's lengths
    backend.forward_decode(*step, batch)
    assert [config for _, config in calls[1:]] == [dict(fa3_default, num_splits=4)]
    assert len(backend.fa3_decodes) == 3


def _strided_q(rows: int) -> torch.Tensor:
    """q as SGLang's layers give it: the first columns of the qkv projection's rows (a view
    whose rows are further apart than its width)."""
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, generator=torch.Generator().manual_seed(3))
    return qkv[:, :HEADS * DIM]


class _Copies(TorchDispatchMode):
    """The tensor copies torch runs while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "clone" in name or "copy" in name:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_a_call_left_to_fa3s_default_copies_nothing(sgl, monkeypatch):
    """A copy of q made before the call is left to SGLang's FA3 code (which makes its own)
    was one more kernel a layer in the H100's graphs at batch 8."""
    backend, _, batch = _backend([12, 7])
    monkeypatch.setattr(integration, "resolve_config", lambda call: {"backend": "fa3", "num_splits": 0,
                                                                     "pack_gqa": None})
    _, k, v, layer = _step(backend, batch)
    q = _strided_q(2)
    assert not q.is_contiguous()
    with _Copies() as copies:
        assert backend.forward_decode(q, k, v, layer, batch, save_kv_cache=False) == "fa3"
    assert copies.ops == []


def test_a_call_tuners_kernel_runs_gets_the_layers_q_as_it_is(sgl, monkeypatch):
    """decode_attention copies q only for a backend that needs it (tests/test_decode_attention)."""
    backend, _, batch = _backend([12, 7])
    calls = _recorded(monkeypatch)
    _, k, v, layer = _step(backend, batch)
    q = _strided_q(2)
    backend.forward_decode(q, k, v, layer, batch)
    (call, _), = calls
    assert call[0].data_ptr() == q.data_ptr() and call[0].stride()[0] == q.stride()[0]


def test_a_strided_q_attends_as_its_contiguous_copy(sgl):
    backend, _, batch = _backend([40, 17, 3])
    _, k, v, layer = _step(backend, batch)
    q = _strided_q(3)
    out = backend.forward_decode(q, k, v, layer, batch)
    torch.testing.assert_close(out, backend.forward_decode(q.contiguous(), k, v, layer, batch, save_kv_cache=False))


@pytest.mark.parametrize("change", [
    dict(backend=dict(use_mla=True)), dict(backend=dict(kv_cache_dtype_str="fp8_e4m3")),
    dict(backend=dict(has_local_attention=True)), dict(backend=dict(use_sliding_window_kv_pool=True)),
    dict(batch=dict(spec_info=object())), dict(layer=dict(is_cross_attention=True)),
    dict(layer=dict(scaling=0.5)), dict(layer=dict(attn_type=types.SimpleNamespace(name="ENCODER_ONLY"))),
    dict(kwargs=dict(q_descale=torch.ones(1))), dict(kwargs=dict(score_mod=print)),
    dict(kwargs=dict(cos_sin_cache=torch.ones(1))),  # a keyword it does not know
    dict(kwargs=dict(return_lse=True)),  # (SGLang 0.5.23's)
    dict(backend=dict(num_splits=1)),  # deterministic inference
    dict(backend=dict(fa_impl_ver=4)), dict(backend=dict(is_prefill_aware_swa=True)),
    dict(layer=dict(attn_type=types.SimpleNamespace(name="DECODER_BIDIRECTIONAL"))),
    dict(metadata=dict(max_seq_len_q=2)),
], ids=lambda change: next(iter(next(iter(change.values())))))
def test_what_decode_attention_does_not_do_runs_sglangs_fa3_code(sgl, change):
    backend, pool, batch = _backend([12, 7])
    q, k, v, layer = _step(backend, batch, **change.get("layer", {}))
    for name, value in change.get("backend", {}).items():
        setattr(backend, name, value)
    for name, value in change.get("batch", {}).items():
        setattr(batch, name, value)
    for name, value in change.get("metadata", {}).items():
        setattr(backend.forward_metadata, name, value)
    assert backend.forward_decode(q, k, v, layer, batch, **change.get("kwargs", {})) == "fa3"
    assert len(backend.fa3_decodes) == 1 and not pool.writes


@pytest.mark.parametrize("name", ["bf16", "bfloat16"])
def test_a_kv_cache_named_as_qs_own_dtype_runs_tuners_decode(sgl, monkeypatch, name):
    """--kv-cache-dtype bf16 for a BF16 model (a helper's review): SGLang's FA3 code then casts
    q to the cache's dtype (no change) and passes no descale, as with "auto"; tuner's backend
    ran SGLang's FA3 code for it, silently. A cache of another dtype, or one with scales, stays
    SGLang's."""
    backend, _, batch = _backend([12, 7])
    calls = _recorded(monkeypatch)
    q, k, v, layer = _step(backend, batch)
    backend.kv_cache_dtype_str, backend.kv_cache_dtype = name, q.dtype
    assert backend.forward_decode(q, k, v, layer, batch) != "fa3" and len(calls) == 1
    backend.kv_cache_dtype = torch.float16  # q would be cast: SGLang's code
    assert backend.forward_decode(q, k, v, layer, batch) == "fa3"
    backend.kv_cache_dtype = q.dtype
    scaled = fake_sglang.Layer(tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, head_dim=DIM, k_scale=torch.ones(1))
    assert backend.forward_decode(q, k, v, scaled, batch) == "fa3"
    assert len(calls) == 1 and len(backend.fa3_decodes) == 2


def test_sinks_a_window_and_a_softcap_reach_decode_attention(sgl, monkeypatch):
    backend, _, batch = _backend([20, 5])
    calls = _recorded(monkeypatch)
    q, k, v, layer = _step(backend, batch, sliding_window_size=7, logit_cap=30.0)
    sinks = torch.zeros(HEADS)
    backend.forward_decode(q, k, v, layer, batch, sinks=sinks, q_rope=None)
    assert calls[-1][0][6:10] == (True, (7, 0), 30.0, sinks)


def _store(db_path, kv_len, config, batch=4):
    from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
    from tuner.workload import DecodeShape

    shape = DecodeShape(batch=batch, kv_len=kv_len, num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                        page_size=1, dtype="float32")
    with TuningDB(db_path) as db:
        db.save_record(Problem("decode_attention", shape.static_key().to_json(), shape.run_key()),
                       (current_fingerprint_id(), current_fingerprint()), config, median_us=1.0, spread_us=0.0,
                       samples=3, default_config={"backend": "fa3"}, default_median_us=2.0,
                       default_spread_us=0.0, method={})


def _graph_step(backend, bs, bound):
    """SGLang's decode step on a graph's buffers: a page table as wide as the bound, the
    padding's lengths (1)."""
    backend.forward_metadata = fake_sglang.Metadata(page_table=torch.zeros(bs, bound, dtype=torch.int32),
                                                    cache_seqlens_int32=torch.ones(bs, dtype=torch.int32),
                                                    max_seq_len_k=1)
    backend.decode_cuda_graph_metadata = {bs: backend.forward_metadata}
    batch = fake_sglang.ForwardBatch(out_cache_loc=torch.zeros(bs, dtype=torch.int64), seq_lens_cpu=None)

    def forward():
        q, k, v, layer = _step(backend, batch)
        return backend.forward_decode(q, k, v, layer, batch)
    return forward


def _triton(block_n, splits):
    return {"backend": "triton_decode", "block_n": block_n, "num_kv_splits": splits, "num_warps": 4, "num_stages": 2}


DEFAULT = (32, 4)  # decode_attention's default (block_n, num_kv_splits) on the CPU


def test_sglangs_graph_runner_captures_a_graph_per_variant_and_replays_each_steps_own(sgl, monkeypatch, db_path):
    """Per-call records that differ by kv bucket: beside each batch size's graph (the default
    here, as no config wins at every bucket), SGLang's runner captures one graph per config set
    (tuner.integrations.graph_variants) under its own label, and the host step before a replay
    picks the step's. A runner of another backend is left as it is."""
    import tuner
    from support.recorders import recording_triton

    _store(db_path, 2048, _triton(64, 8))
    _store(db_path, 1024, _triton(16, 2))
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    ran = recording_triton(monkeypatch)
    monkeypatch.setenv("TUNER_REPLAY_JUDGE", "0")  # every step its own variant (the judge: its own tests)
    current_fingerprint()  # this machine's, and the backends that run here, before it looks like a CUDA one
    installed()
    # a CUDA machine whose runner's third run of a step is a capture, as torch.cuda.graph counts one
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: sgl.capturing[0])
    CAPTURES[0] += 1
    try:
        _capture_and_replay_variants(sgl, db_path, ran)
    finally:
        CAPTURES[0] -= 1


def _capture_and_replay_variants(sgl, db_path, ran):
    integration.register()
    pool = fake_sglang.KVPool(layers=1, slots=16, kv_heads=KV_HEADS, head_dim=DIM)
    backend = integration.create_backend(types.SimpleNamespace(token_to_kv_pool=pool, page_size=1))
    runner = sgl.runner(backend, capture_bs=[4])
    runner.capture_one_shape(4, _graph_step(backend, 4, 2048))
    runner.capture_one_shape(4, _graph_step(backend, 4, 2048), None, "lora")  # SGLang's own variants stay
    assert set(runner.graphs) == {fake_sglang.ShapeKey(4, None, label) for label in (
        None, "tuner-1", "tuner-2", "lora", "lora+tuner-1", "lora+tuner-2")}
    # the base graph's warm-ups at the bound ran its per-call record, its capture the default
    # (Triton's here, on the CPU); each variant its config set's, warm-ups and capture alike
    assert ran == ([(64, 8)] * 2 + [DEFAULT] + [(64, 8)] * 3 + [(16, 2)] * 3) * 2

    def replayed(lengths, lora=None):
        batch = fake_sglang.ForwardBatch(out_cache_loc=torch.zeros(len(lengths), dtype=torch.int64),
                                         seq_lens_cpu=torch.tensor(lengths, dtype=torch.int32))
        batch.lora = lora
        runner.execute(batch)
        return runner._replay_graph_key.variant_label
    assert replayed([2000, 10, 10, 10]) == "tuner-1" and replayed([900, 900, 5]) == "tuner-2"  # 3 padded to 4
    assert replayed([100] * 4) is None and replayed([2000] * 4, lora="lora") == "lora+tuner-1"

    plain = sgl.runner(fake_sglang.FlashAttentionBackend(types.SimpleNamespace(token_to_kv_pool=pool, page_size=1)),
                       capture_bs=[4])
    plain.capture_one_shape(4, lambda: "fa3")
    assert list(plain.graphs) == [fake_sglang.ShapeKey(4)]
    batch = fake_sglang.ForwardBatch(out_cache_loc=torch.zeros(4), seq_lens_cpu=torch.full((4,), 2000))
    assert plain.execute(batch) == "fa3" and plain._replay_graph_key == fake_sglang.ShapeKey(4)


def test_each_captured_batch_size_logs_what_its_graph_runs_and_its_variants(sgl, db_path, caplog):
    """A benchmark reads from the log whether tuner ran anything of its own at a batch size."""
    runner, step = _variant_runner(sgl, db_path)
    with caplog.at_level(logging.INFO, logger="tuner"):
        runner.capture_one_shape(4, step)
    # the record at kv 2048 is a per-call one: the graph at the bound runs the default, a variant the record
    assert "tuner: batch size 4: its graph runs the default; 1 graph variant(s) beside it, tuner-1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tuner"):  # a bound below the record's kv bucket: nothing varies
        runner.capture_one_shape(8, _graph_step(runner.attn_backend, 8, 64))
    assert "tuner: batch size 8: its graph runs the default; 0 graph variant(s) beside it" in caplog.text


@pytest.mark.parametrize("record, default", [
    ({"backend": "fa3", "num_splits": 0, "pack_gqa": None}, True),
    # FA3's default with a flag forward_decode ignores: SGLang's FA3 code runs it, as the default
    ({"backend": "fa3", "num_splits": 0, "pack_gqa": None, "wave_fit": True}, True),
    ({"backend": "fa3", "num_splits": 4, "pack_gqa": None}, False)])
def test_the_plan_log_says_the_default_where_forward_decode_runs_sglangs_fa3_code(monkeypatch, caplog, record,
                                                                                  default):
    monkeypatch.setattr(integration, "resolve_config", lambda call: dict(record))
    monkeypatch.setattr(integration, "graph_runs", lambda config, call: config)  # (as a graph runs it)
    monkeypatch.setattr(integration.decode_attention.tuner, "default",
                        lambda args, kwargs: {"backend": "fa3", "num_splits": 0, "pack_gqa": None})
    with caplog.at_level(logging.INFO, logger="tuner"):
        integration.log_plan(8, [("a call",)], [])
    said = "the default" if default else "tuned configs"
    assert f"tuner: batch size 8: its graph runs {said}; 0 graph variant(s) beside it" in caplog.text


def test_a_plan_log_whose_lookup_fails_says_nothing_and_raises_nothing(monkeypatch, caplog):
    """The line is for benchmarks only: a lookup that raises there must not reach SGLang's
    capture, which calls log_plan outside the planning's own guard."""
    def broken(call):
        raise RuntimeError("lookup failed")
    monkeypatch.setattr(integration, "resolve_config", broken)
    with caplog.at_level(logging.INFO, logger="tuner"):
        integration.log_plan(4, [("a call",)], [])
    assert "batch size 4" not in caplog.text


def test_the_graph_hooks_are_registered_once_and_left_to_sglang_while_it_loads_plugins(sgl, monkeypatch):
    integration.register()
    integration.register()
    hooked = {target.rsplit(".", 1)[1]: len(hooks) for target, hooks in sgl.hooks.hooks.items()}
    assert hooked == {"capture_one_shape": 1, "load_batch": 1, "execute": 1}
    assert len(sgl.hooks.patched) == 3  # applied now: no plugin loading is under way
    monkeypatch.setattr(integration, "_hooks_registered", False)
    fresh = fake_sglang.install(monkeypatch)
    monkeypatch.setattr(sys.modules["sglang.srt.plugins"], "_plugins_loaded", True)  # inside load_plugins
    integration.register()
    assert len(fresh.hooks.hooks) == 3 and not fresh.hooks.patched  # SGLang applies them after the last plugin


def _variant_runner(sgl, db_path, **runner_fields):
    import tuner

    _store(db_path, 2048, _triton(64, 8))
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    integration.register()
    pool = fake_sglang.KVPool(layers=1, slots=16, kv_heads=KV_HEADS, head_dim=DIM)
    backend = integration.create_backend(types.SimpleNamespace(token_to_kv_pool=pool, page_size=1))
    runner = sgl.runner(backend, capture_bs=[4])
    for name, value in runner_fields.items():
        setattr(runner, name, value)
    return runner, _graph_step(backend, 4, 2048)


def _replayed_key(runner, lengths):
    runner.execute(fake_sglang.ForwardBatch(out_cache_loc=torch.zeros(len(lengths)),
                                           seq_lens_cpu=torch.tensor(lengths, dtype=torch.int32)))
    return runner._replay_graph_key


def test_a_variant_that_cannot_be_captured_leaves_its_steps_to_the_batch_sizes_graph(sgl, db_path):
    runner, step = _variant_runner(sgl, db_path)
    with pytest.warns(RuntimeWarning, match="tuner-1 of batch size 4 not captured"):
        runner.capture_one_shape(4, _out_of_memory_in_variants(step))
    assert list(runner.graphs) == [fake_sglang.ShapeKey(4)]
    assert _replayed_key(runner, [2000] * 4) == fake_sglang.ShapeKey(4)
    assert integration.tuner_backend(runner).tuner_variants.label(4, [2000] * 4) is None  # dropped, not just skipped


def test_a_record_variant_that_cannot_be_captured_leaves_its_class_to_the_flashinfer_variant(flashinfer_runner):
    """Where the record's variant fails its capture, its class is served as the base graph's
    classes are: by FlashInfer's variant, captured beside it."""
    runner, backend, _ = flashinfer_runner
    step = _graph_step(backend, 4, 2048)

    def record_variant_out_of_memory():
        from tuner.runtime.state import runtime

        if runtime.declared_lengths is not None and not backend.tuner_capturing_flashinfer:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return step()
    with pytest.warns(RuntimeWarning, match="tuner-1 of batch size 4 not captured"):
        runner.capture_one_shape(4, record_variant_out_of_memory)
    assert set(runner.graphs) == {fake_sglang.ShapeKey(4, None, label) for label in (None, "tuner-2")}
    assert _replayed_key(runner, [2000] * 4) == fake_sglang.ShapeKey(4, None, "tuner-2")


def test_a_plan_that_fails_leaves_the_batch_size_one_graph(sgl, db_path, monkeypatch):
    runner, step = _variant_runner(sgl, db_path)
    monkeypatch.setattr(integration.GraphVariants, "plan", lambda *a, **k: 1 / 0)
    with pytest.warns(RuntimeWarning, match="no graph variants for batch size 4 .ZeroDivisionError"):
        runner.capture_one_shape(4, step)
    assert list(runner.graphs) == [fake_sglang.ShapeKey(4)]


def test_a_variant_that_fails_under_one_of_sglangs_labels_keeps_the_graph_held_under_another(sgl, db_path):
    """SGLang captures a batch size once per LoRA label: a variant whose capture ran out of memory
    under the "lora" label was dropped for the batch size, and plain steps lost the variant
    captured beside their own graph."""
    runner, step = _variant_runner(sgl, db_path)
    runner.capture_one_shape(4, step)
    with pytest.warns(RuntimeWarning, match="lora[+]tuner-1 of batch size 4 not captured"):
        runner.capture_one_shape(4, _out_of_memory_in_variants(step), None, "lora")
    assert set(runner.graphs) == {fake_sglang.ShapeKey(4), fake_sglang.ShapeKey(4, None, "tuner-1"),
                                  fake_sglang.ShapeKey(4, None, "lora")}
    assert _replayed_key(runner, [2000] * 4) == fake_sglang.ShapeKey(4, None, "tuner-1")
    lora_step = fake_sglang.ForwardBatch(out_cache_loc=torch.zeros(4), seq_lens_cpu=torch.full((4,), 2000))
    lora_step.lora = "lora"
    runner.execute(lora_step)
    assert runner._replay_graph_key == fake_sglang.ShapeKey(4, None, "lora")  # (its variant is not held)


def test_a_capture_inside_the_callers_own_graph_capture_gets_no_variant(sgl, db_path):
    """The caller's declaration holds: its graph runs what the declared lengths name, alone."""
    import tuner

    runner, step = _variant_runner(sgl, db_path)
    with tuner.graph_capture([2000] * 4), warnings.catch_warnings():
        warnings.simplefilter("error")  # (not a plan that failed: none was tried)
        runner.capture_one_shape(4, step)
    assert list(runner.graphs) == [fake_sglang.ShapeKey(4)]


def _out_of_memory_in_variants(step):
    """The step, failing as out of memory in a variant's capture (under its declaration)."""
    from tuner.runtime.state import runtime

    def forward():
        if runtime.declared_lengths is not None:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return step()
    return forward


def test_ranks_that_must_replay_alike_keep_one_graph_per_batch_size(sgl, db_path):
    """DP attention: each rank has its own batch, and a rank's collectives pair its captured
    buffers with the others', so no rank may pick a graph of its own. Likewise under pdmux,
    and for a size torch.compile traces."""
    for fields in ({"require_mlp_sync": True}, {"enable_pdmux": True}, {"ragged_verify_mode": True},
                   {"enable_torch_compile": True, "compile_bs": [4]}):
        runner, step = _variant_runner(sgl, db_path, **fields)
        runner.capture_one_shape(4, step)
        assert list(runner.graphs) == [fake_sglang.ShapeKey(4)], fields
        assert _replayed_key(runner, [2000] * 4) == fake_sglang.ShapeKey(4)
    runner, step = _variant_runner(sgl, db_path, enable_torch_compile=True, compile_bs=[8])
    runner.capture_one_shape(4, step)
    assert fake_sglang.ShapeKey(4, None, "tuner-1") in runner.graphs  # a size it does not trace


def test_a_variant_graph_sglang_does_not_hold_is_never_replayed(sgl, db_path):
    runner, step = _variant_runner(sgl, db_path)
    runner.capture_one_shape(4, step)
    assert _replayed_key(runner, [2000] * 4) == fake_sglang.ShapeKey(4, None, "tuner-1")
    del runner.graphs[fake_sglang.ShapeKey(4, None, "tuner-1")]
    assert _replayed_key(runner, [2000] * 4) == fake_sglang.ShapeKey(4)


def test_under_tensor_parallelism_a_variant_that_cannot_be_captured_stops_the_capture(sgl, db_path, monkeypatch):
    """One rank dropping a variant alone would replay other graphs than its peers."""
    model_runner, group, calls, plans = _tp_ranks(monkeypatch, other_rank_ratio=1.0)
    runner, step = _variant_runner(sgl, db_path, tp_size=2, model_runner=model_runner)
    with pytest.raises(RuntimeError, match="TUNER_GRAPH_VARIANTS=0"):
        runner.capture_one_shape(4, _out_of_memory_in_variants(step))


class _Clock:
    """The GPU's time as fake CUDA events see it: each replay adds its graph's cost (ms)."""

    def __init__(self, costs):
        # done: every event (True), none (False), or those of the first n made (an int)
        self.now, self.costs, self.done, self.events, self.waited = 0.0, costs, True, [], []

    def event(self, enable_timing=False):
        clock = self

        class Event:
            def record(self):
                self.at = clock.now

            def query(self):
                return clock.is_done(self)

            def synchronize(self):  # the host waits for it: done from then on
                clock.waited.append(self)

            def elapsed_time(self, end):
                assert clock.is_done(self) and clock.is_done(end), "read before done: a step would wait for the GPU"
                return end.at - self.at

        made = Event()
        self.events.append(made)
        return made

    def is_done(self, event):
        if self.waited and self.events.index(event) <= max(map(self.events.index, self.waited)):
            return True  # (one stream: the events recorded before one waited for are done too)
        return self.done if isinstance(self.done, bool) else self.events.index(event) < self.done

    def replay(self, runner):
        def run(key, forward_batch):
            cost = self.costs[key.variant_label]  # (ms, or a function of the step's batch)
            self.now += cost(forward_batch) if callable(cost) else cost
            return runner.graphs[key]
        return run


@pytest.fixture
def judged(sgl, db_path, monkeypatch):
    """A CUDA machine as the judge sees it (events from a fake clock), and a runner with one
    variant captured: "tuner-1", for batches of 4 whose longest is in the 2048 bucket."""
    def make(costs, **runner_fields):
        clock = _Clock(costs)
        current_fingerprint()  # this machine's, and the backends that run here, before it looks like a CUDA one
        installed()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: sgl.capturing[0])
        monkeypatch.setattr(torch.cuda, "Event", clock.event)
        runner, step = _variant_runner(sgl, db_path, **runner_fields)
        runner.capture_one_shape(4, step)
        runner.backend.replay = clock.replay(runner)
        return runner, clock
    CAPTURES[0] += 1  # as torch.cuda.graph counts a capture
    try:
        yield make
    finally:
        CAPTURES[0] -= 1


DENSE_2K = Pick("tuner-1", (2048, True))  # the judged fixture's variant, on dense steps of kv bucket 2048


def _labels(runner, steps, lengths=(2000,) * 4):
    return [_replayed_key(runner, list(lengths)).variant_label for _ in range(steps)]


def _dropped(caplog, text):
    """Whether the judge logged a drop (a warning; a kept verdict is info) whose line holds text."""
    return any(r.levelno >= logging.WARNING and "graph variant" in r.getMessage() and text in r.getMessage()
               for r in caplog.records)


def test_a_variant_slower_than_the_base_graph_over_its_first_replays_is_dropped(judged, caplog):
    """Its first replays alternate with the batch size's graph, the base graph first; the 8th
    pair's time is read at the next step, which finds the variant dropped (5% slower than the
    base graph), logs it, and replays the base graph, as every later step of its lengths does."""
    runner, clock = judged({None: 1.0, "tuner-1": 1.05})
    assert _labels(runner, 16) == [None, "tuner-1"] * 8 and not _dropped(caplog, "tuner-1")
    assert _labels(runner, 3) == [None] * 3
    assert _dropped(caplog, "graph variant tuner-1 of batch size 4 ran 1.050x")
    assert runner.attn_backend.tuner_judge.verdicts == {(4, DENSE_2K): pytest.approx(1.05)}
    timed = len(clock.events)
    _labels(runner, 5)
    assert len(clock.events) == timed  # judged: no more events


def test_a_variant_no_slower_than_the_base_graph_is_kept_and_timed_no_more(judged):
    runner, clock = judged({None: 1.0, "tuner-1": 0.8})
    assert _labels(runner, 16) == [None, "tuner-1"] * 8
    timed = len(clock.events)
    assert _labels(runner, 4) == ["tuner-1"] * 4
    assert runner.attn_backend.tuner_judge.verdicts == {(4, DENSE_2K): pytest.approx(0.8)}
    # the step that read the last pair had its verdict before its replay: its one event ended
    # the last pair's whole step, and no step times anything after
    assert len(clock.events) == timed + 1
    # a step of lengths no variant was captured for replays the base graph, untimed
    assert _labels(runner, 2, lengths=(100,) * 4) == [None, None] and len(clock.events) == timed + 1


def _time_after_replays(runner, clock, variant=0.0, base=0.0):
    """Each step takes this many ms more after its replay (sampling, the host, say), by the
    graph it replayed: outside the replay's events, inside its whole step."""
    execute = runner.execute

    def step(forward_batch):
        out = execute(forward_batch)
        clock.now += variant if runner._replay_graph_key.variant_label == "tuner-1" else base
        return out
    runner.execute = step


def test_a_variant_whose_replays_gain_but_whose_steps_lose_is_dropped(judged, caplog):
    """The judge times each judged step whole (its start to the next step's) beside its replay,
    and decides on the larger ratio: a cost outside the replay's events counts."""
    runner, clock = judged({None: 1.0, "tuner-1": 0.9})
    _time_after_replays(runner, clock, variant=0.3)
    assert _labels(runner, 16) == [None, "tuner-1"] * 8
    assert _labels(runner, 2) == [None, None]
    assert _dropped(caplog, "tuner-1 of batch size 4 ran 1.200x the time of the batch size's graph over its first "
                            "replays here (0.900x by its replays, 1.200x by its whole steps)")


def test_a_whole_step_that_held_more_than_a_step_is_not_counted(judged, caplog):
    """A base step followed by something else (a prefill, the server idle) before the next
    decode step spans far more than the replays: its pair gives no whole-step ratio, and the
    replays decide alone."""
    runner, clock = judged({None: 1.0, "tuner-1": 0.9})
    _time_after_replays(runner, clock, base=5.0)  # more than STEP_SPAN_MAX times the replays
    with caplog.at_level(logging.INFO, logger="tuner"):
        assert _labels(runner, 16) == [None, "tuner-1"] * 8
        assert _labels(runner, 2) == ["tuner-1"] * 2
    assert "ran 0.900x the time of the batch size's graph over its first replays here (0.900x by its replays, " \
           "not counted by its whole steps); its steps at kv bucket 2048, dense keep it" in caplog.text


def test_a_variant_whose_every_step_runs_long_after_a_quicker_replay_is_dropped_not_hidden(judged, caplog):
    """The span limit is the pair's (STEP_SPAN_MAX times its longer replay) and leaves out long
    base steps only: a variant step is long by the variant's own cost, maybe, and counts."""
    runner, clock = judged({None: 1.0, "tuner-1": 0.9})
    _time_after_replays(runner, clock, variant=1.0, base=0.1)  # variant steps 1.9 ms, base 1.1
    _labels(runner, 16)
    assert _labels(runner, 2) == [None, None]
    assert _dropped(caplog, "ran 1.727x the time of the batch size's graph over its first replays here "
                            "(0.900x by its replays, 1.727x by its whole steps)")


@pytest.mark.parametrize("after, kept", [(0.07, True), (0.10, False)])
def test_whole_steps_are_held_to_their_own_wider_tolerance(judged, caplog, after, kept):
    """A whole step carries the host's jitter: its ratio is held to the step tolerance (3%),
    the replays' to 1%. Whole steps 1.02x: kept; 1.05x: dropped (the replays 0.95x)."""
    runner, clock = judged({None: 1.0, "tuner-1": 0.95})
    _time_after_replays(runner, clock, variant=after)
    _labels(runner, 16)
    assert _labels(runner, 2) == (["tuner-1"] * 2 if kept else [None, None])
    assert _dropped(caplog, "(0.950x by its replays, 1.050x by its whole steps)") is not kept


def test_a_variant_is_judged_per_class_of_lengths_it_serves(judged, caplog):
    """One graph serves every class of lengths whose records name its configs, and may lose on
    one and win on another (a Triton config that loses to FA3 on equal lengths and wins on
    spread ones; inside SGLang, bench_one_batch's warm-up of equal lengths dropped the graph
    its spread lengths would have won with). A verdict holds for its class alone."""
    def variant_cost(forward_batch):
        lengths = forward_batch.seq_lens_cpu
        return 1.05 if int(lengths.sum()) * 2 >= len(lengths) * int(lengths.max()) else 0.8  # dense: slower
    runner, clock = judged({None: 1.0, "tuner-1": variant_cost})
    dense, not_dense = (2000,) * 4, (2000, 10, 10, 10)  # both in kv bucket 2048: tuner-1's
    assert _labels(runner, 16, dense) == [None, "tuner-1"] * 8
    assert _labels(runner, 16, not_dense) == [None, "tuner-1"] * 8
    assert _labels(runner, 2, dense) == [None, None] and _labels(runner, 2, not_dense) == ["tuner-1"] * 2
    assert _dropped(caplog, "ran 1.050x") and _dropped(caplog, "its steps at kv bucket 2048, dense replay")
    assert not _dropped(caplog, "0.800x")
    assert runner.attn_backend.tuner_judge.verdicts == {(4, DENSE_2K): pytest.approx(1.05),
                                                        (4, Pick("tuner-1", (2048, False))): pytest.approx(0.8)}


def test_a_kept_variant_is_judged_again_later_and_dropped_if_it_has_come_to_lose(judged, caplog):
    """A class's traffic may change after its first replays: a kept variant is rechecked after
    `recheck` more replays of its class (then twice as many), so it does not go on losing."""
    cost = {"variant": 0.8}
    runner, clock = judged({None: 1.0, "tuner-1": lambda forward_batch: cost["variant"]})
    judge = runner.attn_backend.tuner_judge
    judge.recheck = 10
    assert _labels(runner, 16) == [None, "tuner-1"] * 8
    assert _labels(runner, 10) == ["tuner-1"] * 10 and judge.verdicts == {(4, DENSE_2K): pytest.approx(0.8)}
    cost["variant"] = 1.05  # its class's traffic has changed
    assert _labels(runner, 16) == [None, "tuner-1"] * 8  # the recheck, from the 10th replay after the verdict
    assert _labels(runner, 3) == [None] * 3 and _dropped(caplog, "ran 1.050x")
    assert judge.verdicts == {(4, DENSE_2K): pytest.approx(1.05)}


def test_a_variant_kept_on_its_recheck_is_rechecked_twice_as_late(judged):
    runner, clock = judged({None: 1.0, "tuner-1": 0.8})
    runner.attn_backend.tuner_judge.recheck = 10
    _labels(runner, 16)
    events = len(clock.events)
    # untimed till the recheck (the first of these steps ends the last judged one's whole step)
    assert _labels(runner, 10) == ["tuner-1"] * 10 and len(clock.events) == events + 1
    assert _labels(runner, 16) == [None, "tuner-1"] * 8  # rechecked, and kept
    events = len(clock.events)
    _labels(runner, 20)
    assert len(clock.events) == events + 1  # the next recheck: 20 replays on
    assert _labels(runner, 2) == [None, "tuner-1"]


def test_a_batch_size_captured_again_is_judged_again(judged, caplog):
    """New graphs: the verdicts on the old ones do not hold, and a dropped class is judged
    again rather than replaying its variant untimed."""
    runner, clock = judged({None: 1.0, "tuner-1": 1.05})
    _labels(runner, 16)
    assert _labels(runner, 2) == [None, None]
    runner.capture_one_shape(4, _graph_step(runner.attn_backend, 4, 2048))
    assert runner.attn_backend.tuner_judge.verdicts == {}
    events = len(clock.events)
    # each judged step: its start and end, and (but the last) its whole step's end at the next step
    assert _labels(runner, 16) == [None, "tuner-1"] * 8 and len(clock.events) == events + 3 * 16 - 1
    assert _labels(runner, 2) == [None, None]


def test_no_step_waits_for_the_gpu_to_time_a_replay(judged, caplog):
    """Events still running on the GPU are left for a later step, and those behind them too
    (replays are read in the order they ran): no verdict, no wait."""
    runner, clock = judged({None: 1.0, "tuner-1": 2.0})
    clock.done = False
    assert _labels(runner, 40) == [None, "tuner-1"] * 20
    # done: the first 7 pairs' events (2 for the first step, then 3 a step: the last one's whole
    # step ended at the next tick) and the 8th pair's base replay's start, not its end
    clock.done = 2 + 13 * 3 + 1 + 1
    assert _labels(runner, 2) == [None, "tuner-1"] and runner.attn_backend.tuner_judge.verdicts == {}
    clock.done = True
    assert _labels(runner, 1) == [None] and _dropped(caplog, "ran 2.000x")


def test_a_variant_replay_pairs_only_with_a_base_replay_of_as_many_real_sequences(judged):
    """A batch padded up to its size holds fewer real sequences, and far less work: a variant
    replay of 4 after a base replay of 3 (or the reverse) is no pair, and gives no verdict."""
    runner, clock = judged({None: 1.0, "tuner-1": 1.5})

    def step(real):
        lengths = [2000] * real
        return _replayed_key(runner, lengths).variant_label
    assert [step(3 if i % 2 == 0 else 4) for i in range(40)] == [None, "tuner-1"] * 20
    assert runner.attn_backend.tuner_judge.verdicts == {}
    assert [step(4) for _ in range(17)] == [None, "tuner-1"] * 8 + [None]  # like pairs: dropped


def test_a_pair_compares_graphs_of_one_server_label(judged, caplog):
    """SGLang's LoRA steps replay graphs of their own label ("lora", "lora+tuner-1"), with
    more work: a base replay without LoRA and a variant replay with it are no pair. Steps
    that alternate between the two give no verdict; runs of one label do."""
    runner, clock = judged({None: 1.0, "tuner-1": 1.0, "lora": 2.0, "lora+tuner-1": 2.0})
    runner.capture_one_shape(4, _graph_step(runner.attn_backend, 4, 2048), None, "lora")

    def step(lora):
        batch = fake_sglang.ForwardBatch(out_cache_loc=torch.zeros(4), seq_lens_cpu=torch.full((4,), 2000))
        batch.lora = lora
        runner.execute(batch)
        return runner._replay_graph_key.variant_label
    assert [step("lora" if i % 2 else None) for i in range(40)] == [None, "lora+tuner-1"] * 20
    assert runner.attn_backend.tuner_judge.verdicts == {} and not _dropped(caplog, "tuner-1")
    for _ in range(17):  # runs of one label: pairs of like graphs, each 1.0 (the 8th read at the 17th)
        step("lora")
    assert runner.attn_backend.tuner_judge.verdicts == {(4, DENSE_2K): pytest.approx(1.0)}


@pytest.mark.parametrize("ranks", [{"pp_size": 2}, {"tp_size": 2, "pp_size": 2}])
def test_pipeline_stages_replay_their_variants_unjudged(judged, monkeypatch, ranks):
    """Pipeline stages would have to agree along the pipeline (not built): every step runs
    its variant, untimed."""
    model_runner, group, calls, plans = _tp_ranks(monkeypatch, other_rank_ratio=1.5)
    runner, clock = judged({None: 1.0, "tuner-1": 1.5}, model_runner=model_runner, **ranks)
    assert _labels(runner, 20) == ["tuner-1"] * 20 and clock.events == [] and calls == []


def test_tensor_parallel_ranks_with_no_group_to_agree_through_keep_one_graph_per_batch_size(judged):
    """Ranks replay one graph together: without SGLang's TP group (here: no model runner) they
    cannot check that they planned alike, nor agree on verdicts, so none captures variants."""
    with pytest.warns(RuntimeWarning, match="planned different graph variants for batch size 4"):
        runner, clock = judged({None: 1.0, "tuner-1": 1.5}, tp_size=2)
    assert list(runner.graphs) == [fake_sglang.ShapeKey(4)]
    assert _labels(runner, 4) == [None] * 4 and clock.events == []


def _tp_ranks(monkeypatch, other_rank_ratio, same_plan=True):
    """SGLang's TP group as tuner sees it: a CPU group, and an all-reduce (MAX) that meets
    another rank's plan digest (the same, or another) and ratio; the ratios and digests it got."""
    group = object()
    calls, plans = [], []

    def all_reduce(tensor, op=None, group=None):
        assert op == torch.distributed.ReduceOp.MAX
        if tensor.dtype == torch.int64:  # a plan's digest, [d, -d]
            plans.append(int(tensor[0]))
            if not same_plan:
                tensor[0] += 1  # the other rank's is larger
            return
        calls.append((float(tensor[0]), op, group))
        tensor.fill_(max(float(tensor[0]), other_rank_ratio))
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    model_runner = types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=group))
    return model_runner, group, calls, plans


def test_tensor_parallel_ranks_act_on_their_slowest_ranks_ratio(judged, monkeypatch, caplog):
    """This rank's variant ran 0.8x, another rank's 1.05x: both ranks drop it (they replay one
    graph together), through one all-reduce (MAX) over the TP CPU group; their plans were
    compared once, at the capture."""
    model_runner, group, calls, plans = _tp_ranks(monkeypatch, other_rank_ratio=1.05)
    runner, clock = judged({None: 1.0, "tuner-1": 0.8}, tp_size=2, model_runner=model_runner)
    assert len(plans) == 1 and "tuner-1" in {key.variant_label for key in runner.graphs}
    labels = _labels(runner, 24)
    assert labels[:16] == [None, "tuner-1"] * 8 and labels[-2:] == [None, None]
    assert calls == [(pytest.approx(0.8), torch.distributed.ReduceOp.MAX, group)]
    assert runner.attn_backend.tuner_judge.verdicts == {(4, DENSE_2K): pytest.approx(1.05)}
    assert _dropped(caplog, "ran 1.050x")


def test_tensor_parallel_ranks_that_planned_differently_capture_no_variant(judged, monkeypatch):
    """A rank whose planning failed, or that read another DB, would replay other graphs than
    its peers: every rank finds the digests differ, and none captures a variant."""
    model_runner, group, calls, plans = _tp_ranks(monkeypatch, other_rank_ratio=1.0, same_plan=False)
    with pytest.warns(RuntimeWarning, match="planned different graph variants for batch size 4"):
        runner, clock = judged({None: 1.0, "tuner-1": 0.8}, tp_size=2, model_runner=model_runner)
    assert list(runner.graphs) == [fake_sglang.ShapeKey(4)] and len(plans) == 1
    assert _labels(runner, 4) == [None] * 4 and calls == [] and clock.events == []


@pytest.mark.parametrize("gpu_done", [True, False])
def test_tensor_parallel_ranks_read_each_replay_a_fixed_number_of_steps_after_it_ran(judged, monkeypatch, gpu_done):
    """A rank's GPU finishes when it does, so a rank reading replays once they are done would
    reach the 8th pair, and the all-reduce, at its own step: the ranks would deadlock or
    disagree. Each replay is read AGREED_READ_LAG steps after it ran, waited for if need be,
    whether its events are long done or not: the verdict's step is the same on every rank."""
    from tuner.integrations.replay_judge import AGREED_READ_LAG

    model_runner, group, calls, plans = _tp_ranks(monkeypatch, other_rank_ratio=0.0)
    runner, clock = judged({None: 1.0, "tuner-1": 1.5}, tp_size=2, model_runner=model_runner)
    clock.done = gpu_done
    labels = _labels(runner, 16 + AGREED_READ_LAG)
    # the 8th pair's variant replay ran at step 16; steps 17 to 16 + AGREED_READ_LAG - 1 go on
    # alternating, and step 16 + AGREED_READ_LAG reads it: dropped at 1.5x, the base graph's
    assert AGREED_READ_LAG == 4 and labels == [None, "tuner-1"] * 8 + [None, "tuner-1", None, None]
    assert len(calls) == 1 and calls[0][0] == pytest.approx(1.5)
    assert bool(clock.waited) != gpu_done  # (waited for only where not done)


def test_two_ranks_whose_gpus_run_at_different_paces_agree_at_the_same_step():
    """Two ranks' judges over the same steps, one rank's GPU done at once, the other's 3 steps
    behind: both call agree at the same step, and act on the same ratio."""
    from tuner.integrations.replay_judge import ReplayJudge

    class Rank:
        def __init__(self, gpu_behind):
            self.gpu_behind, self.step, self.agreed_at = gpu_behind, 0, []

        def event(self):
            rank = self

            class Event:
                def record(self):
                    self.step = rank.step

                def query(self):
                    return rank.step - self.step >= rank.gpu_behind

                def synchronize(self):
                    pass

                def elapsed_time(self, end):
                    return 1.0  # every replay alike: the ratio is 1.0 on both
            return Event()

    ranks = [Rank(0), Rank(3)]
    judges = []
    for rank in ranks:
        def agree(ratio, rank=rank):
            rank.agreed_at.append(rank.step)
            return ratio
        judges.append(ReplayJudge(8, 0.01, on_drop=lambda *a: None, event=rank.event, agree=agree))
    for _ in range(30):
        for rank, judge in zip(ranks, judges):
            rank.step += 1
            with judge.replaying(4, "tuner-1"):
                pass
    assert ranks[0].agreed_at == ranks[1].agreed_at and len(ranks[0].agreed_at) == 1
    assert judges[0].verdicts == judges[1].verdicts == {(4, "tuner-1"): 1.0}


def test_ranks_agree_on_the_slowest_ranks_replay_and_whole_step_ratios_in_one_collective():
    """One rank counted no whole step (0.0 stands for none), another's lost 6%: both ranks
    act on (the slower replays, the lost whole steps) and drop the variant alike."""
    from tuner.integrations.replay_judge import ReplayJudge

    clock, agreed = EventClock(), []

    def agree(ratios):  # another rank's (0.95, 1.06), by MAX
        agreed.append(ratios)
        return tuple(max(mine, theirs) for mine, theirs in zip(ratios, (0.95, 1.06)))
    judge = ReplayJudge(2, 0.01, on_drop=lambda *a: None, event=clock, agree=agree)
    for step in range(10):
        with judge.replaying(4, "tuner-1") as label:
            clock.now += 0.9 if label else 1.0
        clock.now += 5.0  # this rank: every step far past its replay, no whole step counted
    assert agreed == [(pytest.approx(0.9), 0.0)]
    assert judge.dropped(4, "tuner-1") and judge.verdicts == {(4, "tuner-1"): pytest.approx(1.06)}


def test_a_base_replay_timed_at_zero_counts_as_a_neutral_pair():
    """Every rank must count its pairs alike: a base replay read as 0 ms (no ratio to take)
    counts as 1.0 rather than being skipped on one rank only."""
    from tuner.integrations.replay_judge import ReplayJudge

    clock = EventClock()
    judge = ReplayJudge(2, 0.01, on_drop=lambda *a: None, event=clock)
    for step in range(4):  # the base replays take no time, the variant's 1 ms
        with judge.replaying(4, "tuner-1"):
            clock.now += step % 2
    judge.tick()
    assert judge.verdicts == {(4, "tuner-1"): 1.0}  # (a whole step of 0 ms: not counted)


def test_a_judge_of_no_pairs_leaves_every_variant_as_planned(judged, monkeypatch):
    monkeypatch.setenv("TUNER_REPLAY_JUDGE", "0")
    runner, clock = judged({None: 1.0, "tuner-1": 1.5})
    assert _labels(runner, 20) == ["tuner-1"] * 20 and clock.events == []


@pytest.fixture
def flashinfer_runner(sgl, db_path, monkeypatch):
    """A batch-4 runner of tuner's backend with its FlashInfer variant asked for, the default's
    classes and one record's (Triton at kv 2048), unjudged, on a CUDA machine as the runner
    sees it; and the FlashInfer backends SGLang made."""
    import tuner

    _store(db_path, 2048, _triton(64, 8))
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    monkeypatch.setenv("TUNER_REPLAY_JUDGE", "0")
    monkeypatch.setenv("TUNER_SGLANG_FLASHINFER", "1")
    current_fingerprint()
    installed()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: sgl.capturing[0])
    CAPTURES[0] += 1
    integration.register()
    pool = fake_sglang.KVPool(layers=1, slots=16, kv_heads=KV_HEADS, head_dim=DIM)
    model_runner = types.SimpleNamespace(token_to_kv_pool=pool, page_size=1)
    backend = integration.create_backend(model_runner)
    runner = sgl.runner(backend, capture_bs=[4])
    yield runner, backend, fake_sglang.FlashInferAttnBackend.made
    CAPTURES[0] -= 1


def test_a_flashinfer_variant_runs_sglangs_flashinfer_on_the_classes_the_base_graph_would_replay(
        flashinfer_runner, caplog):
    """TUNER_SGLANG_FLASHINFER=1: SGLang's FlashInfer backend beside tuner's (over its model
    runner, decode only, its graph state made for the runner's sizes, at the first capture
    that can hold it) is captured as one more variant, for the classes that replay the base
    graph; before a replay of it, and only then, it plans on the replay's view; a record's
    class keeps its own variant."""
    runner, backend, made = flashinfer_runner
    assert not made  # (none until a graph can hold it)
    with caplog.at_level(logging.INFO, logger="tuner"):
        runner.capture_one_shape(4, _graph_step(backend, 4, 2048))
    [flashinfer] = made
    assert flashinfer.model_runner is backend.tuner_model_runner and flashinfer.skip_prefill
    assert flashinfer.calls[0] == ("graph_state", 4, 4)
    assert "2 graph variant(s) beside it, tuner-1, tuner-2 (flashinfer)" in caplog.text
    assert set(runner.graphs) == {fake_sglang.ShapeKey(4, None, label) for label in (None, "tuner-1", "tuner-2")}
    assert runner.graphs[fake_sglang.ShapeKey(4, None, "tuner-2")] == "flashinfer"
    assert runner.graphs[fake_sglang.ShapeKey(4)] != "flashinfer" != runner.graphs[fake_sglang.ShapeKey(4, None, "tuner-1")]
    # its metadata made in its own capture only, then its warm-ups and the capture ran it
    assert [c[0] for c in flashinfer.calls[1:]] == ["capture", "decode", "decode", "decode"]
    assert flashinfer.calls[1][1].batch_size == 4
    flashinfer.calls.clear()

    def replay(lengths):
        batch = fake_sglang.ForwardBatch(out_cache_loc=torch.zeros(len(lengths), dtype=torch.int64),
                                         seq_lens_cpu=torch.tensor(lengths, dtype=torch.int32))
        return runner.execute(batch), batch
    assert replay([2000] * 4)[0] != "flashinfer" and not flashinfer.calls  # the record's class: no plan
    out, batch = replay([100, 100, 90])  # 3 padded to 4
    assert out == "flashinfer" and runner._replay_graph_key.variant_label == "tuner-2"
    [(kind, view)] = flashinfer.calls
    assert kind == "plan" and view.step is batch and view.batch_size == 4


def test_without_the_setting_no_flashinfer_backend_is_made_nor_captured(flashinfer_runner, monkeypatch, sgl):
    monkeypatch.delenv("TUNER_SGLANG_FLASHINFER")
    pool = fake_sglang.KVPool(layers=1, slots=16, kv_heads=KV_HEADS, head_dim=DIM)
    backend = integration.create_backend(types.SimpleNamespace(token_to_kv_pool=pool, page_size=1))
    runner = sgl.runner(backend, capture_bs=[4])
    runner.capture_one_shape(4, _graph_step(backend, 4, 2048))
    assert backend.tuner_flashinfer is None and not fake_sglang.FlashInferAttnBackend.made
    assert set(runner.graphs) == {fake_sglang.ShapeKey(4, None, label) for label in (None, "tuner-1")}
    assert _replayed_key(runner, [100] * 4) == fake_sglang.ShapeKey(4)


def test_a_flashinfer_backend_that_cannot_be_made_leaves_the_other_variants(flashinfer_runner, monkeypatch, sgl):
    tries = []

    def unavailable(*args, **kwargs):
        tries.append(1)
        raise ImportError("No module named 'flashinfer'")
    monkeypatch.setattr(fake_sglang.FlashInferAttnBackend, "__init__", unavailable)
    pool = fake_sglang.KVPool(layers=1, slots=16, kv_heads=KV_HEADS, head_dim=DIM)
    backend = integration.create_backend(types.SimpleNamespace(token_to_kv_pool=pool, page_size=1))
    runner = sgl.runner(backend, capture_bs=[4])
    with pytest.warns(RuntimeWarning, match="no FlashInfer graph variant .ImportError"):
        runner.capture_one_shape(4, _graph_step(backend, 4, 2048))
    assert set(runner.graphs) == {fake_sglang.ShapeKey(4, None, label) for label in (None, "tuner-1")}
    assert len(tries) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked once: no second warning, nor try
        runner.capture_one_shape(4, _graph_step(backend, 4, 2048))
    assert len(tries) == 1


def test_a_failed_flashinfer_plan_replays_the_batch_sizes_graph_from_then_on(flashinfer_runner):
    """A stale plan must never replay: where FlashInfer's plan fails, the step and its class's
    later steps replay the base graph."""
    runner, backend, _ = flashinfer_runner
    runner.capture_one_shape(4, _graph_step(backend, 4, 2048))
    fake_sglang.FlashInferAttnBackend.fail_plans = True
    with pytest.warns(RuntimeWarning, match="FlashInfer's plan failed .RuntimeError: plan failed"):
        assert _replayed_key(runner, [100] * 4) == fake_sglang.ShapeKey(4)
    fake_sglang.FlashInferAttnBackend.fail_plans = False
    assert _replayed_key(runner, [100] * 4) == fake_sglang.ShapeKey(4)  # its class: dropped
    assert _replayed_key(runner, [200] * 4) == fake_sglang.ShapeKey(4, None, "tuner-2")  # another class: kept


def test_a_flashinfer_variant_held_under_one_of_sglangs_labels_plans_before_each_replay_whatever_the_other_did(
        flashinfer_runner):
    """The FlashInfer variant captured for plain steps, then not under SGLang's "lora" label (out
    of memory): a plain step that replays it still plans FlashInfer first (a stale plan must
    never replay)."""
    runner, backend, made = flashinfer_runner
    step = _graph_step(backend, 4, 2048)
    runner.capture_one_shape(4, step)

    def flashinfer_out_of_memory():
        if backend.tuner_capturing_flashinfer:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return step()
    with pytest.warns(RuntimeWarning, match="lora[+]tuner-2 of batch size 4 not captured"):
        runner.capture_one_shape(4, flashinfer_out_of_memory, None, "lora")
    [flashinfer] = made
    flashinfer.calls.clear()
    assert _replayed_key(runner, [100] * 4) == fake_sglang.ShapeKey(4, None, "tuner-2")
    assert [kind for kind, _ in flashinfer.calls] == ["plan"]


@pytest.mark.parametrize("change, runs", [({}, True), ({"sinks": torch.zeros(HEADS)}, False),
                                          ({"window": 127}, False), ({"sinks": None}, True),
                                          ({"k_rope": None}, True)])
def test_only_calls_sglangs_flashinfer_decode_takes_as_they_are_run_it(sgl, change, runs):
    """FlashInfer's forward_decode takes no sinks, and its backend keeps windowed layers on
    wrappers of their own: such calls, like every call decode_attention does not cover, run
    as in the base graph; a keyword passed as None is one not passed."""
    backend, _, batch = _backend([5, 9])
    kwargs = {name: value for name, value in change.items() if name != "window"}
    layer = fake_sglang.Layer(tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, head_dim=DIM,
                              sliding_window_size=change.get("window", -1))
    q = _step(backend, batch)[0]
    assert integration.runs_flashinfer(backend, q, layer, batch, kwargs) == runs


def test_no_flashinfer_variant_over_pages_of_more_than_one_token(flashinfer_runner, sgl):
    pool = fake_sglang.KVPool(layers=1, slots=16, kv_heads=KV_HEADS, head_dim=DIM)
    backend = integration.create_backend(types.SimpleNamespace(token_to_kv_pool=pool, page_size=16))
    runner = sgl.runner(backend, capture_bs=[4])
    runner.capture_one_shape(4, _graph_step(backend, 4, 2048))
    assert backend.tuner_flashinfer is None and not fake_sglang.FlashInferAttnBackend.made


def test_a_step_sglang_gave_no_replay_view_replays_the_batch_sizes_graph(flashinfer_runner):
    """A step whose metadata SGLang made ahead (no metadata step in its load_batch) has no view
    of its own: FlashInfer would plan on another step's lengths, so it replays the base graph,
    and its class keeps the variant for later steps."""
    runner, backend, made = flashinfer_runner
    runner.capture_one_shape(4, _graph_step(backend, 4, 2048))
    [flashinfer] = made
    assert _replayed_key(runner, [100] * 4) == fake_sglang.ShapeKey(4, None, "tuner-2")  # a view: planned
    flashinfer.calls.clear()
    backend.init_forward_metadata_out_graph = lambda *a, **k: None  # this step's metadata were made ahead
    assert _replayed_key(runner, [100] * 4) == fake_sglang.ShapeKey(4)
    assert not flashinfer.calls
    del backend.init_forward_metadata_out_graph  # (the class's again)
    assert _replayed_key(runner, [100] * 4) == fake_sglang.ShapeKey(4, None, "tuner-2")
    assert [c[0] for c in flashinfer.calls] == ["plan"]


def test_under_tensor_parallelism_a_failed_flashinfer_plan_stops_the_step(flashinfer_runner, monkeypatch):
    """One rank dropping the FlashInfer variant's class alone would replay the base graph while
    its peers replay the variant (their collectives paired with other graphs' buffers)."""
    runner, backend, _ = flashinfer_runner
    model_runner, _, _, _ = _tp_ranks(monkeypatch, other_rank_ratio=1.0)
    runner.tp_size, runner.model_runner = 2, model_runner
    runner.capture_one_shape(4, _graph_step(backend, 4, 2048))
    assert fake_sglang.ShapeKey(4, None, "tuner-2") in runner.graphs
    fake_sglang.FlashInferAttnBackend.fail_plans = True
    with pytest.raises(RuntimeError, match="TUNER_SGLANG_FLASHINFER=0"):
        _replayed_key(runner, [100] * 4)


def test_no_flashinfer_variant_where_no_call_of_the_graph_can_run_it(flashinfer_runner):
    """A model whose every layer has sinks (or a window): FlashInfer's decode would run in no
    call of the variant, which would then be the base graph's kernels plus FlashInfer's plan
    before each of its replays, a graph captured for nothing."""
    runner, backend, made = flashinfer_runner
    _graph_step(backend, 4, 2048)  # (the graph's buffers)
    batch = fake_sglang.ForwardBatch(out_cache_loc=torch.zeros(4, dtype=torch.int64), seq_lens_cpu=None)

    def with_sinks():
        q, k, v, layer = _step(backend, batch)
        return backend.forward_decode(q, k, v, layer, batch, sinks=torch.zeros(HEADS))
    runner.capture_one_shape(4, with_sinks)
    assert backend.tuner_flashinfer_labels == {} and not made  # (nor is its memory taken)


def _judged_flashinfer(sgl, monkeypatch, record: float, flashinfer: float):
    """flashinfer_runner's set-up with the judge on, each replay timed (the base graph 1.0,
    the record's variant tuner-1 and the FlashInfer variant tuner-2 as given): the runner,
    SGLang's FlashInfer backend (its calls so far cleared) and the judge's pairs."""
    monkeypatch.delenv("TUNER_REPLAY_JUDGE")
    clock = _Clock({None: 1.0, "tuner-1": record, "tuner-2": flashinfer})
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    pool = fake_sglang.KVPool(layers=1, slots=16, kv_heads=KV_HEADS, head_dim=DIM)
    backend = integration.create_backend(types.SimpleNamespace(token_to_kv_pool=pool, page_size=1))
    runner = sgl.runner(backend, capture_bs=[4])
    runner.capture_one_shape(4, _graph_step(backend, 4, 2048))
    runner.backend.replay = clock.replay(runner)
    backend.tuner_flashinfer.calls.clear()
    return runner, backend.tuner_flashinfer, integration.settings.replay_judge_pairs()


def test_a_judged_flashinfer_variant_plans_only_before_its_own_replays(flashinfer_runner, monkeypatch, sgl):
    """With the judge on, the FlashInfer variant's first replays alternate with the base graph
    (base first); FlashInfer plans before each of its replays and no other, and a variant
    slower than the base graph is dropped for its class like any other."""
    runner, flashinfer, pairs = _judged_flashinfer(sgl, monkeypatch, record=1.0, flashinfer=1.5)
    labels = _labels(runner, 2 * pairs, lengths=(100,) * 4)
    assert labels == [None, "tuner-2"] * pairs
    assert [c[0] for c in flashinfer.calls] == ["plan"] * pairs
    assert _labels(runner, 3, lengths=(100,) * 4) == [None] * 3  # dropped: 1.5x
    assert len(flashinfer.calls) == pairs


def test_a_class_whose_record_variant_lost_is_judged_on_flashinfer_next(flashinfer_runner, monkeypatch, sgl):
    """A record's variant (tuner-1, kv 2048) that its replays find slower than the base graph
    is dropped for its class, whose steps then try the FlashInfer variant (judged against the
    base graph in turn, its plan before each of its replays) and keep it where it wins."""
    runner, flashinfer, pairs = _judged_flashinfer(sgl, monkeypatch, record=1.5, flashinfer=0.8)
    assert _labels(runner, 2 * pairs) == [None, "tuner-1"] * pairs and not flashinfer.calls
    assert _labels(runner, 2 * pairs) == [None, "tuner-2"] * pairs  # dropped (1.5x): FlashInfer's turn
    assert _labels(runner, 3) == ["tuner-2"] * 3  # kept: 0.8x
    assert [c[0] for c in flashinfer.calls] == ["plan"] * (pairs + 3)
    # the base graph's class: its own verdict, judged from its first step (not the kv-2048 class's)
    assert _labels(runner, 2, lengths=(100,) * 4) == [None, "tuner-2"]


@pytest.mark.parametrize("flashinfer, keeps", [(0.8, "tuner-2"), (1.0, "tuner-1"), (0.905, "tuner-1")])
def test_a_class_whose_record_variant_was_kept_is_challenged_by_flashinfer(flashinfer_runner, monkeypatch, sgl,
                                                                           flashinfer, keeps):
    """A record's variant kept against the base graph (0.9x) is challenged for its class by
    the FlashInfer variant, whose judged replays alternate with the record's variant (FlashInfer
    plans only before its own); the faster of the two keeps the class (1.0 is 1.11x of 0.9), and
    a challenger slower at all loses (0.905 is 1.006x: within the tolerance against the base graph)."""
    runner, backend, pairs = _judged_flashinfer(sgl, monkeypatch, record=0.9, flashinfer=flashinfer)
    assert _labels(runner, 2 * pairs) == [None, "tuner-1"] * pairs and not backend.calls
    assert _labels(runner, 2 * pairs) == ["tuner-1", "tuner-2"] * pairs
    assert _labels(runner, 3) == [keeps] * 3
    assert [c[0] for c in backend.calls] == ["plan"] * (pairs + (3 if keeps == "tuner-2" else 0))
