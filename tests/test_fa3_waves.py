"""decode_attention's wave_fit FA3 config: the host model of FA3's varlen scheduler, the cap
it chooses, and how a call, a capture and a sweep's batch run it (FA3 faked: no GPU here)."""

import dataclasses

import numpy as np
import pytest
import torch

from tuner.integrations.decode_attention import decode_attention, eager_config, graph_runs
from tuner.ops import fa3_waves
from tuner.ops.decode_attention import BACKENDS, graph_config_space
from tuner.ops.fa3_waves import WAVE_FIT, check_config, dynamic_splits, kernel_time, static_splits, wave_cap
from tuner.workload import DecodeShape, make_decode_inputs

WAVE = {"backend": "fa3", "num_splits": 0, "pack_gqa": None, WAVE_FIT: True}
HEADS = dict(num_kv_heads=8, q_per_kv=6, q_len=1, head_dim=128, sms=132)  # 48/8 heads on an H200's 132 SMs


def _cap(lengths: list[int]) -> int:
    return wave_cap(lengths, table_keys=-(-max(lengths) // 16) * 16, **HEADS)


def test_the_model_gives_fa3s_own_split_counts():
    # FA3's host cap for 8 kv heads: 15 splits (8 x 15 = 120 tiles, 0.91 of a wave), none
    # for a short table (at most 4 blocks of 128 keys)
    assert static_splits(8, 131072, 128, 132) == 15
    assert static_splits(8, 512, 128, 132) == 1
    assert static_splits(128, 131072, 128, 132) == 1  # tiles fill 0.8 of the SMs: no splits
    # batch 3 with 87, 83 and 65 blocks: 235 x 1.1 x 8 / 132 -> 16 blocks a tile, so 6, 6, 5 splits
    assert dynamic_splits(np.array([87, 83, 65]), 1, 8, 15, 132).tolist() == [6, 6, 5]
    assert dynamic_splits(np.array([87, 83, 65]), 1, 8, 4, 132).tolist() == [4, 4, 4]  # a caller's num_splits caps them


def test_kernel_time_puts_a_second_wave_on_the_least_loaded_sms():
    # 4 tiles on 2 SMs: 10 and 9 first, then 5 onto the 9 and 1 onto the 10
    assert kernel_time(np.array([10, 9, 5, 1]), np.ones(4, dtype=int), 1, 2) == 14 + 2 * 2  # (9 + 2) + (5 + 2)
    assert kernel_time(np.array([10]), np.array([1]), 3, 2) == 24  # three like tiles on 2 SMs: two waves of 12
    assert kernel_time(np.array([10]), np.array([1]), 5, 2) is None  # five on 2 SMs: past two waves


@pytest.mark.parametrize("lengths, expected", [
    ([11049, 10500, 8200], 5),  # 136 tiles on 132 SMs, all alike: capped to 5 splits, 120 tiles
    ([11049, 11000, 11000], 0),  # 5, 5, 5 splits: one wave already
    ([15000] + [300] * 7, 0),  # 152 tiles, but the overflow is short tiles: a cap would slow the long one
    ([1000] * 40, 0),  # 40 x 8 tiles without splits: past two waves, nothing to fit
    ([100], 0),  # one short sequence
])
def test_the_cap_is_taken_only_where_fitting_one_wave_shortens_the_kernel(lengths, expected):
    assert _cap(lengths) == expected


def test_a_wave_fit_config_is_offered_where_it_can_differ_from_fa3s_default():
    small = DecodeShape(batch=3, kv_len=16384, num_q_heads=48, num_kv_heads=8)
    assert WAVE in [{"backend": "fa3", **c} for c in fa3_waves.configs(small)]
    for other in (dataclasses.replace(small, batch=64),  # 512 tiles without splits
                  dataclasses.replace(small, window=(127, 0)),  # a window's keys are not its lengths
                  dataclasses.replace(small, dtype="float32")):
        assert not any(WAVE_FIT in c for c in fa3_waves.configs(other)), other
    assert check_config({"num_splits": 0, "pack_gqa": None, WAVE_FIT: True}) is None
    assert "num_splits must be 0" in check_config({"num_splits": 2, "pack_gqa": None, WAVE_FIT: True})
    assert check_config({"num_splits": 0, "pack_gqa": None, WAVE_FIT: False}) is not None


@pytest.fixture
def fake_fa3(monkeypatch):
    """FA3 "installed": decode_attention's FA3 backend records the num_splits each call passes."""
    passed = []

    def call(config, q, k_cache, v_cache, *rest, out=None):
        passed.append(config["num_splits"])
        return torch.zeros(*q.shape[:3], v_cache.shape[-1], dtype=q.dtype)

    fa3 = BACKENDS["fa3"]
    monkeypatch.setitem(BACKENDS, "fa3", dataclasses.replace(
        fa3, call=call, op=dataclasses.replace(fa3.op, unavailable=lambda: None)))
    return passed


def _call_args(batch=3):
    inputs = make_decode_inputs(DecodeShape(batch=batch, kv_len=64, num_q_heads=48, num_kv_heads=8, head_dim=16,
                                            dtype="float32"))
    wide = torch.zeros(batch, 11056, dtype=torch.int32)  # a table 11056 keys wide (page size 1)
    return inputs.q, inputs.k_cache, inputs.v_cache, wide, inputs.cache_seqlens, 11049


def test_a_call_runs_the_cap_of_its_own_host_lengths(fake_fa3, monkeypatch):
    args = _call_args()
    for lengths in (torch.tensor([11049, 10500, 8200], dtype=torch.int32), [11049, 10500, 8200],
                    np.array([11049, 10500, 8200])):
        decode_attention(*args, seq_lens_host=lengths, config=WAVE)
    decode_attention(*args, seq_lens_host=[11049, 11000, 11000], config=WAVE)  # one wave already
    decode_attention(*args, config=WAVE)  # lengths unknown: FA3's own choice
    assert fake_fa3 == [5, 5, 5, 0, 0]


def test_a_kept_cap_follows_the_lengths_tensor_when_it_changes_in_place(fake_fa3):
    """Every layer of a step passes one lengths tensor, so its cap is kept; a server that
    updates the tensor in place for the next step must get that step's cap."""
    args = _call_args()
    lengths = torch.tensor([11049, 10500, 8200], dtype=torch.int32)
    decode_attention(*args, seq_lens_host=lengths, config=WAVE)
    lengths.copy_(torch.tensor([11049, 11000, 11000]))
    decode_attention(*args, seq_lens_host=lengths, config=WAVE)
    with torch.inference_mode():
        frozen = torch.tensor([11049, 10500, 8200], dtype=torch.int32)
    decode_attention(*args, seq_lens_host=frozen, config=WAVE)
    assert fake_fa3 == [5, 0, 5]


def test_a_capture_runs_fa3s_default_and_plans_no_graph_for_it(fake_fa3, monkeypatch):
    """A captured graph replays any lengths: a cap from the capture's lengths would be frozen
    for all of them. So a capture runs FA3's own choice, graph records never hold wave_fit,
    and a graph variant of it is the default's graph."""
    import tuner.integrations.decode_attention as entry
    args = _call_args()
    monkeypatch.setattr(entry, "CAPTURES", [1])
    monkeypatch.setattr(entry, "stream_capturing", lambda: True)
    decode_attention(*args, seq_lens_host=[11049, 10500, 8200], config=WAVE)
    assert fake_fa3 == [0]
    assert graph_runs(WAVE, args) == {"backend": "fa3", "num_splits": 0, "pack_gqa": None}
    shape = DecodeShape(batch=3, kv_len=16384, num_q_heads=48, num_kv_heads=8)
    assert not any(WAVE_FIT in c for c in graph_config_space(shape))
    # what a benchmark timing calls in graphs resolves first, as the eager call would run
    assert eager_config(WAVE, *args, seq_lens_host=[11049, 10500, 8200])["num_splits"] == 5


def test_a_sweeps_batch_runs_the_cap_of_its_own_lengths(monkeypatch):
    """A sweep times each batch of a serving trial in a graph of its own lengths: the op's run
    resolves the cap from the batch's host lengths, capture or not."""
    ran = []
    monkeypatch.setattr(fa3_waves, "_fa3_run", lambda inputs, config: ran.append(config["num_splits"]))
    shape = DecodeShape(batch=3, kv_len=11049, num_q_heads=48, num_kv_heads=8, head_dim=16, dtype="float32")
    inputs = make_decode_inputs(shape, seq_lens=[11049, 10500, 8200], table_width=11056)
    fa3_waves.FA3_WITH_WAVES.run(inputs, {k: v for k, v in WAVE.items() if k != "backend"})
    fa3_waves.FA3_WITH_WAVES.run(dataclasses.replace(inputs, seq_lens_host=None),
                                 {k: v for k, v in WAVE.items() if k != "backend"})
    assert ran == [5, 0]


def test_graph_variants_capture_fa3_at_the_caps_steps_need_and_a_step_replays_its_own(db_path, fake_fa3):
    """A graph replays any lengths, so a wave_fit record runs FA3's default there; with graph
    variants a batch size whose record is wave_fit gets graphs of FA3 at the caps its steps
    mostly need (8 kv heads at batch 3: 132 // 24 = 5, and 6), and a step whose lengths
    need one of them replays that graph."""
    import tuner
    from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
    from tuner.integrations.graph_variants import GraphVariants, Pick

    shape = DecodeShape(batch=3, kv_len=16384, num_q_heads=48, num_kv_heads=8, head_dim=16, dtype="bfloat16",
                        lengths="serving")  # (FA3 runs no float32: its records would not apply)
    with TuningDB(db_path) as db:
        db.save_record(Problem("decode_attention", shape.static_key().to_json(), shape.run_key()),
                       (current_fingerprint_id(), current_fingerprint()), WAVE, median_us=1.0, spread_us=0.0,
                       samples=3, default_config={"backend": "fa3", "num_splits": 0, "pack_gqa": None},
                       default_median_us=1.2, default_spread_us=0.0, method={})
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    inputs = make_decode_inputs(dataclasses.replace(shape, kv_len=64, lengths="full"), seq_lens=[17] * 3,
                                table_width=16384)
    call = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 16384)
    variants = GraphVariants(max_variants=8)
    plan = variants.plan(3, [call])
    assert [(v.label, v.lengths.fa3_cap) for v in plan] == [("tuner-1", 5), ("tuner-2", 6)]
    for variant in plan:  # each captured under its declaration runs FA3 at its cap
        with tuner.graph_capture(variant.lengths):
            decode_attention(*call)
    with tuner.graph_capture():  # the base graph: FA3's own choice
        decode_attention(*call)
    assert fake_fa3 == [5, 6, 0]
    assert variants.label(3, torch.tensor([11049, 10500, 8200], dtype=torch.int32)) == "tuner-1"
    assert variants.label(3, [11049, 11000, 11000]) is None  # one wave already: the base graph
    assert variants.label(3, [15000, 300, 300]) is None  # a cap would not pay
    # a step padded up to the captured size: FA3 gives the pad a tile, 8 + 7 + 1 splits fit one wave
    assert variants.label(3, np.array([11049, 10500, 0]), raw_batch=2) is None
    variants.drop(3, "tuner-1")  # not captured (out of memory): its steps replay the base graph
    assert variants.label(3, [11049, 10500, 8200]) is None
    # judged slower on one class of steps (replay_judge): those steps alone go back to the base
    # graph, here FA3's own choice, as their class names no graph without a cap
    variants.plan(3, [call])
    picked = variants.pick(3, [11049, 10500, 8200])
    assert picked == Pick("tuner-1", (16384, True, 5))
    variants.drop_pick(3, picked)
    assert variants.pick(3, [11049, 10500, 8200]) is None
    variants.plan(3, [call])  # captured again: nothing dropped
    assert variants.pick(3, [11049, 10500, 8200]) == picked


def _counting_models(monkeypatch) -> list:
    """Each time the wave model runs (FA3's splits for a batch), an entry."""
    modelled, model = [], fa3_waves.fa3_splits
    monkeypatch.setattr(fa3_waves, "fa3_splits", lambda *a, **k: modelled.append(1) or model(*a, **k))
    return modelled


def test_a_decode_steps_cap_is_modelled_again_only_when_a_sequence_enters_a_new_kv_block(monkeypatch):
    """A server asks for the cap at every step, each sequence a token longer: the model runs
    again only where a sequence's blocks of keys changed (they alone decide the cap)."""
    fa3_waves._caps_by_blocks.clear()
    modelled = _counting_models(monkeypatch)
    args = dict(table_keys=16384, **HEADS)
    assert wave_cap([11049, 10500, 8200], **args) == 5
    assert wave_cap([8201, 11050, 10501], **args) == 5  # a step later, in another order: the same blocks
    assert len(modelled) == 1
    assert wave_cap([11049, 10500, 8200 + 128], **args) == 5  # one sequence in its next block
    assert len(modelled) == 2


def test_a_kept_cap_is_the_one_the_model_gives_for_any_batch_of_the_same_kv_blocks():
    """The cap kept for a batch of kv blocks is what the model gives any batch of the same
    blocks (in any order, each length anywhere in its block). Batches of 1-12 sequences of
    like lengths, where a cap is often taken (90 of these 300)."""
    rng = np.random.default_rng(0)
    args = dict(table_keys=65536, **HEADS)
    for _ in range(300):
        blocks = int(rng.integers(20, 300)) + rng.integers(-15, 16, size=int(rng.integers(1, 13)))
        first = (blocks - 1) * 128 + rng.integers(1, 129, size=blocks.size)  # lengths in those blocks
        other = rng.permutation((blocks - 1) * 128 + rng.integers(1, 129, size=blocks.size))
        fa3_waves._caps_by_blocks.clear()
        modelled = wave_cap(other.tolist(), **args)
        fa3_waves._caps_by_blocks.clear()
        wave_cap(first.tolist(), **args)
        assert wave_cap(other.tolist(), **args) == modelled, blocks


def test_the_caps_kept_are_bounded_and_large_batches_are_modelled_each_time(monkeypatch):
    fa3_waves._caps_by_blocks.clear()
    monkeypatch.setattr(fa3_waves, "CAPS_KEPT", 2)
    modelled = _counting_models(monkeypatch)
    args = dict(table_keys=16384, **HEADS)
    for lengths in ([1000], [2000], [3000], [1000]):  # the third fills the store: it starts again
        wave_cap(lengths, **args)
    assert len(modelled) == 4
    wide = [1000] * (fa3_waves.KEPT_BATCH + 1)
    wave_cap(wide, **args), wave_cap(wide, **args)
    assert len(modelled) == 6


def _default_cap_call(batch=3, dtype="bfloat16", window=None, kv_heads=8, bound=16384):
    """A graph's decode call at a 16k bound (6 q heads a kv head), with no record: FA3's
    default runs. Its positional arguments up to max_kv_len, as the README's example passes
    them, or up to the window where one is given."""
    shape = DecodeShape(batch=batch, kv_len=64, num_q_heads=6 * kv_heads, num_kv_heads=kv_heads, head_dim=16,
                        dtype=dtype)
    inputs = make_decode_inputs(shape, seq_lens=[17] * batch, table_width=bound)
    call = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, bound)
    return call if window is None else (*call, True, window)


