"""One shape's turn in a sweep: measured anew, or its stored winner kept (with a dense pass where due)."""

from __future__ import annotations

from typing import Any

from tuner import settings
from tuner.bench import OK, Outcome, Timing, boundary_sync, one_line, same_config
from tuner.db import Problem, Record
from tuner.keys import canonical_json
from tuner.ops import Config
from tuner.search.pipeline import Measured, SecondTrial, measure
from tuner.sweep.context import SweepRun
from tuner.bench.runner import is_sticky_cuda_error
from tuner.sweep.flight import end_if_lost
from tuner.sweep.dense import DENSE_LENGTHS, dense_pass, dense_pass_due, stored_dense_outcomes
from tuner.sweep.results import FAILED, MEASURED, SKIPPED, ShapeResult
from tuner.sweep.sink import MeasurementSink, stored_outcome, timed_on
from tuner.sweep.trials import build_trial, on_second_trial
from tuner.workload import DecodeShape


def measure_shape(run: SweepRun, shape: DecodeShape, problem: Problem, configs: list[Config],
                  label: str) -> ShapeResult:
    """Measure shape's configs (the default first) on its trial, resuming stored measurements;
    the leader confirms the winner (_confirm) and stores it, and every rank reports that one."""
    options = run.options
    # stored as they come where other ranks read them
    sink = MeasurementSink.resuming(run.db, problem, run.env, run.method, shape, shape.lengths, force=options.force,
                                    at_once=options.ranks is not None, flight=options.flight, run_id=options.run_id)
    trial, why = _trial(run, shape)
    if why is not None:
        boundary_sync()
        run.advance(len(configs), label)
        return ShapeResult(shape, FAILED, None, None, None, 0, 0, 0, note=why)
    boundary_sync(release=False)
    with sink:
        result = measure(
            trial, configs, configs[0], run.timer, strategy=run.strategy, min_gain=options.min_gain,
            resume=sink.resume, record=sink.add, starting=sink.starting, precompiling=sink.precompiling, ranks=options.ranks,
            gather=lambda cs, mine: _all_outcomes(run, problem, cs, mine, shape),
            advance=lambda n: run.advance(n, label), keep_default_if_confirm_fails=True,
        )
    guarded = guard_info(shape, trial)
    del trial  # free the device before the next shape's inputs
    boundary_sync(release=False)
    if run.guide is not None:  # from what every rank holds alike: the ranks' shortlists agree
        run.guide.record(shape, result.first_rung)
    default = configs[0]
    winner, default_timing, info, note = _confirm(run, shape, problem, default, result, label, sink.method)
    if run.leader and winner is not None:
        run.db.save_winner(problem, run.env, winner.config, winner.timing, default, default_timing,
                           method=dict(sink.method, min_gain=options.min_gain,
                                       ranks=options.ranks.world if options.ranks else 1, **guarded, **info))
    if options.ranks is not None:  # every rank takes the one winner rank 0 stored
        winner, default_timing = _stored_winner(run, problem, stored=run.leader and winner is not None)
    if winner is None:
        return ShapeResult(shape, FAILED, None, None, None, result.measured, result.resumed, result.failures,
                           note="no config ran right")
    return ShapeResult(shape, MEASURED, winner.config, winner.timing.median_us,
                       default_timing and default_timing.median_us, result.measured, result.resumed,
                       result.failures, note=note)


def _trial(run: SweepRun, shape: DecodeShape) -> tuple[Any, str | None]:
    """shape's trial, or None and why not: too big for this device, or its reference failed.
    Under ranks, none where any rank has none (free memory differs between GPUs): the ranks
    go on to the next shape together, as their collectives need."""
    try:
        trial, why = build_trial(run.op, shape, run.device, run.options.seed), None
    except (RuntimeError, MemoryError) as e:
        trial, why = None, one_line(e)
        # a lost CUDA context (in the reference, say) ends the worker, or with no supervisor the
        # sweep: every later shape would fail alike
        if run.options.flight is not None and is_sticky_cuda_error(why):
            run.options.flight.landed(why)
        end_if_lost(why)
    ranks = run.options.ranks
    if ranks is not None and ranks.any(trial is None) and trial is not None:
        trial, why = None, "another rank could not build its trial"
    return trial, why


def guard_info(shape: DecodeShape, trial: Any) -> dict[str, Any]:
    """What a record says of its first trial's guard (tuner.sweep.trials.build_trial): the
    length of its equal batch, or None where a serving trial had none (it did not fit, or a
    batch of one); nothing for other shapes. Records without the key predate the guard."""
    if shape.lengths != "serving" or shape.batch <= 1:
        return {}
    return {"equal_guard": trial.guards[0].lengths[0] if trial.guards else None}


