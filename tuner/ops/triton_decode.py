"""Split-KV paged decode in Triton: block size, kv splits (how many, and how chosen), warps
and stages are the knobs.

Stage 1 attends one split of one (sequence, kv head, block of query rows). Its rows are
every (query token, q head) pair that reads that kv head, so K and V are loaded once per
GQA group. It walks its share of the keys the rows can see (window and causal bounds
applied first), BLOCK_N tokens at a time through the page table, with an online softmax,
and writes a normalised partial output plus its log-sum-exp. Stage 2 merges the splits by
log-sum-exp, adds the sinks to the denominator and writes q's dtype; with a single split
for every sequence stage 1 writes the output and stage 2 is not launched.

How the keys are split (a stage-1 kernel each; they share the attention and the stores):
- tokens_per_split 0 (the even split): every sequence divides its keys among num_kv_splits
  splits, one stage-1 program each, on a grid sized for the longest sequence; each writes
  its share, so the merge reads every split without looking up lengths first;
- tokens_per_split > 0 (splits by length): each sequence gets a split per tokens_per_split
  of its own keys, at most num_kv_splits, so one long sequence among short ones is split
  finely and the short ones are not; a fixed number of persistent programs take the
  (split, kv head) items there are, so no program is started for a split no sequence has,
  and a sequence whose keys fit one split gets its output there (the merge passes over it);
- items_per_sm > 0 (splits by load): as by length, with tokens_per_split computed on the
  device at every call from the batch's keys, so that all splits of all kv heads come to
  at most items_per_sm per SM (one split each where that is more). A graph captured once
  adapts to the lengths of each replay, as FA3's own scheduler does: a light batch is split
  finely, a heavy one not at all.

The kernels are in triton_kernels.py. Triton is imported lazily, on first use: `import
tuner` stays fast, and the interpreter (TRITON_INTERPRET=1, which Triton reads when
@triton.jit runs) can be switched on before that file is loaded. CPU tensors always go
through the interpreter. Where CUDA is absent, op.unavailable() and the first call set
TRITON_INTERPRET=1 unless the user set it; that must happen before anything imports
triton, since triton.language's own @jit helpers (tl.sum, tl.max) are decorated at that
import. A clear error says so if it came too late.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from tuner import settings
from tuner.keys import visible_kv_len
from tuner.workload.inputs import DecodeInputs
from tuner.ops.base import Config, Op, sm_count
from tuner.ops.rules import config_error, is_int, is_pow2, one_of
from tuner.workload.shapes import DecodeShape, grid
from tuner.workload.traffic import serving_grid

KERNELS_SOURCE = Path(__file__).with_name("triton_kernels.py")

# the config space. CPU (interpreter): small blocks and few splits keep each run short.
CPU_BLOCK_NS = (16, 32, 64)
CPU_SPLITS = (1, 2, 4, 8)
CPU_TOKENS_PER_SPLIT = (32,)
# CUDA: larger blocks (16 is left out as too small for a GPU's tensor cores); split counts
# come from _cuda_splits. (block_n, num_warps, num_stages): the eight that won a shape of
# the shipped and serving sweeps; the other four of the 3 x 2 x 2 never did
# (docs/decisions.md, "The Triton kernel's config space").
CUDA_BLOCK_NS = (32, 64, 128)
CUDA_KERNEL_SHAPES = ((32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3),
                      (128, 4, 2), (128, 4, 3))
CUDA_MAX_SPLITS = 128
CUDA_WAVES = 4
# splits from each sequence's own length (tokens_per_split), at most CUDA_MAX_SPLITS, at the
# token counts that won, with the three kernel shapes that won most (docs/decisions.md)
CUDA_TOKENS_PER_SPLIT = (256, 512, 2048)
CUDA_TOKEN_KERNEL_SHAPES = ((32, 4, 2), (64, 4, 2), (128, 4, 3))
# splits from the call's load (items_per_sm), for graphs replayed over lengths no one knows
# when they are captured (graph shapes only, unless settings.FULL_SPACE): not yet measured,
# so a few of each (docs/decisions.md)
CUDA_ITEMS_PER_SM = (2, 4, 8)
CUDA_LOAD_KERNEL_SHAPES = ((64, 4, 2), (128, 4, 3))
CPU_ITEMS_PER_SM = (16,)
# pruned unless settings.FULL_SPACE: (almost) never near the best in the H200 sweeps
# (docs/decisions.md, "Pruning the config space")
PRUNED_KERNEL_SHAPES = ((32, 4, 3), (64, 4, 3), (64, 8, 3))
PRUNED_TOKEN_KERNEL_SHAPES = ((32, 4, 2), (64, 4, 2))
# the persistent schedule's programs (tokens_per_split > 0): per SM on a GPU; the interpreter
# runs programs one after another, and a few exercise the loop over items
PERSISTENT_PROGRAMS_PER_SM = 8
INTERPRETED_PROGRAMS = 3
INTERPRETED_SMS = 1  # what items_per_sm multiplies in the interpreter
PART_MAX_BYTES = 256 * 2**20  # partial results of the splits, at most
# the merge reads every split's partial output at once where they fit this many floats (a
# hundred splits of head dim 256: one round trip to memory, not one per chunk), else in chunks.
# 128 x 256 is at the edge of a program's registers (docs/decisions.md, MERGE_TILE)
MERGE_TILE = 128 * 256
MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension: the even split's splits
MAX_BLOCK_M = 64  # rows (query token x q head) per stage-1 program; more go to more programs
DEFAULT: Config = {"block_n": 32, "num_kv_splits": 4, "num_warps": 4, "num_stages": 2}

_kernels_lock = threading.Lock()
_kernels_cache: dict[bool, Kernels] = {}  # interpret? -> the kernels


class Kernels(NamedTuple):
    split: Any  # stage 1, the even split: a program per (sequence x kv head, row block, split)
    by_length: Any  # stage 1, splits by length: persistent programs over the (split, kv head) items
    merge: Any  # stage 2: a program per (sequence, query token, q head)


def _define_kernels() -> Kernels:
    """Load the kernels' module (triton_kernels.py) afresh, decorated as TRITON_INTERPRET now
    says: the caller has set it as wanted. A module of its own per call, so a compiled and an
    interpreted set live side by side, each calling its own helpers."""
    spec = importlib.util.spec_from_file_location(f"{__package__}._triton_kernels", KERNELS_SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Kernels(module._decode_split_kernel, module._decode_by_length_kernel, module._decode_merge_kernel)


def _prepare_env() -> None:
    """Where nothing can be compiled, ask for the interpreter (a user's explicit setting wins).

    Call before the first `import triton`: triton.language's own @jit helpers (tl.sum,
    tl.max, ...) are decorated at that import, and the interpreter can only call them if
    TRITON_INTERPRET was already set then.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _kernels(interpret: bool) -> Kernels:
    """The kernels, compiled (interpret=False) or run by Triton's interpreter; cached. Every
    call reads the cache: the lock is taken only to define them, the first time."""
    if (kernels := _kernels_cache.get(interpret)) is not None:
        return kernels
    with _kernels_lock:
        if interpret in _kernels_cache:
            return _kernels_cache[interpret]
        _prepare_env()
        previous = os.environ.get("TRITON_INTERPRET")
        if interpret:
            # CPU tensors can only run interpreted, even on a CUDA machine: force it
            # while decorating (Triton reads the variable then), and put it back after
            os.environ["TRITON_INTERPRET"] = "1"
        try:
            kernels = _define_kernels()
            # (also where the user's TRITON_INTERPRET=1 interprets CUDA tensors)
            if type(kernels.split).__name__ == "InterpretedFunction" and (problem := _interpreter_problem()):
                raise RuntimeError(f"triton_decode: {problem}")
        finally:
            if previous is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = previous
        if interpret:
            if type(kernels.split).__name__ != "InterpretedFunction":
                raise RuntimeError(
                    "triton_decode: CPU tensors need Triton's interpreter, but Triton did not enable "
                    "it (is triton.knobs.runtime.interpret forced off?)"
                )
            import triton.language as tl
            from triton.runtime.jit import JITFunction

            if isinstance(tl.sum, JITFunction):
                raise RuntimeError(
                    "triton_decode: CPU tensors need Triton's interpreter, but triton was imported "
                    "before TRITON_INTERPRET=1 was set, so its tl.sum/tl.max cannot be interpreted; "
                    "set TRITON_INTERPRET=1 in the environment (or before anything imports triton)"
                )
        _kernels_cache[interpret] = kernels
        return kernels


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Layout(NamedTuple):
    """How one call is cut into programs, decided on the host from the shapes and the config."""
    group: int  # q heads per kv head
    left: int  # keys a query sees to its left (-1: all)
    right: int  # and to its right (-1: all; 0 causal)
    mask_right: bool  # a causal mask among the call's own query tokens
    num_splits: int  # per sequence, at most
    by_tokens: bool  # stage 1 by length (or by load) on persistent programs
    by_load: bool  # split size computed on the device from the call's lengths
    target_items: int  # by load: what all splits of all kv heads come to at most
    block_m: int  # rows (query token x q head) per program
    row_blocks: int
    block_d: int
    block_dv: int

    @property
    def final(self) -> bool:
        """One split for every sequence: stage 1 writes the output, no merge."""
        return self.num_splits == 1


