import dataclasses

import pytest
import torch

from tuner.bench import ERROR, OK, OOM, WRONG, Timing
from tuner.db import TuningDB, current_fingerprint_id
from tuner.keys import canonical_json
from tuner.ops import Op, get_op
from tuner.workload import DecodeShape
from tuner.ops.torch_split import split_kv_decode
from tuner.sweep import DUPLICATE, FAILED, MEASURED, SKIPPED, candidate_configs, sweep

SMALL = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32")


class FakeTimer:
    """Deterministic timing: the op reports each config's cost; spread is 2% of it."""

    method = {"timer": "fake"}

    def __init__(self):
        self.cost = None
        self.bias = {}  # config name -> extra cost seen only in the paired (confirming) run

    def __call__(self, rotation):
        rotation[0]()
        return Timing(self.cost, 0.02 * self.cost, 7)

    def quick(self):
        return QuickFakeTimer(self)

    def paired(self, a, b):
        a[0]()
        ta = self.cost + self.bias.get(self.last, 0.0)
        b[0]()
        tb = self.cost + self.bias.get(self.last, 0.0)
        return Timing(ta, 0.02 * ta, 7), Timing(tb, 0.02 * tb, 7)


class QuickFakeTimer:
    """The quick rung of a FakeTimer: same costs, fewer samples."""

    method = {"timer": "fake-quick"}

    def __init__(self, full):
        self.full = full

    def __call__(self, rotation):
        rotation[0]()
        return Timing(self.full.cost, 0.02 * self.full.cost, 3)


def fake_op(timer, costs, calls=None, interrupt_after=None):
    """A real split-KV decode whose configs carry a cost, or a way to fail."""

    def run(inputs, config):
        name = config["name"]
        timer.last = name
        if calls is not None:
            calls.append(name)
            if interrupt_after is not None and len(calls) > interrupt_after:
                raise KeyboardInterrupt  # the process dies mid-sweep
        if name == "crash":
            raise RuntimeError("too many resources requested for launch\nmore detail")  # fails, context intact
        if name == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory")
        out = split_kv_decode(inputs, 0)
        if name == "wrong":
            out = out + 1
        timer.cost = costs.get(name, 100.0)
        return out

    names = ["default", "fast", "slightly", "crash", "wrong", "oom"]
    return Op(
        name="fake",
        description="test op",
        configs=lambda shape: [{"name": n} for n in names],
        default=lambda shape: {"name": "default"},
        run=run,
        grids={"g": [DecodeShape(batch=1, kv_len=64, **SMALL), DecodeShape(batch=2, kv_len=128, **SMALL)]},
    )


COSTS = {"default": 100.0, "fast": 50.0, "slightly": 99.0, "wrong": 1.0, "crash": 1.0, "oom": 1.0}


def test_winner_rule_and_failures_never_chosen(db_path):
    timer = FakeTimer()
    op = fake_op(timer, COSTS)
    db = TuningDB(db_path)
    results = sweep(op, op.grids["g"], db, timer=timer)
    assert [r.status for r in results] == [MEASURED, MEASURED]
    assert all(r.winner == {"name": "fast"} and r.speedup == pytest.approx(2.0) for r in results)
    assert all(r.failures == 3 and r.measured == 6 for r in results)
    rows = db.measurements(db.records()[0].problem, current_fingerprint_id())
    status = {m.config["name"]: m.status for m in rows}
    assert status == {"default": OK, "fast": OK, "slightly": OK, "crash": ERROR, "wrong": WRONG, "oom": OOM}
    crash = next(m for m in rows if m.config["name"] == "crash")
    assert crash.error == "RuntimeError: too many resources requested for launch"  # one line
    record = db.records()[0]
    assert record.default_config == {"name": "default"} and record.default_median_us == 100.0


def test_default_stays_unless_beaten_by_more_than_the_noise(db_path):
    timer = FakeTimer()
    # 1.5% faster: past the 1% minimum gain, within the 2% noise (each timing's spread)
    op = fake_op(timer, dict(COSTS, fast=101.0, slightly=98.5))
    results = sweep(op, op.grids["g"], TuningDB(db_path), timer=timer)
    assert all(r.winner == {"name": "default"} for r in results)
    # and 1% faster: within the minimum gain
    op = fake_op(timer, dict(COSTS, fast=101.0, slightly=99.0))
    results = sweep(op, op.grids["g"], TuningDB(db_path), timer=timer, force=True)
    assert all(r.winner == {"name": "default"} for r in results)


def test_a_win_that_does_not_hold_when_confirmed_keeps_the_default(db_path):
    timer = FakeTimer()
    timer.bias = {"fast": 60.0}  # looked fast once; in the paired run it is slower
    op = fake_op(timer, COSTS)
    results = sweep(op, op.grids["g"], TuningDB(db_path), timer=timer)
    assert all(r.winner == {"name": "default"} for r in results)


class FailingConfirmTimer(FakeTimer):
    """Measures as FakeTimer; the side-by-side re-timing runs out of device memory."""

    def paired(self, a, b):
        raise torch.OutOfMemoryError("CUDA out of memory")


def test_a_confirming_run_that_fails_keeps_the_default_and_the_sweep_moves_on(db_path):
    timer = FailingConfirmTimer()
    op = fake_op(timer, COSTS)
    db = TuningDB(db_path)
    results = sweep(op, op.grids["g"], db, timer=timer)
    assert [r.status for r in results] == [MEASURED, MEASURED]
    assert [r.winner for r in results] == [{"name": "default"}] * 2
    assert [r.config for r in db.records()] == [{"name": "default"}] * 2


def test_a_shape_where_nothing_runs_right_stores_no_winner(db_path):
    timer = FakeTimer()
    op = fake_op(timer, COSTS)
    broken = Op(name="broken", description="", configs=lambda s: [{"name": "crash"}, {"name": "wrong"}],
                default=lambda s: {"name": "crash"}, run=op.run, grids=op.grids)
    db = TuningDB(db_path)
    results = sweep(broken, broken.grids["g"], db, timer=timer)
    assert [r.status for r in results] == [FAILED, FAILED]
    assert db.records() == []


def test_interrupted_sweep_resumes_measuring_only_what_is_missing(db_path):
    timer = FakeTimer()
    db = TuningDB(db_path)
    calls = []
    # 11 calls finish shape 1 (check + time per config, one call per failure, 2 to confirm);
    # shape 2 then gets its default and "fast" measured before the 16th call dies
    op = fake_op(timer, COSTS, calls=calls, interrupt_after=15)
    with pytest.raises(KeyboardInterrupt) as stopped:
        sweep(op, op.grids["g"], db, timer=timer, strategy="exhaustive")
    assert len(db.records()) == 1  # the first shape finished and was stored
    # and the interrupt says which, for the CLI to show
    assert [(r.shape, r.status, r.winner) for r in stopped.value.done] == [(op.grids["g"][0], MEASURED, {"name": "fast"})]
    assert stopped.value.total == 2
    calls2 = []
    op2 = fake_op(timer, COSTS, calls=calls2)
    results = sweep(op2, op2.grids["g"], db, timer=timer, strategy="exhaustive")
    assert results[0].status == SKIPPED and results[0].winner == {"name": "fast"}
    # the second shape had 2 configs measured before the interrupt; only 4 remain
    assert (results[1].resumed, results[1].measured) == (2, 4)
    assert len(db.records()) == 2
    # and a third run measures nothing at all
    calls3 = []
    results = sweep(fake_op(timer, COSTS, calls=calls3), op.grids["g"], db, timer=timer, strategy="exhaustive")
    assert [r.status for r in results] == [SKIPPED, SKIPPED] and calls3 == []


def test_an_interrupted_sweep_does_not_count_a_duplicate_of_the_key_in_flight_as_done(db_path):
    """Review: a shape of the same key as a later one is answered "duplicate" at once; when
    the interrupt came during that later one, the duplicate was reported done."""
    timer = FakeTimer()
    op = fake_op(timer, COSTS, calls=[], interrupt_after=3)  # inside the first key measured
    first, second = op.grids["g"]
    same_key = DecodeShape(batch=first.batch, kv_len=first.kv_len - 8, **SMALL)  # its kv bucket, shorter
    with pytest.raises(KeyboardInterrupt) as stopped:
        sweep(op, [same_key, first, second], TuningDB(db_path), timer=timer, strategy="exhaustive")
    assert stopped.value.done == [] and stopped.value.total == 3
    op = fake_op(timer, COSTS, calls=[], interrupt_after=14)  # the first key done, the second in flight
    with pytest.raises(KeyboardInterrupt) as stopped:
        sweep(op, [same_key, first, second], TuningDB(db_path), timer=timer, strategy="exhaustive", force=True)
    assert [(r.shape, r.status) for r in stopped.value.done] == [(same_key, DUPLICATE), (first, MEASURED)]


def test_an_interrupted_sweep_whose_db_refuses_the_write_still_raises_the_interrupt(db_path, monkeypatch):
    from tuner.db import DBError

    timer = FakeTimer()
    db = TuningDB(db_path)
    op = fake_op(timer, COSTS, calls=[], interrupt_after=3)  # mid-shape, 2 configs measured

    def refuse(*args, **kwargs):
        raise DBError("tuning DB x stayed locked by another writer")

    monkeypatch.setattr(db, "save_measurements", refuse)
    with pytest.warns(UserWarning, match="were not stored: tuning DB x stayed locked"), \
            pytest.raises(KeyboardInterrupt):  # what the user did, not what the DB did after it
        sweep(op, op.grids["g"], db, timer=timer, strategy="exhaustive")


