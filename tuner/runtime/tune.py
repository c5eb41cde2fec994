"""Tune on a miss (TUNER_MODE=tune or force): every config measured on the very call that
missed, by the sweep's own pipeline (tuner.search.pipeline) and winner rule, the winner
stored and served from then on. Under a process group every rank measures and rank 0's
winner is everyone's."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from tuner import settings
from tuner.bench import WallClockTimer, same_config, tolerance_for, with_default_first
from tuner.bench.trial import Trial
from tuner.db import Problem, current_environment
from tuner.errors import one_line
from tuner.ranks import Ranks
from tuner.runtime.borrowing import Config, winner_gain
from tuner.runtime.state import runtime
from tuner.search.pipeline import Measured, confirm_again, measure


def _output_of(out: Any) -> Any:
    """What a run's result is checked on: the output tensor, the first of a tuple such as
    (out, softmax_lse) as FA3 returns with return_softmax_lse."""
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return out


def tune_call(function: Any, problem: Problem, kv_len: int, default: Config, args: tuple, kwargs: dict,
              ranks: Ranks | None = None) -> Config | None:
    """The winner for this call of an @autotune function (its configs, fn and tolerance),
    stored and served; None when nothing ran right. The trial is the call itself; its
    reference the default's output, copied (a kernel writing into the caller's out= returns
    that one tensor for every config, and each would be checked against itself)."""
    configs = with_default_first(default, function.configs(args, kwargs))
    run = lambda c: _output_of(function.fn(*args, config=c, **kwargs))  # noqa: E731
    reference = run(default)
    reference = reference.clone() if isinstance(reference, torch.Tensor) else reference
    trial = Trial(runs=[run], reference=reference,
                  tolerance=function.tolerance or tolerance_for(getattr(reference, "dtype", None)), kv_len=kv_len)
    preset = settings.TIMERS["runtime"]
    timer = WallClockTimer(warmup=preset.warmup, repeats=preset.repeats, min_repeats=preset.min_repeats,
                           max_seconds=preset.max_seconds, cuda_sync=torch.cuda.is_available())
    # every rank measures its own call; exhaustively, as tune mode always has (halving, the
    # sweeps' default, was measured on sweeps only)
    result = measure(trial, configs, default, timer, strategy="exhaustive")
    confirmation = _confirm(result, trial, default, timer)
    winner, default_timing = result.winner, result.default_timing
    if ranks is not None:  # rank 0's choice, as an index into the configs every rank listed alike
        index = next((i for i, c in enumerate(configs) if winner and same_config(c, winner.config)), -1)
        index = ranks.broadcast(index if ranks.rank == 0 else -1)
        if index < 0:
            return None
        mine = next((o for o in result.outcomes if same_config(o.config, configs[index])), None)
        if ranks.rank != 0:  # rank 0 stores it; the others serve it (its gain unknown here: never lent)
            runtime.store((problem.op, problem.static_key), problem.run_key, configs[index], 1.0)
            return configs[index]
        winner = mine
    if winner is None:
        return None
    try:
        with runtime.writing() as db:
            db.save_winner(problem, current_environment(), winner.config, winner.timing, default, default_timing,
                           method=dict(timer.method, source="runtime", kv_len=kv_len, **confirmation))
    except Exception as e:  # noqa: BLE001 - the winner still serves this process; the call must not fail
        warnings.warn(f"tuner: could not store the tuned config of {function.name}: {one_line(e)}", stacklevel=5)
    runtime.store((problem.op, problem.static_key), problem.run_key, winner.config,
                  winner_gain(winner.timing.median_us, default_timing and default_timing.median_us))
    return winner.config


def _confirm(result: Measured, trial: Trial, default: Config, timer: WallClockTimer) -> dict[str, Any]:
    """A winner other than the default is re-checked and re-timed side by side with the
    default once more, as a sweep's second trial does (tuner.search.pipeline.confirm_again):
    one paired timing on a loaded host can crown a config that is slower. One that loses there
    gives way to the default, whose timing there is stored (the key is not tuned again);
    one that fails to run leaves no winner. What the stored record's method says of it."""
    winner = result.winner
    if winner is None or result.default_timing is None or same_config(winner.config, default):
        return {}
    again = confirm_again(trial, winner.config, default, timer)
    if again.held:
        return {"confirmed": again.as_method(0)}
    if again.error is not None:  # not a loss: nothing is stored, and the key is tuned again later
        result.winner = None
        return {}
    refused = dict(again.as_method(0), config=winner.config)
    default_timing = again.default or result.default_timing
    result.winner = dataclasses.replace(winner, config=default, timing=default_timing)
    result.default_timing = default_timing
    return {"confirmed": refused}
