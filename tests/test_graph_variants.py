"""Graph variants (issues 37 and 38): several graphs per batch size, one per config set that
decode_attention's per-call records name over the lengths a replay may hold, and the choice
among them before each replay from the step's host lengths."""

import dataclasses
import types

import numpy as np
import pytest
import torch

import tuner
from support.fake_events import EventClock
from support.recorders import recording_triton
from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
from tuner.integrations.decode_attention import decode_attention
from tuner.integrations import graph_variants
from tuner.integrations.graph_variants import GraphVariants, Pick, StepLengths
from tuner.ops.decode_attention import by_fill
from tuner.workload import DecodeShape, make_decode_inputs

SHAPE = DecodeShape(batch=2, kv_len=64, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, dtype="float32")
BOUND = 2048
DEFAULT = (32, 4)  # the CPU default's (block_n, num_kv_splits)


def _triton(block_n, splits):
    return {"backend": "triton_decode", "block_n": block_n, "num_kv_splits": splits, "num_warps": 4, "num_stages": 2}


def _store(db_path, kv_len, config, op="decode_attention", batch=4, lengths="full"):
    shape = dataclasses.replace(SHAPE, batch=batch, kv_len=kv_len, lengths=lengths)
    with TuningDB(db_path) as db:
        db.save_record(Problem(op, shape.static_key().to_json(), shape.run_key()),
                       (current_fingerprint_id(), current_fingerprint()), config, median_us=1.0, spread_us=0.0,
                       samples=3, default_config={"backend": "triton_decode"}, default_median_us=2.0,
                       default_spread_us=0.0, method={})


def _call(batch=4, bound=BOUND):
    """decode_attention's arguments as a graph captures them: the bound as max length, no host lengths."""
    inputs = make_decode_inputs(dataclasses.replace(SHAPE, batch=batch), seq_lens=[17] * batch)
    return (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, bound)


@pytest.fixture
def records(db_path):
    """Per-call records of batch 4 that differ by kv bucket, one of them by fill."""
    _store(db_path, 2048, _triton(64, 8))
    _store(db_path, 1024, _triton(16, 2))
    _store(db_path, 512, by_fill(_triton(16, 8), _triton(64, 2)))
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    return db_path


@pytest.mark.parametrize("few_lengths", [32, 0])  # (0: every batch read as a large one is, with NumPy)
def test_each_config_set_the_records_name_up_to_the_bound_gets_a_graph_and_each_step_its_own(records, monkeypatch,
                                                                                             few_lengths):
    monkeypatch.setattr(graph_variants, "FEW_LENGTHS", few_lengths)
    ran = recording_triton(monkeypatch)
    variants = GraphVariants(max_variants=8)
    plan = variants.plan(4, [_call()])
    assert [(v.label, v.lengths.top, v.lengths.dense) for v in plan] == [
        ("tuner-1", 2048, True), ("tuner-2", 1024, True), ("tuner-3", 512, True), ("tuner-4", 512, False)]
    # each variant captured under its declaration runs its records' config; the base graph the default
    expected = {"tuner-1": (64, 8), "tuner-2": (16, 2), "tuner-3": (16, 8), "tuner-4": (64, 2)}
    for variant in plan:
        with tuner.graph_capture(variant.lengths):
            decode_attention(*_call())
        assert ran.pop() == expected[variant.label]
    with tuner.graph_capture():
        decode_attention(*_call())
    assert ran.pop() == DEFAULT
    # before each replay: the step's longest picks the kv bucket, its fill the dense part
    steps = {(2000, 17, 17, 17): "tuner-1", (1000, 900, 900, 900): "tuner-2",
             (500, 450, 450, 450): "tuner-3", (500, 10, 10, 10): "tuner-4",
             (300, 20, 20, 20): "tuner-4",  # kv 512's records serve 257-512 by borrowing: the same graph
             (40, 30, 30, 30): None}  # no record near: the default, which the base graph runs
    for lengths, label in steps.items():
        assert variants.label(4, torch.tensor(lengths, dtype=torch.int32)) == label, lengths
        assert variants.label(4, np.array(lengths)) == variants.label(4, list(lengths)) == label
        assert variants.label(4, np.array(lengths, dtype=np.float64)) == label  # (read as integers)
    # a step padded up to the captured batch: the pads count as length 1
    assert variants.label(4, [500, 500, 500, 0], raw_batch=3) == "tuner-3"  # 1501 of 4 x 500: dense
    # dense only through its pads: 999 real tokens (the zeros read as lengths: 999), 1001 with them
    assert variants.label(4, [500, 499, 0, 0], raw_batch=2) == "tuner-3"
    assert variants.label(4, [500, 450, 0, 0], raw_batch=2) == "tuner-4"  # 952: not
    assert variants.label(3, [500, 10, 10]) is None  # a batch size planned for no variant
    assert variants.label(4, torch.tensor([500, 10, 10, 10], device="meta")) is None  # not on the host


