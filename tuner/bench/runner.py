"""Measuring candidates: check each against the reference, time the correct ones, and
record failures (crash, out of memory, wrong result) without letting them poison the next."""

from __future__ import annotations

import functools
import gc
from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

import torch

from tuner import settings
from tuner.bench.check import compare
from tuner.bench.select import ERROR, OK, OOM, WRONG, Outcome, beats, same_config
from tuner.bench.timing import Timing
from tuner.bench.trial import Guard


def boundary_sync(release: bool = True) -> None:
    """Quiesce before and after a tuning burst: every rank and stream is idle and (release)
    freed memory is returned, so one burst's leftovers cannot skew the next. A sweep moving
    between shapes skips the release: a garbage collection is slow in a process holding a
    DB session and the kernel libraries (docs/decisions.md, "Timing method"), while
    its trial's memory is freed by reference counting and stays in PyTorch's cache for
    the next (tuner.sweep.trials.too_big counts it as free)."""
    dist = torch.distributed if torch.distributed.is_available() else None
    group = dist is not None and dist.is_initialized()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
    if group:
        dist.barrier()
    if not release:
        return
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    if group:
        dist.barrier()


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# errors after which a CUDA context is unusable (CUDA's sticky errors, as its runtime words
# them): a sweep's worker stops as if the fault had killed it
STICKY_CUDA_ERRORS = ("illegal memory access", "unspecified launch failure", "misaligned address",
                      "illegal instruction", "device-side assert", "launch timed out", "uncorrectable ECC",
                      "hardware stack error", "invalid program counter", "not supported on global/shared address space",
                      "CUDA error: unknown error")


def is_sticky_cuda_error(error: str | None) -> bool:
    return bool(error) and any(s in error for s in STICKY_CUDA_ERRORS)


# How to run a config: one callable taking the config, or one per copy of the inputs
# (all copies hold the same values; the timers rotate through them for a cold cache).
Runs = Callable[[dict[str, Any]], Any] | Sequence[Callable[[dict[str, Any]], Any]]


def rotation(runs: Runs, config: dict[str, Any]) -> list[Callable[[], Any]]:
    """Zero-argument calls of config, one per input copy, for a timer."""
    return [functools.partial(run, config) for run in ([runs] if callable(runs) else runs)]


def measure_config(
    runs: Runs,
    config: dict[str, Any],
    *,
    reference: torch.Tensor,
    tolerance: tuple[float, float],
    timer: Any,
    checks: Sequence[tuple[int, Any]] = (),
) -> Outcome:
    """Run config once on each distinct input (the first run, and each run of `checks` with
    its own reference) and check it; time it only if it was right on all."""
    calls = rotation(runs, config)
    try:
        wrong = check_config(calls, config, reference=reference, tolerance=tolerance, checks=checks)
        if wrong.status == WRONG:
            return wrong
        return Outcome(config, OK, timer(calls), max_error=wrong.max_error)
    except torch.OutOfMemoryError as e:
        outcome = Outcome(config, OOM, error=one_line(e))
    except Exception as e:  # a candidate may fail in any way; it must not stop the sweep
        return Outcome(config, ERROR, error=one_line(e))
    # free what the candidate that ran out of memory left behind before the next one runs
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return outcome


def check_config(calls: Sequence[Callable[[], Any]], config: dict[str, Any], *, reference: torch.Tensor,
                 tolerance: tuple[float, float], checks: Sequence[tuple[int, Any]] = ()) -> Outcome:
    """config's calls run once on each distinct input and checked: an Outcome of WRONG with
    the reason, else of OK (untimed) with the largest error. A failing call raises."""
    max_error = 0.0
    for i, expected in ((0, reference), *checks):
        check = compare(calls[i](), expected, *tolerance)
        if not check.ok:
            reason = check.reason if i == 0 else f"run {i}: {check.reason}"
            return Outcome(config, WRONG, max_error=check.max_error, error=reason)
        max_error = max(max_error, check.max_error or 0.0)
    return Outcome(config, OK, max_error=max_error)


def measure_configs(
    runs: Runs,
    configs: Iterable[dict[str, Any]],
    *,
    reference: torch.Tensor,
    tolerance: tuple[float, float],
    timer: Any,
) -> list[Outcome]:
    return [measure_config(runs, c, reference=reference, tolerance=tolerance, timer=timer) for c in configs]


