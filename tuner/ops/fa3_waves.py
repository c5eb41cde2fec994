"""FA3's split counts as its scheduler computes them from a batch's lengths, and the cap on
them that keeps the kernel's work within one wave of the GPU where that shortens it: a host
model of sgl-kernel FA3's varlen scheduler, and the decode_attention config ("wave_fit") that
runs it per call.

Why (docs/decisions.md, "FA3's wave overflow"): with cache_seqlens, FA3 gives each sequence
ceil(its blocks / blocks_per_sm) splits, blocks_per_sm sized on the whole batch with a 10%
margin. Rounding up per sequence can still make a few work tiles more than the SMs, and
then a second wave of full-size tiles nearly doubles the kernel's time (batch 3 x 11k keys,
8 kv heads: splits 6, 6, 5 make 136 tiles on 132 SMs). A cap on num_splits that fits one
wave gains there; on skewed batches the overflow is of short tiles and a cap would only
lengthen the long sequence's, so the cap is taken only where the modelled kernel time drops.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from typing import Any

import numpy as np
import torch

from tuner import settings
from tuner.ops.base import Config, sm_count
from tuner.ops.fa3 import FA3, RULES, shape_problem
from tuner.ops.fa3 import _run as _fa3_run
from tuner.ops.rules import config_error, one_of
from tuner.workload.inputs import DecodeInputs
from tuner.workload.shapes import DecodeShape

WAVE_FIT = "wave_fit"  # the knob: {"num_splits": 0, "pack_gqa": None, "wave_fit": True}
# the sgl-kernel releases whose FA3 scheduler this models (read in its source; timed on the H200
# and H100): where FA3's default runs, graph variants add cap graphs only with one of these
MODELLED_SGL_KERNEL = frozenset({"0.4.5"})
MAX_BATCH = 992  # past this FA3's scheduler gives every sequence one split
# FA3's blocks_per_sm margin (flash_prepare_scheduler.cu), in float32 as it computes it
_F32 = struct.Struct("f")
_MARGIN = _F32.unpack(_F32.pack(1.1))[0]


def block_n(head_dim: int, local: bool = False) -> int:
    """FA3's kBlockN on SM90 for a paged cache read without TMA (every decode call: its
    queries per kv head are far below the tile's rows), 16-bit elements (tile_size.h)."""
    if head_dim <= 128:
        return 128
    if head_dim <= 192:
        return 96
    return 64 if local else 80


def block_m(head_dim: int) -> int:
    return 192 if head_dim <= 96 else 128