@pytest.fixture
def modelled_fa3(monkeypatch, fake_fa3):
    """FA3 installed in a release whose scheduler the wave model follows; no record anywhere."""
    import tuner
    from tuner.integrations import graph_variants

    monkeypatch.setattr(graph_variants, "_modelled_fa3_installed", lambda: True)
    tuner.configure(mode="off")  # FA3's default for every call
    return fake_fa3


def test_a_graph_that_runs_fa3s_default_gets_cap_graphs_and_a_step_replays_the_one_its_lengths_need(
        modelled_fa3):
    """FA3 spills past one wave on some batches of any kv bucket, and a record that keeps the
    default (or no record) never asked whether a cap pays: where the base graph runs FA3's
    default, graph variants capture FA3 at the caps such steps mostly need (8 kv heads at
    batch 3: 5 and 6), and a step whose lengths need one replays it."""
    import tuner
    from tuner.integrations.graph_variants import GraphVariants

    call = _default_cap_call()
    variants = GraphVariants(max_variants=8)
    plan = variants.plan(3, [call])
    assert [(v.label, v.lengths.fa3_cap) for v in plan] == [("tuner-1", 5), ("tuner-2", 6)]
    for variant in plan:
        with tuner.graph_capture(variant.lengths):
            decode_attention(*call)
    with tuner.graph_capture():  # the base graph: FA3's own choice
        decode_attention(*call)
    decode_attention(*call)  # eager, outside any capture: FA3's own choice (no record asks for a cap)
    assert modelled_fa3 == [5, 6, 0, 0]
    assert variants.label(3, [11049, 10500, 8200]) == "tuner-1"
    assert variants.label(3, [7219, 5871, 7554]) == "tuner-1"  # a shorter bucket's step, the same cap
    assert variants.label(3, [11049, 11000, 11000]) is None  # one wave already: the base graph
    assert variants.label(3, [15000, 300, 300]) is None  # a cap would not pay


