"""Targets of child processes that tests kill: light to import (no pytest), so a forkserver
child is up in milliseconds."""

import os

from tuner.db import TuningDB


def create_db(path, ready, go) -> None:
    """Say it is up, wait for the word, then create a tuning DB at path."""
    ready.set()
    go.wait()
    TuningDB(path)
    os._exit(0)


def sweep_one_shape(path, store_every_s: float) -> None:
    """Sweep one small shape of many candidates, storing measurements every store_every_s."""
    from tuner import settings
    from tuner.bench import WallClockTimer
    from tuner.ops import get_op
    from tuner.workload import DecodeShape
    from tuner.sweep import sweep

    settings.STORE_EVERY_S = store_every_s
    shape = DecodeShape(batch=3, kv_len=700, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                        dtype="float32")
    sweep(get_op("torch_split_decode"), [shape], TuningDB(path), timer=WallClockTimer(warmup=1, repeats=30),
          strategy="exhaustive")
    os._exit(0)
