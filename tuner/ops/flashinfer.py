"""The sweepable FlashInfer op: its config space (tensor cores, backend, split size), rules
and defaults, and paged attention in tuner's layouts on FlashInfer's plan-reuse wrappers
(tuner.ops.flashinfer_wrappers), one per config and set of planned lengths.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np
import torch

from tuner.ops import flashinfer_wrappers as wrappers
from tuner.ops.base import Config, Op
from tuner.ops.fa3 import _decode_grid, _mtp_grid
from tuner.ops.flashinfer_plan import paged_metadata
from tuner.ops.flashinfer_wrappers import (DECODE_DEFAULT, PREFILL_DEFAULT, PlanReuseDecodeWrapper,
                                           PlanReusePrefillWrapper, _PlanReuseWrapper)
from tuner.ops.rules import IS_BOOL, config_error, is_int, one_of, optional
from tuner.workload.inputs import DecodeInputs
from tuner.workload.shapes import DecodeShape, grid

OP_NAME = "flashinfer"
WORKSPACE_BYTES = 512 * 2**20
# wrappers kept for explicit-config calls (paged_attention): a sweep's timing captures at most
# two configs x a trial's dozen length draws at once, and each must outlive its graph. Each
# FlashInfer wrapper holds an 8 MiB device workspace and as much page-locked host memory
# (a prefill wrapper also a 64 MiB index buffer), for as long as it is kept
OP_WRAPPERS = 48
SPLIT_COUNTS = (2, 4, 8, 16, 32)  # fixed_split_size candidates: kv split into this many chunks


def unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed (pip install 'tuner-attn[gpu]')"
    return None


def supports(shape: DecodeShape) -> bool:
    """Shapes FlashInfer's wrappers run as our reference defines them: no attention sinks,
    equal q/v head dims, and (for several query tokens) a causal mask."""
    return not shape.sinks and (shape.q_len == 1 or shape.causal)


def config_space(shape: DecodeShape) -> list[Config]:
    """Decode (one query token): CUDA-core or tensor-core kernels; the tensor-core FA2 path
    also takes a fixed split size (in pages) or no split. Several query tokens: the prefill
    wrapper, FA2 or FA3, the same split choices for FA2."""
    if not supports(shape):
        return []
    pages = -(-shape.kv_len // shape.page_size)
    splits = sorted({-(-pages // n) for n in SPLIT_COUNTS if pages >= 2 * n})
    fa2 = ([{"fixed_split_size": None, "disable_split_kv": False}, {"fixed_split_size": None, "disable_split_kv": True}]
           + [{"fixed_split_size": f, "disable_split_kv": False} for f in splits])
    if shape.q_len == 1:
        return ([dict(DECODE_DEFAULT), {**DECODE_DEFAULT, "use_tensor_cores": True, "flashinfer_backend": "fa3"}]
                + [{"use_tensor_cores": True, "flashinfer_backend": "fa2", **c} for c in fa2])
    return ([dict(PREFILL_DEFAULT), {**PREFILL_DEFAULT, "flashinfer_backend": "fa3"}]
            + [{"flashinfer_backend": "fa2", **c} for c in fa2])


_PLAN_RULES = {"flashinfer_backend": one_of("auto", "fa2", "fa3"), "fixed_split_size": optional(is_int(1, 2**31)),
               "disable_split_kv": IS_BOOL}
DECODE_RULES = {"use_tensor_cores": IS_BOOL, **_PLAN_RULES}
PREFILL_RULES = dict(_PLAN_RULES)


def check_config(config: Config, shape: DecodeShape) -> str | None:
    """Decode (one query token) configs for the decode wrapper, prefill configs for more."""
    if not supports(shape):
        return "FlashInfer's wrappers do not run this shape (attention sinks, or several non-causal query tokens)"
    return config_error(config, DECODE_RULES if shape.q_len == 1 else PREFILL_RULES)


def default_config(shape: DecodeShape) -> Config:
    return dict(DECODE_DEFAULT if shape.q_len == 1 else PREFILL_DEFAULT)


# -- the sweepable op -----------------------------------------------------------------------


@functools.cache
def _workspace(device: str) -> torch.Tensor:
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


@functools.lru_cache(maxsize=OP_WRAPPERS)
def _op_wrapper(lib: Any, device: str, q_len_is_one: bool, config_items: tuple, plan_slot: Hashable
                ) -> _PlanReuseWrapper:
    """One wrapper per config, device, flashinfer module (whose wrappers it holds) and plan slot.

    Calls captured together into one CUDA graph (a sweep's rotation of length draws) must
    each be planned before the capture: FlashInfer cannot plan inside one (it copies host
    tensors that are not page-locked), so draws sharing a wrapper re-planned inside the
    capture, which failed, and the trial was timed eagerly (docs/decisions.md, "A sweep that
    nothing kills")."""
    cls = PlanReuseDecodeWrapper if q_len_is_one else PlanReusePrefillWrapper
    return cls(_workspace(device), "NHD", config=dict(config_items))


@dataclass
class _PagedLayout:
    """A page table and host kv lengths in FlashInfer's layout."""

    seq_lens: np.ndarray
    qo_indptr: torch.Tensor  # host
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


@dataclass(frozen=True)
class _Gather:
    """Where a layout's indices sit in a page table of some width, for some kv lengths:
    the host-side half of a layout, which depends on the lengths only (never on the table's
    contents), so it can be kept and reused while the table changes in place."""

    indptr: torch.Tensor  # device
    last_page_len: torch.Tensor  # device
    qo_indptr: torch.Tensor  # host
    pages: int | None  # every request's page count, when all are equal: a slice, no gather
    flat: torch.Tensor | None  # device, positions in page_table.reshape(-1), otherwise


@functools.lru_cache(maxsize=256)
def _gather(lens_bytes: bytes, width: int, page_size: int, q_len: int, device: str) -> _Gather:
    seq_lens = np.frombuffer(lens_bytes, dtype=np.int64)
    # (checked here, once per set of lengths: a length past the table read the next row's pages)
    if len(seq_lens) and (seq_lens.min() < 0 or seq_lens.max() > width * page_size):
        raise ValueError(f"kv lengths must be 0 to the page table's capacity ({width} pages of {page_size}), "
                         f"got {seq_lens.min()} to {seq_lens.max()}")
    indptr_h, last_h = paged_metadata(seq_lens, page_size)
    pages = np.diff(indptr_h)
    same = bool(len(pages)) and bool(np.all(pages == pages[0]))
    flat = None
    if not same:
        positions = [i * width + np.arange(n) for i, n in enumerate(pages)]
        flat = torch.from_numpy(np.concatenate(positions).astype(np.int64) if positions else
                                np.zeros(0, dtype=np.int64)).to(device)
    return _Gather(
        indptr=torch.from_numpy(indptr_h).to(device),
        last_page_len=torch.from_numpy(last_h).to(device),
        qo_indptr=torch.arange(len(seq_lens) + 1, dtype=torch.int32) * q_len,
        pages=int(pages[0]) if same else None,
        flat=flat,
    )


def _layout(page_table: torch.Tensor, seq_lens: np.ndarray, page_size: int, q_len: int) -> _PagedLayout:
    """FlashInfer's indptr/indices/last_page_len for a [batch, max_pages] page table: the
    indices are read from the table as it is now (a persistent table is updated in place
    between steps: a layout kept from an earlier call would point at its old pages)."""
    seq_lens = np.ascontiguousarray(seq_lens, dtype=np.int64)
    g = _gather(seq_lens.tobytes(), page_table.shape[1], page_size, q_len, str(page_table.device))
    if g.pages is not None:
        indices = page_table[:, : g.pages].reshape(-1)
    else:
        indices = page_table.reshape(-1)[g.flat]
    return _PagedLayout(seq_lens=seq_lens, qo_indptr=g.qo_indptr, indptr=g.indptr, indices=indices.contiguous(),
                        last_page_len=g.last_page_len)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    seq_lens: np.ndarray, config: Config, causal: bool = True, window_left: int = -1,
                    softcap: float | None = None, *, plan_slot: Hashable = None) -> torch.Tensor:
    """Paged attention in tuner's layouts (q [batch, q_len, heads, dim], k/v caches
    [pages, page_size, kv_heads, dim], page_table [batch, max_pages]) on FlashInfer with an
    explicit config; seq_lens: each request's kv length, on the host. Calls of one config
    share one wrapper, which re-plans as their lengths need, unless their plan_slot differs:
    calls captured together into a CUDA graph must each have their own (see _op_wrapper)."""
    batch, q_len, heads, dim = q.shape
    if len(seq_lens) != batch or page_table.shape[0] < batch:
        raise ValueError(f"seq_lens must hold one length per sequence ({batch}), and the page table a row each: "
                         f"got {len(seq_lens)} lengths, {page_table.shape[0]} rows")
    layout = _layout(page_table, seq_lens, k_cache.shape[1], q_len)
    wrapper = _op_wrapper(wrappers.library(), str(q.device), q_len == 1, tuple(sorted(config.items())), plan_slot)
    common = dict(window_left=window_left, logits_soft_cap=softcap or None, q_data_type=q.dtype,
                  kv_data_type=k_cache.dtype, seq_lens=layout.seq_lens)
    if q_len == 1:
        wrapper.plan(layout.indptr, layout.indices, layout.last_page_len, heads, k_cache.shape[2], dim,
                     k_cache.shape[1], **common)
    else:
        wrapper.plan(layout.qo_indptr, layout.indptr, layout.indices, layout.last_page_len, heads,
                     k_cache.shape[2], dim, k_cache.shape[1], causal=causal, **common)
    out = wrapper.run(q.reshape(batch * q_len, heads, dim), (k_cache, v_cache))
    return out.view(batch, q_len, heads, dim)


_UNIFORM_LENS: dict[tuple[int, int], np.ndarray] = {}


def _run(inputs: DecodeInputs, config: Config) -> torch.Tensor:
    s = inputs.shape
    if inputs.seq_lens_host is not None:
        lens = inputs.seq_lens_host.numpy().astype(np.int64)
    else:
        lens = _UNIFORM_LENS.get((s.batch, s.kv_len))
        if lens is None:
            lens = _UNIFORM_LENS[(s.batch, s.kv_len)] = np.full(s.batch, s.kv_len, dtype=np.int64)
    # timers capture a rotation of calls into one CUDA graph: each set of lengths of a trial
    # plans on its own wrapper, so a replay never runs one call's kernels on another's plan
    # (uniform lengths: every copy plans alike, one wrapper serves them all)
    slot = None if inputs.seq_lens_host is None else lens.tobytes()
    return paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, lens, config,
                           causal=s.causal, window_left=s.window[0], softcap=s.softcap or None, plan_slot=slot)


FLASHINFER = Op(
    name=OP_NAME,
    description="FlashInfer paged decode/prefill wrappers; tunes use_tensor_cores, backend, split size (GPU)",
    configs=config_space,
    default=default_config,
    run=_run,
    grids={"decode": _decode_grid(), "mtp": _mtp_grid(), "smoke": grid([1, 64], [512, 8192])},
    unavailable=unavailable,
    device=lambda: "cuda",
    check=check_config,
)