def test_a_padded_steps_cap_counts_the_padding_as_fa3_does(modelled_fa3):
    """A server pads a batch up to its captured size, and FA3 gives each padded sequence a tile:
    3 sequences of 6000, 6000 and 8800 keys need cap 6 alone, and cap 5 with one pad, which
    batch 4's cap graphs hold (4 and 5). The step replays the cap-5 graph."""
    from tuner.integrations.graph_variants import GraphVariants

    variants = GraphVariants(max_variants=8)
    plan = variants.plan(4, [_default_cap_call(batch=4)])
    assert [(v.label, v.lengths.fa3_cap) for v in plan] == [("tuner-1", 4), ("tuner-2", 5)]
    real = [6000, 6000, 8800]
    assert variants.label(4, real + [0], raw_batch=3) == "tuner-2"
    assert variants.label(4, real + [1]) == "tuner-2"  # the same step, its pad given as a length
    shape = dict(num_kv_heads=8, q_per_kv=6, q_len=1, head_dim=16, sms=132, table_keys=16384)
    assert wave_cap(real, **shape) == 6  # (what an unpadded model would have asked for: no graph)


def test_a_wave_fit_records_classes_keep_the_cap_graphs_where_fa3s_default_runs_longer_ones(
        modelled_fa3, db_path):
    """Cap graphs hold one set of configs. Two keys of one shape in a graph at a 32k bound: at
    kv 16k one key's record is wave_fit and the other's Triton, and at 32k both keep FA3's
    default. The record's classes keep the cap graphs (as without caps of the default), not
    the longer default ones, which would run the 16k steps' wave_fit call uncapped."""
    import tuner
    from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
    from tuner.integrations.graph_variants import GraphVariants

    triton = {"backend": "triton_decode", "block_n": 64, "num_kv_splits": 8, "num_warps": 4, "num_stages": 2}
    default = {"backend": "fa3", "num_splits": 0, "pack_gqa": None}
    with TuningDB(db_path) as db:
        for softcap, kv_len, config in ((0.0, 16384, WAVE), (30.0, 16384, triton), (0.0, 32768, default),
                                        (30.0, 32768, default)):
            shape = DecodeShape(batch=3, kv_len=kv_len, num_q_heads=48, num_kv_heads=8, head_dim=16,
                                dtype="bfloat16", softcap=softcap, lengths="serving")
            db.save_record(Problem("decode_attention", shape.static_key().to_json(), shape.run_key()),
                           (current_fingerprint_id(), current_fingerprint()), config, median_us=1.0,
                           spread_us=0.0, samples=3, default_config=default, default_median_us=1.2,
                           default_spread_us=0.0, method={})
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    inputs = make_decode_inputs(DecodeShape(batch=3, kv_len=64, num_q_heads=48, num_kv_heads=8, head_dim=16,
                                            dtype="bfloat16"), seq_lens=[17] * 3, table_width=32768)
    plain = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, 32768, True, (-1, -1))
    variants = GraphVariants(max_variants=8)
    plan = variants.plan(3, [(*plain, 0.0), (*plain, 30.0)])
    capped = [v for v in plan if v.lengths.fa3_cap]
    assert [(v.lengths.top, v.lengths.fa3_cap) for v in capped] == [(16384, 5), (16384, 6)]
    assert variants.label(3, [11049, 10500, 8200]) == capped[0].label


