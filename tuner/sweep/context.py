"""A sweep's options (SweepOptions) and what one sweep resolves from them for every shape (SweepRun)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tuner import settings
from tuner.bench import timer_for
from tuner.db import TuningDB, current_environment
from tuner.errors import TunerError
from tuner.ops import Op
from tuner.ranks import Ranks
from tuner.search import DEFAULT_STRATEGY, GuidesShapes, ShapeGuide, Strategy, get_strategy
from tuner.sweep.flight import Flight
from tuner.workload import DecodeShape


@dataclass(frozen=True)
class SweepOptions:
    """How a sweep measures; tuner.sweep.sweep's keywords say what each does."""

    timer: Any = None
    force: bool = False
    min_gain: float = settings.MIN_GAIN
    seed: int = 0
    strategy: str = DEFAULT_STRATEGY
    halving: bool = False
    on_advance: Callable[[int, str], None] | None = None
    ranks: Ranks | None = None
    second_trial: bool = True
    dense_pass: bool = True
    flight: Flight | None = None
    run_id: str | None = None  # a supervised run's id: with force, what this run measured is resumed


@dataclass(frozen=True)
class SweepRun:
    """One sweep of op into db: its options, strategy, guides (for a strategy that
    GuidesShapes: one for the shapes, one for their dense passes), device, timer, this
    machine's environment and the method every measurement's record starts from."""

    op: Op
    db: TuningDB
    options: SweepOptions
    strategy: Strategy
    guide: ShapeGuide | None
    dense_guide: ShapeGuide | None
    device: str
    timer: Any
    env: Any
    method: dict[str, Any]

    @classmethod
    def start(cls, op: Op, db: TuningDB, options: SweepOptions) -> SweepRun:
        """TunerError where op cannot run here or the strategy is unknown."""
        unavailable = op.unavailable()
        if unavailable:
            raise TunerError(f"op {op.name} cannot run here: {unavailable}")
        strategy = get_strategy("halving" if options.halving else options.strategy)
        guided = isinstance(strategy, GuidesShapes)
        device = op.device()
        timer = options.timer or timer_for("sweep-gpu" if device == "cuda" else "sweep-cpu", device)
        return cls(op, db, options, strategy, guide=strategy.guide() if guided else None,
                   dense_guide=strategy.guide(across_kv=settings.GUIDED_ACROSS_KV) if guided else None,
                   device=device, timer=timer, env=current_environment(),
                   method=dict(timer.method, device=device, **({"sweep_run": options.run_id} if options.run_id else {})))

    def advance(self, n: int, label: str) -> None:
        """Tell the caller (on_advance) n more configs of the shape `label` are done."""
        if self.options.on_advance is not None:
            self.options.on_advance(n, label)

    @property
    def leader(self) -> bool:
        """Whether this process decides and stores winners (rank 0, or a sweep of one process)."""
        return self.options.ranks is None or self.options.ranks.rank == 0

    def wants_dense(self, shape: DecodeShape) -> bool:
        """Whether shape's winner gets a dense pass (tuner.sweep.dense)."""
        return self.options.dense_pass and self.options.ranks is None and self.op.by_fill is not None \
            and shape.lengths == "serving" and shape.batch > 1