def _check_args(q: torch.Tensor, k_cache: torch.Tensor, block_n: int, tokens_per_split: int,
                items_per_sm: int) -> None:
    num_q_heads, num_kv_heads = q.shape[2], k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16 (tl.dot), got {block_n}")
    if tokens_per_split < 0 or items_per_sm < 0:
        raise ValueError(f"tokens_per_split and items_per_sm must be >= 0, got {tokens_per_split}, {items_per_sm}")
    if tokens_per_split and items_per_sm:
        raise ValueError("tokens_per_split and items_per_sm are two ways to size splits: give one")


_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_tensors(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                   cache_seqlens: torch.Tensor, sinks: torch.Tensor | None) -> None:
    """The shapes the kernels index by: a cache, page table or lengths vector that does not
    fit q read out of bounds (garbage or a fault on a GPU) instead of failing. Shapes and
    dtypes only: no device value is read."""
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"q must be (batch, q_len, q heads, head dim) and each cache (pages, page size, kv heads, "
                         f"head dim): got {q.dim()}, {k_cache.dim()} and {v_cache.dim()} dims")
    if not q.dtype == k_cache.dtype == v_cache.dtype:  # (tl.dot takes one dtype: no FP8 cache with 16-bit q)
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if k_cache.shape[:3] != v_cache.shape[:3] or q.shape[3] != k_cache.shape[3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must share pages, "
                         f"page size and kv heads, and k_cache q's head dim {q.shape[3]}")
    batch = q.shape[0]
    for name, t, dims in (("page_table", page_table, 2), ("cache_seqlens", cache_seqlens, 1)):
        if t.dim() != dims or t.shape[0] < batch or t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be {dims}-d int32 or int64 with a row per sequence ({batch}), "
                             f"got {tuple(t.shape)} of {t.dtype}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[2],):
        raise ValueError(f"sinks must hold one value per q head ({q.shape[2]}), got {tuple(sinks.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("page_table", page_table),
                    ("cache_seqlens", cache_seqlens), ("sinks", sinks)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: every tensor on q's device")
    _check_unit_strides(cache_seqlens, sinks)


def _check_unit_strides(cache_seqlens: torch.Tensor, sinks: torch.Tensor | None) -> None:
    """The kernels read the lengths and the sinks as packed vectors: a strided view (a column
    of a server's metadata buffer) gave wrong outputs, silently. No copy is made for it (a
    copy inside a captured graph is one more kernel per layer and step)."""
    for name, t in (("cache_seqlens", cache_seqlens), ("sinks", sinks)):
        if t is not None and t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous (stride 1), got stride {t.stride(0)}: pass a packed "
                             "vector (.contiguous())")


