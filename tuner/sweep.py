"""Offline sweeps: shapes x candidate configs -> checked, timed -> winners in the DB.

Each shape is a trial (tuner.ops.trial) measured by the one pipeline (tuner.search.pipeline)
with a search strategy chosen by name. Resumable: a shape's measurements are stored together
every few seconds and when it ends (MeasurementSink), a shape whose winner is stored is
skipped, and a shape cut short resumes from its stored measurements.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from tuner import settings
from tuner.bench import OK, Outcome, Timing, boundary_sync, one_line, same_config, timer_for, with_default_first
from tuner.bench.trial import cold_l2_copies
from tuner.db import MeasurementRow, MissRow, Problem, TuningDB, current_environment
from tuner.errors import TunerError
from tuner.keys import canonical_json
from tuner.ops import Config, Op
from tuner.workload import DecodeInputs, DecodeShape
from tuner.workload.rotation import bytes_read
from tuner.workload.shapes import shape_from_keys
from tuner.workload.traffic import draws_per_distribution
from tuner.ops.trial import build_dense_trial, build_second_trial, build_trial
from tuner.ranks import Ranks
from tuner.search import DEFAULT_STRATEGY, Step, get_strategy
from tuner.search.pipeline import SecondTrial, confirm_again, measure

# a shape's status: a new winner measured, its stored winner kept, no config ran right, or
# the same key as an earlier shape (not "tuned": tuner.ops.base.TUNED is another thing)
MEASURED, SKIPPED, FAILED, DUPLICATE = "measured", "skipped", "failed", "duplicate"
# the method's lengths of a dense pass's measurements (each a by_fill config over the shape's
# winner, timed on the dense batches alone), kept apart from the mix's
DENSE_LENGTHS = "serving-dense"


def _rounds(shape: DecodeShape) -> dict[str, int]:
    """A serving trial's rounds of draws (tuner.workload.traffic.draws_per_distribution), as a
    method says them: only where there is more than one."""
    rounds = draws_per_distribution(shape.batch)
    return {"rounds": rounds} if rounds > 1 else {}


def _batches_of(shape: DecodeShape, lengths: str) -> dict[str, Any]:
    """What a measurement's method says of the batches it was timed on: their lengths and
    their rounds of draws (_rounds); a stored timing resumes only a measurement on the same
    kind of batches."""
    return {} if lengths == "full" else {"lengths": lengths, **_rounds(shape)}


def _timed_on(method: dict[str, Any], shape: DecodeShape, lengths: str) -> bool:
    """Whether a stored measurement's method names the batches shape's trial of `lengths`
    holds (timings of one round, stored before trials drew more, are not resumed)."""
    want = _batches_of(shape, lengths)
    return method.get("lengths", "full") == lengths and method.get("rounds", 1) == want.get("rounds", 1)


@dataclass(frozen=True)
class ShapeResult:
    shape: DecodeShape
    status: str  # measured | skipped (its stored winner is reported) | failed | duplicate
    winner: Config | None
    winner_us: float | None
    default_us: float | None
    measured: int  # configs measured in this run
    resumed: int  # configs whose stored measurement was reused
    failures: int  # configs that crashed, ran out of memory or were wrong
    note: str = ""  # why a shape failed, or which shape it duplicates

    @property
    def speedup(self) -> float | None:
        if self.winner_us and self.default_us:
            return self.default_us / self.winner_us
        return None


def kv_copies(inputs: DecodeInputs, device: str, max_copies: int = 64) -> int:
    """How many copies a cold-L2 rotation needs (tuner.bench.trial), by the bytes a call
    reads (tuner.workload.rotation), not the bytes allocated."""
    return cold_l2_copies(bytes_read(inputs), device, max_copies)


def shape_from_miss(miss: MissRow) -> DecodeShape | None:
    """The shape `tuner sweep --from-misses` measures for a missed key: at the top of its kv
    bucket, on serving batches (DecodeShape.lengths) where its calls' lengths were mixed;
    None when the key is not one a sweep can build."""
    shape = shape_from_keys(miss.problem.static_key, miss.problem.run_key)
    if shape is None or miss.lengths is None or miss.lengths.mean >= settings.MISS_MIXED_BELOW * miss.lengths.longest:
        return shape
    return dataclasses.replace(shape, lengths="serving")


def candidate_configs(op: Op, shape: DecodeShape) -> list[Config]:
    """The default first (so it is always measured), then the rest of the space once each."""
    return with_default_first(op.default(shape), op.configs(shape))


def _stored_outcome(row: MeasurementRow) -> Outcome:
    timing = Timing(row.median_us, row.spread_us, row.samples) if row.status == OK else None
    return Outcome(row.config, row.status, timing, row.max_error, row.error)


class MeasurementSink:
    """A shape's measurements on their way to the DB. Stored together (a write costs
    milliseconds on a GPU host), at the latest settings.STORE_EVERY_S after the oldest one
    not yet stored, so a process killed outright loses at most that much of its work; at
    once where other ranks read them (at_once); and whatever is left by store() when the
    shape ends, fails or is interrupted."""

    def __init__(self, db: TuningDB, problem: Problem, env: Any, method: dict[str, Any], kv_len: int, *,
                 at_once: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.db, self.problem, self.env, self.method, self.kv_len = db, problem, env, method, kv_len
        self.at_once, self.clock = at_once, clock
        self.pending: list[dict[str, Any]] = []
        self._oldest: float | None = None

    def add(self, step: Step, outcome: Outcome) -> None:
        t = outcome.timing
        self.pending.append(dict(
            config=step.config, kv_len=self.kv_len, status=outcome.status,
            # the timer's method as of this measurement (a failed capture says so); a quick
            # rung's also in method, where a tuner before the rung column reads it
            method=dict(self.method, **step.timer.method, **({"rung": step.rung} if step.rung != 1 else {})),
            rung=step.rung, median_us=t and t.median_us, spread_us=t and t.spread_us,
            samples=t.samples if t else 0, max_error=outcome.max_error, error=outcome.error,
        ))
        now = self.clock()
        if self._oldest is None:
            self._oldest = now
        if self.at_once or now - self._oldest >= settings.STORE_EVERY_S:
            self.store()

    def store(self) -> None:
        """Write what is pending, in one transaction; tried once (a write that fails is not
        tried again)."""
        measurements, self.pending, self._oldest = self.pending, [], None
        if measurements:
            self.db.save_measurements(self.problem, self.env, measurements)


class SweepInterrupted(KeyboardInterrupt):
    """A sweep interrupted (Ctrl-C, or SIGINT at a deadline): the shapes it finished, in
    the order given, and how many it was given."""

    def __init__(self, done: list[ShapeResult], total: int) -> None:
        super().__init__(f"interrupted after {len(done)} of {total} shapes")
        self.done, self.total = done, total


def sweep(
    op: Op,
    shapes: list[DecodeShape],
    db: TuningDB,
    *,
    timer: Any = None,
    force: bool = False,
    min_gain: float = settings.MIN_GAIN,
    seed: int = 0,
    strategy: str = DEFAULT_STRATEGY,
    halving: bool = False,
    on_advance: Callable[[int, str], None] | None = None,
    ranks: Ranks | None = None,
    second_trial: bool = True,
    dense_pass: bool = True,
) -> list[ShapeResult]:
    """Tune op over shapes into db. on_advance(n, label) reports n configs done.

    strategy: the search (tuner.search: "exhaustive" times every config fully; "halving"
    times every config quickly, then only the contenders fully; "guided" halves on the
    power-of-two batches and searches the others over their neighbours' leaders, for dense
    grids); halving=True is "halving".

    ranks (a torch.distributed job, every rank calling sweep with the same arguments and a
    DB they all reach): each shape's first rung is shared round robin; the ranks meet when
    it is measured, rank 0 runs the later rungs, re-times and stores the winner, they meet
    again, and every rank reads that one winner back.

    second_trial: a serving shape's winner (not the default) must hold again on a second
    trial of freshly drawn lengths (tuner.search.pipeline.confirm_again), else the default
    is stored; the method of the stored winner says how it went.

    dense_pass: for a serving shape of batch > 1 of an op with by_fill configs
    (decode_attention), once its winner W is known, a dense pass (_dense_pass) searches a
    config for its dense batches, which W keeps serving the rest of; a stored winner that
    has had none gets one (its record is replaced), as does one whose config the second
    trial refused when it asked for a gain (_dense_pass_due). Not in a distributed sweep.
    """
    unavailable = op.unavailable()
    if unavailable:
        raise TunerError(f"op {op.name} cannot run here: {unavailable}")
    strategy = get_strategy("halving" if halving else strategy)
    guide = strategy.guide() if hasattr(strategy, "guide") else None  # tuner.search.guided
    order = guide.order(shapes) if guide is not None else list(range(len(shapes)))
    device = op.device()
    timer = timer or timer_for("sweep-gpu" if device == "cuda" else "sweep-cpu", device)
    env = current_environment()
    method = dict(timer.method, device=device)
    advance = on_advance or (lambda n, label: None)
    results: list[ShapeResult] = []
    # shapes of one key (static key and run key) share one record, and one of them is swept:
    # a mixed-length one before full batches, and the longest, at its kv bucket's top (a
    # bucket bounds its calls' lengths)
    def preference(shape: DecodeShape) -> tuple[bool, int]:
        return shape.lengths != "full", shape.kv_len

    problems = [Problem(op.name, shape.static_key().to_json(), shape.run_key()) for shape in shapes]
    chosen: dict[Problem, DecodeShape] = {}
    for shape, problem in zip(shapes, problems):
        if problem not in chosen or preference(shape) > preference(chosen[problem]):
            chosen[problem] = shape
    swept: set[Problem] = set()
    # the dense passes' own anchors
    dense_guide = strategy.guide(across_kv=settings.GUIDED_ACROSS_KV) if guide is not None else None

    def wants_dense(shape: DecodeShape) -> bool:
        return dense_pass and ranks is None and op.by_fill is not None and shape.lengths == "serving" \
            and shape.batch > 1

    def run_dense(shape: DecodeShape, problem: Problem, winner: Config, default: Config, label: str):
        return _dense_pass(op, shape, problem, db, env, device, seed, winner, default, timer, strategy,
                           dense_guide, min_gain, method, force,
                           # the bar counts the mixes' measurements: a dense pass only names itself
                           lambda n: advance(0, f"{label} (dense pass)"))

    try:
        for shape, problem in ((shapes[i], problems[i]) for i in order):
            configs = candidate_configs(op, shape)
            if guide is not None:
                shortlist = guide.shortlist(shape, configs)
                advance(len(configs) - len(shortlist), shape.label())  # left out: decided, for the progress bar
                configs = shortlist
            label = shape.label()
            if problem in swept or shape != chosen[problem]:
                advance(len(configs), label)
                results.append(ShapeResult(shape, DUPLICATE, None, None, None, 0, 0, 0,
                                           note=f"same key as {chosen[problem].label()}"))
                continue
            swept.add(problem)
            stored_winner = None if force else db.record(problem, environment=env.data)  # one that applies here
            if stored_winner is not None:
                if guide is not None:
                    # which configs ran fast there, to shortlist for its neighbours: timings of a
                    # trial of fewer rounds say that too
                    rows = db.measurements(problem, env.id)
                    guide.record(shape, [_stored_outcome(m) for m in rows
                                         if m.method.get("lengths", "full") == shape.lengths], stored_winner.config)
                    if wants_dense(shape):
                        # and on dense batches, for the dense passes of its neighbours (timings of
                        # fewer rounds too, as above): without it, a resumed sweep's dense passes
                        # searched every candidate (H200, 32/4: 52 configs a key, against 12 in
                        # the process that ran the anchors' passes)
                        dense_guide.record(shape, _stored_dense_outcomes(
                            op, shape, stored_winner.config,
                            [m for m in rows if m.method.get("lengths") == DENSE_LENGTHS]))
                advance(len(configs), label)
                local = stored_winner.fingerprint_id == env.id
                if wants_dense(shape) and _dense_pass_due(stored_winner.method, local) \
                        and op.check(op.by_fill(stored_winner.config, stored_winner.config), shape) is None:
                    found, info = run_dense(shape, problem, stored_winner.config, stored_winner.default_config, label)
                    if found is not None:
                        config, timing, default_timing = found
                        db.save_winner(problem, env, config, timing, stored_winner.default_config, default_timing,
                                       method=dict(stored_winner.method, **info))
                        results.append(ShapeResult(shape, MEASURED, config, timing.median_us, default_timing.median_us,
                                                   0, 0, 0, note="a dense pass over its stored winner"))
                        continue
                    if local:  # one measured elsewhere is not copied as this one's
                        db.save_record(problem, env, stored_winner.config, median_us=stored_winner.median_us,
                                       spread_us=stored_winner.spread_us, samples=stored_winner.samples,
                                       default_config=stored_winner.default_config,
                                       default_median_us=stored_winner.default_median_us,
                                       default_spread_us=stored_winner.default_spread_us,
                                       method=dict(stored_winner.method, **info), created_at=stored_winner.created_at)
                results.append(ShapeResult(
                    shape, SKIPPED, stored_winner.config, stored_winner.median_us,
                    stored_winner.default_median_us, 0, 0, 0,
                ))
                continue
            # what measured this shape's kind of batch (a "serving" mix is not a full batch)
            lengths = _batches_of(shape, shape.lengths)
            stored = {} if force else {canonical_json(m.config): m for m in db.measurements(problem, env.id)
                                       if _timed_on(m.method, shape, shape.lengths)}
            try:
                trial = build_trial(op, shape, device, seed)
            except (RuntimeError, MemoryError) as e:  # too big for this device, or the reference failed
                boundary_sync()
                advance(len(configs), label)
                results.append(ShapeResult(shape, FAILED, None, None, None, 0, 0, 0, note=one_line(e)))
                continue

            def resume(config: Config) -> tuple[Outcome, int] | None:
                row = stored.get(canonical_json(config))
                return (_stored_outcome(row), row.rung) if row is not None else None

            # stored as they come where other ranks read them
            sink = MeasurementSink(db, problem, env, dict(method, **lengths), shape.kv_len, at_once=ranks is not None)
            boundary_sync(release=False)
            try:
                result = measure(
                    trial, configs, configs[0], timer, strategy=strategy, min_gain=min_gain, resume=resume,
                    record=sink.add, ranks=ranks,
                    gather=lambda cs, mine: _all_outcomes(db, problem, env.id, cs, mine, shape),
                    advance=lambda n: advance(n, label), keep_default_if_confirm_fails=True,
                )
            except BaseException:
                # what was measured stays stored when a later step fails or is interrupted; the
                # first error is the one raised (a DB that cannot take the write says so too)
                try:
                    sink.store()
                except TunerError as e:
                    warnings.warn(f"tuner: the measurements of {label} were not stored: {e}", stacklevel=2)
                raise
            sink.store()
            del trial  # free the device before the next shape's inputs
            boundary_sync(release=False)
            default = configs[0]
            winner, default_timing = result.winner, result.default_timing
            if guide is not None:  # from what every rank holds alike: the ranks' shortlists agree
                guide.record(shape, result.first_rung)
            again: dict[str, Any] = {}
            note = ""
            leader = ranks is None or ranks.rank == 0
            if (leader and second_trial and shape.lengths != "full" and winner is not None
                    and default_timing is not None and not same_config(winner.config, default)):
                checked = _second_trial(op, shape, device, seed, winner.config, default, timer, min_gain)
                again = {"second_trial": checked.as_method(seed + settings.SECOND_TRIAL_SEED)}
                if not checked.held:
                    note = f"kept the default: its winner did not hold on a second trial ({_how(checked)})"
                    winner = Outcome(default, OK, default_timing)
            dense: dict[str, Any] = {}
            if leader and winner is not None and default_timing is not None and wants_dense(shape):
                found, dense = run_dense(shape, problem, winner.config, default, label)
                if found is not None:
                    config, timing, default_timing = found
                    winner = Outcome(config, OK, timing)
                    note = "a dense pass: timed on its second trial"
            if leader and winner is not None:
                db.save_winner(problem, env, winner.config, winner.timing, default, default_timing,
                               method=dict(method, **lengths, min_gain=min_gain, ranks=ranks.world if ranks else 1,
                                           **again, **dense))
            if ranks is not None:  # every rank takes the one winner rank 0 stored
                ranks.barrier()
                record_ = db.record(problem, env.id)
                winner = Outcome(record_.config, OK, Timing(record_.median_us, record_.spread_us, record_.samples)) \
                    if record_ else None
                default_timing = Timing(record_.default_median_us, 0.0, 0) \
                    if record_ and record_.default_median_us is not None else None
            if winner is None:
                results.append(ShapeResult(shape, FAILED, None, None, None, result.measured, result.resumed,
                                           result.failures, note="no config ran right"))
                continue
            results.append(ShapeResult(
                shape, MEASURED, winner.config, winner.timing.median_us,
                default_timing and default_timing.median_us, result.measured, result.resumed, result.failures,
                note=note,
            ))
    except KeyboardInterrupt:
        # each finished shape's winner is stored, and the measurements of the one in flight:
        # say which shapes are done, for the caller to show (the same sweep resumes the rest)
        by_index = dict(zip(order, results))
        finished = {problems[i] for i, r in by_index.items() if r.status != DUPLICATE}
        # a duplicate of a key still in flight is not done
        done = [r for i, r in sorted(by_index.items()) if r.status != DUPLICATE or problems[i] in finished]
        raise SweepInterrupted(done, len(shapes)) from None
    by_index = dict(zip(order, results))
    return [by_index[i] for i in range(len(shapes))]


def _dense_pass(op: Op, shape: DecodeShape, problem: Problem, db: TuningDB, env: Any, device: str, seed: int,
                winner: Config, default: Config, timer: Any, strategy: Any, guide: Any, min_gain: float,
                method: dict[str, Any], force: bool, advance: Callable[[int], None]
                ) -> tuple[tuple[Config, Timing, Timing] | None, dict[str, Any]]:
    """A serving shape's dense pass over its winner W. Each candidate C is measured as
    by_fill(C, W) on dense batches alone (tuner.ops.trial.build_dense_trial), the search and
    the winner rule as a sweep's, with by_fill(W, W) as the default to beat: on the H200 an
    even-split Triton config won a bucket's dense batches by 1.32x and lost on its skewed
    ones, where one config per key kept FA3's default. A winner by_fill(D, W) must then
    hold against the library default on the shape's second trial (a mix of every
    distribution, freshly drawn), whose timings it is stored with: lose to it nowhere, by
    more than the noise on the mix or settings.MAX_PART_LOSS on a batch. No gain is asked
    there (so the stored mix timings may show it level with the default, or just behind
    within the noise): D's gain was established on the dense batches, and the mix's other
    batches run W, so the mix dilutes it (on the H200 a record whose dense part ran 1.35x of FA3's
    default on serving.py's dense batch gained 1.024x on one round of the mix and did not
    pass the winner rule on two, and gave way to the default). Returns (config, its timing,
    the default's) or None (W stays), and what the record's method says of it.
    Measurements are stored (lengths DENSE_LENGTHS) and resumed like a mix's."""
    every = candidate_configs(op, shape)
    configs = guide.shortlist(shape, every) if guide is not None else every
    baseline = op.by_fill(winner, winner)
    candidates = [baseline] + [op.by_fill(c, winner) for c in configs if not same_config(c, winner)]
    stored = {} if force else {canonical_json(m.config): m for m in db.measurements(problem, env.id)
                               if _timed_on(m.method, shape, DENSE_LENGTHS)}
    try:
        trial = build_dense_trial(op, shape, device, seed)
    except (RuntimeError, MemoryError) as e:
        return None, {"dense_pass": {"error": one_line(e)}}
    sink = MeasurementSink(db, problem, env, dict(method, **_batches_of(shape, DENSE_LENGTHS)), shape.kv_len)

    def resume(config: Config) -> tuple[Outcome, int] | None:
        row = stored.get(canonical_json(config))
        return (_stored_outcome(row), row.rung) if row is not None else None

    boundary_sync(release=False)
    try:
        result = measure(trial, candidates, baseline, timer, strategy=strategy, min_gain=min_gain, resume=resume,
                         record=sink.add, advance=advance, keep_default_if_confirm_fails=True)
    finally:
        sink.store()
    del trial
    boundary_sync(release=False)
    if guide is not None:  # its anchors' leaders, as plain configs (a shortlist's currency)
        plain = {canonical_json(op.by_fill(c, winner)): c for c in configs}
        # the winner too, always searched (the baseline), where the shortlist did not hold it:
        # an anchor's shortlist hands it on to the next kv length's
        plain.setdefault(canonical_json(baseline), winner)
        guide.record(shape, [dataclasses.replace(o, config=plain[canonical_json(o.config)])
                             for o in result.first_rung if canonical_json(o.config) in plain])
    found = result.winner
    info: dict[str, Any] = dict(seed=seed + settings.DENSE_TRIAL_SEED, measured=result.measured,
                                resumed=result.resumed, **_rounds(shape))
    if len(configs) < len(every):  # what a replay (benchmarks/dense_guide_replay.py) leaves out
        info.update(shortlisted=len(configs), candidates=len(every))
    if found is None or same_config(found.config, baseline) or result.default_timing is None:
        return None, {"dense_pass": dict(info, kept=True)}
    info.update(dense_us=round(found.timing.median_us, 3), winner_on_dense_us=round(result.default_timing.median_us, 3))
    checked = _second_trial(op, shape, device, seed, found.config, default, timer, min_gain, must_gain=False)
    info.update(second_trial=checked.as_method(seed + settings.SECOND_TRIAL_SEED), rule=DENSE_RULE)
    if not checked.held:  # (kept: the winner W stays alone, no by_fill config)
        return None, {"dense_pass": dict(info, kept=True)}
    return (found.config, checked.winner, checked.default), {"dense_pass": dict(info, kept=False)}


def _stored_dense_outcomes(op: Op, shape: DecodeShape, stored: Config, rows: list[MeasurementRow]) -> list[Outcome]:
    """A stored dense pass's outcomes as plain configs, a guide's currency: its measurements
    are of by_fill(C, W), W the winner it ran beside: the stored config, or the one a stored
    by_fill(D, W) runs beside D (rows beside another W, of a sweep before, are not its
    pass's); none where no candidate is W."""
    configs = candidate_configs(op, shape)
    measured = {canonical_json(m.config): m for m in rows}
    key = canonical_json(stored)
    baselines = [w for w in configs if canonical_json(op.by_fill(w, w)) in measured]  # a pass's W each
    beside = next((w for w in baselines if canonical_json(w) == key
                   or any(canonical_json(op.by_fill(d, w)) == key for d in configs)), None)
    if beside is None:
        return []
    return [dataclasses.replace(_stored_outcome(m), config=c) for c in configs
            if (m := measured.get(canonical_json(op.by_fill(c, beside)))) is not None]


DENSE_RULE = "loses nowhere"  # what a dense pass's second trial asks (its info says so since it asks no gain)


def _dense_pass_due(method: dict[str, Any], local: bool) -> bool:
    """Whether a stored winner gets a dense pass: none yet, or, for one measured here (local:
    a pass that refuses again stores its info only there, so another's would run on every
    sweep), one whose config its second trial refused when that still asked for the winner
    rule's gain (its info names no rule). Where its dense trial's measurements are stored
    they are resumed, and such a pass costs about a second trial."""
    info = method.get("dense_pass")
    if info is None:
        return True
    checked = info.get("second_trial") or {}
    return local and checked.get("held") is False and not checked.get("error") and info.get("rule") != DENSE_RULE


def _second_trial(op: Op, shape: DecodeShape, device: str, seed: int, config: Config, default: Config,
                  timer: Any, min_gain: float, must_gain: bool = True) -> SecondTrial:
    """config against the default on the shape's second trial (its own draws of lengths, one
    batch at the bucket's top; pipeline.confirm_again's rule), built once the first is
    freed; one that cannot be built does not hold."""
    try:
        trial = build_second_trial(op, shape, device, seed)
    except (RuntimeError, MemoryError) as e:
        return SecondTrial(False, error=one_line(e))
    boundary_sync(release=False)
    return confirm_again(trial, config, default, timer, min_gain=min_gain, must_gain=must_gain)


def _how(checked: SecondTrial) -> str:
    if checked.error:
        return checked.error
    return f"{checked.default.median_us / checked.winner.median_us:.3f}x of the default on its mix"


def _all_outcomes(db: TuningDB, problem: Problem, fp_id: str, configs: list[Config],
                  mine: list[Outcome], shape: DecodeShape) -> list[Outcome]:
    """Every config's outcome: this rank's own, the others' as they stored them (on this
    shape's kind of batch)."""
    own = {canonical_json(o.config): o for o in mine}
    rows = {canonical_json(m.config): m for m in db.measurements(problem, fp_id)
            if _timed_on(m.method, shape, shape.lengths)}
    out = []
    for config in configs:
        key = canonical_json(config)
        if key in own:
            out.append(own[key])
        elif key in rows:
            out.append(_stored_outcome(rows[key]))
        else:
            out.append(Outcome(config, "error", None, None, "not measured: its rank stored nothing"))
    return out
