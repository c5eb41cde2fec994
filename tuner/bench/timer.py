"""The wall-clock timer, and the timer of a preset for a device."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from tuner import settings
from tuner.bench.timing import Rotation, Timer, Timing, as_rotation, summarize

def timer_for(preset: str | settings.TimerPreset, device: str) -> Timer:
    """The timer of a named preset (tuner.settings.TIMERS) or a preset, for a device: CUDA
    graphs with a cold L2 on a GPU, the wall clock on a CPU."""
    if isinstance(preset, str):
        preset = settings.TIMERS[preset]
    if device == "cuda":
        from tuner.bench.cuda_timer import CudaGraphTimer

        return CudaGraphTimer(warmup=max(1, preset.warmup), repeats=preset.repeats,
                              min_sample_us=preset.min_sample_us)
    return WallClockTimer(warmup=preset.warmup, repeats=preset.repeats,
                          min_repeats=min(preset.min_repeats, preset.repeats), max_seconds=preset.max_seconds)


class WallClockTimer:
    """Host wall-clock timing of whole calls: warm-up, then repeats (stopping early once
    max_seconds have passed and min_repeats were taken), each sample a pass over the
    rotation. Synchronises CUDA when asked,
    so it is right (if launch-bound) for GPU work too."""

    def __init__(
        self,
        warmup: int = 2,
        repeats: int = 15,
        min_repeats: int = 5,
        max_seconds: float = 2.0,
        cuda_sync: bool = False,
    ) -> None:
        if warmup < 0 or repeats < 1 or not 1 <= min_repeats <= repeats or max_seconds <= 0:
            raise ValueError("warmup >= 0, 1 <= min_repeats <= repeats and max_seconds > 0")
        self.warmup, self.repeats, self.min_repeats = warmup, repeats, min_repeats
        self.max_seconds = max_seconds
        self._sync: Callable[[], None] = _cuda_sync if cuda_sync else (lambda: None)

    @property
    def method(self) -> dict[str, Any]:
        return {
            "timer": "wallclock",
            "warmup": self.warmup,
            "repeats": self.repeats,
            "min_repeats": self.min_repeats,
            "max_seconds": self.max_seconds,
        }

    def quick(self) -> "WallClockTimer":
        """A cheaper timer for the first, quick rung of a successive-halving sweep."""
        quick = settings.QUICK_REPEATS_CPU
        timer = WallClockTimer(warmup=min(self.warmup, 1), repeats=quick, min_repeats=quick,
                               max_seconds=self.max_seconds / 4)
        timer._sync = self._sync
        return timer

    def __call__(self, fns: Rotation) -> Timing:
        rotation = as_rotation(fns)
        for _ in range(self.warmup):
            self._pass(rotation)
        samples: list[float] = []
        deadline = time.perf_counter() + self.max_seconds
        for i in range(self.repeats):
            samples.append(self._pass(rotation))
            if i + 1 >= self.min_repeats and time.perf_counter() > deadline:
                break
        return summarize(samples)

    def _pass(self, rotation: Sequence[Callable[[], Any]]) -> float:
        """One sample: a pass over the whole rotation, per call (so a rotation of different
        inputs, a serving trial's batches, is timed as their mean, as on the GPU)."""
        start = time.perf_counter_ns()
        for fn in rotation:
            fn()
        self._sync()
        return (time.perf_counter_ns() - start) / 1000.0 / len(rotation)


    def paired(self, fns_a: Rotation, fns_b: Rotation) -> tuple[Timing, Timing]:
        """Time two rotations in alternation (a, b, a, b, ...) so drift in the machine's
        load falls on both alike; for confirming a winner against the default."""
        a, b = as_rotation(fns_a), as_rotation(fns_b)
        for _ in range(self.warmup):
            self._pass(a)
            self._pass(b)
        samples: tuple[list[float], list[float]] = ([], [])
        deadline = time.perf_counter() + 2 * self.max_seconds
        for i in range(self.repeats):
            samples[0].append(self._pass(a))
            samples[1].append(self._pass(b))
            if i + 1 >= self.min_repeats and time.perf_counter() > deadline:
                break
        return summarize(samples[0]), summarize(samples[1])


def _cuda_sync() -> None:
    import torch

    torch.cuda.synchronize()
