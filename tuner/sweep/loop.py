"""The sweep loop: every shape in the strategy's order, each once per key, stored winners kept, an interruption reported."""

from __future__ import annotations

from typing import Any, Callable

from tuner import settings
from tuner.db import Problem, Record, TuningDB
from tuner.ops import Op
from tuner.ranks import Ranks
from tuner.search import DEFAULT_STRATEGY
from tuner.sweep.context import SweepOptions, SweepRun
from tuner.sweep.flight import Flight
from tuner.sweep.measure import keep_stored, measure_shape
from tuner.sweep.plan import candidate_configs, chosen_per_key, problems_of
from tuner.sweep.results import DUPLICATE, ShapeResult, SweepInterrupted
from tuner.workload import DecodeShape


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
    flight: Flight | None = None,
    run_id: str | None = None,
) -> list[ShapeResult]:
    """Tune op over shapes into db, a result per shape in their order. on_advance(n, label)
    reports n configs done. force: measure again what db holds.

    strategy: the search by name (tuner.search; halving=True is "halving"). ranks (a
    torch.distributed job, every rank calling sweep with the same arguments and a DB they all
    reach): each shape's first rung is shared round robin, rank 0 runs the later rungs and
    stores the winner, and every rank reads that one winner back. second_trial: a serving
    shape's winner (not the default) must hold again on a second trial of freshly drawn
    lengths, else the default is stored. dense_pass: a serving shape of batch > 1 of an op
    with by_fill configs gets a second config for its dense batches (tuner.sweep.dense), as
    does a stored winner that has had none; not in a distributed sweep. flight: where a
    supervisor reads what was in flight should this process die (tuner.sweep.guard); run_id:
    the supervised run this process belongs to, whose own measurements and winners a force
    sweep resumes after a restart (what the DB held before the run it measures again)."""
    options = SweepOptions(timer=timer, force=force, min_gain=min_gain, seed=seed, strategy=strategy,
                           halving=halving, on_advance=on_advance, ranks=ranks, second_trial=second_trial,
                           dense_pass=dense_pass, flight=flight, run_id=run_id)
    return sweep_with(op, shapes, db, options)


def sweep_with(op: Op, shapes: list[DecodeShape], db: TuningDB, options: SweepOptions) -> list[ShapeResult]:
    """sweep(), its options given as one. SweepInterrupted on Ctrl-C (or SIGINT at a deadline):
    each finished shape's winner is stored, and the measurements of the one in flight."""
    run = SweepRun.start(op, db, options)
    order = run.guide.order(shapes) if run.guide is not None else list(range(len(shapes)))
    problems = problems_of(op, shapes)
    chosen = chosen_per_key(shapes, problems)
    swept: set[Problem] = set()
    results: list[ShapeResult] = []
    try:
        for i in order:
            results.append(_one_shape(run, shapes[i], problems[i], chosen, swept))
    except KeyboardInterrupt:
        raise _interrupted(order, results, problems) from None
    by_index = dict(zip(order, results))
    return [by_index[i] for i in range(len(shapes))]


def _one_shape(run: SweepRun, shape: DecodeShape, problem: Problem, chosen: dict[Problem, DecodeShape],
               swept: set[Problem]) -> ShapeResult:
    """shape's result: a duplicate of its key's chosen shape, its stored winner, or measured."""
    configs = candidate_configs(run.op, shape)
    if run.guide is not None:
        shortlist = run.guide.shortlist(shape, configs)
        run.advance(len(configs) - len(shortlist), shape.label())  # left out: decided, for the progress bar
        configs = shortlist
    label = shape.label()
    if problem in swept or shape != chosen[problem]:
        run.advance(len(configs), label)
        return ShapeResult(shape, DUPLICATE, None, None, None, 0, 0, 0, note=f"same key as {chosen[problem].label()}")
    swept.add(problem)
    stored = run.db.record(problem, environment=run.env.data)  # one that applies here
    if run.options.force and not this_run(run, stored):
        stored = None
    if stored is not None:
        return keep_stored(run, shape, problem, stored, configs, label)
    return measure_shape(run, shape, problem, configs, label)


def this_run(run: SweepRun, record: Record | None) -> bool:
    """Whether a stored winner was made by this supervised run (before its worker restarted)."""
    return record is not None and run.options.run_id is not None \
        and record.method.get("sweep_run") == run.options.run_id


def _interrupted(order: list[int], results: list[ShapeResult], problems: list[Problem]) -> SweepInterrupted:
    """The shapes finished, in the order given; a duplicate of a key still in flight is not done."""
    by_index = dict(zip(order, results))
    finished = {problems[i] for i, r in by_index.items() if r.status != DUPLICATE}
    done = [r for i, r in sorted(by_index.items()) if r.status != DUPLICATE or problems[i] in finished]
    return SweepInterrupted(done, len(problems))
