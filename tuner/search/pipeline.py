"""The one measuring pipeline: a trial's candidate configs measured as a search strategy
says (each checked against the reference before it is timed), then the winner confirmed
against the default side by side (tuner.bench.decide). Sweeps, tune mode and the
verification of shipped winners all run through it; what they store, and where, is theirs
(the callbacks below), so this module knows no DB.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tuner import settings
from tuner.bench import (ERROR, OK, WRONG, Outcome, Timer, Timing, beats, check_config, decide, measure_config, one_line,
                         same_config, side_by_side)
from tuner.bench.runner import guards_problem, is_sticky_cuda_error, rotation
from tuner.bench.trial import Trial
from tuner.ranks import Ranks
from tuner.search import DEFAULT_STRATEGY, get_strategy
from tuner.search.base import Config, Step, Strategy
from tuner.keys import canonical_json


@dataclass
class Measured:
    """What the pipeline did: every outcome the winner was chosen from, the winner (None:
    nothing ran right) and the default's timing from the confirming run, and how many
    measurements were made here or resumed from earlier ones."""

    outcomes: list[Outcome] = field(default_factory=list)
    first_rung: list[Outcome] = field(default_factory=list)  # every rank's alike (gathered)
    winner: Outcome | None = None
    default_timing: Timing | None = None
    measured: int = 0
    resumed: int = 0

    @property
    def failures(self) -> int:
        return sum(o.status != OK for o in self.outcomes)


# a stored measurement of a config: (outcome, the rung it was measured at), or None
Resume = Callable[[Config], tuple[Outcome, int] | None]
# store one measurement: (step, outcome)
Record = Callable[[Step, Outcome], None]
# the outcomes of every config of the first rung, the other ranks' included (their stored ones)
Gather = Callable[[list[Config], list[Outcome]], list[Outcome]]


def measure(
    trial: Trial,
    configs: list[Config],
    default: Config,
    timer: Timer,
    *,
    strategy: str | Strategy = DEFAULT_STRATEGY,
    min_gain: float = settings.MIN_GAIN,
    resume: Resume | None = None,
    record: Record | None = None,
    ranks: Ranks | None = None,
    gather: Gather | None = None,
    advance: Callable[[int], None] | None = None,
    decide_winner: bool = True,
    keep_default_if_confirm_fails: bool = False,
    starting: Callable[[Step], None] | None = None,
    precompiling: Callable[[], None] | None = None,
) -> Measured:
    """Measure `configs` (the default first) on `trial` as `strategy` says and choose the
    winner. resume: a stored measurement to reuse instead (of its rung or a later one);
    record: store each new one; ranks (with gather): the first rung shared round robin, the
    later rungs and the choice on rank 0 only (decide_winner False: no choice here).
    advance(n): n first-rung steps done, for a progress bar. starting(step): told before a
    step's config runs (a sweep's flight recorder, tuner.sweep.flight); precompiling(): before
    the first rung's configs are built ahead, likewise. keep_default_if_confirm_fails:
    a side-by-side re-timing that fails (out of memory, say) keeps the default as the winner,
    for a sweep that moves on to its next shape; otherwise its error propagates (tune mode
    stores nothing then, and tries the key again)."""
    strategy = get_strategy(strategy) if isinstance(strategy, str) else strategy
    runner = _StepRunner(trial, timer, resume, record, starting)
    runner.default = default
    first = strategy.first(configs, timer)
    _precompile_mine(trial, first, ranks, resume, precompiling)
    outcomes = _first_rung(first, runner.run, ranks, gather, advance)
    result = Measured(first_rung=list(outcomes))
    leader = ranks is None or ranks.rank == 0
    if leader:
        outcomes = _later_rungs(strategy, outcomes, default, timer, max((s.rung for s in first), default=1), runner.run)
    result.outcomes = outcomes
    result.measured, result.resumed = len(runner.measured_now), len(runner.resumed - runner.measured_now)
    if leader and decide_winner:
        try:
            result.winner, result.default_timing = decide(trial.runs, outcomes, default, timer=timer,
                                                          min_gain=min_gain, parts=trial.parts,
                                                          guards=trial.guards, guard_problem=runner.guards_problem,
                                                          confirming=runner.confirming)
        except (RuntimeError, MemoryError) as e:
            runner.lost_context(e)
            if not keep_default_if_confirm_fails:
                raise
            _keep_default(result, default)
    return result


class _StepRunner:
    """Runs one search step of a trial (or hands back its stored measurement) and checks a
    config on the trial's guards, keeping count of what was measured here and resumed."""

    def __init__(self, trial: Trial, timer: Timer, resume: Resume | None, record: Record | None,
                 starting: Callable[[Step], None] | None) -> None:
        self.trial, self.timer, self.resume, self.record, self.starting = trial, timer, resume, record, starting
        self.measured_now: set[str] = set()
        self.resumed: set[str] = set()
        self._in_flight: Step | None = None  # the config run outside a measurement, last told
        self.default: Config | None = None  # run on the guards before any challenger is (guards_problem)

    def run(self, step: Step) -> Outcome:
        key = canonical_json(step.config)
        stored = self.resume(step.config) if self.resume is not None else None
        if stored is not None and stored[1] >= step.rung:
            self.resumed.add(key)
            return stored[0]
        if self.starting is not None:
            self.starting(step)
        trial = self.trial
        outcome = measure_config(trial.runs, step.config, reference=trial.reference, tolerance=trial.tolerance,
                                 timer=step.timer, checks=trial.checks)
        if self.record is not None:
            self.record(step, outcome)
        self.measured_now.add(key)
        return outcome

    def guards_problem(self, config: Config) -> str | None:
        """guards_problem, the flight recorder told first (the guards' lengths are new to the
        config). The default runs there first, alone, so that a fault on its first run of
        them is blamed on it. An error that lost the CUDA context propagates, for measure to
        record it as the config's (lost_context)."""
        if self.default is not None:
            default, self.default = self.default, None
            self.confirming(default)
            guards_problem(default, self.trial.guards, self.trial.tolerance)
        self.confirming(config)
        return guards_problem(config, self.trial.guards, self.trial.tolerance)

    def confirming(self, config: Config) -> None:
        """Before config runs outside a measurement (on the guards, or re-timed against the
        default): the flight recorder told, so that a fault there is blamed on config."""
        self._in_flight = Step(config, self.timer, 0)
        if self.starting is not None:
            self.starting(self._in_flight)

    def lost_context(self, error: BaseException) -> None:
        """Where error lost the CUDA context, it is recorded as the error of the config last
        run outside a measurement (a sweep's sink then ends the worker; every later config
        would fail alike); otherwise nothing."""
        step = self._in_flight
        if self.record is not None and step is not None and is_sticky_cuda_error(str(error)):
            self.record(step, Outcome(step.config, ERROR, error=one_line(error)))