def test_force_measures_again(db_path):
    timer = FakeTimer()
    db = TuningDB(db_path)
    op = fake_op(timer, COSTS)
    sweep(op, op.grids["g"], db, timer=timer)
    results = sweep(fake_op(timer, dict(COSTS, fast=200.0)), op.grids["g"], db, timer=timer, force=True)
    assert all(r.status == MEASURED and r.winner == {"name": "default"} and r.measured == 6 for r in results)
    assert all(r.config == {"name": "default"} for r in db.records())


def test_candidates_start_with_the_default_once():
    op = get_op("torch_split_decode")
    shape = op.grids["cpu-tiny"][0]
    configs = candidate_configs(op, shape)
    assert configs[0] == op.default(shape)
    assert len(configs) == len({tuple(sorted(c.items())) for c in configs})


def test_real_cpu_sweep_stores_a_checked_winner_per_shape(db_path):
    op = get_op("torch_split_decode")
    shapes = [DecodeShape(batch=1, kv_len=256, **SMALL), DecodeShape(batch=2, kv_len=300, q_len=2, **SMALL)]
    from tuner.bench import WallClockTimer

    db = TuningDB(db_path)
    results = sweep(op, shapes, db, timer=WallClockTimer(warmup=1, repeats=3, min_repeats=3))
    assert [r.status for r in results] == [MEASURED, MEASURED]
    records = db.records(fingerprint_id=current_fingerprint_id())
    assert len(records) == 2
    for r, shape in zip(records, shapes):
        assert r.config in op.configs(shape) and r.median_us > 0 and r.samples >= 3
        assert r.method["device"] == "cpu" and r.method["timer"] == "wallclock"
    assert all(m.status == OK for m in db.measurements(records[0].problem, current_fingerprint_id()))


def test_shapes_sharing_a_key_are_measured_once(db_path):
    timer = FakeTimer()
    op = fake_op(timer, COSTS)
    shapes = [DecodeShape(batch=1, kv_len=300, **SMALL), DecodeShape(batch=1, kv_len=500, **SMALL)]
    results = sweep(op, shapes, TuningDB(db_path), timer=timer)
    assert [r.status for r in results] == ["duplicate", MEASURED]  # the longest: at the bucket's top
    assert "kv500" in results[0].note and results[0].measured == 0


def test_windowed_shapes_past_their_window_are_each_their_own_kv_bucket(db_path):
    """A 15-key window: kv 64, 500 and 2000 read 16 keys a query on full batches, but their
    mixed batches read less the shorter their sequences: each is its own record, at its
    longest sequence's bucket."""
    timer = FakeTimer()
    op = fake_op(timer, COSTS)
    shapes = [DecodeShape(batch=1, kv_len=kv, window=(15, -1), **SMALL) for kv in (64, 500, 2000)]
    for lengths in ("full", "serving"):
        batches = [dataclasses.replace(s, lengths=lengths) for s in shapes]
        results = sweep(op, batches, TuningDB(db_path), timer=timer, force=True)
        assert [r.status for r in results] == [MEASURED] * 3
    buckets = sorted(r.problem.run_key.kv_len_bucket for r in TuningDB(db_path).records())
    assert buckets == [64, 512, 2048]
    # a shape listed twice is swept once
    twice = sweep(op, [shapes[0], shapes[0]], TuningDB(db_path), timer=timer, force=True)
    assert [r.status for r in twice] == [MEASURED, "duplicate"]


def test_a_shape_too_big_for_memory_fails_alone(db_path):
    timer = FakeTimer()
    op = fake_op(timer, COSTS)
    huge = DecodeShape(batch=2**20, kv_len=2**30, **SMALL)
    results = sweep(op, [huge, op.grids["g"][0]], TuningDB(db_path), timer=timer)
    assert results[0].status == FAILED and "GiB" in results[0].note
    assert results[1].status == MEASURED


def test_a_serving_trial_counts_the_pages_its_batches_hold_not_full_batches():
    """A fresh H100 (78.4 GiB free) refused the serving grid's 4M-token shapes of 48/8 heads
    as needing 80.6 GiB: each batch of the mix was counted as full, while a batch's pool holds
    only its own sequences' pages (a long tail's are a fraction of a full batch's)."""
    from tuner import settings
    from tuner.sweep.trials import trial_bytes
    from tuner.workload.traffic import serving_draws

    shape = DecodeShape(batch=256, kv_len=16384, num_q_heads=48, num_kv_heads=8, head_dim=128, lengths="serving")
    draws = serving_draws(shape.batch, shape.kv_len, seed=0)
    assert trial_bytes(shape, "cpu") == 5 * shape.kv_bytes() == 80 * 2**30  # every batch counted full (+0.6 on a GPU)
    pools = [sum(lens) * shape.static_key().kv_bytes_per_token() for lens in draws]  # page size 1
    assert trial_bytes(shape, "cpu", draws) == sum(pools) + 2 * max(pools) < 50 * 2**30
    # pages are whole: a sequence of 17 tokens at page size 16 holds two
    small = DecodeShape(batch=2, kv_len=64, lengths="serving", **dict(SMALL, page_size=16))
    per_page = 16 * small.static_key().kv_bytes_per_token()
    assert trial_bytes(small, "cpu", [[17, 64], [1, 1]]) == 8 * per_page + 2 * settings.REFERENCE_CHUNK_BYTES


def test_halving_measures_only_the_contenders_fully(db_path):
    timer = FakeTimer()
    op = fake_op(timer, COSTS)
    db = TuningDB(db_path)
    results = sweep(op, op.grids["g"][:1], db, timer=timer, halving=True)
    assert results[0].winner == {"name": "fast"} and results[0].failures == 3
    rows = {m.config["name"]: m for m in db.measurements(db.records()[0].problem, current_fingerprint_id())}
    assert {name: m.rung for name, m in rows.items()} == {  # the rung is a column of its own
        "default": 1, "fast": 1, "slightly": 0, "crash": 0, "wrong": 0, "oom": 0}
    # a quick rung is also in method, where a tuner before the rung column reads it
    assert rows["slightly"].method["rung"] == 0 and "rung" not in rows["fast"].method
    assert "search" not in rows["fast"].method and "search" not in db.records()[0].method
    assert rows["fast"].samples == 7 and rows["slightly"].samples == 3


def test_a_halving_sweep_resumes_each_rung(db_path):
    timer = FakeTimer()
    db = TuningDB(db_path)
    calls = []
    # rung 0 of shape 1: 3 configs checked + timed (6 calls) and 3 failures (3 calls); then
    # rung 1 dies on its first call
    with pytest.raises(KeyboardInterrupt):
        sweep(fake_op(timer, COSTS, calls=calls, interrupt_after=9), fake_op(timer, COSTS).grids["g"][:1], db,
              timer=timer, halving=True)
    calls2 = []
    [result] = sweep(fake_op(timer, COSTS, calls=calls2), fake_op(timer, COSTS).grids["g"][:1], db,
                     timer=timer, halving=True)
    assert result.winner == {"name": "fast"}
    assert result.resumed == 4 and result.measured == 2  # rung 0 reused; rung 1 measured anew
    assert set(calls2) == {"fast", "default"}


def test_each_measurement_stores_its_timers_method_as_of_that_measurement(db_path):
    """The CUDA-graph timer says in its method when a capture fell back to eager calls (some
    libraries plan on the host per call): a sweep stores the method as it was after each
    measurement, not as it was when the sweep began."""

    class FallingBackTimer(FakeTimer):
        def __init__(self):
            super().__init__()
            self.failed = False

        @property
        def method(self):
            return {"timer": "fake", **({"capture": "failed, timed eagerly"} if self.failed else {})}

        def __call__(self, rotation):
            self.failed = self.last == "slightly"  # this config cannot be captured
            return super().__call__(rotation)

    timer = FallingBackTimer()
    op = fake_op(timer, COSTS)
    db = TuningDB(db_path)
    sweep(op, op.grids["g"][:1], db, timer=timer, strategy="exhaustive")
    rows = {m.config["name"]: m for m in db.measurements(db.records()[0].problem, current_fingerprint_id())}
    assert rows["slightly"].method.get("capture") == "failed, timed eagerly"
    assert "capture" not in rows["fast"].method and "capture" not in rows["default"].method


def test_a_serving_shape_is_measured_on_mixed_length_batches_each_checked(db_path):
    """A "serving" shape's trial holds one batch per length distribution: a config that is
    right on full batches only (it ignores each sequence's length) is wrong there."""
    from tuner.bench import WallClockTimer
    from tuner.workload.traffic import serving_draws

    def run(inputs, config):
        if config["name"] == "full only":  # every sequence as if it held kv_len tokens
            inputs = dataclasses.replace(inputs, seq_lens_host=None,
                                         cache_seqlens=torch.full_like(inputs.cache_seqlens, inputs.shape.kv_len))
        return split_kv_decode(inputs, config["chunk"])

    op = Op(name="mixed", description="test op", configs=lambda s: [{"name": n, "chunk": c} for n, c in (
        ("default", 0), ("chunked", 16), ("full only", 0))], default=lambda s: {"name": "default", "chunk": 0},
        run=run, grids={})
    full, serving = (DecodeShape(batch=3, kv_len=64, lengths=m, **SMALL) for m in ("full", "serving"))
    assert all(max(d) > 32 for d in serving_draws(3, 64, 0))  # each batch's longest in the kv bucket
    db = TuningDB(db_path)
    timer = WallClockTimer(warmup=0, repeats=2, min_repeats=2)
    [on_full] = sweep(op, [full], db, timer=timer)
    assert on_full.status == MEASURED and on_full.failures == 0
    [on_serving] = sweep(op, [serving], db, timer=timer, force=True)  # the same key: measured again
    assert on_serving.status == MEASURED and on_serving.failures == 1
    rows = db.measurements(db.records()[0].problem, current_fingerprint_id())
    mixed = [m for m in rows if m.method.get("lengths") == "serving"]
    assert {m.config["name"]: m.status for m in mixed} == {"default": OK, "chunked": OK, "full only": WRONG}
    assert db.records()[0].method["lengths"] == "serving"


