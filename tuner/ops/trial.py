"""The trial builder of an op: a shape's inputs on a device, the reference output, copies
that read fresh pages for a cold L2 (tuner.ops.rotation), and the op's tolerance."""

from __future__ import annotations

import functools
import os

import torch

from tuner.bench.trial import Trial, cold_l2_copies
from tuner.ops.base import Op
from tuner.ops.rotation import bytes_read, fresh_page_copies
from tuner.ops.shapes import DecodeShape


def too_big(shape: DecodeShape, device: str) -> str | None:
    """Why the shape's KV cache (and the reference's copy of it) cannot fit, or None."""
    need = 3 * shape.kv_bytes()  # the cache, plus headroom for outputs and the reference's work
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0]
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    if need > free:
        return f"needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free on {device}"
    return None


def build_trial(op: Op, shape: DecodeShape, device: str, seed: int = 0) -> Trial:
    """The trial of one shape of an op. MemoryError when it cannot fit; a RuntimeError of
    the reference passes through (the caller records the shape as failed)."""
    why = too_big(shape, device)
    if why:
        raise MemoryError(why)
    inputs = op.make_inputs(shape, device=device, seed=seed)
    reference = inputs.reference()
    copies = fresh_page_copies(inputs, cold_l2_copies(bytes_read(inputs), device))
    del inputs  # its caches live on in the copies' pool
    return Trial(runs=[functools.partial(op.run, copy) for copy in copies], reference=reference,
                 tolerance=op.tolerance[shape.dtype], kv_len=shape.kv_len)