def tiles_per_split(num_kv_heads: int, q_per_kv: int, q_len: int, head_dim: int, **_: int) -> int:
    """FA3's work tiles for one split of one sequence: its kv heads x the blocks of their
    packed queries (takes wave_args' dict, whose other keys it ignores)."""
    return num_kv_heads * -(-(q_len * q_per_kv) // block_m(head_dim))


def static_splits(tiles: int, table_keys: int, head_dim: int, sms: int) -> int:
    """FA3's host cap on each sequence's splits when the caller passes num_splits=0
    (num_splits_heuristic with the varlen scheduler's batch of 1): tiles is kv heads x the
    query blocks of one sequence; table_keys, the page table's width in keys."""
    return _static_splits(tiles, -(-table_keys // block_n(head_dim)), sms)


@functools.lru_cache(maxsize=4096)  # a loop of up to 128 steps; a server asks for few widths
def _static_splits(tiles: int, n_blocks: int, sms: int) -> int:
    if tiles >= 0.8 * sms or n_blocks <= 4:
        return 1
    top = min(128, sms, n_blocks)
    efficiency = []
    for splits in range(1, top + 1):
        waves = tiles * splits / sms
        efficiency.append(waves / math.ceil(waves))
    best = max(efficiency)
    return next(s for s, e in enumerate(efficiency, 1) if e >= 0.85 * best)


def _f32(value: float) -> float:
    """value rounded to float32, as FA3's scheduler computes (a NumPy scalar op costs ~1 us)."""
    return _F32.unpack(_F32.pack(value))[0]


def dynamic_splits(n_blocks: np.ndarray, m_blocks: int, kv_heads: int, cap: int, sms: int) -> np.ndarray:
    """Each sequence's splits as FA3's scheduler kernel computes them on the device, at most cap."""
    total = _f32(float(m_blocks * int(n_blocks.sum())))
    per_sm = math.ceil(_f32(_f32(_f32(total * _MARGIN) * kv_heads) / sms))
    if per_sm <= 0:
        return np.ones_like(n_blocks)
    splits = (n_blocks + (per_sm - 1)) // per_sm
    np.minimum(splits, max(cap, 1), out=splits)
    return np.maximum(splits, 1, out=splits)


def kernel_time(n_blocks: np.ndarray, splits: np.ndarray, tiles_per_split: int, sms: int) -> float | None:
    """The kernel's modelled time in kv blocks: each tile reads its share of its sequence's
    blocks plus settings.FA3_WAVE_TILE_OVERHEAD_BLOCKS, longest first onto the least loaded SM
    (exact for at most two tiles per SM); None past two waves."""
    counts = splits * tiles_per_split
    total = int(counts.sum())
    if total > 2 * sms:
        return None
    works = np.repeat((n_blocks + splits - 1) // splits, counts)
    works.sort()
    works = works[::-1]  # longest first
    first = min(total, sms)
    second = total - first
    overhead = settings.FA3_WAVE_TILE_OVERHEAD_BLOCKS
    if not second:
        return float(works[0]) + overhead
    # the k-th tile of the second wave goes onto the SM of the k-th shortest of the first
    return float(max(works[0], (works[first - second:first][::-1] + works[first:]).max() + overhead)) + overhead


def _fitting_cap(splits: np.ndarray, tiles: int, sms: int) -> int:
    """The largest cap below the largest split count whose tiles fit one wave (1 where none above 1 does)."""
    ordered = np.sort(splits)
    room = sms // tiles  # splits in all that one wave holds
    for cap in range(int(ordered[-1]) - 1, 1, -1):
        below = int(np.searchsorted(ordered, cap))  # sequences with fewer splits than the cap keep theirs
        if int(ordered[:below].sum()) + cap * (ordered.size - below) <= room:
            return cap
    return 1


def fa3_splits(lengths: Any, *, num_kv_heads: int, q_per_kv: int, q_len: int, head_dim: int, table_keys: int,
               sms: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(each sequence's kv blocks, its split count, work tiles per split) as FA3 runs a batch of
    these lengths with num_splits=0; None where no cap could make one wave of it (past two
    waves of tiles without splits, or more than FA3's varlen scheduler takes) or FA3 would
    not split it at all."""
    tiles = tiles_per_split(num_kv_heads, q_per_kv, q_len, head_dim)
    batch = len(lengths)
    if not batch or batch > MAX_BATCH or batch * tiles > 2 * sms:
        return None
    cap = static_splits(tiles, table_keys, head_dim, sms)
    if cap <= 1:
        return None
    bn = block_n(head_dim)
    n_blocks = (np.asarray(lengths, dtype=np.int64) + (bn - 1)) // bn
    return n_blocks, dynamic_splits(n_blocks, tiles // num_kv_heads, num_kv_heads, cap, sms), tiles


CAPS_KEPT = 4096  # wave_cap's batches of kv blocks kept
KEPT_BATCH = 32  # wave_cap keeps the caps of batches of up to this many sequences
_caps_by_blocks: dict[tuple, int] = {}


def wave_cap(lengths: Any, *, sms: int, **shape: int) -> int:
    """The num_splits a wave_fit config passes FA3 for a batch of these kv lengths (a list,
    an array or a CPU tensor; shape: fa3_splits's): 0 (FA3's own choice) unless FA3's tiles
    would spill past one wave and a cap that fits them in one makes the modelled kernel at
    least settings.FA3_WAVE_MIN_GAIN faster.

    Kept per batch of kv blocks: a server asks at every decode step, on its host step's clock,
    and the model costs tens of us; the cap depends on the lengths only through each
    sequence's blocks, in any order, which a decoding sequence changes once in block_n steps.
    A batch of more than KEPT_BATCH sequences crosses a block at most steps: computed each time."""
    if len(lengths) > KEPT_BATCH:
        return _wave_cap(lengths, sms=sms, **shape)
    bn = block_n(shape["head_dim"])
    blocks = tuple(sorted([(n + bn - 1) // bn for n in _host_list(lengths)]))
    key = (blocks, sms, shape["num_kv_heads"], shape["q_per_kv"], shape["q_len"], shape["head_dim"],
           shape["table_keys"], settings.FA3_WAVE_MIN_GAIN, settings.FA3_WAVE_TILE_OVERHEAD_BLOCKS)
    cap = _caps_by_blocks.get(key)
    if cap is None:
        if len(_caps_by_blocks) >= CAPS_KEPT:
            _caps_by_blocks.clear()  # (a server's batches revisit few block sets; a sweep's do not)
        cap = _caps_by_blocks[key] = _wave_cap(lengths, sms=sms, **shape)
    return cap


def _host_list(lengths: Any) -> list[int]:
    """The lengths as Python ints (tolist(): faster than NumPy's ops on a batch's few)."""
    if isinstance(lengths, (torch.Tensor, np.ndarray)):
        return lengths.tolist()
    return [int(n) for n in lengths]


def _wave_cap(lengths: Any, *, sms: int, **shape: int) -> int:
    """wave_cap, computed."""
    own_splits = fa3_splits(lengths, sms=sms, **shape)
    if own_splits is None:
        return 0
    n_blocks, splits, tiles = own_splits
    if tiles * int(splits.sum()) <= sms or splits.max() <= 1:
        return 0  # one wave already, or nothing to cap
    fit = _fitting_cap(splits, tiles, sms)
    own = kernel_time(n_blocks, splits, tiles, sms)
    capped = kernel_time(n_blocks, np.minimum(splits, fit), tiles, sms)
    if own is None or capped is None or capped * (1 + settings.FA3_WAVE_MIN_GAIN) > own:
        return 0
    return fit


def wave_args(q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor, sms: int) -> dict[str, int]:
    """wave_cap's arguments besides the lengths, for a decode call of these tensors (shapes only)."""
    kv_heads = k_cache.shape[2]
    return dict(num_kv_heads=kv_heads, q_per_kv=q.shape[2] // kv_heads, q_len=q.shape[1], head_dim=q.shape[3],
                table_keys=page_table.shape[1] * k_cache.shape[1], sms=sms)


def fits_shape(shape: DecodeShape) -> bool:
    """Whether a wave_fit config can differ from FA3's default for the shape: 16-bit
    elements, no sliding window (its keys per sequence are not its length), a batch whose
    tiles without splits fit two waves."""
    tiles = tiles_per_split(shape.num_kv_heads, shape.num_q_heads // shape.num_kv_heads, shape.q_len, shape.head_dim)
    return (shape.dtype in ("bfloat16", "float16") and tuple(shape.window) == (-1, -1)
            and shape.batch * tiles <= 2 * sm_count())


def resolved(config: Config, lengths: Any, num_kv_heads: int, q_per_kv: int, q_len: int, head_dim: int,
             table_keys: int) -> Config:
    """The plain FA3 config a wave_fit config runs for a batch of these host lengths (None:
    unknown, FA3's own choice); any other config as it is."""
    if not config.get(WAVE_FIT):
        return config
    cap = 0 if lengths is None else wave_cap(
        [int(n) for n in lengths], num_kv_heads=num_kv_heads, q_per_kv=q_per_kv, q_len=q_len, head_dim=head_dim,
        table_keys=table_keys, sms=sm_count())
    return {k: v for k, v in config.items() if k != WAVE_FIT} | {"num_splits": cap}


def resolved_for(config: Config, inputs: DecodeInputs) -> Config:
    """resolved() for a sweep's batch (its host lengths; a graph's replayed batch has none)."""
    s = inputs.shape
    return resolved(config, inputs.seq_lens_host, s.num_kv_heads, s.num_q_heads // s.num_kv_heads, s.q_len,
                    s.head_dim, inputs.page_table.shape[1] * s.page_size)


def configs(shape: DecodeShape) -> list[Config]:
    """FA3's configs, and where it can differ from the default (fits_shape), the wave_fit one."""
    extra = [{"num_splits": 0, "pack_gqa": None, WAVE_FIT: True}] if fits_shape(shape) else []
    return FA3.configs(shape) + extra


def check_config(config: Config, shape: DecodeShape | None = None) -> str | None:
    why = config_error(config, RULES, {WAVE_FIT: one_of(True)})
    if why is None and config.get(WAVE_FIT) and config["num_splits"] != 0:
        return f"{WAVE_FIT} caps FA3's own split counts: num_splits must be 0"
    return why or (shape_problem(shape) if shape is not None else None)


def _run(inputs: DecodeInputs, config: Config) -> torch.Tensor:
    return _fa3_run(inputs, resolved_for(config, inputs))


# FA3 as decode_attention runs it: the wave_fit config besides FA3's own
FA3_WITH_WAVES = dataclasses.replace(FA3, configs=configs, check=check_config, run=_run)
