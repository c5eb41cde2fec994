"""GPU timing under CUDA-graph replay: launch overhead out, cold L2 by rotation, CUDA events.

One graph holds one call per input copy (the rotation); a sample is one replay of the graph
timed with CUDA events, divided by the rotation's length. When a callable cannot be
captured (some libraries plan on the host per call), it is timed eagerly with events and
the method says so.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from tuner import settings
from tuner.bench.timing import Rotation, Timing, as_rotation, summarize


class CudaGraphTimer:
    def __init__(self, warmup: int = 3, repeats: int = 20, min_sample_us: float = 200.0,
                 budget_us: float | None = None) -> None:
        if warmup < 1 or repeats < 1 or (budget_us is not None and budget_us <= 0):
            raise ValueError("warmup >= 1, repeats >= 1 and budget_us > 0")
        self.warmup, self.repeats = warmup, repeats
        # sampling stops once 2 samples are in and the samples took this long (a long call's
        # samples scatter little; its quick rung need not take 5): None, every repeat
        self.budget_us = budget_us
        # a graph replay shorter than this is replayed several times per sample, so the
        # event timer's resolution (~0.5 us) and replay launch cost stay negligible
        self.min_sample_us = min_sample_us
        self.last_capture_failed = False
        self._capture_stream: torch.cuda.Stream | None = None  # made on first use

    @property
    def method(self) -> dict[str, Any]:
        """How it measured; after a capture that failed (some libraries plan on the host per
        call), "capture": "failed, timed eagerly" says the last timing was not a replay."""
        method = {
            "timer": "cuda-graph",
            "warmup": self.warmup,
            "repeats": self.repeats,
            "min_sample_us": self.min_sample_us,
        }
        if self.budget_us is not None:
            method["budget_us"] = self.budget_us
        if self.last_capture_failed:
            method["capture"] = "failed, timed eagerly"
        return method

    def quick(self) -> "CudaGraphTimer":
        """A cheaper timer for the first, quick rung of a successive-halving sweep."""
        return CudaGraphTimer(warmup=1, repeats=min(self.repeats, settings.QUICK_REPEATS_GPU),
                              min_sample_us=self.min_sample_us, budget_us=settings.QUICK_BUDGET_US_GPU)

    def _capture(self, rotation: Sequence[Callable[[], Any]]) -> Callable[[], None]:
        """A replay function for the rotation, or eager calls if capture fails.

        Captured with CUDAGraph.capture_begin/end on a side stream, not torch.cuda.graph:
        that empties PyTorch's memory cache at every capture (measured: a tenth of a
        serving-grid sweep's time, a capture per config). One warm-up call first, outside
        the capture (lazy initialisation, module loads: a rotation's calls all run the same
        kernels, on copies or same-sized batches)."""
        stream = self._stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            rotation[0]()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for attempt in range(2):
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.stream(stream):
                    graph.capture_begin()
                    try:
                        for fn in rotation:
                            fn()
                    finally:
                        graph.capture_end()
            except Exception as e:
                torch.cuda.synchronize()
                graph = None  # (the failed capture's graph freed before a retry)
                if attempt or not _out_of_memory(e):
                    break  # a call that cannot be captured (a host-side plan): timed eagerly
                # a capture cannot take memory from PyTorch's cache (its allocator frees none
                # while capturing): empty it and try once more
                torch.cuda.empty_cache()
                continue
            self.last_capture_failed = False
            return graph.replay
        self.last_capture_failed = True

        def eager() -> None:
            for fn in rotation:
                fn()

        return eager

    def _stream(self) -> torch.cuda.Stream:
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
        return self._capture_stream

    def _time(self, replay: Callable[[], None], calls: int) -> tuple[float, float]:
        """Microseconds per call for one sample, and the sample's own microseconds."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        once_us = start.elapsed_time(end) * 1000.0
        reps = max(1, int(self.min_sample_us / max(once_us, 1e-3)))
        if reps == 1:
            return once_us / calls, once_us
        start.record()
        for _ in range(reps):
            replay()
        end.record()
        end.synchronize()
        total_us = start.elapsed_time(end) * 1000.0
        return total_us / (reps * calls), total_us + once_us

    def __call__(self, fns: Rotation) -> Timing:
        rotation = as_rotation(fns)
        replay = self._capture(rotation)
        for _ in range(self.warmup):
            replay()
        samples, spent = [], 0.0
        for _ in range(self.repeats):
            per_call, took = self._time(replay, len(rotation))
            samples.append(per_call)
            spent += took
            if self.budget_us is not None and len(samples) >= 2 and spent >= self.budget_us:
                break
        return summarize(samples)

    def paired(self, fns_a: Rotation, fns_b: Rotation) -> tuple[Timing, Timing]:
        """Alternate samples of two rotations, so clock and thermal drift hit both alike."""
        a, b = self.interleaved([fns_a, fns_b])
        return a, b

    def interleaved(self, rotations: Sequence[Rotation]) -> list[Timing]:
        """Samples of several rotations taken in turn (a, b, c, a, b, c, ...): one timing each."""
        rots = [as_rotation(fns) for fns in rotations]
        replays, failed = [], False
        for rot in rots:
            replays.append(self._capture(rot))
            failed = failed or self.last_capture_failed
        self.last_capture_failed = failed
        for _ in range(self.warmup):
            for replay in replays:
                replay()
        samples: list[list[float]] = [[] for _ in rots]
        for _ in range(self.repeats):
            for replay, rot, out in zip(replays, rots, samples):
                out.append(self._time(replay, len(rot))[0])
        return [summarize(s) for s in samples]


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