def test_a_serving_sweep_resumes_only_its_own_kind_of_measurement(db_path):
    """Measurements of full batches, left by an interrupted sweep, are not a serving sweep's:
    it measures every config itself, where a sweep of the full shape resumes them."""
    timer = FakeTimer()
    full, serving = (DecodeShape(batch=3, kv_len=64, lengths=m, **SMALL) for m in ("full", "serving"))
    db = TuningDB(db_path)
    with pytest.raises(KeyboardInterrupt):  # mid-shape
        sweep(fake_op(timer, COSTS, calls=[], interrupt_after=3), [full], db, timer=timer, strategy="exhaustive")
    [on_serving] = sweep(fake_op(timer, COSTS), [serving], db, timer=timer, strategy="exhaustive")
    assert on_serving.status == MEASURED and on_serving.resumed == 0 and on_serving.measured == 6
    kinds = [m.method.get("lengths", "full") for m in db.measurements(db.records()[0].problem,
                                                                      current_fingerprint_id())]
    assert kinds == ["serving"] * 6
    # the same interrupted sweep of full batches, then the full shape: resumed (so the run
    # above had measurements of full batches to refuse)
    db2 = TuningDB(db_path.with_name("other.db"))
    with pytest.raises(KeyboardInterrupt):
        sweep(fake_op(timer, COSTS, calls=[], interrupt_after=3), [full], db2, timer=timer, strategy="exhaustive")
    [on_full] = sweep(fake_op(timer, COSTS), [full], db2, timer=timer, strategy="exhaustive")
    assert on_full.resumed >= 1


def test_a_serving_trial_holds_each_batch_once_per_copy_with_its_reference():
    from tuner.sweep.trials import build_trial
    from tuner.workload.traffic import serving_draws

    op = get_op("torch_split_decode")
    shape = DecodeShape(batch=3, kv_len=64, lengths="serving", **SMALL)
    trial = build_trial(op, shape, "cpu", seed=5)
    draws = serving_draws(3, 64, 5)
    # one copy each on a CPU; batch 3: two rounds of the three distributions
    assert len(trial.runs) == len(draws) == 6 and [i for i, _ in trial.checks] == [1, 2, 3, 4, 5]
    for i, lens in enumerate(draws):
        expected = trial.reference if i == 0 else dict(trial.checks)[i]
        torch.testing.assert_close(trial.runs[i]({"chunk": 0}), expected, atol=1e-5, rtol=1e-5)
        assert trial.runs[i].args[0].lengths() == lens


