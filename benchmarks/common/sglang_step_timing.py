"""sglang_e2e.py --step-timing: where each decode graph step's time goes, a line per step in a
worker's log, and those lines read back into its results.

Wrapped around SGLang's DecodeCudaGraphRunner, outside tuner's own hooks where tuner's backend
runs: the host time of load_batch (the host step before a replay: SGLang's copies of the step's
inputs, tuner's graph pick and judge) and of execute (load_batch, then the replay's launch),
and on a GPU the time between two CUDA events around execute (the GPU's time for the step's
graph, with any wait for the host inside it). Where SGLang's own load_batch was wrapped before
tuner's hooks went on (wrap_own), its time alone too (sglang_us): load_us less sglang_us is
tuner's hooks'. A step's line is printed once the next step's
graph is launched (while it runs), or at exit, so that no step waits for its own events:
bench_one_batch waits for each step's tokens, so they are done by then. The warm-up's last
line so lands after bench_one_batch's "Benchmark ..." marker, and `step_timings` drops it.
TP rank 0 alone times its steps.
"""

from __future__ import annotations

import atexit
import functools
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

from common.sglang_logs import STEP_LINE

ENV = "TUNER_E2E_STEP_TIMING"
RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
LINE = re.compile(r"tuner-e2e step: bs=(?P<batch>\d+) load_us=(?P<load>[\d.]+)(?: sglang_us=(?P<sglang>[\d.]+))? "
                  r"host_us=(?P<host>[\d.]+)(?: gpu_us=(?P<gpu>[\d.]+))?")


class StepTimer:
    """Times a runner class's load_batch and execute once wrap(cls) has wrapped them. event: a
    CUDA event factory (None: host times alone); rank: this process's TP rank (rank 0 prints)."""

    def __init__(self, event: Callable[[], Any] | None = None, clock: Callable[[], int] = time.perf_counter_ns,
                 emit: Callable[..., None] = print, rank: Callable[[], int] = lambda: 0) -> None:
        self.event, self.clock, self.emit, self.rank = event, clock, emit, rank
        self._load_ns = 0
        self._own_ns: int | None = None  # SGLang's own load_batch's, where wrap_own wrapped it
        self._pending: tuple[int, int, int | None, int, tuple[Any, Any] | None] | None = None

    def _timed(self, load_batch: Callable[..., Any], total: str) -> Callable[..., Any]:
        """load_batch, its host time added to the attribute named total."""
        @functools.wraps(load_batch)
        def timed_load_batch(runner: Any, *args: Any, **kwargs: Any) -> Any:
            start = self.clock()
            try:
                return load_batch(runner, *args, **kwargs)
            finally:
                setattr(self, total, getattr(self, total) + self.clock() - start)
        return timed_load_batch

    def wrap_own(self, runner_class: type) -> None:
        """Time SGLang's own load_batch: before tuner's hooks wrap it, so inside them."""
        self._own_ns = 0
        runner_class.load_batch = self._timed(runner_class.load_batch, "_own_ns")

    def wrap(self, runner_class: type) -> None:
        load_batch, execute = runner_class.load_batch, runner_class.execute
        timed_load_batch = self._timed(load_batch, "_load_ns")

        @functools.wraps(execute)
        def timed_execute(runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
            if self.rank() != 0:  # (asked while the TP group is up: bench_one_batch ends it before exit)
                return execute(runner, forward_batch, *args, **kwargs)
            self._load_ns = 0
            if self._own_ns is not None:
                self._own_ns = 0
            events = (self.event(), self.event()) if self.event is not None else None
            start = self.clock()
            if events is not None:
                events[0].record()
            output = execute(runner, forward_batch, *args, **kwargs)
            if events is not None:
                events[1].record()
            step = (getattr(forward_batch, "batch_size", 0), self._load_ns, self._own_ns, self.clock() - start, events)
            self.flush()  # the last step's line, printed while this step's graph runs
            self._pending = step
            return output

        runner_class.load_batch, runner_class.execute = timed_load_batch, timed_execute

    def flush(self) -> None:
        """Print the last step's line (its end event waited for, if not yet done)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        batch, load_ns, own_ns, host_ns, events = pending
        own = "" if own_ns is None else f" sglang_us={own_ns / 1e3:.1f}"
        gpu = ""
        if events is not None:
            events[1].synchronize()
            gpu = f" gpu_us={events[0].elapsed_time(events[1]) * 1e3:.1f}"
        self.emit(f"tuner-e2e step: bs={batch} load_us={load_ns / 1e3:.1f}{own} host_us={host_ns / 1e3:.1f}{gpu}",
                  flush=True)


def install_own() -> StepTimer:
    """A timer of this process's SGLang decode graph runner, its own load_batch wrapped: call
    it before tuner's hooks go on, then install(timer) after."""
    import pkgutil

    import torch

    def rank() -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    event = functools.partial(torch.cuda.Event, enable_timing=True) if torch.cuda.is_available() else None
    timer = StepTimer(event=event, rank=rank)
    timer.wrap_own(pkgutil.resolve_name(RUNNER))
    return timer


def install(timer: StepTimer) -> StepTimer:
    """Time the runner's steps (after tuner's hooks are on it), lines printed by TP rank 0 alone."""
    import pkgutil

    timer.wrap(pkgutil.resolve_name(RUNNER))
    atexit.register(timer.flush)
    return timer


def step_timings(log_text: str) -> dict[str, dict[str, Any]]:
    """Per batch size, the measured decode steps' times (after bench_one_batch's "Benchmark ..."),
    in step order: load_us, host_us, where timed sglang_us (SGLang's own load_batch) and, on a
    GPU, gpu_us; missing: how many of the decode
    steps logged there (with --log-decode-step 1: all) have no line (a worker killed before
    its exit printed the last one, say), extra: lines past them. A line between the marker and
    the first measured step's own is the warm-up's last step, printed at that step's launch."""
    _, marker, measured = log_text.partition("Benchmark ...")
    if not marker:
        return {}
    steps: dict[str, int] = {}
    for m in STEP_LINE.finditer(measured):
        steps[m["batch"]] = steps.get(m["batch"], 0) + 1
    first = STEP_LINE.search(measured)
    # (a line before the first measured step's own: the warm-up's last, printed at its launch)
    timed = [m for m in LINE.finditer(measured) if first is not None and m.start() > first.start()]
    found: dict[str, dict[str, Any]] = {}
    for batch, count in steps.items():
        kept = [m for m in timed if m["batch"] == batch]
        timing: dict[str, Any] = {"load_us": [float(m["load"]) for m in kept],
                                  "host_us": [float(m["host"]) for m in kept]}
        if kept and all(m["sglang"] is not None for m in kept):
            timing["sglang_us"] = [float(m["sglang"]) for m in kept]
        if kept and all(m["gpu"] is not None for m in kept):
            timing["gpu_us"] = [float(m["gpu"]) for m in kept]
        if count > len(kept):
            timing["missing"] = count - len(kept)
        elif count < len(kept):
            timing["extra"] = len(kept) - count
        found[batch] = timing
    return found


def medians_text(timing: dict[str, list[float]]) -> str:
    """One batch size's step times as medians, in words."""
    parts = [f"{name[:-3]} {statistics.median(values):.0f} us" for name, values in timing.items()
             if name.endswith("_us") and values]
    if not parts:
        return "no steps timed"
    missing = f", {timing['missing']} not timed" if timing.get("missing") else ""
    return ", ".join(parts) + f" (medians of {len(timing['host_us'])} steps{missing})"