@pytest.mark.parametrize("why_not", ["another sgl-kernel", "switched off", "a window", "32-bit", "batch 1",
                                     "batch 40", "a short table", "two shapes"])
def test_no_cap_graph_of_fa3s_default_where_the_model_does_not_hold_or_no_step_can_spill(
        modelled_fa3, monkeypatch, why_not):
    """A release whose FA3 the model was not read from, $TUNER_GRAPH_WAVE_CAPS=0, a window (its
    keys are not its lengths), 32-bit elements, or a batch size whose tiles fit one wave at
    FA3's most splits (batch 1 with 8 kv heads: 15 x 8 = 120 tiles on 132 SMs) plan none;
    nor a batch past the sizes whose cap the host step keeps (40 sequences of one kv head
    could spill, but the model would run at every step); nor a table FA3 never splits (at
    most 4 kv blocks: a 512-key bound); nor a graph whose calls differ in shape."""
    from tuner.integrations import graph_variants

    batch, args = 3, {}
    if why_not == "another sgl-kernel":
        monkeypatch.setattr(graph_variants, "_modelled_fa3_installed", lambda: False)
    elif why_not == "switched off":
        monkeypatch.setenv("TUNER_GRAPH_WAVE_CAPS", "0")
    elif why_not == "a window":
        args = dict(window=(4095, 0))
    elif why_not == "32-bit":
        args = dict(dtype="float32")
    elif why_not == "batch 1":
        batch = 1
    elif why_not == "batch 40":
        batch, args = 40, dict(kv_heads=1)
    elif why_not == "a short table":  # (20 x 8 tiles without splits spill, but FA3 splits no 512-key table)
        batch, args = 20, dict(bound=512)
    calls = [_default_cap_call(batch, **args)]
    if why_not == "two shapes":  # (a cap graph caps every call alike: one shape's cap would not fit the other)
        calls.append(_default_cap_call(batch, kv_heads=4))
    assert graph_variants.GraphVariants(max_variants=8).plan(batch, calls) == []


