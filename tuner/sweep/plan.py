"""What a sweep measures: the shapes (of the runtime's misses; one per key) and each shape's candidate configs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tuner import settings
from tuner.bench import with_default_first
from tuner.db import MissRow, Problem, Snapshot, TuningDB, current_fingerprint, current_fingerprint_id
from tuner.keys import attention_run_key
from tuner.ops import Config, Op, get_grid
from tuner.workload import DecodeShape
from tuner.workload.shapes import shape_from_keys


def candidate_configs(op: Op, shape: DecodeShape) -> list[Config]:
    """The default first (so it is always measured), then the rest of the space once each."""
    return with_default_first(op.default(shape), op.configs(shape))


def all_serving(shapes: list[DecodeShape]) -> bool:
    """Whether every shape is a serving batch (a serving grid, --lengths serving or graph):
    a sweep for CUDA-graph decode, with its own defaults."""
    return bool(shapes) and all(s.lengths in ("serving", "graph") for s in shapes)


def default_strategy(shapes: list[DecodeShape]) -> str:
    """The search a sweep of these shapes runs unless told: settings.SERVING_STRATEGY for
    serving batches (a dense grid of capture batch sizes), else settings.DEFAULT_STRATEGY."""
    return settings.SERVING_STRATEGY if all_serving(shapes) else settings.DEFAULT_STRATEGY


def default_backends(op: Op, shapes: list[DecodeShape]) -> tuple[str, ...] | None:
    """The decode_attention backends a sweep of these shapes searches unless told:
    settings.SERVING_BACKENDS for serving batches (a captured decode graph cannot hold
    FlashInfer's per-call plan), else None (every installed one)."""
    from tuner.ops.decode_attention import BACKEND_OPS

    return settings.SERVING_BACKENDS if op.name in BACKEND_OPS and all_serving(shapes) else None


def shape_from_miss(miss: MissRow) -> DecodeShape | None:
    """The shape `tuner sweep --from-misses` measures for a missed key: at the top of its kv
    bucket, on serving batches (DecodeShape.lengths) where its calls' lengths were mixed;
    None when the key is not one a sweep can build."""
    shape = shape_from_keys(miss.problem.static_key, miss.problem.run_key)
    if shape is None or miss.lengths is None or miss.lengths.mean >= settings.MISS_MIXED_BELOW * miss.lengths.longest:
        return shape
    return dataclasses.replace(shape, lengths="serving")


@dataclass(frozen=True)
class MissPlan:
    """The shapes to sweep for the runtime's misses, and how many missed keys (static keys,
    with a grid) no sweep can build."""

    shapes: list[DecodeShape]
    left_out: int = 0
    of_what: str = "keys"

    @property
    def warning(self) -> str | None:
        """What to tell the user of the keys left out; None where none were."""
        if not self.left_out:
            return None
        return f"{self.left_out} missed {self.of_what} are not attention shapes a sweep can build; left out"


def plan_from_misses(db: TuningDB, op: Op, grid: str | None = None) -> MissPlan:
    """The shapes `tuner sweep OP --from-misses` sweeps: each key op missed in this
    environment (shape_from_miss), or with a grid, the grid's run keys (e.g. serving: every
    capture batch size x kv bucket) for every static key it missed. A graph op
    (settings.GRAPH_RECORD_OPS) takes its serving op's missed static keys, on its serving grid
    unless told. TunerError for an unknown grid."""
    # a graph op's keys are its serving op's (no call runs a graph op; captures record no misses)
    served_by = next((name for name, graph in settings.GRAPH_RECORD_OPS.items() if graph == op.name), None)
    if served_by is not None:
        grid = grid or "serving"
    missed = db.misses(current_fingerprint_id(), op=served_by or op.name, environment=current_fingerprint())
    if grid is None:
        shapes = [s for s in (shape_from_miss(m) for m in missed) if s is not None]
        return MissPlan(shapes, len(missed) - len(shapes))
    statics = list(dict.fromkeys(m.problem.static_key for m in missed))
    runs = get_grid(op, grid)
    per_static = [[dataclasses.replace(s, lengths=g.lengths) for g in runs
                   if (s := shape_from_keys(static, attention_run_key(g.batch, g.q_len, g.kv_len))) is not None]
                  for static in statics]
    return MissPlan([s for group in per_static for s in group], sum(not group for group in per_static),
                    "static keys")


def problems_of(op: Op, shapes: list[DecodeShape]) -> list[Problem]:
    """Each shape's key (op, static key, run key)."""
    return [Problem(op.name, shape.static_key().to_json(), shape.run_key()) for shape in shapes]


def chosen_per_key(shapes: list[DecodeShape], problems: list[Problem]) -> dict[Problem, DecodeShape]:
    """The one shape swept of each key: shapes of one key share one record. A mixed-length one
    is preferred to full batches, and the longest, at its kv bucket's top (a bucket bounds
    its calls' lengths)."""

    def preference(shape: DecodeShape) -> tuple[bool, int]:
        return shape.lengths != "full", shape.kv_len

    chosen: dict[Problem, DecodeShape] = {}
    for shape, problem in zip(shapes, problems):
        if problem not in chosen or preference(shape) > preference(chosen[problem]):
            chosen[problem] = shape
    return chosen


@dataclass(frozen=True)
class SweepPlan:
    """What `tuner sweep --plan` says before anything runs: the shapes by static key, their
    candidate configs (every shape's, once: what the progress bar counts) and the estimated
    GPU time."""

    shapes: list[DecodeShape]
    candidates: int
    # None off a GPU (the time depends on the op and the machine) and for graph replays (not
    # measured yet); fresh: on a machine that compiles every kernel first, where measured
    estimate_s: float | None
    fresh_estimate_s: float | None = None

    @classmethod
    def of(cls, op: Op, shapes: list[DecodeShape], strategy: str, device: str) -> "SweepPlan":
        candidates = sum(len(candidate_configs(op, s)) for s in shapes)
        if device != "cuda" or any(s.lengths == "graph" for s in shapes):
            return cls(shapes, candidates, None)
        rates, fresh = settings.PLAN_S_PER_CANDIDATE_GPU, settings.PLAN_FRESH_S_PER_CANDIDATE_GPU.get(strategy)
        compiles = op.precompile is not None  # (a fresh machine's extra time is Triton's compiles)
        return cls(shapes, candidates, candidates * rates.get(strategy, rates["exhaustive"]),
                   None if fresh is None or not compiles else candidates * fresh)

    def kept(self, op: Op, snapshot: Snapshot) -> tuple[int, int]:
        """(shapes whose key has a winner stored that applies here, which a sweep keeps
        unless forced; shapes that share another's key, measured once), from a DB's
        snapshot (TuningDB.snapshot) of this environment."""
        problems = problems_of(op, self.shapes)
        chosen = chosen_per_key(self.shapes, problems)
        stored = sum(p.run_key in snapshot.table.get((p.op, p.static_key), {}) for p in chosen)
        return stored, len(self.shapes) - len(chosen)

    def by_static_key(self) -> dict[str, list[DecodeShape]]:
        keys: dict[str, list[DecodeShape]] = {}
        for shape in self.shapes:
            keys.setdefault(shape.static_label(), []).append(shape)
        return keys