def _later_rungs(strategy: Strategy, outcomes: list[Outcome], default: Config, timer: Timer, rung: int,
                 run: Callable[[Step], Outcome]) -> list[Outcome]:
    """The strategy's later rungs after the first's outcomes, until it asks for none: each
    replaces what it measured again; what failed stays in (counted once)."""
    while True:
        steps = strategy.then(outcomes, default, timer, rung)
        if not steps:
            return outcomes
        outcomes = [run(s) for s in steps] + [o for o in outcomes if o.status != OK]
        rung = max(s.rung for s in steps)


def _precompile_mine(trial: Trial, first: list[Step], ranks: Ranks | None, resume: Resume | None,
                     precompiling: Callable[[], None] | None = None) -> None:
    """Build this rank's share of the first rung ahead, what no stored measurement covers
    (the later rungs' find Triton's disk cache); precompiling() told first, where any is to
    be built."""
    if trial.precompile is None or not settings.precompile_enabled():
        return
    configs = [s.config for i, s in enumerate(first) if (ranks is None or ranks.mine(i))
               and (resume is None or resume(s.config) is None)]
    if not configs:
        return
    if precompiling is not None:
        precompiling()
    try:
        trial.precompile(configs)
    except Exception:  # best effort: a config that cannot be built fails when it runs
        pass


