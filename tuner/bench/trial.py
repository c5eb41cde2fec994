"""A trial: everything a measurement of candidate configs needs, whoever built it (a sweep's
shape, a call that missed in tune mode, a winner re-checked before it ships)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from tuner import settings
from tuner.keys import Config



@dataclass
class Trial:
    """runs: one callable of a config per copy of the inputs (all copies hold the same values;
    a timer rotates through them for a cold cache); reference: the output every candidate
    must match within tolerance (atol, rtol); kv_len: the kv length it measures."""

    runs: Sequence[Callable[[Config], Any]]
    reference: Any
    tolerance: tuple[float, float]
    kv_len: int


def cold_l2_copies(nbytes: int, device: str, max_copies: int = 64) -> int:
    """How many copies of inputs of `nbytes` to rotate through so that each timed call finds
    them out of the L2 (twice the L2 in all), as consecutive layers of a model do. On the CPU
    the wall-clock timer measures whole calls, and one copy is used."""
    if device != "cuda":
        return 1
    l2_bytes = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
    l2_bytes = l2_bytes or settings.DEFAULT_L2_BYTES
    return max(1, min(max_copies, math.ceil(2 * l2_bytes / max(nbytes, 1))))
