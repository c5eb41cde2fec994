"""When a FlashInfer plan may be reused: host-side rules, no FlashInfer import.

A plan fixes, per request, how the kv sequence is split into chunks. FlashInfer's kernels
(decode, and the prefill kernel behind tensor-core decode) read each request's current kv
length from the device and compute chunk j as [j*c, min((j+1)*c, kv_len)) in unsigned
arithmetic: a chunk that starts past kv_len underflows, and tokens past the last planned
chunk are never read. So a plan made for lengths P stays valid for lengths A exactly when
every request keeps its chunk count: ceil(A_i / c) == ceil(P_i / c). A plan that does not
split kv reads each whole sequence and stays valid for any lengths.

The chunk length and counts are read back from the plan itself (its page-locked host
buffer), in the layout of FlashInfer 0.6's DecodePlanInfo (10 fields) and FA2
PrefillPlanInfo (15 fields). Any other layout (FlashInfer's FA3 backend, another version)
gives no coverage, and the plan is then reused only for identical page counts and lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

# field indices in FlashInfer's plan_info vectors: (split_kv, o_indptr offset, kv chunk size offset)
_DECODE_LAYOUT = (10, 9, 5, 7)
_PREFILL_FA2_LAYOUT = (15, 14, 8, 9)


@dataclass(frozen=True)
class PlanCoverage:
    """What a plan fixed about the kv of each request."""

    split: bool
    chunk_tokens: int
    chunks: np.ndarray  # kv chunks per request

    def covers(self, seq_lens: np.ndarray) -> bool:
        """True when running with these kv lengths reads exactly what the plan scheduled."""
        lo, hi = self.bounds()
        return len(seq_lens) == len(lo) and bool(np.all(seq_lens > lo)) and bool(np.all(seq_lens <= hi))

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Per request, the kv lengths (lo, hi] the plan stays valid for."""
        if not self.split:
            return np.full(len(self.chunks), 0, dtype=np.int64), np.full(len(self.chunks), np.iinfo(np.int64).max)
        return (self.chunks - 1) * self.chunk_tokens, self.chunks * self.chunk_tokens


def valid_bounds(coverage: PlanCoverage | None, planned: np.ndarray, kv_upper: int) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi] per request within which a plan made for `planned` lengths may be reused: the
    coverage's bounds (only the planned lengths themselves when the coverage is unknown),
    capped at kv_upper, the top of the kv-length bucket the config was chosen for."""
    lo, hi = coverage.bounds() if coverage is not None else (planned - 1, planned)
    return lo, np.minimum(hi, kv_upper)


def coverage_from_plan(plan_info: Sequence[int], pinned: Any, batch: int,
                       qo_lens: np.ndarray | None = None) -> PlanCoverage | None:
    """The coverage a FlashInfer plan fixed, read from its plan_info and page-locked int
    buffer (a uint8 CPU tensor or array); None when the layout is not one we know.

    qo_lens: query tokens per request, for prefill plans (their o_indptr counts chunks
    times query rows); None for decode.
    """
    info = [int(x) for x in plan_info]
    for size, split_at, o_indptr_at, chunk_at in (_DECODE_LAYOUT, _PREFILL_FA2_LAYOUT):
        if len(info) == size:
            break
    else:
        return None
    raw = np.asarray(pinned).view(np.uint8)
    o_off, chunk_off = info[o_indptr_at], info[chunk_at]
    if min(o_off, chunk_off) < 0 or o_off + 4 * (batch + 1) > raw.size or chunk_off + 4 > raw.size:
        return None
    split = bool(info[split_at])
    o_indptr = raw[o_off:o_off + 4 * (batch + 1)].view(np.int32).astype(np.int64)
    chunks = np.diff(o_indptr)
    if qo_lens is not None:
        if np.any(qo_lens <= 0) or np.any(chunks % qo_lens):
            return None
        chunks = chunks // qo_lens
    chunk_tokens = int(raw[chunk_off:chunk_off + 4].view(np.int32)[0])
    if split and (chunk_tokens <= 0 or np.any(chunks <= 0)):
        return None
    return PlanCoverage(split=split, chunk_tokens=chunk_tokens, chunks=chunks)


def pages_per_request(seq_lens: np.ndarray, page_size: int) -> np.ndarray:
    return -(-seq_lens // page_size)


def paged_metadata(seq_lens: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(indptr, last_page_len) of FlashInfer's paged layout for these kv lengths, on the host."""
    pages = pages_per_request(seq_lens, page_size)
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    last_page_len = (seq_lens - (pages - 1) * page_size).astype(np.int32)
    return indptr, last_page_len


def host_seq_lens(seq_lens: Any, indptr: Any, last_page_len: Any, page_size: int) -> np.ndarray | None:
    """Each request's kv length as a host int64 array, from whatever the caller gave on the
    host: seq_lens, else indptr and last_page_len. None when they live on the device (reading
    them would synchronise), so the caller plans the standard way."""
    if seq_lens is not None:
        return _host_array(seq_lens)
    indptr_h, last_h = _host_array(indptr), _host_array(last_page_len)
    if indptr_h is None or last_h is None:
        return None
    return (np.diff(indptr_h) - 1) * page_size + last_h


def _host_array(value: Any) -> np.ndarray | None:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            return None
        value = value.numpy()
    array = np.asarray(value)
    if array.dtype.kind not in "iu":  # not lengths (a float one was truncated silently): the caller's way
        return None
    return array.astype(np.int64, copy=False)