def decide(
    runs: Runs,
    outcomes: list[Outcome],
    default_config: dict[str, Any],
    *,
    timer: Any,
    min_gain: float = settings.MIN_GAIN,
    parts: Sequence[Sequence[Callable[[dict[str, Any]], Any]]] = (),
    guards: Sequence[Guard] = (),
    guard_problem: Callable[[dict[str, Any]], str | None] | None = None,
    confirming: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[Outcome | None, Timing | None]:
    """The winner and the default's timing.

    The fastest correct challenger that looked faster than the default in the first pass is
    re-timed against the default in alternation, and wins only if it beats the default
    there by more than the noise (select.beats); both timings then come from that paired
    run, so a burst of load during one measurement can neither crown a config nor make the
    default look slow. Failed candidates never win; if the default failed, the fastest
    correct candidate wins; if nothing ran right, there is no winner.

    parts (a serving trial's batches, the runs of each over its own copies): a
    challenger that wins on the mix must also not lose to the default on any one batch by
    more than settings.MAX_PART_LOSS, timed side by side on that batch alone; one that does
    gives way to the next fastest (settings.CONFIRM_TRIES challengers in all), else the
    default stays: the mix's mean can hide a large loss on one distribution's batches.
    guards (batches outside the mix, tuner.bench.trial.Guard): likewise, and a challenger
    must first run right on each (guard_problem(config): why not, or None; the caller's, so
    that a sweep's flight recorder hears of the new lengths first).
    confirming(config): told before a challenger is re-timed (a sweep's flight recorder
    blames it for a fault there).
    """
    ok = [o for o in outcomes if o.status == OK and o.timing is not None]
    if not ok:
        return None, None
    default = next((o for o in ok if same_config(o.config, default_config)), None)
    if default is None:
        return min(ok, key=lambda o: o.timing.median_us), None
    challengers = sorted((o for o in ok if o is not default and o.timing.median_us < default.timing.median_us),
                         key=lambda o: o.timing.median_us)
    t_default = default.timing
    for challenger in challengers[:settings.CONFIRM_TRIES if parts or guards else 1]:
        if guards and guard_problem is not None and guard_problem(challenger.config) is not None:
            continue
        if confirming is not None:
            confirming(challenger.config)
        (t_challenger, t_default), holds, _ = side_by_side(runs, parts, challenger.config, default.config, timer,
                                                           guards=guards)
        if holds and beats(t_challenger, t_default, min_gain):
            return replace(challenger, timing=t_challenger), t_default
    return replace(default, timing=t_default), t_default


def side_by_side(runs: Runs, parts: Sequence[Sequence[Callable[[dict[str, Any]], Any]]], config: dict[str, Any],
                 default: dict[str, Any], timer: Any,
                 guards: Sequence[Guard] = ()) -> tuple[tuple[Timing, Timing], bool, list[tuple[Timing, Timing]]]:
    """config and default timed side by side: on the whole rotation when there are no parts;
    else on each part alone (in one interleaved run where the timer has one), their mix's
    timings being the parts' means. Also whether config lost to the default on no part, and
    on no guard (timed alone like a part, outside the mean), by more than
    settings.MAX_PART_LOSS; and each guard's (config, default) timings. Each part rotates
    through copies of its own batch, cold in the L2 as the whole rotation is
    (tuner.bench.trial.Trial.parts)."""
    subsets = [list(part) for part in parts] + [list(guard.runs) for guard in guards]
    if not subsets:
        return timer.paired(rotation(runs, config), rotation(runs, default)), True, []
    if hasattr(timer, "interleaved"):
        timings = timer.interleaved([rotation(sub, c) for c in (config, default) for sub in subsets])
        mine, theirs = timings[:len(subsets)], timings[len(subsets):]
    else:
        pairs = [timer.paired(rotation(sub, config), rotation(sub, default)) for sub in subsets]
        mine, theirs = [a for a, _ in pairs], [b for _, b in pairs]
    holds = all(a.median_us <= b.median_us * (1 + settings.MAX_PART_LOSS) for a, b in zip(mine, theirs))
    guarded = list(zip(mine[len(parts):], theirs[len(parts):]))
    if not parts:  # guards alone: the mix is the whole rotation
        return timer.paired(rotation(runs, config), rotation(runs, default)), holds, guarded
    return (_mean_timing(mine[:len(parts)]), _mean_timing(theirs[:len(parts)])), holds, guarded


def guards_problem(config: dict[str, Any], guards: Sequence[Guard], tolerance: tuple[float, float]) -> str | None:
    """Why config does not run right on every guard (its error, or how its output differs
    from the guard's reference), or None. Out of memory, and an error that leaves the CUDA
    context unusable, propagate: the caller decides what becomes of the shape."""
    for guard in guards:
        try:
            out = guard.runs[0](config)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - a candidate may fail in any way: it is not right there
            if is_sticky_cuda_error(str(e)):
                raise
            return f"failed on a guard batch: {one_line(e)}"
        check = compare(out, guard.reference, *tolerance)
        if not check.ok:
            return f"wrong on a guard batch: {check.reason}"
    return None


def _mean_timing(timings: Sequence[Timing]) -> Timing:
    n = len(timings)
    return Timing(sum(t.median_us for t in timings) / n, sum(t.spread_us for t in timings) / n,
                  min(t.samples for t in timings))