def test_the_variants_kept_are_the_longest_lengths_and_the_rest_run_the_base_graph(records):
    variants = GraphVariants(max_variants=2)
    assert [v.label for v in variants.plan(4, [_call()])] == ["tuner-1", "tuner-2"]
    assert variants.label(4, [500] * 4) is None and variants.label(4, [1000] * 4) == "tuner-2"
    none = GraphVariants(max_variants=0)
    assert none.plan(4, [_call()]) == [] and none.label(4, [2000] * 4) is None


def test_an_alternative_backend_serves_the_base_graphs_classes_and_those_whose_own_variant_lost(records):
    """plan(alternative=...) (SGLang's FlashInfer): one more variant, after the records'; a
    step of a class the base graph would replay picks it, and so does one of a class whose
    own variant the replay judge dropped, or that no variant was kept for; where it is
    dropped too, that class replays the base graph. Other classes keep their graphs."""
    variants = GraphVariants(max_variants=8)
    plan = variants.plan(4, [_call()], alternative="flashinfer")
    assert [(v.label, v.alternative) for v in plan] == [
        ("tuner-1", None), ("tuner-2", None), ("tuner-3", None), ("tuner-4", None), ("tuner-5", "flashinfer")]
    assert plan[-1].configs == ("flashinfer",)
    assert variants.label(4, [40, 30, 30, 30]) == "tuner-5"  # no record near: the base graph's class
    record = variants.pick(4, [1000, 900, 900, 900])
    assert record.label == "tuner-2"
    variants.drop_pick(4, record)
    fallback = variants.pick(4, [1000, 900, 900, 900])
    assert fallback == Pick("tuner-5", record.step_class)
    assert variants.label(4, [2000] * 4) == "tuner-1"
    variants.drop_pick(4, fallback)
    assert variants.pick(4, [1000, 900, 900, 900]) is None
    assert variants.label(4, [40, 30, 30, 30]) == "tuner-5" and variants.label(4, [2000] * 4) == "tuner-1"
    variants.drop(4, "tuner-5")  # (its capture failed)
    assert variants.label(4, [40, 30, 30, 30]) is None and variants.label(4, [2000] * 4) == "tuner-1"

    few = GraphVariants(max_variants=2)
    assert [v.label for v in few.plan(4, [_call()], alternative="flashinfer")] == ["tuner-1", "tuner-2", "tuner-3"]
    assert few.label(4, [500] * 4) == "tuner-3"  # a record's class no variant was kept for
    plain = GraphVariants(max_variants=8)
    plain.plan(4, [_call()])
    plain.drop_pick(4, plain.pick(4, [1000, 900, 900, 900]))
    assert plain.pick(4, [1000, 900, 900, 900]) is None and plain.label(4, [2000] * 4) == "tuner-1"


def test_the_alternative_backend_challenges_a_variant_the_judge_kept_for_its_class(records):
    """A pick the judge keeps (keep_pick) is challenged for its class by the alternative
    backend's variant, judged against it (`against`); where the challenger loses, the class
    goes back to the variant kept. Without an alternative nothing challenges."""
    variants = GraphVariants(max_variants=8)
    variants.plan(4, [_call()], alternative="flashinfer")
    record = variants.pick(4, [2000] * 4)
    assert record == Pick("tuner-1", (2048, True))
    variants.keep_pick(4, record)
    challenger = variants.pick(4, [2000] * 4)
    assert challenger == Pick("tuner-5", (2048, True), against="tuner-1")
    assert variants.label(4, [1000] * 4) == "tuner-2"  # another class: its own verdict
    variants.keep_pick(4, challenger)  # (the challenger kept: it goes on serving the class)
    assert variants.pick(4, [2000] * 4) == challenger
    variants.drop_pick(4, challenger)
    assert variants.pick(4, [2000] * 4) == record
    variants.drop(4, "tuner-5")  # (an alternative whose capture failed challenges nothing)
    variants.keep_pick(4, variants.pick(4, [1000] * 4))
    assert variants.label(4, [1000] * 4) == "tuner-2"

    plain = GraphVariants(max_variants=8)
    plain.plan(4, [_call()])
    plain.keep_pick(4, plain.pick(4, [2000] * 4))  # (no alternative: nothing challenges)
    assert plain.pick(4, [2000] * 4) == Pick("tuner-1", (2048, True))


