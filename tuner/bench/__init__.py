"""Timing, correctness checks and winner selection. Knows no DB."""

from tuner.bench.check import Check, compare
from tuner.bench.cuda_timer import CudaGraphTimer
from tuner.bench.runner import boundary_sync, decide, measure_config, measure_configs
from tuner.bench.select import ERROR, OK, OOM, WRONG, Outcome, beats
from tuner.bench.timer import Timing, WallClockTimer, summarize

__all__ = [
    "ERROR", "OK", "OOM", "WRONG",
    "Check", "CudaGraphTimer", "Outcome", "Timing", "WallClockTimer",
    "beats", "boundary_sync", "decide", "compare", "measure_config", "measure_configs",
    "summarize",
]