def _first_rung(first: list[Step], run: Callable[[Step], Outcome], ranks: Ranks | None, gather: Gather | None,
                advance: Callable[[int], None] | None) -> list[Outcome]:
    """Every first-rung step's outcome: this rank's share run here, the others' gathered."""
    outcomes = []
    for i, step in enumerate(first):
        if ranks is None or ranks.mine(i):
            outcomes.append(run(step))
        if advance is not None:
            advance(1)
    if ranks is not None and gather is not None:
        ranks.barrier()
        outcomes = gather([s.config for s in first], outcomes)
        # every rank has read the first rung before rank 0's later rungs overwrite its rows:
        # the ranks' first rungs, and a guided search's shortlists built on them, agree
        ranks.barrier()
    return outcomes


def _keep_default(result: Measured, default: Config) -> None:
    """When the side-by-side re-timing itself failed (the device ran out of memory, say):
    keep the default's own outcome as the winner."""
    result.winner = next((o for o in result.outcomes if o.status == OK and same_config(o.config, default)), None)
    result.default_timing = result.winner.timing if result.winner else None


@dataclass(frozen=True)
class SecondTrial:
    """A winner against the default on a second trial: whether it held (right on every
    batch, lost on none by more than settings.MAX_PART_LOSS, beat the default by the
    winner rule, or where no gain is asked was not beaten by it), the two timings there,
    each guard's (winner, default) medians in us, and why not where it failed to run."""

    held: bool
    winner: Timing | None = None
    default: Timing | None = None
    error: str | None = None
    guards_us: list[tuple[float, float]] = field(default_factory=list)

    def as_method(self, seed: int) -> dict:
        """What a stored winner's method says of it."""
        return dict(seed=seed, held=self.held, error=self.error,
                    winner_us=self.winner and round(self.winner.median_us, 3),
                    default_us=self.default and round(self.default.median_us, 3),
                    **({"guards_us": [[round(a, 3), round(b, 3)] for a, b in self.guards_us]}
                       if self.guards_us else {}))


def confirm_again(trial: Trial, config: Config, default: Config, timer: Timer, *,
                  min_gain: float = settings.MIN_GAIN, must_gain: bool = True,
                  starting: Callable[[Config], None] | None = None) -> SecondTrial:
    """config checked on a second trial (lengths drawn independently of the first's) and
    timed side by side with the default there, as tuner.bench.decide confirms it on the
    first: one draw of lengths per distribution can crown a config that loses on another
    draw of the same bucket. must_gain=False asks only that it lose nowhere: the default
    does not beat it on the mix by more than the noise, nor, where the trial has parts (a
    mix's batches), on any batch by more than settings.MAX_PART_LOSS (for a config whose
    gain another trial established). A call that fails does not hold (the caller keeps the
    default). starting(c): told before c first runs on these lengths (a sweep's flight
    recorder); the default then runs first, alone, so that a fault on its first run of them
    is blamed on it, not on config."""
    try:
        if starting is not None:
            starting(default)
            check_config(rotation(trial.runs, default), default, reference=trial.reference,
                         tolerance=trial.tolerance, checks=trial.checks)
            guards_problem(default, trial.guards, trial.tolerance)
            starting(config)
        checked = check_config(rotation(trial.runs, config), config, reference=trial.reference,
                               tolerance=trial.tolerance, checks=trial.checks)
        if checked.status == WRONG:
            return SecondTrial(False, error=checked.error)
        problem = guards_problem(config, trial.guards, trial.tolerance)
        if problem is not None:
            return SecondTrial(False, error=problem)
        (mine, theirs), holds, guarded = side_by_side(trial.runs, trial.parts, config, default, timer,
                                                      guards=trial.guards)
    except Exception as e:  # out of memory, a capture that failed: unsure, so not held
        return SecondTrial(False, error=one_line(e))
    kept = beats(mine, theirs, min_gain) if must_gain else not beats(theirs, mine, 0.0)
    return SecondTrial(holds and kept, mine, theirs, guards_us=[(a.median_us, b.median_us) for a, b in guarded])
