"""Offline sweeps: shapes x candidate configs -> checked, timed -> winners in the DB.

Resumable: each measurement is stored as it finishes (one transaction each), a shape
whose winner is stored is skipped, and a shape cut short resumes from its measurements.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tuner.bench import (
    OK, Outcome, Timing, boundary_sync, contenders, decide, measure_config, one_line, same_config, timer_for,
    with_default_first,
)
from tuner import settings
from tuner.db import Problem, TuningDB, current_environment
from tuner.errors import TunerError
from tuner.keys import canonical_json
from tuner.ops import Config, DecodeInputs, DecodeShape, Op
from tuner.ranks import Ranks


TUNED, SKIPPED, FAILED, DUPLICATE = "tuned", "skipped", "failed", "duplicate"


@dataclass(frozen=True)
class ShapeResult:
    shape: DecodeShape
    status: str  # tuned | skipped (its stored winner is reported) | failed | duplicate
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
    """How many copies of the KV cache to rotate through so that each timed call finds its
    KV out of the L2 (twice the L2 in all), as consecutive layers of a model do. On the CPU
    the wall-clock timer measures whole calls, and one copy is used."""
    if device != "cuda":
        return 1
    l2_bytes = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
    l2_bytes = l2_bytes or settings.DEFAULT_L2_BYTES
    return max(1, min(max_copies, math.ceil(2 * l2_bytes / max(inputs.kv_bytes, 1))))


def _too_big(shape: DecodeShape, device: str) -> str | None:
    """Why the shape's KV cache (and the reference's copy of it) cannot fit, or None."""
    need = 3 * shape.kv_bytes()  # the cache, plus headroom for outputs and the reference's work
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0]
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    if need > free:
        return f"needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free on {device}"
    return None


def candidate_configs(op: Op, shape: DecodeShape) -> list[Config]:
    """The default first (so it is always measured), then the rest of the space once each."""
    return with_default_first(op.default(shape), op.configs(shape))


def _stored_outcome(row: Any) -> Outcome:
    timing = Timing(row.median_us, row.spread_us, row.samples) if row.status == OK else None
    return Outcome(row.config, row.status, timing, row.max_error, row.error)


def sweep(
    op: Op,
    shapes: list[DecodeShape],
    db: TuningDB,
    *,
    timer: Any = None,
    force: bool = False,
    min_gain: float = settings.MIN_GAIN,
    seed: int = 0,
    halving: bool = False,
    on_advance: Callable[[int, str], None] | None = None,
    ranks: Ranks | None = None,
) -> list[ShapeResult]:
    """Tune op over shapes into db. on_advance(n, label) reports n configs done.

    ranks (a torch.distributed job, every rank calling sweep with the same arguments and a
    DB they all reach): each shape's candidates are shared round robin; the ranks meet
    when they are measured, rank 0 re-times and stores the winner, they meet again, and
    every rank reads that one winner back.

    halving: time every config quickly first (timer.quick()), then only the contenders (the
    default and those within 10% of the fastest, at most 6) with the full timer; the
    winner is chosen among those. Off by default until its agreement with full sweeps is
    measured on the GPU.
    """
    unavailable = op.unavailable()
    if unavailable:
        raise TunerError(f"op {op.name} cannot run here: {unavailable}")
    device = op.device()
    timer = timer or timer_for("sweep-gpu" if device == "cuda" else "sweep-cpu", device)
    env = current_environment()
    fp_id, fp = env
    method = dict(timer.method, device=device)
    quick_timer = timer.quick() if halving else None
    advance = on_advance or (lambda n, label: None)
    results: list[ShapeResult] = []
    seen: dict[Problem, DecodeShape] = {}
    for shape in shapes:
        configs = candidate_configs(op, shape)
        problem = Problem(op.name, shape.static_key().to_json(), shape.run_key())
        label = shape.label()
        if problem in seen:  # same static key and kv bucket: one record holds both
            advance(len(configs), label)
            results.append(ShapeResult(shape, DUPLICATE, None, None, None, 0, 0, 0,
                                       note=f"same key as {seen[problem].label()}"))
            continue
        seen[problem] = shape
        stored_winner = None if force else db.record(problem, environment=fp)  # one that applies here
        if stored_winner is not None:
            advance(len(configs), label)
            results.append(ShapeResult(
                shape, SKIPPED, stored_winner.config, stored_winner.median_us,
                stored_winner.default_median_us, 0, 0, 0,
            ))
            continue
        stored = {} if force else {canonical_json(m.config): m for m in db.measurements(problem, fp_id)}
        too_big = _too_big(shape, device)
        try:
            if too_big:
                raise MemoryError(too_big)
            inputs = op.make_inputs(shape, device=device, seed=seed)
            reference = inputs.reference()
            copies = [inputs] + [inputs.with_kv_copy() for _ in range(kv_copies(inputs, device) - 1)]
        except (RuntimeError, MemoryError) as e:  # too big for this device, or the reference failed
            inputs = reference = copies = None
            boundary_sync()
            advance(len(configs), label)
            results.append(ShapeResult(shape, FAILED, None, None, None, 0, 0, 0, note=one_line(e)))
            continue
        runs = [functools.partial(op.run, copy) for copy in copies]
        tolerance = op.tolerance[shape.dtype]
        measured_now: set[str] = set()
        resumed_from_db: set[str] = set()

        def measure(config: Config, rung_timer: Any, rung: int) -> Outcome:
            """A stored measurement of this rung or a later one, else a new, stored one."""
            key = canonical_json(config)
            row = stored.get(key)
            if row is not None and row.method.get("rung", 1) >= rung:
                resumed_from_db.add(key)
                return _stored_outcome(row)
            outcome = measure_config(runs, config, reference=reference, tolerance=tolerance, timer=rung_timer)
            t = outcome.timing
            db.save_measurement(
                problem, env, config, kv_len=shape.kv_len, status=outcome.status,
                # the timer's method as of this measurement (a failed capture says so)
                method=dict(method, **rung_timer.method, **({"rung": rung} if halving else {})),
                median_us=t and t.median_us, spread_us=t and t.spread_us, samples=t.samples if t else 0,
                max_error=outcome.max_error, error=outcome.error,
            )
            measured_now.add(key)
            return outcome

        boundary_sync()
        outcomes = []
        for i, config in enumerate(configs):  # halving: rung 0, every config quickly; else the only rung
            if ranks is None or ranks.mine(i):
                outcomes.append(measure(config, quick_timer, 0) if halving else measure(config, timer, 1))
            advance(1, label)
        if ranks is not None:  # the other ranks' measurements, from the DB, once all are in
            ranks.barrier()
            outcomes = _all_outcomes(db, problem, fp_id, configs, outcomes)
        leader = ranks is None or ranks.rank == 0
        if halving and leader:  # rung 1: the contenders, fully; the winner is chosen among them only
            kept = contenders(outcomes, configs[0])
            outcomes = [measure(o.config, timer, 1) for o in kept] + [o for o in outcomes if o.status != OK]
        measured, resumed = len(measured_now), len(resumed_from_db - measured_now)
        default = configs[0]
        failures = sum(o.status != OK for o in outcomes)
        winner = default_timing = None
        if leader:
            try:
                winner, default_timing = decide(runs, outcomes, default, timer=timer, min_gain=min_gain)
            except (RuntimeError, MemoryError):  # the side-by-side re-timing failed: keep the default
                winner = next((o for o in outcomes if o.status == OK and same_config(o.config, default)), None)
                default_timing = winner.timing if winner else None
        del inputs, copies, runs, reference  # free the device before the next shape's inputs
        boundary_sync()
        if leader and winner is not None:
            db.save_winner(problem, env, winner.config, winner.timing, default, default_timing,
                           method=dict(method, min_gain=min_gain, ranks=ranks.world if ranks else 1))
        if ranks is not None:  # every rank takes the one winner rank 0 stored
            ranks.barrier()
            record = db.record(problem, fp_id)
            winner = Outcome(record.config, OK, Timing(record.median_us, record.spread_us, record.samples)) \
                if record else None
            default_timing = Timing(record.default_median_us, 0.0, 0) \
                if record and record.default_median_us is not None else None
        if winner is None:
            results.append(ShapeResult(shape, FAILED, None, None, None, measured, resumed, failures,
                                       note="no config ran right"))
            continue
        results.append(ShapeResult(
            shape, TUNED, winner.config, winner.timing.median_us,
            default_timing and default_timing.median_us, measured, resumed, failures,
        ))
    return results


def _all_outcomes(db: TuningDB, problem: Problem, fp_id: str, configs: list[Config],
                  mine: list[Outcome]) -> list[Outcome]:
    """Every config's outcome: this rank's own, the others' as they stored them."""
    own = {canonical_json(o.config): o for o in mine}
    rows = {canonical_json(m.config): m for m in db.measurements(problem, fp_id)}
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