def _layout(q: torch.Tensor, num_kv_heads: int, head_dim_v: int, *, max_kv_len: int, causal: bool,
            window: tuple[int, int], block_n: int, num_kv_splits: int, tokens_per_split: int, items_per_sm: int,
            interpreted: bool) -> _Layout:
    batch, q_len, num_q_heads, head_dim = q.shape
    left, right = window
    left = left if left >= 0 else -1
    right = right if right >= 0 else -1
    if causal:
        right = 0 if right < 0 else min(right, 0)
    by_load = items_per_sm > 0
    # the items a call's splits aim at: per SM (the interpreter runs programs in turn)
    target_items = 0 if not by_load else items_per_sm * (INTERPRETED_SMS if interpreted else sm_count(q.device.index))
    # at most num_kv_splits, and partial results within PART_MAX_BYTES (a split's: a float32
    # output row and its log-sum-exp per (sequence, query, q head)); by load: splits of at least
    # a block, and no sequence takes more than target_items over its kv heads; by length: as
    # many as the longest visible span takes; the even split: as many as hold a block each
    part_cap = PART_MAX_BYTES // max(batch * q_len * num_q_heads * (head_dim_v + 1) * 4, 1)
    visible = visible_kv_len(max_kv_len, q_len, left)
    if by_load:
        wanted = min(_cdiv(visible, block_n), _cdiv(target_items, num_kv_heads))
    elif tokens_per_split > 0:
        wanted = _cdiv(visible, max(tokens_per_split, block_n))
    else:
        wanted = min(_cdiv(max_kv_len, block_n), MAX_GRID_Z)
    num_splits = max(1, min(num_kv_splits, wanted, part_cap))
    group = num_q_heads // num_kv_heads
    block_m = min(MAX_BLOCK_M, max(16, _next_pow2(q_len * group)))  # tl.dot needs >= 16
    # one split each: the even split's single program per unit, by whatever rule
    by_tokens = (tokens_per_split > 0 or by_load) and num_splits > 1
    return _Layout(group=group, left=left, right=right, mask_right=right >= 0 and q_len > 1, num_splits=num_splits,
                   by_tokens=by_tokens, by_load=by_load and by_tokens, target_items=target_items, block_m=block_m,
                   row_blocks=_cdiv(q_len * group, block_m), block_d=max(16, _next_pow2(head_dim)),
                   block_dv=max(16, _next_pow2(head_dim_v)))


