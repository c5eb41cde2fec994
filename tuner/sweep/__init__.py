"""Offline sweeps: shapes x candidate configs -> checked, timed -> winners in the DB.

Each shape is a trial (trials) measured by the one pipeline (tuner.search.pipeline) with a
search strategy chosen by name (measure), in a loop over the shapes (loop) that the plan
chose (plan). Resumable: a shape's measurements are stored together every few seconds and
when it ends (sink), a shape whose winner is stored is skipped, and a shape cut short
resumes from its stored measurements. A serving winner may get a dense pass (dense).
"""

from tuner.sweep.context import SweepOptions
from tuner.sweep.dense import DENSE_LENGTHS, DENSE_RULE
from tuner.sweep.loop import sweep, sweep_with
from tuner.sweep.plan import (MissPlan, all_serving, candidate_configs, default_backends, default_strategy,
                              plan_from_misses, shape_from_miss)
from tuner.sweep.results import DUPLICATE, FAILED, MEASURED, SKIPPED, ShapeResult, SweepInterrupted
from tuner.sweep.sink import MeasurementSink
from tuner.sweep.trials import build_dense_trial, build_second_trial, build_trial, kv_copies

__all__ = [
    "all_serving",
    "DENSE_LENGTHS",
    "DENSE_RULE",
    "DUPLICATE",
    "FAILED",
    "MEASURED",
    "SKIPPED",
    "MeasurementSink",
    "MissPlan",
    "ShapeResult",
    "SweepInterrupted",
    "SweepOptions",
    "build_dense_trial",
    "build_second_trial",
    "build_trial",
    "candidate_configs",
    "default_backends",
    "default_strategy",
    "kv_copies",
    "plan_from_misses",
    "shape_from_miss",
    "sweep",
    "sweep_with",
]
