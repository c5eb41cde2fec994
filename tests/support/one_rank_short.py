"""The tuner command in which rank $SHORT_RANK cannot build the trial of a batch of
$SHORT_BATCH (as a GPU with less free memory than the others' answers a shape that fits
theirs), for a sweep under torchrun.

    torchrun --nproc-per-node 2 tests/support/one_rank_short.py sweep OP --shapes S --db D
"""

import os

import tuner.sweep.measure
from tuner.cli import main

build_trial = tuner.sweep.measure.build_trial


def short_of_memory(op, shape, device, seed=0, **kwargs):
    if os.environ.get("RANK") == os.environ["SHORT_RANK"] and shape.batch == int(os.environ["SHORT_BATCH"]):
        raise MemoryError("needs 9.9 GB, 1.2 GB free")
    return build_trial(op, shape, device, seed, **kwargs)


tuner.sweep.measure.build_trial = short_of_memory
main()
