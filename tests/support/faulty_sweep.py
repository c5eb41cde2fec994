"""The tuner command with one more op, "faulty": torch_split_decode whose kernel, for the chunk named
in $FAULTY_KILLS, prints a CUDA fault and kills its own process (as FA3's illegal memory access
did); for $FAULTY_HANGS, never returns; for $FAULTY_STICKY, raises the error a lost CUDA context
gives; for $FAULTY_KILLS_LATER, kills its process only on lengths other than a serving shape's
first trial (its second trial's); $FAULTY_STICKY_LATER: there raises the error a lost CUDA context
gives, and from then on every call in the process raises it too (as a lost context does);
$FAULTY_KILLS_CONFIRMING and $FAULTY_STICKY_CONFIRMING: likewise, but only while
tuner.bench.decide re-times the chunk against the default; $FAULTY_FAST: every other chunk
sleeps 30 ms a call (so that chunk wins, also on a loaded machine); $FAULTY_TRIAL_STICKY: building
the trial of a batch of that size (its reference) raises the error a lost CUDA context gives;
$FAULTY_PRECOMPILE_KILLS and $FAULTY_PRECOMPILE_HANGS: building configs ahead (the op's
precompile) kills its process, or never returns, where that chunk is among them;
$FAULTY_DIES_AT_START: a supervised
worker dies before it runs anything. Each measurement a process starts appends "pid chunk" to
$FAULTY_LOG.

    python tests/support/faulty_sweep.py sweep faulty --shapes S --db D
"""

import dataclasses
import os
import signal
import sys
import time

import tuner.bench.runner
import tuner.ops
import tuner.search.pipeline
import tuner.sweep.measure
from tuner.cli import main
from tuner.ops.torch_split import TORCH_SPLIT_DECODE
from tuner.sweep.guard import WORKER_ENV

def _chunk(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _die() -> None:
    print("CUDA error (flash_fwd_launch_template.h:175): an illegal memory access was encountered",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _first_trial(batch: int, kv_len: int) -> list[list[int]]:
    from tuner.workload.traffic import equal_draw, serving_draws

    return serving_draws(batch, kv_len, 0) + [equal_draw(batch, kv_len, 0)]


_LOST = []  # the CUDA context, once FAULTY_STICKY_LATER or FAULTY_STICKY_CONFIRMING has lost it
_CONFIRMING = []  # while tuner.bench.decide re-times a challenger against the default


def run(inputs, config):
    chunk = config["chunk"]
    if _LOST:
        raise RuntimeError("CUDA error: unspecified launch failure")
    if chunk == _chunk("FAULTY_STICKY_LATER"):
        lengths = inputs.lengths()
        if lengths not in _first_trial(len(lengths), int(os.environ["FAULTY_KV_LEN"])):
            _LOST.append(True)
            raise RuntimeError("CUDA error: unspecified launch failure")
    if chunk == _chunk("FAULTY_STICKY_CONFIRMING") and _CONFIRMING:
        _LOST.append(True)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if chunk == _chunk("FAULTY_KILLS") or (chunk == _chunk("FAULTY_KILLS_CONFIRMING") and _CONFIRMING):
        _die()
    if chunk == _chunk("FAULTY_KILLS_LATER"):
        lengths = inputs.lengths()
        if lengths not in _first_trial(len(lengths), int(os.environ["FAULTY_KV_LEN"])):
            _die()
    if _chunk("FAULTY_FAST") is not None and chunk != _chunk("FAULTY_FAST"):
        time.sleep(0.03)
    if chunk == _chunk("FAULTY_HANGS"):
        time.sleep(3600)
    if chunk == _chunk("FAULTY_STICKY"):
        raise RuntimeError("CUDA error: unspecified launch failure")
    return TORCH_SPLIT_DECODE.run(inputs, config)


def logged(measure_config):
    def measure(runs, config, **kwargs):
        with open(os.environ["FAULTY_LOG"], "a") as log:
            log.write(f"{os.getpid()} {config['chunk']}\n")
        return measure_config(runs, config, **kwargs)
    return measure


def confirming(side_by_side):
    def timed(*args, **kwargs):
        _CONFIRMING.append(True)
        try:
            return side_by_side(*args, **kwargs)
        finally:
            _CONFIRMING.pop()
    return timed


def trial_sticky(build_trial):
    def build(op, shape, *args, **kwargs):
        if str(shape.batch) == os.environ.get("FAULTY_TRIAL_STICKY"):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return build_trial(op, shape, *args, **kwargs)
    return build


tuner.bench.runner.side_by_side = confirming(tuner.bench.runner.side_by_side)  # decide's, not a second trial's
tuner.sweep.measure.build_trial = trial_sticky(tuner.sweep.measure.build_trial)
if os.environ.get("FAULTY_LOG"):
    tuner.search.pipeline.measure_config = logged(tuner.search.pipeline.measure_config)
def precompile(inputs, configs):
    chunks = {config["chunk"] for config in configs}
    if _chunk("FAULTY_PRECOMPILE_KILLS") in chunks:
        _die()
    if _chunk("FAULTY_PRECOMPILE_HANGS") in chunks:
        time.sleep(3600)


tuner.ops._REGISTRY["faulty"] = dataclasses.replace(TORCH_SPLIT_DECODE, name="faulty", run=run, precompile=precompile)
if os.environ.get("FAULTY_DIES_AT_START") and os.environ.get(WORKER_ENV):
    _die()
main()