def test_a_judged_challenger_replays_against_the_variant_it_challenges(records, caplog):
    """Through the judge: a record's variant kept against the base graph (0.9x) is challenged
    by the alternative's variant, whose judged replays alternate with the record's (not the
    base graph); at 0.8 it keeps the class, at 1.0 (1.11x of the record's) the class goes back
    to the record's variant."""
    from tuner.integrations.replay_judge import ReplayJudge

    for alternative, wins in ((0.8, True), (1.0, False)):
        variants = GraphVariants(max_variants=8)
        variants.plan(4, [_call()], alternative="flashinfer")
        events = EventClock()
        judge = ReplayJudge.for_variants(variants, event=events)
        cost = {None: 1.0, "tuner-1": 0.9, "tuner-5": alternative}

        def step():
            with judge.replaying(4, variants.pick(4, [2000] * 4)) as chosen:
                events.now += cost[chosen]
            return chosen

        # (the verdict is read at the next step's start, after that step's pick: one more of the record's)
        assert [step() for _ in range(17)] == [None, "tuner-1"] * 8 + ["tuner-1"]
        assert [step() for _ in range(16)] == ["tuner-1", "tuner-5"] * 8
        assert [step() for _ in range(3)] == ["tuner-5" if wins else "tuner-1"] * 3
    assert "graph variant tuner-5 of batch size 4 ran 1.111x the time of variant tuner-1" in caplog.text


def test_ranks_that_agree_drop_a_challenger_that_only_one_rank_finds_faster(records):
    """Tensor-parallel ranks act on the slowest rank's ratios (one collective per verdict): where
    the alternative's variant would win its challenge on one rank (0.85 against the record's
    0.9) and lose on the other (0.95), both drop it, and every step replays the same graph on
    both ranks."""
    from tuner.integrations.replay_judge import ReplayJudge

    def run(flashinfer: float, agree) -> list:
        variants = GraphVariants(max_variants=8)
        variants.plan(4, [_call()], alternative="flashinfer")
        events = EventClock()
        judge = ReplayJudge.for_variants(variants, event=events)
        judge.agree = agree
        cost = {None: 1.0, "tuner-1": 0.9, "tuner-5": flashinfer}
        labels = []
        for _ in range(60):
            with judge.replaying(4, variants.pick(4, [2000] * 4)) as chosen:
                events.now += cost[chosen]
            labels.append(chosen)
        return labels

    # each rank's own ratios, verdict by verdict (what it would bring to the collective)
    own = {}
    for flashinfer in (0.85, 0.95):
        own[flashinfer] = []
        run(flashinfer, lambda ratios, mine=own[flashinfer]: mine.append(ratios) or ratios)
    assert len(own[0.85]) >= 2 and own[0.85][0] == own[0.95][0]  # the record's verdict: alike

    def collective(flashinfer):
        calls = iter(range(100))
        return lambda ratios: tuple(map(max, *(own[f][next(calls)] if f != flashinfer else ratios
                                               for f in own)))
    fast, slow = run(0.85, collective(0.85)), run(0.95, collective(0.95))
    assert fast == slow and fast[-3:] == ["tuner-1"] * 3
    assert "tuner-5" in fast  # (it was challenged)


def test_a_class_that_runs_what_the_base_graph_runs_needs_no_graph_of_its_own(db_path):
    """With a graph record the base graph runs it; a bucket whose per-call record is that
    config adds no variant. A plan asks about lengths no call had: it records no miss."""
    _store(db_path, 2048, _triton(64, 8))
    _store(db_path, 1024, _triton(16, 2))
    _store(db_path, BOUND, _triton(64, 8), op="decode_attention_graph", lengths="graph")
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    variants = GraphVariants(max_variants=8)
    plan = variants.plan(4, [_call()])
    # kv 512 and 256 borrow 1024's record; 128 is too far
    assert [(v.label, v.lengths.top) for v in plan] == [("tuner-1", 1024), ("tuner-2", 128)]
    assert variants.label(4, [2048] * 4) is None  # the base graph's config
    assert variants.label(4, [10] * 4) == "tuner-2"  # no record within reach: the default, unlike the base
    assert tuner.flush_misses() == 0