def _confirm(run: SweepRun, shape: DecodeShape, problem: Problem, default: Config, result: Measured,
             label: str, method: dict[str, Any]) -> tuple[Outcome | None, Timing | None, dict[str, Any], str]:
    """The leader's winner, the default's timing, what the record's method says of them and a
    note: a serving winner must hold on a second trial (else the default stays), and may
    then get a dense pass."""
    winner, default_timing = result.winner, result.default_timing
    if not run.leader or winner is None or default_timing is None:
        return winner, default_timing, {}, ""
    info: dict[str, Any] = {}
    note = ""
    if run.options.second_trial and shape.lengths != "full" and not same_config(winner.config, default):
        seed = run.options.seed
        flight = run.options.flight
        # fresh lengths: a config that faults on them is refused for the shape
        journal = None if flight is None else \
            (lambda config: flight.running(problem, run.env, method, shape.kv_len, config, label))
        checked = on_second_trial(run.op, shape, run.device, seed, winner.config, default, run.timer,
                                  run.options.min_gain, starting=journal)
        if flight is not None:
            flight.landed(checked.error)
        else:
            end_if_lost(checked.error)
        info["second_trial"] = checked.as_method(seed + settings.SECOND_TRIAL_SEED)
        if not checked.held:
            note = f"kept the default: its winner did not hold on a second trial ({_how(checked)})"
            winner = Outcome(default, OK, default_timing)
    if run.wants_dense(shape):
        found, dense = dense_pass(run, shape, problem, winner.config, default, label)
        info.update(dense)
        if found is not None:
            config, timing, default_timing = found
            winner = Outcome(config, OK, timing)
            note = "a dense pass: timed on its second trial"
    return winner, default_timing, info, note


def _stored_winner(run: SweepRun, problem: Problem, stored: bool) -> tuple[Outcome | None, Timing | None]:
    """The winner rank 0 stored (stored: rank 0's word; the others' is not heard), and its
    default's timing, read once every rank is here; none where it stored none (a --force
    sweep's record from before, still in the DB, is not this sweep's winner)."""
    if not run.options.ranks.broadcast(int(stored)):
        return None, None
    record = run.db.record(problem, run.env.id)
    if record is None:
        return None, None
    default_timing = Timing(record.default_median_us, 0.0, 0) if record.default_median_us is not None else None
    return Outcome(record.config, OK, Timing(record.median_us, record.spread_us, record.samples)), default_timing


def _how(checked: SecondTrial) -> str:
    if checked.error:
        return checked.error
    return f"{checked.default.median_us / checked.winner.median_us:.3f}x of the default on its mix"


def _all_outcomes(run: SweepRun, problem: Problem, configs: list[Config], mine: list[Outcome],
                  shape: DecodeShape) -> list[Outcome]:
    """Every config's outcome: this rank's own, the others' as they stored them (on this
    shape's kind of batch)."""
    own = {canonical_json(o.config): o for o in mine}
    rows = {canonical_json(m.config): m for m in run.db.measurements(problem, run.env.id)
            if timed_on(m.method, shape, shape.lengths)}
    out = []
    for config in configs:
        key = canonical_json(config)
        if key in own:
            out.append(own[key])
        elif key in rows:
            out.append(stored_outcome(rows[key]))
        else:
            out.append(Outcome(config, "error", None, None, "not measured: its rank stored nothing"))
    return out


def keep_stored(run: SweepRun, shape: DecodeShape, problem: Problem, stored: Record, configs: list[Config],
                label: str) -> ShapeResult:
    """A shape whose winner is stored: the guides learn from it, and it gets a dense pass
    where one is due (dense_pass_due); a pass that finds a config stores a new winner."""
    op = run.op
    if run.guide is not None:
        _teach_guides(run, shape, problem, stored)
    run.advance(len(configs), label)
    local = stored.fingerprint_id == run.env.id
    if run.wants_dense(shape) and dense_pass_due(stored.method, local) \
            and op.check(op.by_fill(stored.config, stored.config), shape) is None:
        found, info = dense_pass(run, shape, problem, stored.config, stored.default_config, label)
        if found is not None:
            config, timing, default_timing = found
            run.db.save_winner(problem, run.env, config, timing, stored.default_config, default_timing,
                               method=dict(stored.method, **info))
            return ShapeResult(shape, MEASURED, config, timing.median_us, default_timing.median_us, 0, 0, 0,
                               note="a dense pass over its stored winner")
        if local:  # one measured elsewhere is not copied as this one's
            run.db.save_record(problem, run.env, stored.config, median_us=stored.median_us,
                               spread_us=stored.spread_us, samples=stored.samples,
                               default_config=stored.default_config, default_median_us=stored.default_median_us,
                               default_spread_us=stored.default_spread_us, method=dict(stored.method, **info),
                               created_at=stored.created_at)
    return ShapeResult(shape, SKIPPED, stored.config, stored.median_us, stored.default_median_us, 0, 0, 0)


def _teach_guides(run: SweepRun, shape: DecodeShape, problem: Problem, stored: Record) -> None:
    """Which configs ran fast for a stored winner, to shortlist for its neighbours: its mix's
    and its dense pass's stored measurements (timings of a trial of fewer rounds say that too).
    Without the dense ones a resumed sweep's dense passes searched every candidate
    (docs/decisions.md, "Search")."""
    rows = run.db.measurements(problem, run.env.id)
    run.guide.record(shape, [stored_outcome(m) for m in rows if m.method.get("lengths", "full") == shape.lengths],
                     stored.config)
    if run.wants_dense(shape):
        run.dense_guide.record(shape, stored_dense_outcomes(
            run.op, shape, stored.config, [m for m in rows if m.method.get("lengths") == DENSE_LENGTHS]))