def _partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The splits' partial outputs, their log-sum-exps, and a slot for the split size stage 1
    computes by load, for the merge. The slot lies past the log-sum-exps, 16 bytes on, so its
    pointer's alignment (which Triton specialises on) is the same for every shape, and one
    compiled variant serves them all."""
    batch, q_len, num_q_heads, head_dim_v = out.shape
    part = torch.empty(batch, q_len, num_q_heads, num_splits, head_dim_v, dtype=torch.float32, device=out.device)
    n_lse = batch * q_len * num_q_heads * num_splits
    lse_slots = torch.empty(_cdiv(n_lse, 4) * 4 + 4, dtype=torch.float32, device=out.device)
    return part, lse_slots[:n_lse].view(batch, q_len, num_q_heads, num_splits), lse_slots[-4:-3].view(torch.int32)


def triton_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    max_kv_len: int,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_n: int = 32,
    num_kv_splits: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
    tokens_per_split: int = 0,
    items_per_sm: int = 0,
    compile_only: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Paged decode attention, same layouts and semantics as paged_decode_reference.

    q (batch, q_len, Hq, D); k_cache/v_cache (num_pages, page_size, Hkv, D[v]); page_table
    (batch, max_pages); cache_seqlens (batch,) on the device, read only by the kernel.
    max_kv_len (host-side, >= every cache_seqlens entry) caps num_kv_splits at a block of
    keys a split for the longest sequence (rounding to whole blocks can still leave the last
    splits without keys: they store weight 0). tokens_per_split 0: each sequence divides its
    own visible keys among all num_kv_splits splits. tokens_per_split > 0: each sequence gets
    a split per tokens_per_split of its own visible keys, at most num_kv_splits, on
    persistent programs (see the module's docstring); a sequence in one split skips the
    merge. items_per_sm > 0 (splits by load): as tokens_per_split, with the split size
    computed on the device from the call's lengths, so that the splits of all sequences and
    kv heads come to at most items_per_sm per SM (or one split each, where that is more).
    Either way, at most what PART_MAX_BYTES of partial results hold.
    compile_only: build the kernels this call would launch, launch nothing, return None.
    out: the (batch, q_len, Hq, Dv) tensor of q's dtype to write into and return (its last
    dim of unit stride; decode_attention checks it), as FA3's out=; else a new one.
    """
    _check_tensors(q, k_cache, v_cache, page_table, cache_seqlens, sinks)
    _check_args(q, k_cache, block_n, tokens_per_split, items_per_sm)
    # the kernels index the last dim with unit stride
    q, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache))
    kernels = _kernels(interpret=q.device.type != "cuda")
    # TRITON_INTERPRET=1 set by the user interprets CUDA tensors too
    interpreted = type(kernels.split).__name__ == "InterpretedFunction"
    batch, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k_cache.shape[2], v_cache.shape[-1]
    layout = _layout(q, num_kv_heads, head_dim_v, max_kv_len=max_kv_len, causal=causal, window=window,
                     block_n=block_n, num_kv_splits=num_kv_splits, tokens_per_split=tokens_per_split,
                     items_per_sm=items_per_sm, interpreted=interpreted)
    if out is None:
        out = torch.empty(batch, q_len, num_q_heads, head_dim_v, dtype=q.dtype, device=q.device)
    # unused where stage 1 writes out directly
    part, lse, split_size = (out, out, out) if layout.final else _partials(out, layout.num_splits)
    sinks_arg = sinks if sinks is not None else out  # a valid pointer, never read without sinks
    strides = dict(part=part.stride()[:4] if not layout.final else (0, 0, 0, 0),
                   lse=lse.stride()[:3] if not layout.final else (0, 0, 0), out=out.stride()[:3])
    launch = (lambda kernel, grid: functools.partial(kernel.warmup, grid=grid)) if compile_only \
        else (lambda kernel, grid: kernel[grid])
    grid = _stage1_grid(layout, batch, num_kv_heads, interpreted, q.device)
    launch(kernels.by_length if layout.by_tokens else kernels.split, grid)(
        q, k_cache, v_cache, page_table, cache_seqlens, sinks_arg, part, lse, out,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *page_table.stride(),
        *strides["part"], *strides["lse"], *strides["out"],
        q_len=q_len, num_kv_heads=num_kv_heads, num_splits=layout.num_splits, scale=1.0 / math.sqrt(head_dim),
        softcap=float(softcap or 1.0), left=layout.left, right=layout.right,
        GROUP=layout.group, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=layout.block_m, BLOCK_N=block_n, BLOCK_D=layout.block_d, BLOCK_DV=layout.block_dv,
        MASK_LEFT=layout.left >= 0, MASK_RIGHT=layout.mask_right, HAS_SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None, F32_DOT=_f32_dot(q.dtype, interpreted), num_warps=num_warps,
        num_stages=num_stages, **_stage1_kind_args(layout, batch, grid, tokens_per_split or block_n, split_size))
    if not layout.final:
        _merge(kernels.merge, launch, layout, part, lse, cache_seqlens, sinks_arg, out, split_size, strides,
               block_n=block_n, tokens_per_split=tokens_per_split or block_n, has_sinks=sinks is not None)
    return None if compile_only else out


