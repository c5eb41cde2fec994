"""What an op is: data (name, grids, tolerance) plus three functions (configs, inputs, run)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tuner import settings
from tuner.bench.check import TOLERANCE
from tuner.keys import Config
from tuner.workload.inputs import DecodeInputs, make_decode_inputs
from tuner.workload.shapes import DecodeShape

class _Tuned:
    """An argument left to tuner: the FlashInfer wrappers' default for plan arguments (and
    FA3's drop-in's old default for num_splits and pack_gqa, taken as the library's choice)."""

    def __repr__(self) -> str:
        return "TUNED"


TUNED: Any = _Tuned()


@functools.cache
def _has_cuda() -> bool:
    return torch.cuda.is_available()  # ~0.5 us a call: asked once, as no capture can begin without it


def stream_capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph."""
    return _has_cuda() and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=16)
def sm_count(device_index: int | None = None) -> int:
    """The GPU's SM count (the current device's by default), what a GPU op's config space is
    sized by; settings.DEFAULT_SM_COUNT where there is no GPU (a plan made on the CPU)."""
    if not torch.cuda.is_available():
        return settings.DEFAULT_SM_COUNT
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(index).multi_processor_count

@dataclass(frozen=True)
class Op:
    """A tunable op. configs(shape) lists candidates; default(shape) is the library's choice;
    check(config, shape) says why a config (stored, imported, borrowed) cannot run for that
    shape, or None when it can."""

    name: str
    description: str
    configs: Callable[[DecodeShape], list[Config]]
    default: Callable[[DecodeShape], Config]
    run: Callable[[DecodeInputs, Config], torch.Tensor]
    grids: dict[str, list[DecodeShape]]
    # None when the op can run here, else one line saying why not
    unavailable: Callable[[], str | None] = lambda: None
    device: Callable[[], str] = lambda: "cpu"
    make_inputs: Callable[..., DecodeInputs] = make_decode_inputs
    tolerance: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(TOLERANCE))
    check: Callable[[Config, DecodeShape], str | None] = lambda config, shape: None
    # compile what configs will run on these inputs, ahead and in parallel (Triton), so that
    # timing never waits on a compiler; best effort: a config it could not build fails later,
    # when it runs, as it would without this. None: nothing to compile
    precompile: Callable[[DecodeInputs, list[Config]], None] | None = None
    # by_fill(dense, other): one config that runs `dense` on dense batches
    # (tuner.workload.traffic.is_dense) and `other` on the rest, for a sweep's dense pass
    # (tuner.sweep); None: the op has no such config
    by_fill: Callable[[Config, Config], Config] | None = None
