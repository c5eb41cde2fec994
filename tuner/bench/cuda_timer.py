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
from tuner.bench.timer import Rotation, Timing, as_rotation, summarize


class CudaGraphTimer:
    def __init__(self, warmup: int = 3, repeats: int = 20, min_sample_us: float = 200.0) -> None:
        if warmup < 1 or repeats < 1:
            raise ValueError("warmup >= 1 and repeats >= 1")
        self.warmup, self.repeats = warmup, repeats
        # a graph replay shorter than this is replayed several times per sample, so the
        # event timer's resolution (~0.5 us) and replay launch cost stay negligible
        self.min_sample_us = min_sample_us
        self.last_capture_failed = False

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
        if self.last_capture_failed:
            method["capture"] = "failed, timed eagerly"
        return method

    def quick(self) -> "CudaGraphTimer":
        """A cheaper timer for the first, quick rung of a successive-halving sweep."""
        return CudaGraphTimer(warmup=1, repeats=min(self.repeats, settings.QUICK_REPEATS_GPU),
                              min_sample_us=self.min_sample_us)

    def _capture(self, rotation: Sequence[Callable[[], Any]]) -> Callable[[], None]:
        """A replay function for the rotation, or eager calls if capture fails."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
            for fn in rotation:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for fn in rotation:
                    fn()
        except Exception:
            torch.cuda.synchronize()
            self.last_capture_failed = True

            def eager() -> None:
                for fn in rotation:
                    fn()

            return eager
        self.last_capture_failed = False
        return graph.replay

    def _time(self, replay: Callable[[], None], calls: int) -> float:
        """Microseconds per call for one sample."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        once_us = start.elapsed_time(end) * 1000.0
        reps = max(1, int(self.min_sample_us / max(once_us, 1e-3)))
        if reps == 1:
            return once_us / calls
        start.record()
        for _ in range(reps):
            replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0 / (reps * calls)

    def __call__(self, fns: Rotation) -> Timing:
        rotation = as_rotation(fns)
        replay = self._capture(rotation)
        for _ in range(self.warmup):
            replay()
        return summarize([self._time(replay, len(rotation)) for _ in range(self.repeats)])

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
                out.append(self._time(replay, len(rot)))
        return [summarize(s) for s in samples]