def test_a_serving_batch_runs_as_a_call_of_it_does_at_its_own_longest_length():
    """Not at the bucket's top: FA3's split heuristic reads the page table's width and the
    Triton kernel plans its splits from the max length, as a server's call passes them."""
    from tuner.sweep.trials import build_trial
    from tuner.workload.traffic import serving_draws

    shape = DecodeShape(batch=3, kv_len=64, lengths="serving", **dict(SMALL, page_size=1))
    trial = build_trial(get_op("torch_split_decode"), shape, "cpu", seed=5)
    for run, lens in zip(trial.runs, serving_draws(3, 64, 5)):
        inputs = run.args[0]
        assert inputs.shape.kv_len == max(lens) and inputs.run_key() == shape.run_key()
        assert inputs.page_table.shape[1] == -(-max(lens) // 16) * 16  # its width, in whole 16-page units


def test_a_trial_drops_each_batchs_own_pool_once_its_copies_are_made(monkeypatch):
    """A batch given cold-L2 copies gets a new pool (its pages and their copies): the batch's
    first pool must be gone before the next batch's copies are made, else a windowed mix held
    every pool twice at its peak, past what the memory check counts."""
    import gc
    import weakref

    import tuner.sweep.trials as trial_module

    originals = []
    make_copies = trial_module.fresh_page_copies

    def copies(inputs, count):
        gc.collect()
        assert all(pool() is None for pool in originals), "an earlier batch's own pool is still held"
        made = make_copies(inputs, count)
        assert made[0].k_cache is not inputs.k_cache  # a new pool: the original may go
        originals.append(weakref.ref(inputs.k_cache))
        return made

    monkeypatch.setattr(trial_module, "fresh_page_copies", copies)
    monkeypatch.setattr(trial_module, "cold_l2_copies", lambda nbytes, device, max_copies=64: 2)
    monkeypatch.setattr(trial_module, "l2_bytes", lambda: 2**30)
    monkeypatch.setattr(trial_module, "too_big", lambda shape, device, draws=None: None)
    plain = get_op("torch_split_decode")
    op = dataclasses.replace(plain, make_inputs=lambda shape, device, **kw: plain.make_inputs(shape, "cpu", **kw))
    trial = trial_module.build_trial(op, DecodeShape(batch=3, kv_len=64, lengths="serving", **SMALL), "cuda", seed=5)
    assert len(trial.parts) == 6 and len(trial.guards) == 1
    assert len(originals) == 7  # the guard's own pool too


def test_a_serving_trial_guards_its_winner_with_a_batch_of_equal_lengths_in_its_kv_bucket(monkeypatch):
    """Inside SGLang at batch 8 x 32k (bench_one_batch: one prompt length for the batch) the
    dense record's Triton config ran about 4% slower than FA3 end to end; at equal lengths the
    grid had timed it 14-18% slower, where the serving trials' spread lengths put it ahead."""
    import tuner.sweep.trials as trial_module
    from tuner.keys import kv_len_bucket

    op = get_op("torch_split_decode")
    shape = DecodeShape(batch=3, kv_len=64, lengths="serving", **SMALL)
    trial = trial_module.build_trial(op, shape, "cpu", seed=5)
    [guard] = trial.guards
    [inputs] = {id(r.args[0]): r.args[0] for r in guard.runs}.values()  # one copy on the CPU
    lengths = inputs.lengths()
    assert len(set(lengths)) == 1 and len(lengths) == 3 and kv_len_bucket(lengths[0]) == kv_len_bucket(64)
    torch.testing.assert_close(guard.runs[0](op.default(shape)), guard.reference)
    # the second trial's guard is another draw; a batch of one has none (every batch of one is even)
    [other] = trial_module.build_second_trial(op, shape, "cpu", seed=5).guards
    other_lengths = other.runs[0].args[0].lengths()
    assert len(set(other_lengths)) == 1 and other_lengths != lengths
    assert trial_module.build_trial(op, dataclasses.replace(shape, batch=1), "cpu", seed=5).guards == []
    # where the guard would not fit beside the mix, the mix is measured without it
    real = trial_module.too_big
    mix = len(trial.parts)  # (CPU trials: one copy a batch, a part each)
    monkeypatch.setattr(trial_module, "too_big", lambda s, d, draws=None: "no room" if draws and len(draws) > mix else
                        real(s, d, draws))
    assert trial_module.build_trial(op, shape, "cpu", seed=5).guards == []


def test_a_serving_trials_parts_are_each_batchs_runs_over_copies_cold_on_their_own(monkeypatch):
    """decide() holds a winner to every batch of the mix, each timed alone: a part is one
    batch's copies, as many as that batch alone needs for a cold L2 (a part with the copies
    sized for the whole mix found a small batch's pages in the L2); the whole rotation runs
    as many copies of each batch as the mix needs."""
    import tuner.sweep.trials as trial_module
    from tuner.workload.rotation import bytes_read
    from tuner.workload.traffic import serving_draws

    asked = []

    def copies(nbytes, device, max_copies=64):  # the mix needs 2; a batch alone, one per 1,000 bytes
        asked.append(max_copies)
        return 2 if len(asked) == 1 else min(max_copies, max(1, nbytes // 1000))

    monkeypatch.setattr(trial_module, "cold_l2_copies", copies)
    monkeypatch.setattr(trial_module, "l2_bytes", lambda: 2**30)  # room for any page tables
    monkeypatch.setattr(trial_module.settings, "PART_MAX_COPIES", 40)
    shape = DecodeShape(batch=3, kv_len=64, lengths="serving", **SMALL)
    # "cuda": the part copies' rule is for GPUs (one copy of anything on a CPU); the inputs stay on the CPU
    plain = get_op("torch_split_decode")
    op = dataclasses.replace(plain, make_inputs=lambda shape, device, **kw: plain.make_inputs(shape, "cpu", **kw))
    monkeypatch.setattr(trial_module, "too_big", lambda shape, device, draws=None: None)
    trial = trial_module.build_trial(op, shape, "cuda", seed=5)
    draws = serving_draws(3, 64, 5)
    assert len(draws) == 6  # batch 3: two rounds of the three distributions
    assert len(trial.runs) == 12 and len(trial.parts) == 6 and asked[1:] == [40] * 7  # the guard's too
    guard_inputs = [run.args[0] for run in trial.guards[0].runs]  # as many as it alone needs, at least one
    assert len(guard_inputs) == min(40, max(1, bytes_read(guard_inputs[0]) // 1000))
    for j, (part, lens) in enumerate(zip(trial.parts, draws, strict=True)):
        inputs = [run.args[0] for run in part]
        assert all(i.lengths() == lens for i in inputs)
        assert len(inputs) == min(40, max(2, bytes_read(inputs[0]) // 1000))  # its own, at least the mix's
        assert len({i.page_table.data_ptr() for i in inputs}) == len(inputs)  # each copy its own pages
        # the whole rotation runs the first copies of each batch: copy c of batch j at c * 6 + j
        assert all(trial.runs[c * 6 + j].args[0] is inputs[c] for c in range(2))
    full = trial_module.build_trial(get_op("torch_split_decode"), dataclasses.replace(shape, lengths="full"), "cpu")
    assert full.parts == []  # one batch: nothing to hold a winner to beyond the mean


def drawn_op(timer, first_draw_cost, other_cost=50.0, wrong_off_first_draw=False, seed=0, seen=None):
    """Configs "default" (100 us) and "lucky": first_draw_cost on the batches of the first
    trial's draws (serving_draws with the sweep's seed, and its guard's equal_draw), other_cost
    on any other draw of the bucket, and (wrong_off_first_draw) a wrong result there."""
    from tuner.workload.traffic import equal_draw, serving_draws

    first_trial = serving_draws(SERVING.batch, SERVING.kv_len, seed) + [equal_draw(SERVING.batch, SERVING.kv_len, seed)]

    def run(inputs, config):
        timer.last = config["name"]
        first = inputs.lengths() in first_trial
        if seen is not None:
            seen.append(inputs.lengths())
        out = split_kv_decode(inputs, 0)
        if config["name"] == "default":
            timer.cost = 100.0
            return out
        timer.cost = first_draw_cost if first else other_cost
        return out if first or not wrong_off_first_draw else out + 1

    return Op(name="drawn", description="test op", configs=lambda s: [{"name": "default"}, {"name": "lucky"}],
              default=lambda s: {"name": "default"}, run=run, grids={})


SERVING = DecodeShape(batch=3, kv_len=64, lengths="serving", **SMALL)


def test_a_serving_winner_that_loses_on_a_second_draw_of_lengths_keeps_the_default(db_path):
    """Ahead on the trial it was found on, behind on another draw of the same bucket (as a
    shipped 16-split Triton config was on the H200): the default is stored."""
    from tuner import settings

    from tuner.workload.traffic import serving_draws

    timer = FakeTimer()
    db = TuningDB(db_path)
    seen = []
    [result] = sweep(drawn_op(timer, first_draw_cost=50.0, other_cost=120.0, seen=seen), [SERVING], db, timer=timer)
    assert result.winner == {"name": "default"} and "second trial" in result.note and "0.833x" in result.note
    # the second trial: other draws, its first batch at the bucket's top
    second = serving_draws(3, 64, settings.SECOND_TRIAL_SEED, reach_top=True)
    assert max(second[0]) == 64 and all(lens in seen for lens in second)
    [record] = db.records()
    again = record.method["second_trial"]
    assert record.config == {"name": "default"} and record.default_median_us == 100.0
    # its guard (one length, drawn with the second trial's seed) timed too: the winner's, the default's
    assert again == dict(seed=settings.SECOND_TRIAL_SEED, held=False, error=None, winner_us=120.0, default_us=100.0,
                         guards_us=[[120.0, 100.0]])
    # without it, the first trial's winner stands
    [unchecked] = sweep(drawn_op(timer, 50.0, 120.0), [SERVING], db, timer=timer, force=True, second_trial=False)
    assert unchecked.winner == {"name": "lucky"} and "second_trial" not in db.records()[0].method


def test_a_serving_winner_that_holds_on_a_second_draw_is_stored_with_what_it_measured(db_path):
    timer = FakeTimer()
    db = TuningDB(db_path)
    [result] = sweep(drawn_op(timer, first_draw_cost=50.0, other_cost=60.0, seed=4), [SERVING], db, timer=timer,
                     seed=4)
    assert result.winner == {"name": "lucky"} and result.note == "" and result.winner_us == 50.0
    again = db.records()[0].method["second_trial"]
    assert again["held"] is True and again["winner_us"] == 60.0 and again["seed"] == 4 + 1_000_003
    # the record says which equal batch guarded its first trial
    from tuner.workload.traffic import equal_draw

    assert db.records()[0].method["equal_guard"] == equal_draw(SERVING.batch, SERVING.kv_len, 4)[0]


def test_a_serving_winner_only_level_with_the_default_on_a_second_draw_keeps_it(db_path):
    """A second trial asks for the winner rule's gain, not just no loss: 0.5% ahead is a tie."""
    timer = FakeTimer()
    db = TuningDB(db_path)
    [result] = sweep(drawn_op(timer, first_draw_cost=50.0, other_cost=99.5), [SERVING], db, timer=timer)
    assert result.winner == {"name": "default"} and "second trial" in result.note
    again = db.records()[0].method["second_trial"]
    assert again["held"] is False and again["winner_us"] == 99.5 and again["default_us"] == 100.0


def test_a_serving_winner_wrong_on_a_second_draw_keeps_the_default(db_path):
    timer = FakeTimer()
    db = TuningDB(db_path)
    op = drawn_op(timer, first_draw_cost=50.0, wrong_off_first_draw=True)
    [result] = sweep(op, [SERVING], db, timer=timer)
    assert result.winner == {"name": "default"}
    again = db.records()[0].method["second_trial"]
    assert again["held"] is False and "run 0" not in again["error"] and again["winner_us"] is None
    assert again["error"] and "second trial" in result.note


def test_a_full_batch_winner_and_a_kept_default_take_no_second_trial(db_path):
    timer = FakeTimer()
    db = TuningDB(db_path)
    full = dataclasses.replace(SERVING, lengths="full")
    [on_full] = sweep(drawn_op(timer, 50.0, 50.0), [full], db, timer=timer)
    assert on_full.winner == {"name": "lucky"} and "second_trial" not in db.records()[0].method
    [slow] = sweep(drawn_op(timer, first_draw_cost=150.0), [SERVING], db, timer=timer, force=True)
    assert slow.winner == {"name": "default"} and "second_trial" not in db.records()[0].method


# -- guided search and kernels built ahead ---------------------------------------------------

GUIDED_NAMES = ["default"] + [f"s{k}" for k in range(1, 9)]


def guided_op(timer, calls):
    """Configs s1..s8 and the default; s_k is fastest at batch k and slower the further the
    batch is from k (as a split count tracks the batch size)."""

    def run(inputs, config):
        name, batch = config["name"], inputs.shape.batch
        calls.append((batch, name))
        timer.last = name
        timer.cost = 100.0 if name == "default" else 50.0 + 5.0 * abs(int(name[1:]) - batch)
        return split_kv_decode(inputs, 0)

    return Op(name="fake-guided", description="test op", configs=lambda shape: [{"name": n} for n in GUIDED_NAMES],
              default=lambda shape: {"name": "default"}, run=run, grids={})


def _batches(*batches):
    return [DecodeShape(batch=b, kv_len=64, **SMALL) for b in batches]


def test_a_guided_sweep_searches_a_batch_between_anchors_over_their_leaders_only(db_path, monkeypatch):
    from tuner import settings

    monkeypatch.setattr(settings, "GUIDED_KEEP", 2)
    timer, calls = FakeTimer(), []
    results = sweep(guided_op(timer, calls), _batches(3, 2, 4, 8), TuningDB(db_path), timer=timer, strategy="guided")
    assert [r.shape.batch for r in results] == [3, 2, 4, 8]  # in the order given
    # anchors (powers of two) come first, each over every candidate
    assert [b for b, _ in calls][:len(GUIDED_NAMES)] == [2] * len(GUIDED_NAMES)
    assert {n for b, n in calls if b == 4} == set(GUIDED_NAMES)
    # batch 3: the default and the two fastest of batch 2 (s2, then s1/s3) and of batch 4 (s4, s3/s5)
    tried = {n for b, n in calls if b == 3}
    assert tried < set(GUIDED_NAMES) and "default" in tried and {"s2", "s4"} <= tried and len(tried) <= 5
    assert results[0].winner == {"name": "s3"} and results[0].measured == len(tried)


def test_a_guided_sweep_searches_every_candidate_where_no_anchor_is_measured(db_path):
    timer, calls = FakeTimer(), []
    [result] = sweep(guided_op(timer, calls), _batches(3), TuningDB(db_path), timer=timer, strategy="guided")
    assert {n for _, n in calls} == set(GUIDED_NAMES) and result.winner == {"name": "s3"}


def test_a_resumed_guided_sweep_learns_from_the_anchors_the_db_holds(db_path, monkeypatch):
    from tuner import settings

    monkeypatch.setattr(settings, "GUIDED_KEEP", 2)
    timer = FakeTimer()
    sweep(guided_op(timer, []), _batches(2, 4), TuningDB(db_path), timer=timer, strategy="guided")
    calls = []
    results = sweep(guided_op(timer, calls), _batches(2, 3, 4), TuningDB(db_path), timer=timer, strategy="guided")
    assert [r.status for r in results] == [SKIPPED, MEASURED, SKIPPED]
    tried = {n for _, n in calls}
    assert {b for b, _ in calls} == {3} and "default" in tried and len(tried) <= 5
    assert results[1].winner == {"name": "s3"}


def test_a_shape_none_of_whose_neighbours_leaders_it_can_run_is_searched_whole(db_path, monkeypatch):
    """Candidate spaces differ with the batch (Triton's split counts): a shortlist of only the
    default would store the default as the shape's winner for good."""
    from tuner import settings

    monkeypatch.setattr(settings, "GUIDED_KEEP", 2)
    timer, calls = FakeTimer(), []
    op = guided_op(timer, calls)
    # batch 3's own space: the default and s5..s8, none of which lead at batches 2 and 4
    op = dataclasses.replace(op, configs=lambda shape: [{"name": n} for n in GUIDED_NAMES
                                                        if shape.batch != 3 or n == "default" or n >= "s5"])
    results = sweep(op, _batches(2, 3, 4), TuningDB(db_path), timer=timer, strategy="guided")
    assert {n for b, n in calls if b == 3} == {"default", "s5", "s6", "s7", "s8"}
    assert results[1].winner == {"name": "s5"}


def test_a_guided_sweep_reports_progress_for_every_candidate(db_path):
    timer, done = FakeTimer(), []
    op = guided_op(timer, [])
    shapes = _batches(1, 3, 2, 6, 4)
    sweep(op, shapes, TuningDB(db_path), timer=timer, strategy="guided", on_advance=lambda n, label: done.append(n))
    assert sum(done) == sum(len(candidate_configs(op, s)) for s in shapes)


def test_a_shapes_kernels_are_built_ahead_once_before_any_config_runs(db_path):
    """An op's precompile (Triton's: every candidate built in parallel) runs once per shape,
    with the configs the shape measures, before the first of them runs; one that fails costs
    the sweep nothing."""
    timer, calls, built = FakeTimer(), [], []
    base = guided_op(timer, calls)

    def precompile(inputs, configs):
        built.append((len(calls), inputs.shape.batch, [c["name"] for c in configs]))
        if inputs.shape.batch == 2:
            raise RuntimeError("compiler crashed")

    op = dataclasses.replace(base, precompile=precompile)
    results = sweep(op, _batches(1, 2), TuningDB(db_path), timer=timer)
    assert [(b, names) for _, b, names in built] == [(1, GUIDED_NAMES), (2, GUIDED_NAMES)]
    assert built[0][0] == 0 and built[1][0] == sum(b == 1 for b, _ in calls)  # before that shape's first run
    assert [r.status for r in results] == [MEASURED, MEASURED]


def test_decode_attention_builds_ahead_only_what_each_backend_compiles(monkeypatch):
    from tuner.ops.decode_attention import BACKENDS, DECODE_ATTENTION

    got = []
    triton = BACKENDS["triton_decode"]
    monkeypatch.setitem(BACKENDS, "triton_decode", dataclasses.replace(
        triton, op=dataclasses.replace(triton.op, precompile=lambda inputs, configs: got.append(configs))))
    configs = [{"backend": "fa3", "num_splits": 0, "pack_gqa": None},
               {"backend": "triton_decode", "block_n": 32, "num_kv_splits": 2, "num_warps": 4, "num_stages": 2}]
    DECODE_ATTENTION.precompile(None, configs)
    assert got == [[{"block_n": 32, "num_kv_splits": 2, "num_warps": 4, "num_stages": 2}]]


def test_a_sweep_moving_between_shapes_collects_no_garbage(db_path, monkeypatch):
    """A collection costs ~0.1 s in a sweeping process (measured on the H200: a fifth of a
    serving grid's sweep, two per shape); a trial's memory is freed by reference counting."""

    import tuner.bench.runner as runner

    collections = []
    monkeypatch.setattr(runner.gc, "collect", lambda *a: collections.append(1) or 0)
    timer = FakeTimer()
    results = sweep(fake_op(timer, {"default": 100.0, "fast": 50.0}), _batches(1, 2), TuningDB(db_path), timer=timer)
    assert [r.winner for r in results] == [{"name": "fast"}] * 2
    # only the candidate that ran out of memory is collected after, once per shape
    assert len(collections) == 2


def fill_op(timer, dense_cost=50.0, skewed_cost=150.0, runs=None):
    """Configs "default" (100 us on any batch) and "even" (dense_cost on dense batches,
    skewed_cost on the rest), and by_fill configs that run one on dense batches and the
    other elsewhere, as decode_attention's do."""
    from tuner.workload.traffic import is_dense

    def plain(inputs, config):
        if "dense.name" in config:
            lens = inputs.lengths()
            part = "dense" if is_dense(sum(lens), len(lens), max(lens)) else "other"
            return plain(inputs, {"name": config[f"{part}.name"]})
        lens = inputs.lengths()
        dense = is_dense(sum(lens), len(lens), max(lens))
        if runs is not None:
            runs.append((config["name"], dense))
        timer.last = config["name"]
        timer.cost = 100.0 if config["name"] == "default" else dense_cost if dense else skewed_cost
        return split_kv_decode(inputs, 0)

    return Op(name="filled", description="test op", configs=lambda s: [{"name": "default"}, {"name": "even"}],
              default=lambda s: {"name": "default"}, run=plain, grids={},
              by_fill=lambda dense, other: {"dense.name": dense["name"], "other.name": other["name"]})


FILLED = DecodeShape(batch=4, kv_len=256, lengths="serving", **SMALL)


def test_a_config_that_wins_dense_batches_only_is_stored_for_them_beside_the_winner(db_path):
    """An even split 2x faster on dense batches and 1.5x slower on skewed ones loses the
    serving mix to the default; the dense pass stores it for dense calls, the default for
    the rest, held on the second trial against the default and timed there."""
    from tuner import settings
    from tuner.workload.traffic import dense_draws, is_dense, serving_draws

    draws = serving_draws(FILLED.batch, FILLED.kv_len, 0)
    def dense(d):
        return is_dense(sum(d), len(d), max(d))
    assert dense(draws[0]) and not dense(draws[2])  # the test's premise: uniform is dense, few_long not
    assert all(dense(d) for d in dense_draws(4, 256, settings.DENSE_TRIAL_SEED))
    timer = FakeTimer()
    db = TuningDB(db_path)
    [result] = sweep(fill_op(timer), [FILLED], db, timer=timer)
    composite = {"dense.name": "even", "other.name": "default"}
    assert result.winner == composite and result.status == MEASURED
    [record] = db.records()
    assert record.config == composite
    # the second trial's mix: the even split on its dense batches, the default on the others
    second = serving_draws(4, 256, settings.SECOND_TRIAL_SEED, reach_top=True)
    expected = sum(50.0 if dense(d) else 100.0 for d in second) / 3
    assert expected < 100.0 and not all(map(dense, second))
    assert record.median_us == pytest.approx(expected) and record.default_median_us == 100.0
    info = record.method["dense_pass"]
    assert info["kept"] is False and info["dense_us"] == 50.0 and info["winner_on_dense_us"] == 100.0
    assert info["second_trial"]["held"] is True
    rows = db.measurements(record.problem, record.fingerprint_id)
    assert {r.method["lengths"] for r in rows} == {"serving", "serving-dense"}
    assert composite in [r.config for r in rows if r.method["lengths"] == "serving-dense"]


def test_a_dense_config_whose_gain_the_mix_dilutes_is_kept_where_it_loses_nowhere(db_path):
    """The dense part 4% ahead on dense batches; the second trial's mix holds one dense batch
    in three, so by_fill gains there less than the noise, and the default runs the rest
    alike: it loses nowhere, and is stored (a second trial that asked for the winner rule's
    gain refused such a record on the H200, one that ran 1.35x on a dense serving batch)."""
    from tuner import settings
    from tuner.bench import beats
    from tuner.workload.traffic import is_dense, serving_draws

    second = serving_draws(FILLED.batch, FILLED.kv_len, settings.SECOND_TRIAL_SEED, reach_top=True)
    mix = sum(96.0 if is_dense(sum(d), len(d), max(d)) else 100.0 for d in second) / len(second)
    # the premise: the winner rule refuses that gain on the mix, as the noise is 2%
    assert mix < 100.0 and not beats(Timing(mix, 0.02 * mix, 7), Timing(100.0, 2.0, 7))
    timer = FakeTimer()
    db = TuningDB(db_path)
    [result] = sweep(fill_op(timer, dense_cost=96.0), [FILLED], db, timer=timer)
    composite = {"dense.name": "even", "other.name": "default"}
    assert result.winner == composite
    [record] = db.records()
    assert record.config == composite and record.median_us == pytest.approx(mix)
    assert record.method["dense_pass"]["second_trial"]["held"] is True


def test_a_second_trial_asking_no_gain_still_refuses_a_config_the_default_beats():
    from tuner.bench.trial import Guard, Trial
    from tuner.search.pipeline import confirm_again

    class PairedTimer:
        method = {"timer": "fixed"}

        def __init__(self, mine, theirs):
            self.times = mine, theirs

        def paired(self, a, b):
            a[0](), b[0]()
            return tuple(Timing(t, 1.0, 7) for t in self.times)

    out = torch.ones(2)
    trial = Trial(runs=[lambda config: out], reference=out, tolerance=(1e-3, 1e-3), kv_len=64)
    mine, default = {"name": "dense"}, {"name": "default"}
    def held(mine_us, must_gain):
        return confirm_again(trial, mine, default, PairedTimer(mine_us, 100.0), must_gain=must_gain).held
    assert held(99.5, must_gain=False) and not held(99.5, must_gain=True)  # within the noise
    assert held(90.0, must_gain=True) and held(90.0, must_gain=False)
    assert not held(101.5, must_gain=False) and held(100.5, must_gain=False)  # slower beyond the noise / within it

    class PartsTimer(PairedTimer):  # each batch of the mix alone, in turn
        def __init__(self, pairs):
            self.times = list(pairs)

        def paired(self, a, b):
            a[0](), b[0]()
            return tuple(Timing(t, 1.0, 7) for t in self.times.pop(0))

    run = lambda config: out  # noqa: E731
    mix = Trial(runs=[run] * 2, reference=out, tolerance=(1e-3, 1e-3), kv_len=64, parts=[[run], [run]])
    # ahead on the mix (96.5 against 100), 3% behind on its second batch: it loses there
    behind = confirm_again(mix, mine, default, PartsTimer([(90.0, 100.0), (103.0, 100.0)]), must_gain=False)
    assert not behind.held and behind.winner.median_us == pytest.approx(96.5)
    assert confirm_again(mix, mine, default, PartsTimer([(90.0, 100.0), (101.0, 100.0)]), must_gain=False).held
    # a guard (a batch of equal lengths, outside the mix): behind there by 3%, it loses; the mix is the parts' mean
    guarded = dataclasses.replace(mix, guards=[Guard(runs=[run], reference=out)])
    behind = confirm_again(guarded, mine, default, PartsTimer([(90.0, 100.0), (90.0, 100.0), (103.0, 100.0)]),
                           must_gain=False)
    assert not behind.held and behind.winner.median_us == pytest.approx(90.0)
    assert confirm_again(guarded, mine, default, PartsTimer([(90.0, 100.0), (90.0, 100.0), (101.0, 100.0)])).held
    wrong_there = dataclasses.replace(mix, guards=[Guard(runs=[lambda config: -out], reference=out)])
    refused = confirm_again(wrong_there, mine, default, PartsTimer([(90.0, 100.0)] * 3))
    assert not refused.held and "guard" in refused.error


def test_a_fault_on_a_guard_is_told_to_the_flight_recorder_first_and_recorded_as_the_configs():
    """The guard's lengths are new to a challenger: the sweep's flight recorder hears of the
    config before it runs there (a hard crash then refuses it for the shape), and an error that
    lost the CUDA context is recorded as its outcome (a sweep's sink then ends the worker)."""
    from tuner.bench.trial import Guard, Trial
    from tuner.search.pipeline import measure

    timer = FakeTimer()
    out = torch.ones(2)

    def run(config):
        timer.last, timer.cost = config["name"], 100.0 if config["name"] == "default" else 50.0
        return out

    def on_guard(config):
        if config["name"] == "faulty":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return run(config)

    trial = Trial(runs=[run] * 2, reference=out, tolerance=(1e-3, 1e-3), kv_len=64, parts=[[run], [run]],
                  guards=[Guard(runs=[on_guard], reference=out)])
    events = []
    result = measure(trial, [{"name": "default"}, {"name": "faulty"}], {"name": "default"}, timer,
                     strategy="exhaustive", keep_default_if_confirm_fails=True,
                     starting=lambda step: events.append(("starting", step.config["name"])),
                     record=lambda step, outcome: events.append((outcome.status, step.config["name"], outcome.error)))
    assert events[-2] == ("starting", "faulty")  # before it ran on the guard
    assert events[-1] == (ERROR, "faulty", "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert result.winner.config == {"name": "default"}  # where no sink ends the process, the default stays


def test_a_dense_pass_runs_its_second_trial_with_its_config_in_flight(db_path, tmp_path, monkeypatch):
    """A dense pass's winner runs again on the shape's second trial: should it fault there,
    the supervisor must find it in flight, to refuse it among the pass's measurements (it
    found none, restarted the worker into the same fault and gave up: a helper's review)."""
    import tuner.sweep.dense as dense_module
    from tuner.sweep.flight import Flight, read_flight

    journal = tmp_path / "flight.jsonl"
    in_flight = []
    second_trial = dense_module.on_second_trial

    def watched(op, shape, device, seed, config, default, *args, starting, **kwargs):
        def told(c):  # after it, what a supervisor would read were the worker to die
            starting(c)
            entries = read_flight(journal)
            in_flight.append(entries[-1][2] if entries else None)
        return second_trial(op, shape, device, seed, config, default, *args, starting=told, **kwargs)

    monkeypatch.setattr(dense_module, "on_second_trial", watched)
    timer = FakeTimer()
    db = TuningDB(db_path)
    [result] = sweep(fill_op(timer), [FILLED], db, timer=timer, flight=Flight(journal))
    composite = {"dense.name": "even", "other.name": "default"}
    assert result.winner == composite
    # the default first (its first run on these lengths is blamed on it), then the pass's winner
    default, running = in_flight
    assert default is not None and default["config"] == {"name": "default"}
    assert running is not None and running["config"] == composite
    assert running["method"]["lengths"] == "serving-dense" and running["method"]["refused"] is True
    assert all(not rows and running is None for _, rows, running in read_flight(journal))  # nothing left


def test_measurements_a_failed_write_leaves_stay_in_the_flight_journal(db_path, tmp_path):
    """A DB write that fails keeps its measurements pending and in the journal, for the
    supervisor to store (the write emptied both before it was tried: a helper's review)."""
    from tuner.bench import Outcome
    from tuner.db import DBError, Problem
    from tuner.keys import attention_run_key
    from tuner.search import Step
    from tuner.sweep.flight import Flight, read_flight
    from tuner.sweep.sink import MeasurementSink

    class FailingDB:
        def save_measurements(self, *args):
            raise DBError("cannot write tuning DB: server closed the connection unexpectedly")

    journal = tmp_path / "flight.jsonl"
    problem = Problem("faulty", '{"heads":4}', attention_run_key(1, 1, 256))
    env = ("env-id", {"device": "cpu"})
    sink = MeasurementSink(FailingDB(), problem, env, {}, 256, at_once=True, label="b1", flight=Flight(journal))
    timer = FakeTimer()
    step = Step({"chunk": 64}, timer, 1)
    with pytest.raises(DBError), pytest.warns(UserWarning, match="were not stored"):  # (tried again on the way out)
        with sink:
            sink.add(step, Outcome({"chunk": 64}, OK, Timing(10.0, 0.1, 5)))
    assert [row["config"] for row in sink.pending] == [{"chunk": 64}]
    ((context, rows, running),) = read_flight(journal)
    assert context["label"] == "b1" and [row["config"] for row in rows] == [{"chunk": 64}] and running is None


def test_a_dense_pass_that_finds_nothing_keeps_the_winner_and_says_so(db_path):
    timer = FakeTimer()
    db = TuningDB(db_path)
    runs = []
    [result] = sweep(fill_op(timer, dense_cost=99.5, runs=runs), [FILLED], db, timer=timer)
    assert result.winner == {"name": "default"}
    [record] = db.records()
    assert record.method["dense_pass"]["kept"] is True and "second_trial" not in record.method["dense_pass"]
    assert ("even", True) in runs  # it was measured on dense batches


def test_a_stored_winner_gets_its_dense_pass_once(db_path):
    """A DB swept before dense passes (or seeded from a shipped file) gets one on the next
    sweep: the record is replaced by its by_fill config; a third sweep measures nothing."""
    timer = FakeTimer()
    db = TuningDB(db_path)
    [first] = sweep(fill_op(timer), [FILLED], db, timer=timer, dense_pass=False)
    assert first.winner == {"name": "default"} and "dense_pass" not in db.records()[0].method
    [second] = sweep(fill_op(timer), [FILLED], db, timer=timer)
    assert second.status == MEASURED and second.winner == {"dense.name": "even", "other.name": "default"} and "dense pass" in second.note
    assert db.records()[0].config == second.winner
    runs = []
    [third] = sweep(fill_op(timer, runs=runs), [FILLED], db, timer=timer)
    assert third.status == SKIPPED and third.winner == second.winner and runs == []


def test_no_dense_pass_where_every_call_is_dense_or_the_op_has_no_by_fill(db_path):
    timer = FakeTimer()
    db = TuningDB(db_path)
    one = dataclasses.replace(FILLED, batch=1)  # one sequence: every batch is dense
    sweep(fill_op(timer), [one, dataclasses.replace(FILLED, lengths="full")], db, timer=timer)
    assert all("dense_pass" not in r.method for r in db.records())
    plain = dataclasses.replace(fill_op(timer), by_fill=None)
    [result] = sweep(plain, [FILLED], db, timer=timer, force=True)
    [record] = [r for r in db.records() if r.problem.run_key == FILLED.run_key()]
    assert result.winner == {"name": "default"} and "dense_pass" not in record.method


def test_a_dense_config_refused_by_a_second_trial_that_asked_for_a_gain_gets_its_pass_again(db_path):
    """A record whose dense pass found a config that the second trial refused when it still
    asked for the winner rule's gain (no "rule" in its info) gets another pass; once its info
    names the rule, a sweep leaves it alone."""
    from tuner.db import current_environment

    timer = FakeTimer()
    [record] = _swept_without_dense_pass(db_path, timer)
    db = TuningDB(db_path)
    refused = {"kept": True, "dense_us": 96.0, "winner_on_dense_us": 100.0,
               "second_trial": {"held": False, "error": None, "winner_us": 98.7, "default_us": 100.0}}
    db.save_record(record.problem, current_environment(), record.config, median_us=record.median_us,
                   spread_us=record.spread_us, samples=record.samples, default_config=record.default_config,
                   default_median_us=record.default_median_us, default_spread_us=record.default_spread_us,
                   method=dict(record.method, dense_pass=refused))
    [again] = sweep(fill_op(timer, dense_cost=96.0), [FILLED], db, timer=timer)
    composite = {"dense.name": "even", "other.name": "default"}
    assert again.status == MEASURED and again.winner == composite
    [stored] = db.records()
    assert stored.method["dense_pass"]["rule"] == "loses nowhere" and stored.method["dense_pass"]["kept"] is False
    runs = []
    [third] = sweep(fill_op(timer, dense_cost=96.0, runs=runs), [FILLED], db, timer=timer)
    assert third.status == SKIPPED and runs == []


def dense_guided_op(timer, other_cost=400.0):
    """Configs s1..s8 and the default: on dense batches s_k is fastest at batch k (as
    guided_op's), on the rest each costs other_cost (the default 100); and their by_fill
    configs."""
    from tuner.workload.traffic import is_dense

    def run(inputs, config):
        lens = inputs.lengths()
        dense = is_dense(sum(lens), len(lens), max(lens))
        if "dense.name" in config:
            return run(inputs, {"name": config["dense.name" if dense else "other.name"]})
        name = config["name"]
        timer.last = name
        near = 50.0 + 5.0 * abs(int(name[1:]) - len(lens)) if name != "default" else None
        timer.cost = 100.0 if name == "default" else near if dense else other_cost
        return split_kv_decode(inputs, 0)

    return Op(name="fake-dense-guided", description="test op",
              configs=lambda shape: [{"name": n} for n in GUIDED_NAMES],
              default=lambda shape: {"name": "default"}, run=run, grids={},
              by_fill=lambda dense, other: {"dense.name": dense["name"], "other.name": other["name"]})


def _dense_configs_at_batch_3(db):
    [record] = [r for r in db.records() if r.problem.run_key.batch == 3]
    return {canonical_json(m.config) for m in db.measurements(record.problem, record.fingerprint_id)
            if m.method["lengths"] == "serving-dense"}


def test_a_resumed_guided_sweep_shortlists_dense_passes_from_the_stored_anchors(db_path, monkeypatch):
    """The anchors' dense passes stored in one sweep guide the dense passes between them in
    the next, as in the sweep that ran them: the same shortlist, not every candidate."""
    from tuner import settings

    monkeypatch.setattr(settings, "GUIDED_KEEP", 2)
    served = [dataclasses.replace(FILLED, batch=b) for b in (2, 4, 3)]

    timer = FakeTimer()
    at_once = TuningDB(db_path.with_name("at_once.db"))
    sweep(dense_guided_op(timer), served, at_once, timer=timer, strategy="guided")
    resumed = TuningDB(db_path)
    sweep(dense_guided_op(timer), served[:2], resumed, timer=timer, strategy="guided")
    results = sweep(dense_guided_op(timer), served, resumed, timer=timer, strategy="guided")
    assert [r.status for r in results] == [SKIPPED, SKIPPED, MEASURED]
    assert results[2].winner == {"dense.name": "s3", "other.name": "default"}
    searched = _dense_configs_at_batch_3(resumed)
    assert searched == _dense_configs_at_batch_3(at_once)
    assert 1 < len(searched) < len(GUIDED_NAMES)


def test_a_resumed_dense_guide_reads_the_pass_beside_the_stored_winner_not_an_older_one(db_path, monkeypatch):
    """An anchor whose winner W is not the default, and whose DB also holds a dense pass
    beside the default from an older sweep (rows are kept): the guide reads the pass beside W."""
    from tuner import settings
    from tuner.db import current_environment

    monkeypatch.setattr(settings, "GUIDED_KEEP", 2)
    served = [dataclasses.replace(FILLED, batch=b) for b in (2, 4, 3)]
    timer = FakeTimer()
    op = dense_guided_op(timer, other_cost=60.0)  # s_k wins batch k's mix too

    at_once = TuningDB(db_path.with_name("at_once.db"))
    sweep(op, served, at_once, timer=timer, strategy="guided")
    resumed = TuningDB(db_path)
    sweep(op, served[:2], resumed, timer=timer, strategy="guided")
    [anchor] = [r for r in resumed.records() if r.problem.run_key.batch == 2]
    assert anchor.config == {"name": "s2"}
    # an older pass beside the default, its baseline measured, s7 and s8 fastest there
    older = [dict(config={"dense.name": n, "other.name": "default"}, kv_len=FILLED.kv_len, status="ok",
                  method={"lengths": "serving-dense", "timer": "fake"}, rung=1,
                  median_us=10.0 if n in ("s7", "s8") else 90.0, spread_us=0.1, samples=7, max_error=0.0, error=None)
             for n in GUIDED_NAMES]
    resumed.save_measurements(anchor.problem, current_environment(), older)
    sweep(op, served, resumed, timer=timer, strategy="guided")
    searched = _dense_configs_at_batch_3(resumed)
    assert searched == _dense_configs_at_batch_3(at_once)
    assert not any('"dense.name":"s8"' in c for c in searched)


def _swept_without_dense_pass(path, timer):
    db = TuningDB(path)
    sweep(fill_op(timer), [FILLED], db, timer=timer, dense_pass=False)
    return db.records()


def test_a_dense_pass_that_keeps_a_winner_measured_elsewhere_does_not_store_it_as_this_ones(db_path):
    """A stored winner of another environment that applies here (another driver): keeping
    it wrote a copy under this environment, dated now, with the other machine's timings."""
    from tuner.db import current_fingerprint
    from tuner.db.fingerprint import MAY_DIFFER

    timer = FakeTimer()
    [mine] = [r for r in _swept_without_dense_pass(db_path.with_name("there.db"), timer)]
    db = TuningDB(db_path)
    elsewhere = dict(current_fingerprint(), **{sorted(MAY_DIFFER)[0]: "elsewhere"})
    db.save_record(mine.problem, ("elsewhere00000000", elsewhere), mine.config, median_us=mine.median_us,
                   spread_us=mine.spread_us, samples=mine.samples, default_config=mine.default_config,
                   default_median_us=mine.default_median_us, default_spread_us=mine.default_spread_us,
                   method=dict(mine.method, note="measured elsewhere"))
    sweep(fill_op(timer, dense_cost=99.5), [FILLED], db, timer=timer)  # the dense pass keeps it
    assert [(r.fingerprint_id, r.method.get("note")) for r in db.records()] == [("elsewhere00000000", "measured elsewhere")]


@pytest.mark.parametrize("stored_method, resumed", [
    ({"lengths": "serving"}, False),  # a trial of one round, as before: other batches
    ({"lengths": "serving", "rounds": 4}, True),  # the trial this sweep draws
])
def test_a_batch_1_serving_sweep_resumes_only_timings_of_a_trial_of_as_many_rounds(tmp_path, stored_method, resumed):
    """Trials at batch 1 draw 4 rounds of lengths (settings.TRIAL_MIN_SEQUENCES): a timing
    stored from a trial of one round is of other batches, and is measured again."""
    from tuner.bench import WallClockTimer
    from tuner.db import Problem, current_fingerprint

    op = get_op("torch_split_decode")
    shape = DecodeShape(batch=1, kv_len=64, lengths="serving", **SMALL)
    problem = Problem(op.name, shape.static_key().to_json(), shape.run_key())
    configs = candidate_configs(op, shape)
    db = TuningDB(tmp_path / "t.db")
    db.save_measurements(problem, (current_fingerprint_id(), current_fingerprint()), [
        dict(config=c, kv_len=64, status=OK, method=dict(stored_method, device="cpu"), rung=1, median_us=5.0 + i,
             spread_us=0.1, samples=2, max_error=0.0, error=None) for i, c in enumerate(configs)])
    [result] = sweep(op, [shape], db, timer=WallClockTimer(warmup=0, repeats=2, min_repeats=2), halving=False,
                     strategy="exhaustive")
    assert result.status == MEASURED
    if resumed:
        assert result.resumed == len(configs) and result.measured == 0
    else:
        assert result.resumed == 0 and result.measured == len(configs)
    assert db.records()[0].method["rounds"] == 4


SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def split_op(timer, calls):
    """Configs of one kernel with a fixed split count each, and the default: the fastest has
    batch x splits = 96, as a split count that fills the GPU tracks the batch size."""
    import math

    def run(inputs, config):
        batch = inputs.shape.batch
        calls.append((batch, config.get("num_splits")))
        timer.last = canonical(config)
        timer.cost = 100.0 if config["name"] == "default" else 50.0 + 20.0 * abs(
            math.log2(batch * config["num_splits"] / 96))
        return split_kv_decode(inputs, 0)

    def canonical(config):
        return f"{config['name']}/{config.get('num_splits')}"

    configs = [{"name": "default"}] + [{"name": "k", "num_splits": s} for s in SPLITS]
    return Op(name="fake-splits", description="test op", configs=lambda shape: list(configs),
              default=lambda shape: {"name": "default"}, run=run, grids={})


def test_a_guided_shortlist_holds_the_anchors_leaders_with_their_split_counts_scaled_to_the_batch(db_path, monkeypatch):
    """batch x splits carries over between batch sizes where the split count does not: batch
    24 between anchors 16 (6 splits lead) and 32 (3 lead) wins with 4 splits, which neither
    anchor's leaders hold (H200: FA3 with 6 splits, 1.23x at 70B tp8 b24 x kv 64k, was in no
    shortlist)."""
    from tuner import settings

    monkeypatch.setattr(settings, "GUIDED_KEEP", 1)
    timer, calls = FakeTimer(), []
    results = sweep(split_op(timer, calls), _batches(16, 32, 24), TuningDB(db_path), timer=timer, strategy="guided")
    assert [r.winner for r in results] == [{"name": "k", "num_splits": s} for s in (6, 3, 4)]
    assert {s for b, s in calls if b == 24} == {None, 6, 3, 4}  # the default, the leaders, the scaled one


def test_scaled_splits_picks_the_nearest_sibling_in_octaves_or_both_either_side():
    from tuner.search.guided import scaled_splits

    configs = [{"name": "default"}] + [{"name": "k", "num_splits": s} for s in SPLITS] + [
        {"name": "other", "num_splits": 5}, {"name": "k", "num_splits": 4, "tokens_per_split": 256}]
    leader = {"name": "k", "num_splits": 8}
    assert scaled_splits(leader, 16, 24, configs) == [{"name": "k", "num_splits": 6}]  # 5.33: nearer 6 than 4
    assert scaled_splits(leader, 16, 16, configs) == [{"name": "k", "num_splits": 8}]
    assert scaled_splits(leader, 8, 40, configs) == [{"name": "k", "num_splits": 2}]  # 1.6
    # 3 x 4 / 5 = 2.4: 2 and 3 lie about as far on either side, in octaves (within 0.1)
    assert scaled_splits({"name": "k", "num_splits": 3}, 4, 5, configs) == [
        {"name": "k", "num_splits": 2}, {"name": "k", "num_splits": 3}]
    assert scaled_splits(leader, 1, 256, configs) == [{"name": "k", "num_splits": 1}]  # below every sibling
    # a count set by the heuristic (0), by each sequence's length or by the call's load, is not scaled
    assert scaled_splits({"name": "k", "num_splits": 0}, 16, 24, configs) == []
    assert scaled_splits({"name": "k", "num_splits": 4, "tokens_per_split": 256}, 16, 24, configs) == []
    by_load = [{"name": "k", "num_splits": n, "items_per_sm": 4} for n in (2, 4)]
    assert scaled_splits(by_load[1], 16, 24, configs + by_load) == []
    assert scaled_splits({"name": "none", "num_splits": 4}, 16, 24, configs) == []  # no sibling


def test_scaled_splits_leaves_a_split_count_beyond_any_rules_range_or_a_bool():
    from tuner.search.guided import scaled_splits

    configs = [{"name": "k", "num_splits": s} for s in SPLITS]
    assert scaled_splits({"name": "k", "num_splits": 1 << 40}, 16, 24, configs) == []
    assert scaled_splits({"name": "k", "num_splits": True}, 16, 24, configs) == []  # a bool is no count


def _dense_configs(db, kv_len):
    [record] = [r for r in db.records() if r.problem.run_key.kv_len_bucket == kv_len]
    return {canonical_json(m.config) for m in db.measurements(record.problem, record.fingerprint_id)
            if m.method["lengths"] == "serving-dense"}, record


def test_an_anchors_dense_pass_is_shortlisted_from_the_anchor_of_its_batch_at_another_kv_length(
        db_path, monkeypatch):
    """The dense passes' guide (settings.GUIDED_ACROSS_KV): batch 4 at kv 256 searches its
    winner, the default and kv 128's leaders on dense batches, not every candidate (replayed
    over the H200's anchors, 87% fewer configs); its mix is still searched over them all."""
    from tuner import settings

    monkeypatch.setattr(settings, "GUIDED_KEEP", 2)
    served = [dataclasses.replace(FILLED, kv_len=kv) for kv in (128, 256)]
    timer = FakeTimer()
    db = TuningDB(db_path)
    results = sweep(dense_guided_op(timer), served, db, timer=timer, strategy="guided")
    assert [r.winner for r in results] == [{"dense.name": "s4", "other.name": "default"}] * 2
    first, _ = _dense_configs(db, 128)
    second, record = _dense_configs(db, 256)
    assert len(first) == len(GUIDED_NAMES)  # no other anchor of batch 4 was recorded yet
    # the default's by_fill (the pass's baseline: the winner is the default) and kv 128's two
    # leaders: s4, and s3 before s5 (as fast; the first of the candidates)
    assert second == {canonical_json({"dense.name": n, "other.name": "default"}) for n in ("default", "s3", "s4")}
    assert record.method["dense_pass"]["measured"] < len(GUIDED_NAMES)
    assert record.method["dense_pass"]["shortlisted"] == 3 and record.method["dense_pass"]["candidates"] == 9
    # resumed from a DB holding kv 128's anchor, the same shortlist
    resumed = TuningDB(db_path.with_name("resumed.db"))
    sweep(dense_guided_op(timer), served[:1], resumed, timer=timer, strategy="guided")
    sweep(dense_guided_op(timer), served, resumed, timer=timer, strategy="guided")
    assert _dense_configs(resumed, 256)[0] == second
    mix = {canonical_json(m.config) for m in db.measurements(record.problem, record.fingerprint_id)
           if m.method["lengths"] == "serving"}
    assert len(mix) == len(GUIDED_NAMES)


def test_with_across_kv_off_an_anchors_dense_pass_searches_every_candidate(db_path, monkeypatch):
    from tuner import settings

    monkeypatch.setattr(settings, "GUIDED_KEEP", 2)
    monkeypatch.setattr(settings, "GUIDED_ACROSS_KV", False)
    served = [dataclasses.replace(FILLED, kv_len=kv) for kv in (128, 256)]
    timer = FakeTimer()
    db = TuningDB(db_path)
    sweep(dense_guided_op(timer), served, db, timer=timer, strategy="guided")
    assert len(_dense_configs(db, 256)[0]) == len(GUIDED_NAMES)


def test_an_across_kv_guide_shortlists_an_anchor_only_over_its_batchs_other_kv_anchors():
    """An anchor: the leaders of its batch's nearest anchors at another kv length (either
    side), with its family's nearest batches' and the default; every config where no
    anchor of its batch at another kv length is recorded, or without across_kv."""
    from tuner.bench import Outcome
    from tuner.search.guided import Guide

    configs = [{"name": n} for n in GUIDED_NAMES]

    def ran(*names):
        return [Outcome({"name": n}, OK, Timing(10.0 + i, 0.1, 5)) for i, n in enumerate(names)]

    def at(batch, kv):
        return dataclasses.replace(FILLED, batch=batch, kv_len=kv)

    guide, plain = Guide(keep=2, across_kv=True), Guide(keep=2)
    for g in (guide, plain):
        g.record(at(2, 128), ran("s1", "s2", "s3"))
        g.record(at(4, 512), ran("s5", "s6"))
        g.record(at(8, 1024), ran("s7", "s8"))
    names = lambda cs: [c["name"] for c in cs]  # noqa: E731
    assert names(guide.shortlist(at(2, 256), configs)) == ["default", "s1", "s2"]
    guide.record(at(4, 256), ran("s3", "s4"))
    # batch 4's anchor at kv 256 (not its own record at 512)
    assert names(guide.shortlist(at(4, 512), configs)) == ["default", "s3", "s4"]
    # the nearest of batch 4's kv lengths (512, not 256), and batch 8 of its own family
    assert names(guide.shortlist(at(4, 1024), configs)) == ["default", "s5", "s6", "s7", "s8"]
    assert guide.shortlist(at(16, 256), configs) == configs  # nothing of batch 16 at another kv
    assert plain.shortlist(at(2, 256), configs) == configs  # without across_kv: every candidate
    # the nearest on each side: batch 8 at kv 256 between its anchors at 128 and 512
    guide.record(at(8, 128), ran("s1", "s2"))
    guide.record(at(8, 512), ran("s3", "s4"))
    assert names(guide.shortlist(at(8, 256), configs)) == ["default", "s1", "s2", "s3", "s4"]
    # at most settings.GUIDED_ACROSS_KV_OCTAVES away: kv 128 is 3 octaves from batch 2's 1024
    assert guide.shortlist(at(2, 1024), configs) == configs


def handed_on_op(timer):
    """On dense batches (and the mix) of batch 4: a, b, c lead the dense batches at every kv
    (60, 65, 70 us; 400 on the others); m is slow at kv 128, wins the mix at kv 256 (40 dense,
    50 elsewhere) and is fastest on dense batches again at kv 512, where the default (100)
    wins the mix. kv 256's dense pass searches m as its baseline, not from its shortlist."""
    from tuner.workload.traffic import is_dense

    dense_cost = {"a": 60.0, "b": 65.0, "c": 70.0}

    def run(inputs, config):
        lens = inputs.lengths()
        dense = is_dense(sum(lens), len(lens), max(lens))
        if "dense.name" in config:
            return run(inputs, {"name": config["dense.name" if dense else "other.name"]})
        name, kv = config["name"], inputs.shape.kv_len
        timer.last = name
        if name == "default":
            timer.cost = 100.0
        elif name == "m":
            timer.cost = 200.0 if kv <= 128 else 40.0 if dense else 50.0 if kv <= 256 else 400.0
        else:
            timer.cost = dense_cost[name] if dense else 400.0
        return split_kv_decode(inputs, 0)

    return Op(name="fake-handed-on", description="test op",
              configs=lambda shape: [{"name": n} for n in ("default", "a", "b", "c", "m")],
              default=lambda shape: {"name": "default"}, run=run, grids={},
              by_fill=lambda dense, other: {"dense.name": dense["name"], "other.name": other["name"]})


HANDED_ON = [dataclasses.replace(FILLED, kv_len=kv) for kv in (128, 256, 512)]


def test_an_anchors_winner_off_its_dense_shortlist_is_handed_on_to_the_next_kv_length(db_path, monkeypatch):
    """kv 256's winner m, searched as its dense pass's baseline though its shortlist (kv 128's
    leaders a, b) did not hold it, was fastest there: kv 512's shortlist holds it, and its
    dense pass finds it (without: a, 1.5x slower on dense batches)."""
    from tuner import settings

    monkeypatch.setattr(settings, "GUIDED_KEEP", 2)
    timer = FakeTimer()
    db = TuningDB(db_path)
    results = sweep(handed_on_op(timer), HANDED_ON, db, timer=timer, strategy="guided")
    assert [r.winner for r in results] == [{"dense.name": "a", "other.name": "default"}, {"name": "m"},
                                           {"dense.name": "m", "other.name": "default"}]
    searched, _ = _dense_configs(db, 256)
    assert searched == {canonical_json({"dense.name": n, "other.name": "m"}) for n in ("m", "default", "a", "b")}


def test_measurements_wait_for_store_every_s_then_go_to_the_db_together(db_path, monkeypatch):
    """A write costs milliseconds on a GPU host: measurements are held until the oldest is
    STORE_EVERY_S old, then stored together (and what is left, at the shape's end)."""
    from tuner import settings
    from tuner.bench import Outcome, Timing
    from tuner.db import Problem, current_fingerprint
    from tuner.search.base import Step
    from tuner.sweep.sink import MeasurementSink

    monkeypatch.setattr(settings, "STORE_EVERY_S", 10.0)
    db = TuningDB(db_path)
    shape = DecodeShape(batch=3, kv_len=64, **SMALL)
    problem = Problem("fake", shape.static_key().to_json(), shape.run_key())
    now = [0.0]
    sink = MeasurementSink(db, problem, (current_fingerprint_id(), current_fingerprint()), {}, 64,
                           clock=lambda: now[0])
    stored = []
    for t, name in ((0.0, "a"), (9.9, "b"), (10.0, "c"), (12.0, "d")):
        now[0] = t
        sink.add(Step({"name": name}, FakeTimer(), 1), Outcome({"name": name}, OK, Timing(1.0, 0.1, 3)))
        stored.append(len(db.measurements(problem, current_fingerprint_id())))
    assert stored == [0, 0, 3, 3]
    sink.store()
    assert len(db.measurements(problem, current_fingerprint_id())) == 4
