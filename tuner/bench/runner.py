"""Measuring candidates: check each against the reference, time the correct ones, and
record failures (crash, out of memory, wrong result) without letting them poison the next."""

from __future__ import annotations

import gc
from dataclasses import replace
from typing import Any, Callable, Iterable

import torch

from tuner.bench.check import compare
from tuner.bench.select import ERROR, OK, OOM, WRONG, Outcome, beats
from tuner.bench.timer import Timing


def boundary_sync() -> None:
    """Quiesce before and after a tuning burst: every rank and stream is idle and
    freed memory is returned, so one burst's leftovers cannot skew the next."""
    dist = torch.distributed if torch.distributed.is_available() else None
    group = dist is not None and dist.is_initialized()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
    if group:
        dist.barrier()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    if group:
        dist.barrier()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def measure_config(
    call: Callable[[dict[str, Any]], Any],
    config: dict[str, Any],
    *,
    reference: torch.Tensor,
    tolerance: tuple[float, float],
    timer: Callable[[Callable[[], Any]], Timing],
) -> Outcome:
    """Run config once and check it; time it only if it was right."""
    try:
        check = compare(call(config), reference, *tolerance)
        if not check.ok:
            return Outcome(config, WRONG, max_error=check.max_error, error=check.reason)
        return Outcome(config, OK, timer(lambda: call(config)), max_error=check.max_error)
    except torch.OutOfMemoryError as e:
        outcome = Outcome(config, OOM, error=_one_line(e))
    except Exception as e:  # a candidate may fail in any way; it must not stop the sweep
        outcome = Outcome(config, ERROR, error=_one_line(e))
    # free what the failed candidate left behind before the next one runs
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return outcome


def measure_configs(
    call: Callable[[dict[str, Any]], Any],
    configs: Iterable[dict[str, Any]],
    *,
    reference: torch.Tensor,
    tolerance: tuple[float, float],
    timer: Callable[[Callable[[], Any]], Timing],
    on_outcome: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    outcomes = []
    for config in configs:
        outcome = measure_config(call, config, reference=reference, tolerance=tolerance, timer=timer)
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)
    return outcomes


def confirm_winner(
    call: Callable[[dict[str, Any]], Any],
    winner: Outcome,
    default: Outcome | None,
    *,
    timer: Any,
    min_gain: float = 0.01,
) -> tuple[Outcome, Timing | None]:
    """Re-time a challenger against the default in alternation; it keeps the win only if
    it beats the default there too. Returns (chosen outcome, default timing), both from
    the paired run, so one burst of load during the sweep cannot crown a config."""
    if default is None or default.status != OK or winner.config == default.config:
        return winner, default.timing if default is not None else None
    t_winner, t_default = timer.paired(lambda: call(winner.config), lambda: call(default.config))
    if beats(t_winner, t_default, min_gain):
        return replace(winner, timing=t_winner), t_default
    return replace(default, timing=t_default), t_default