def test_no_graph_is_planned_for_a_sparse_batch_the_batch_size_cannot_hold(db_path, monkeypatch):
    """A batch of 1 or 2 is always dense (its lengths, pads included, sum to at least half of
    batch x longest), so a record's not-dense part there gets no graph that no step would
    replay; at batch 3 it does. (A graph record makes the base graph run neither part.)"""
    for batch in (2, 3):
        _store(db_path, 512, by_fill(_triton(16, 8), _triton(64, 2)), batch=batch)
        _store(db_path, 512, _triton(32, 16), op="decode_attention_graph", batch=batch, lengths="graph")
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    variants = GraphVariants(max_variants=8)
    pairs = [(v.lengths.top, v.lengths.dense) for v in variants.plan(2, [_call(batch=2, bound=512)])]
    assert (512, True) in pairs and not any(not dense for _, dense in pairs)
    assert variants.label(2, [500, 1]) == variants.label(2, [500, 499]) == "tuner-1"
    pairs = [(v.lengths.top, v.lengths.dense) for v in variants.plan(3, [_call(batch=3, bound=512)])]
    assert pairs[:2] == [(512, True), (512, False)]
    assert variants.label(3, [500, 1, 1]) == "tuner-2" and variants.label(3, [500, 499, 499]) == "tuner-1"
    monkeypatch.setattr(graph_variants, "_sparse_can_occur", lambda batch, top: True)  # without the rule
    assert (512, False) in [(v.lengths.top, v.lengths.dense) for v in variants.plan(2, [_call(batch=2, bound=512)])]


def test_a_step_class_declares_one_kv_bucket_and_fill():
    dense, sparse = StepLengths(4096, True), StepLengths(4096, False)
    assert dense.known and dense.kv_len(7) == 4096 and dense.fill_share(7, 0.5) == 1.0
    assert sparse.fill_share(7, 0.5) == 0.0 and "not dense" in repr(sparse)


def test_a_capture_of_a_made_up_class_records_no_miss(db_path, monkeypatch):
    """A variant's declaration is a class of lengths tuner names, not the deployment's traffic:
    its capture's borrowed or default keys are not misses to sweep. A declaration of the
    traffic's lengths records them as before."""
    recording_triton(monkeypatch)
    _store(db_path, 1024, _triton(16, 2))
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    with tuner.graph_capture(StepLengths(512, False)):  # served by borrowing from 1024
        decode_attention(*_call())
    assert tuner.flush_misses() == 0
    with tuner.graph_capture([500] * 16):
        decode_attention(*_call())
    assert tuner.flush_misses() == 1


def test_a_record_a_graph_cannot_hold_counts_as_what_the_graph_runs():
    """A FlashInfer record (a per-call host plan) runs the default backend's config in a
    graph: as a variant it is that config, not a config set of its own."""
    from tuner.integrations.decode_attention import graph_runs

    flashinfer = {"backend": "flashinfer", "use_tensor_cores": True, "flashinfer_backend": "fa2",
                  "fixed_split_size": None, "disable_split_kv": False}
    call = _call()
    assert graph_runs(_triton(64, 8), call) == _triton(64, 8)
    fallback = graph_runs(flashinfer, call)
    assert fallback["backend"] == "triton_decode" and (fallback["block_n"], fallback["num_kv_splits"]) == DEFAULT


def test_the_cap_on_variants_comes_from_the_environment(monkeypatch):
    from tuner import settings

    monkeypatch.setenv("TUNER_GRAPH_VARIANTS", "2")
    assert GraphVariants().max_variants == 2
    monkeypatch.setenv("TUNER_GRAPH_VARIANTS", "0")
    assert GraphVariants().max_variants == 0
    for unreadable in ("", "-1", "many"):
        monkeypatch.setenv("TUNER_GRAPH_VARIANTS", unreadable)
        assert GraphVariants().max_variants == settings.GRAPH_VARIANTS == 12