def _f32_dot(dtype: torch.dtype, interpreted: bool) -> bool:
    """float32 dots for float32 inputs (no tf32), and for bfloat16 in the interpreter, whose
    tl.dot multiplies bfloat16's raw uint16 bits (triton 3.9); GPUs use bf16 tensor cores."""
    return dtype == torch.float32 or (interpreted and dtype == torch.bfloat16)


def _stage1_grid(layout: _Layout, batch: int, num_kv_heads: int, interpreted: bool,
                 device: torch.device) -> tuple[int, ...]:
    """By length: persistent programs, at most one per item there can be (by load: at most
    the target, or one split per unit and kv head where that is more). Else a program per
    (sequence x kv head, row block, split)."""
    if not layout.by_tokens:
        return batch * num_kv_heads, layout.row_blocks, layout.num_splits
    units = batch * layout.row_blocks
    items = units * layout.num_splits * num_kv_heads
    if layout.by_load:
        items = min(items, max(layout.target_items, units * num_kv_heads))
    return (min(items, INTERPRETED_PROGRAMS if interpreted else PERSISTENT_PROGRAMS_PER_SM * sm_count(device.index)),)


def _stage1_kind_args(layout: _Layout, batch: int, grid: tuple[int, ...], tokens_per_split: int,
                      split_size: torch.Tensor) -> dict[str, Any]:
    """The arguments that only one of the two stage-1 kernels takes."""
    if not layout.by_tokens:
        return dict(FINAL=layout.final)
    return dict(batch=batch, tokens_per_split=tokens_per_split, target_items=max(layout.target_items, 1),
                num_programs=grid[0], SplitSize=split_size, ROW_BLOCKS=layout.row_blocks,
                BLOCK_U=max(64, _next_pow2(batch * layout.row_blocks)), BY_LOAD=layout.by_load)