def test_the_modelled_sgl_kernel_is_read_from_the_installed_release(monkeypatch):
    from tuner.integrations import graph_variants

    for version, modelled in (("0.4.5", True), ("0.4.6.post1", False), (None, False)):
        monkeypatch.setattr(graph_variants, "library_version", lambda names, module, v=version: v)
        graph_variants._modelled_fa3_installed.cache_clear()
        assert graph_variants._modelled_fa3_installed() is modelled
    graph_variants._modelled_fa3_installed.cache_clear()


def test_a_cap_the_model_gives_less_than_the_minimum_gain_is_not_taken(monkeypatch):
    """A cap is taken only where the model gives it settings.FA3_WAVE_MIN_GAIN (5%) over FA3's
    own splits: some batches' caps gain less, and those run FA3's own splits."""
    from tuner import settings

    rng = np.random.default_rng(0)
    batches = [sorted(rng.integers(2048, 65536, size=int(rng.integers(2, 9))).tolist()) for _ in range(300)]

    def caps(min_gain):
        monkeypatch.setattr(settings, "FA3_WAVE_MIN_GAIN", min_gain)
        fa3_waves._caps_by_blocks.clear()  # (caps are kept per batch of blocks)
        return [_cap(lengths) for lengths in batches]
    any_gain, five_percent = caps(0.0), caps(0.05)
    small = [i for i, (a, b) in enumerate(zip(any_gain, five_percent)) if a and not b]
    assert small and all(b in (0, a) for a, b in zip(any_gain, five_percent))
    for i in small[:3]:  # each: a modelled gain under 5%
        lengths = batches[i]
        own = fa3_waves.fa3_splits(lengths, table_keys=-(-max(lengths) // 16) * 16, **HEADS)
        n_blocks, splits, tiles = own
        ratio = kernel_time(n_blocks, splits, tiles, HEADS["sms"]) / kernel_time(
            n_blocks, np.minimum(splits, any_gain[i]), tiles, HEADS["sms"])
        assert 1.0 < ratio < 1.05, (lengths, ratio)


def test_a_batch_size_whose_cap_graphs_were_all_dropped_reads_no_steps_lengths(modelled_fa3, monkeypatch):
    """Every cap graph dropped (its capture failed, or the TP ranks' plans differed): no graph is
    left to pick, and the step's host path no longer reads its lengths (6.4 us a step against
    0.3 us for a batch size without variants, on this project's CPU machine)."""
    from tuner.integrations import graph_variants

    variants = graph_variants.GraphVariants(max_variants=8)
    planned = variants.plan(3, [_default_cap_call()])
    assert planned
    for variant in planned:
        variants.drop(3, variant.label)
    read = []
    real_lengths = graph_variants._real_lengths
    monkeypatch.setattr(graph_variants, "_real_lengths", lambda *args: read.append(args) or real_lengths(*args))
    assert variants.label(3, torch.tensor([11049, 10500, 8200], dtype=torch.int32)) is None and read == []


@pytest.mark.parametrize("given", [32, 33])
def test_lengths_beyond_the_batch_size_are_not_the_steps(modelled_fa3, given):
    """A host buffer longer than the batch (no raw batch size given): its first `batch`
    lengths are the step's (more made the padding negative, or raised from NumPy)."""
    from tuner.integrations import graph_variants

    variants = graph_variants.GraphVariants(max_variants=8)
    variants.plan(3, [_default_cap_call()])
    step = [11049, 10500, 8200]
    assert variants.pick(3, step + [60000] * (given - 3)) == variants.pick(3, step) is not None


def test_no_variant_at_all_where_variants_are_set_to_zero(modelled_fa3):
    """TUNER_GRAPH_VARIANTS=0 is the documented off switch: no cap graph and no alternative
    backend's graph either."""
    from tuner.integrations.graph_variants import GraphVariants

    assert GraphVariants(max_variants=8).plan(3, [_default_cap_call()], alternative="flashinfer")
    off = GraphVariants(max_variants=0)
    assert off.plan(3, [_default_cap_call()], alternative="flashinfer") == []
    assert off.label(3, [11049, 10500, 8200]) is None
