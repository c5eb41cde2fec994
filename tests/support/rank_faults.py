"""The tuner command, for a sweep of torch_split_decode under torchrun, with faults: rank
$SHORT_RANK cannot build the trial of a batch of $SHORT_BATCH (as a GPU with less free
memory than the others' answers a shape that fits theirs); every config of a batch of
$BROKEN_BATCH fails on every rank.

    torchrun --nproc-per-node 2 tests/support/rank_faults.py sweep torch_split_decode --shapes S --db D
"""

import dataclasses
import os

import tuner.ops
import tuner.sweep.measure
from tuner.cli import main
from tuner.ops.torch_split import TORCH_SPLIT_DECODE

build_trial = tuner.sweep.measure.build_trial


def short_of_memory(op, shape, device, seed=0, **kwargs):
    if os.environ.get("RANK") == os.environ.get("SHORT_RANK") and str(shape.batch) == os.environ.get("SHORT_BATCH"):
        raise MemoryError("needs 9.9 GB, 1.2 GB free")
    return build_trial(op, shape, device, seed, **kwargs)


def run(inputs, config):
    if str(len(inputs.lengths())) == os.environ.get("BROKEN_BATCH"):
        raise RuntimeError("no config runs here")
    return TORCH_SPLIT_DECODE.run(inputs, config)


tuner.sweep.measure.build_trial = short_of_memory
tuner.ops._REGISTRY["torch_split_decode"] = dataclasses.replace(TORCH_SPLIT_DECODE, run=run)
main()
