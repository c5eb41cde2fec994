"""Timing, correctness checks and winner selection. Knows no DB."""

from tuner.bench.check import TOLERANCE, Check, compare, tolerance_for
from tuner.bench.cuda_timer import CudaGraphTimer
from tuner.bench.runner import (boundary_sync, check_config, decide, measure_config, measure_configs, one_line,
                                side_by_side)
from tuner.bench.select import ERROR, OK, OOM, WRONG, Outcome, beats, contenders, same_config, with_default_first
from tuner.bench.timer import WallClockTimer, timer_for
from tuner.bench.timing import Timer, Timing, summarize

__all__ = [
    "ERROR", "OK", "OOM", "WRONG",
    "Check", "CudaGraphTimer", "Outcome", "Timer", "Timing", "WallClockTimer",
    "beats", "boundary_sync", "check_config", "contenders", "decide", "compare", "measure_config", "measure_configs",
    "one_line",
    "TOLERANCE", "same_config", "side_by_side", "summarize", "timer_for", "tolerance_for", "with_default_first",
]
