"""A trial: everything a measurement of candidate configs needs, whoever built it (a sweep's
shape, a call that missed in tune mode, a winner re-checked before it ships)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from tuner import settings
from tuner.keys import Config



@dataclass(frozen=True)
class Guard:
    """A batch a winner must lose on nowhere, outside the mix whose mean ranks candidates:
    runs of a config over copies of it (cold in the L2 as a part's are) and its reference
    output, which a challenger must match before it is timed there."""

    runs: Sequence[Callable[[Config], Any]]
    reference: Any
    lengths: tuple[int, ...] = ()  # its sequences' kv lengths, for what a record says of its trial


@dataclass
class Trial:
    """runs: one callable of a config per copy of the inputs (a timer rotates through them
    for a cold cache); reference: the output of runs[0], which every candidate must match
    within tolerance (atol, rtol); checks: (run index, its reference) for runs whose inputs
    differ from runs[0]'s (a mixed-length trial's other batches), checked likewise; every
    other run holds the same values as one of those. kv_len: the kv length it measures.
    precompile(configs): builds those configs' kernels ahead (tuner.ops.base.Op.precompile),
    or None."""

    runs: Sequence[Callable[[Config], Any]]
    reference: Any
    tolerance: tuple[float, float]
    kv_len: int
    checks: Sequence[tuple[int, Any]] = ()
    precompile: Callable[[list[Config]], None] | None = None
    # a mix's batches, each timed alone (tuner.bench.decide): per batch, runs over copies of it
    # alone, as many as read twice the L2 within settings.PART_MAX_COPIES and the copies'
    # memory (tuner.sweep.trials.part_copies)
    parts: Sequence[Sequence[Callable[[Config], Any]]] = ()
    # batches the winner must also lose on nowhere, each timed alone, outside the mix's mean
    # (a serving trial's batch of equal lengths: tuner.sweep.trials.build_trial)
    guards: Sequence[Guard] = ()


def cold_l2_copies(nbytes: int, device: str, max_copies: int = 64) -> int:
    """How many copies of inputs of `nbytes` to rotate through so that each timed call finds
    them out of the L2 (twice the L2 in all), as consecutive layers of a model do. On the CPU
    the wall-clock timer measures whole calls, and one copy is used."""
    if device != "cuda":
        return 1
    return max(1, min(max_copies, math.ceil(2 * l2_bytes() / max(nbytes, 1))))


def l2_bytes() -> int:
    """The current GPU's L2 (settings.DEFAULT_L2_BYTES where it does not say)."""
    size = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
    return size or settings.DEFAULT_L2_BYTES