def test_a_server_replaying_its_own_graphs_has_each_variant_judged_against_the_base_graph(records, caplog):
    """The README's pattern for any server: the step's pick, then judge.replaying around the
    replay. A variant 10% slower than the base graph over its first 8 pairs of a class of
    lengths is dropped there (those steps then replay the base graph, and label() no longer
    names it for them); one 10% faster keeps its steps; a step no variant was planned for is
    left alone. A plain label is judged for every step that replays it."""

    from tuner.integrations.replay_judge import ReplayJudge

    variants = GraphVariants(max_variants=8)
    variants.plan(4, [_call()])
    events = EventClock()
    judge = ReplayJudge.for_variants(variants, event=events)
    cost = {None: 1.0, "tuner-1": 1.1, "tuner-2": 0.9}

    def step(lengths, choice=None):
        with judge.replaying(4, choice or variants.pick(4, lengths)) as chosen:
            events.now += cost[chosen]  # the replay
        return chosen

    assert [step([2000] * 4) for _ in range(16)] == [None, "tuner-1"] * 8
    assert step([2000] * 4) is None
    assert "graph variant tuner-1 of batch size 4 ran 1.100x" in caplog.text
    dense_2k = Pick("tuner-1", (2048, True))
    assert variants.label(4, [2000] * 4) is None and judge.dropped(4, dense_2k)
    assert variants.label(4, [2000, 10, 10, 10]) == "tuner-1"  # its other class: not judged yet
    assert [step([1000] * 4) for _ in range(18)] == [None, "tuner-2"] * 8 + ["tuner-2"] * 2
    dense_1k = Pick("tuner-2", (1024, True))
    assert not judge.dropped(4, dense_1k) and judge.verdicts[(4, dense_1k)] == pytest.approx(0.9)
    made = events.made
    assert step([40] * 4) is None and events.made == made  # a step no variant was planned for: untimed
    # a plain label: one verdict for the graph, whatever the lengths
    assert [step(None, "tuner-1") for _ in range(17)] == [None, "tuner-1"] * 8 + [None]
    assert judge.dropped(4, "tuner-1") and variants.label(4, [2000, 10, 10, 10]) is None


def test_tensor_parallel_ranks_whose_classes_of_steps_replay_other_graphs_disagree(tmp_path, monkeypatch):
    """Rank A's DB holds one record more than rank B's (kv 256, the config of kv 2048's): both
    plan the same one variant, but steps whose longest is in the 256 bucket would replay it on
    rank A and the base graph on rank B. Their plans' digests differ, as do those of ranks
    whose variants run other configs."""
    from tuner.integrations import sglang as integration

    planned, labels, digests = [], [], []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None:
                        digests.append(int(tensor[0])))
    runner = types.SimpleNamespace(tp_size=2, model_runner=types.SimpleNamespace(
        tp_group=types.SimpleNamespace(cpu_group=object())))
    for name, records in (("a", ((2048, (64, 8)), (256, (64, 8)))), ("b", ((2048, (64, 8)),)),
                          ("c", ((2048, (64, 4)),))):
        for kv_len, config in records:
            _store(tmp_path / f"{name}.db", kv_len, _triton(*config))
        tuner.configure(db=tmp_path / f"{name}.db", mode="lookup", shipped="off")
        variants = GraphVariants(max_variants=8)
        planned.append(variants.plan(4, [_call()]))
        labels.append(variants.label(4, [200] * 4))
        integration.plan_agreed(runner, 4, planned[-1], variants.described(4))
    assert repr(planned[0]) == repr(planned[1]) != repr(planned[2])  # (repr: what ranks compare)
    assert labels == ["tuner-1", None, None]
    assert len(set(digests)) == 3  # (b and c send each class alike, to variants of other configs)


def test_a_steps_class_is_its_longest_sequences_wherever_it_stands_in_the_batch(db_path):
    """A server's batch is in no order of length."""
    _store(db_path, 2048, _triton(64, 8))
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    variants = GraphVariants(max_variants=8)
    variants.plan(4, [_call()])
    steps = ([2000, 200, 100, 50], [200, 100, 50, 2000], [50, 2000, 100, 200])
    assert [variants.label(4, lengths) for lengths in steps] == ["tuner-1"] * 3
    assert variants.label(4, torch.tensor(steps[1], dtype=torch.int32)) == "tuner-1"
    assert variants.label(40, [200] * 39 + [2000]) is None  # (no graph planned at 40)


def test_a_step_without_host_lengths_or_sequences_replays_the_base_graph_and_raw_batch_cuts_any_buffer(db_path):
    _store(db_path, 2048, _triton(64, 8))
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    variants = GraphVariants(max_variants=8)
    variants.plan(4, [_call()])
    assert variants.label(4, None) is None and variants.label(4, []) is None
    assert variants.label(4, torch.tensor([], dtype=torch.int32)) is None
    # a buffer longer than the step's batch: only its first raw_batch are the step's sequences
    held = [2000, 100, 100, 3000]  # (the last, past the bound, is another step's)
    for buffer in (held, torch.tensor(held, dtype=torch.int32), np.array(held)):
        assert variants.label(4, buffer, raw_batch=3) == "tuner-1"
        assert variants.label(4, buffer) is None
