"""The dense pass: a serving shape's second config, for its dense batches, searched beside its winner."""

from __future__ import annotations

import dataclasses
from typing import Any

from tuner import settings
from tuner.bench import Outcome, Timing, boundary_sync, one_line, same_config
from tuner.db import MeasurementRow, Problem
from tuner.keys import canonical_json
from tuner.ops import Config, Op
from tuner.search import ShapeGuide
from tuner.search.pipeline import Measured, measure
from tuner.sweep.context import SweepRun
from tuner.sweep.plan import candidate_configs
from tuner.sweep.sink import MeasurementSink, rounds, stored_outcome
from tuner.sweep.trials import build_dense_trial, on_second_trial
from tuner.workload import DecodeShape

# the method's lengths of a dense pass's measurements (each a by_fill config over the shape's
# winner, timed on the dense batches alone), kept apart from the mix's
DENSE_LENGTHS = "serving-dense"
DENSE_RULE = "loses nowhere"  # what a dense pass's second trial asks (its info says so since it asks no gain)

# (config, its timing, the default's) of a dense pass's winner, or None (W stays); its record's info
DensePass = tuple[tuple[Config, Timing, Timing] | None, dict[str, Any]]


def dense_pass(run: SweepRun, shape: DecodeShape, problem: Problem, winner: Config, default: Config,
               label: str) -> DensePass:
    """A serving shape's dense pass over its winner W (docs/decisions.md, "Dense pass"). Each
    candidate C is measured as by_fill(C, W) on dense batches alone (build_dense_trial), the
    search and the winner rule as a sweep's, with by_fill(W, W) as the default to beat. A
    winner by_fill(D, W) must then hold against the library default on the shape's second
    trial, where it need only lose nowhere (DENSE_RULE): D's gain was established on the dense
    batches, and the mix's other batches run W. Measurements are stored (lengths DENSE_LENGTHS)
    and resumed like a mix's."""
    op, guide = run.op, run.dense_guide
    every = candidate_configs(op, shape)
    configs = guide.shortlist(shape, every) if guide is not None else every
    baseline = op.by_fill(winner, winner)
    candidates = [baseline] + [op.by_fill(c, winner) for c in configs if not same_config(c, winner)]
    sink = MeasurementSink.resuming(run.db, problem, run.env, run.method, shape, DENSE_LENGTHS,
                                    force=run.options.force, flight=run.options.flight, run_id=run.options.run_id)
    try:
        trial = build_dense_trial(op, shape, run.device, run.options.seed)
    except (RuntimeError, MemoryError) as e:
        sink.landed(one_line(e))  # a lost CUDA context ends the worker (or the sweep)
        return None, {"dense_pass": {"error": one_line(e)}}
    boundary_sync(release=False)
    with sink:
        # the progress bar counts the mixes' measurements: a dense pass only names itself
        result = measure(trial, candidates, baseline, run.timer, strategy=run.strategy,
                         min_gain=run.options.min_gain, resume=sink.resume, record=sink.add,
                         starting=sink.starting, precompiling=sink.precompiling, advance=lambda n: run.advance(0, f"{label} (dense pass)"),
                         keep_default_if_confirm_fails=True)
    del trial
    boundary_sync(release=False)
    if guide is not None:
        _teach(guide, op, shape, winner, baseline, configs, result)
    info: dict[str, Any] = dict(seed=run.options.seed + settings.DENSE_TRIAL_SEED, measured=result.measured,
                                resumed=result.resumed, **rounds(shape))
    if len(configs) < len(every):  # what the guide's shortlist left out
        info.update(shortlisted=len(configs), candidates=len(every))
    return _decide(run, shape, default, baseline, result, info, sink)


def _teach(guide: ShapeGuide, op: Op, shape: DecodeShape, winner: Config, baseline: Config,
           configs: list[Config], result: Measured) -> None:
    """Record a pass's first rung in the dense guide, as plain configs (a shortlist's currency);
    the winner too (the baseline, always searched), which an anchor's shortlist hands on to
    the next kv length's."""
    plain = {canonical_json(op.by_fill(c, winner)): c for c in configs}
    plain.setdefault(canonical_json(baseline), winner)
    guide.record(shape, [dataclasses.replace(o, config=plain[canonical_json(o.config)])
                         for o in result.first_rung if canonical_json(o.config) in plain])


def _decide(run: SweepRun, shape: DecodeShape, default: Config, baseline: Config, result: Measured,
            info: dict[str, Any], sink: MeasurementSink) -> DensePass:
    """The pass's winner where it beat W on the dense batches and loses nowhere to the default
    on the second trial; else W stays (kept). A winner that faults there is refused among the
    pass's measurements (sink's), so the pass that resumes after it never picks it again."""
    found = result.winner
    if found is None or same_config(found.config, baseline) or result.default_timing is None:
        return None, {"dense_pass": dict(info, kept=True)}
    info.update(dense_us=round(found.timing.median_us, 3), winner_on_dense_us=round(result.default_timing.median_us, 3))
    seed = run.options.seed
    checked = on_second_trial(run.op, shape, run.device, seed, found.config, default, run.timer,
                              run.options.min_gain, must_gain=False, starting=sink.running)
    sink.landed(checked.error)
    info.update(second_trial=checked.as_method(seed + settings.SECOND_TRIAL_SEED), rule=DENSE_RULE)
    if not checked.held:  # (kept: the winner W stays alone, no by_fill config)
        return None, {"dense_pass": dict(info, kept=True)}
    return (found.config, checked.winner, checked.default), {"dense_pass": dict(info, kept=False)}


def stored_dense_outcomes(op: Op, shape: DecodeShape, stored: Config, rows: list[MeasurementRow]) -> list[Outcome]:
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
    return [dataclasses.replace(stored_outcome(m), config=c) for c in configs
            if (m := measured.get(canonical_json(op.by_fill(c, beside)))) is not None]


def dense_pass_due(method: dict[str, Any], local: bool) -> bool:
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