def _merge(kernel: Any, launch: Callable, layout: _Layout, part: torch.Tensor, lse: torch.Tensor,
           cache_seqlens: torch.Tensor, sinks_arg: torch.Tensor, out: torch.Tensor, split_size: torch.Tensor,
           strides: dict[str, tuple[int, ...]], *, block_n: int, tokens_per_split: int, has_sinks: bool) -> None:
    """Stage 2: merge each (sequence, query, q head)'s splits by log-sum-exp."""
    batch, q_len, num_q_heads, head_dim_v = out.shape
    block_s = _next_pow2(layout.num_splits)
    # the split plan's constants matter to the by-length merge alone: the even split's
    # gets fixed ones, so that one compiled merge serves every block size and window
    plan = dict(GROUP=layout.group, BLOCK_M=layout.block_m, BLOCK_N=block_n, MASK_LEFT=layout.left >= 0,
                MASK_RIGHT=layout.mask_right) if layout.by_tokens \
        else dict(GROUP=1, BLOCK_M=16, BLOCK_N=16, MASK_LEFT=False, MASK_RIGHT=False)
    launch(kernel, (batch * q_len * num_q_heads,))(
        part, lse, cache_seqlens, sinks_arg, out, split_size, *strides["part"], *strides["lse"], *strides["out"],
        q_len, num_q_heads, layout.num_splits, tokens_per_split, layout.left, layout.right,
        HEAD_DIM_V=head_dim_v, BLOCK_S=block_s, MERGE_CHUNK=min(block_s, max(1, MERGE_TILE // layout.block_dv)),
        BLOCK_DV=layout.block_dv, HAS_SINKS=has_sinks, BY_TOKENS=layout.by_tokens, BY_LOAD=layout.by_load,
        num_warps=4, **plan)


# ---- the op ------------------------------------------------------------------------------


def _visible_len(shape: DecodeShape) -> int:
    """Keys the queries of a row block can see at most: what the splits divide."""
    return visible_kv_len(shape.kv_len, shape.q_len, shape.window[0])


def _splits_fit(visible: int, block_n: int, splits: int) -> bool:
    """True when `splits` splits of whole blocks all get keys (the kernel's chunking)."""
    chunk = _cdiv(_cdiv(visible, splits), block_n) * block_n
    return _cdiv(visible, chunk) == splits


def _block_ns(visible: int, candidates: tuple[int, ...]) -> list[int]:
    # a block past the visible keys only adds masked work: keep the smallest such
    fitting = [n for n in candidates if n <= visible]
    return fitting or [candidates[0]]


def _cuda_splits(shape: DecodeShape) -> list[int]:
    """1, 2, 4, ... up to the first count that fills CUDA_WAVES waves of programs.

    Splitting pays while (sequence, kv head) pairs alone leave SMs idle; past a few waves
    it only adds merge work, so large batches get few candidates and batch 1 gets many.
    """
    base = shape.batch * shape.num_kv_heads * _cdiv(shape.q_len * shape.num_q_heads // shape.num_kv_heads, MAX_BLOCK_M)
    target = CUDA_WAVES * sm_count()
    splits = [1]
    while base * splits[-1] < target and splits[-1] < CUDA_MAX_SPLITS:
        splits.append(splits[-1] * 2)
    return splits


def _configs(shape: DecodeShape) -> list[Config]:
    """Splits over the longest sequence (num_kv_splits, each sequence divides its keys among
    all of them) and, where the keys hold two splits or more, splits by each sequence's
    own length (tokens_per_split) and, for graph shapes, by the call's load (items_per_sm)."""
    visible = _visible_len(shape)
    if torch.cuda.is_available():
        block_ns, splits = _block_ns(visible, CUDA_BLOCK_NS), _cuda_splits(shape)
        even_pruned, token_pruned = ((), ()) if settings.FULL_SPACE else (PRUNED_KERNEL_SHAPES,
                                                                           PRUNED_TOKEN_KERNEL_SHAPES)
        kernel_shapes = [k for k in CUDA_KERNEL_SHAPES if k[0] in block_ns and k not in even_pruned]
        token_shapes = [k for k in CUDA_TOKEN_KERNEL_SHAPES if k[0] in block_ns and k not in token_pruned]
        token_shapes = token_shapes or kernel_shapes[:1]
        load_shapes = [k for k in CUDA_LOAD_KERNEL_SHAPES if k[0] in block_ns] or kernel_shapes[:1]
        tokens, loads, max_splits = CUDA_TOKENS_PER_SPLIT, CUDA_ITEMS_PER_SM, CUDA_MAX_SPLITS
    else:
        # the interpreter ignores warps and stages: keep them fixed (no duplicate candidates)
        w, st = DEFAULT["num_warps"], DEFAULT["num_stages"]
        kernel_shapes = [(n, w, st) for n in _block_ns(visible, CPU_BLOCK_NS)]
        splits, token_shapes = list(CPU_SPLITS), kernel_shapes[:1]
        load_shapes = token_shapes
        tokens, loads, max_splits = CPU_TOKENS_PER_SPLIT, CPU_ITEMS_PER_SM, CPU_SPLITS[-1]
    even = [
        {"block_n": n, "num_kv_splits": s, "num_warps": w, "num_stages": st}
        for n, w, st in kernel_shapes
        for s in splits
        if _splits_fit(visible, n, s)  # no split left without keys
    ]
    by_length = [
        {"block_n": n, "num_kv_splits": max_splits, "num_warps": w, "num_stages": st, "tokens_per_split": t}
        for t in tokens
        if _cdiv(visible, t) >= 2  # one split would be the even configs' single split
        for n, w, st in token_shapes
    ]
    # by load: for graphs, whose lengths are unknown when captured; a call with its lengths
    # known has a fixed config for them (and the serving sweeps' measured cost stays), unless
    # the full space is asked
    by_load = [
        {"block_n": n, "num_kv_splits": max_splits, "num_warps": w, "num_stages": st, "items_per_sm": i}
        for i in loads
        for n, w, st in load_shapes
        if visible >= 2 * n  # room for two splits of a block
    ] if shape.lengths == "graph" or settings.FULL_SPACE else []
    return even + by_length + by_load


RULES = {"block_n": is_pow2(16, 1024), "num_kv_splits": is_int(1, 4096), "num_warps": one_of(1, 2, 4, 8, 16),
         "num_stages": is_int(1, 8)}
# added after configs were stored and shipped without them (they mean 0)
OPTIONAL_RULES = {"tokens_per_split": is_int(0, 1 << 24), "items_per_sm": is_int(0, 64)}


def check_config(config: Config, shape: DecodeShape | None = None) -> str | None:
    if (error := config_error(config, RULES, OPTIONAL_RULES)) is not None:
        return error
    if config.get("tokens_per_split") and config.get("items_per_sm"):
        return "tokens_per_split and items_per_sm both size the splits: give one"
    return None


def _default(shape: DecodeShape) -> Config:
    """DEFAULT, with block and splits cut back to what the shape's visible keys hold."""
    visible = _visible_len(shape)
    block_n = DEFAULT["block_n"] if visible >= DEFAULT["block_n"] else 16
    splits = max(s for s in range(1, DEFAULT["num_kv_splits"] + 1) if _splits_fit(visible, block_n, s))
    return {**DEFAULT, "block_n": block_n, "num_kv_splits": splits}


def _run(inputs: DecodeInputs, config: Config, compile_only: bool = False) -> torch.Tensor | None:
    s = inputs.shape
    return triton_paged_decode(
        inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
        max_kv_len=s.kv_len, causal=s.causal, window=s.window, softcap=s.softcap or None,
        sinks=inputs.sinks,
        block_n=int(config["block_n"]), num_kv_splits=int(config["num_kv_splits"]),
        num_warps=int(config["num_warps"]), num_stages=int(config["num_stages"]),
        tokens_per_split=int(config.get("tokens_per_split", 0)), items_per_sm=int(config.get("items_per_sm", 0)),
        compile_only=compile_only,
    )


def _precompile(inputs: DecodeInputs, configs: list[Config]) -> None:
    """Build every config's kernels for these inputs, before any is timed: in parallel on
    settings.COMPILE_WORKERS threads where this Triton compiles in the background (its
    AsyncCompileMode), else one after another. The interpreter compiles nothing."""
    if inputs.q.device.type != "cuda" or type(_kernels(False).split).__name__ == "InterpretedFunction":
        return
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older Triton: compiled here, in turn
        AsyncCompileMode = None
    todo = [c for c in configs if check_config(c) is None]

    def build_each() -> None:
        for config in todo:
            try:
                _run(inputs, config, compile_only=True)
            except Exception:  # noqa: BLE001 - that config fails when it runs; the others are built
                pass

    if AsyncCompileMode is None:
        build_each()
        return
    with ThreadPoolExecutor(max_workers=settings.COMPILE_WORKERS) as pool, AsyncCompileMode(pool):
        build_each()


def _unavailable() -> str | None:
    _prepare_env()  # before triton's first import (see _prepare_env)
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # an ImportError, or a broken install failing at import
        return f"triton cannot be imported: {type(e).__name__}: {e}"
    return None if torch.cuda.is_available() else _interpreter_problem()


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def _interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run here, if it cannot. Triton 3.6's converts arrays of
    one element to Python ints, an error since NumPy 2.4. Triton 3.8's does not, and 3.7 is
    untried, so it is not refused; the advice names the version known to work."""
    import numpy
    import triton

    if _major_minor(triton.__version__) < (3, 7) and _major_minor(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter cannot run with NumPy {numpy.__version__} (it converts "
                "1-element arrays to ints, an error since NumPy 2.4): install 'numpy<2.4', or Triton >= 3.8")
    return None


_TINY = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, dtype="float32")
_SMALL = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")

TRITON_DECODE = Op(
    name="triton_decode",
    description="split-KV paged decode in Triton; tunes kv block, splits, warps, stages "
    "(compiled on CUDA, interpreted on CPU)",
    configs=_configs,
    default=_default,
    run=_run,
    unavailable=_unavailable,
    device=lambda: "cuda" if torch.cuda.is_available() else "cpu",
    check=check_config,
    precompile=_precompile,
    grids={
        # interpreter-sized: every program and kv block costs milliseconds there
        "cpu-tiny": grid([1, 2], [64, 128], **_TINY),
        "cpu-small": grid([1, 4], [256, 512], **_SMALL),
        "cpu-serving": serving_grid((1, 3), (64,), **_TINY),
        "serving": serving_grid(),
        "decode": grid([1, 4, 16, 64, 256], [512, 2048, 8192, 32768, 131072], max_tokens=4 * 2**20)
        + grid([1, 4, 16, 64, 256], [512, 2048, 8192, 32768, 131072], max_tokens=4 * 2**20,
               num_q_heads=8, num_kv_heads=1),
    },
)
