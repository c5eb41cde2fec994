"""FlashInfer's paged decode and prefill wrappers, tuned: the plan arguments
(use_tensor_cores, backend, fixed_split_size, disable_split_kv) come from the tuning DB,
and planning costs little host time.

The wrappers here take FlashInfer's own arguments. Given kv lengths on the host (`seq_lens`
as a CPU tensor or array, or indptr and last_page_len on the CPU), a plan:
- reads nothing back from the device;
- is skipped while the previous plan stays valid (tuner.ops.flashinfer_plan says when): same
  config, same kv-length bucket, and every request keeps its planned kv chunk count;
- still points the kernel at the caller's current indptr/indices/last_page_len, and under
  CUDA graphs copies them into the captured buffers, so a replay never reads stale pages.
Without host lengths, it plans the standard way with FlashInfer's default config.

`FLASHINFER` is the sweepable op over the same wrappers. FlashInfer is imported on first use.
"""

from __future__ import annotations

import functools
import importlib.util
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tuner.keys import canonical_json, static_key_from_parts
from tuner.ops.base import Config, DecodeInputs, Op
from tuner.ops.fa3 import TUNED, _decode_grid, _mtp_grid  # TUNED: an argument left to tuner
from tuner.ops.flashinfer_plan import coverage_from_plan, host_seq_lens, paged_metadata, valid_bounds
from tuner.keys import kv_len_bucket
from tuner.ops.shapes import DecodeShape, grid
from tuner.runtime import ConfigLookup

OP_NAME = "flashinfer"
WORKSPACE_BYTES = 512 * 2**20
# FlashInfer's defaults: what a caller gets without tuner
# (FlashInfer's `backend` argument is `flashinfer_backend` here: decode_attention's configs
# carry their own "backend", the library that runs)
DECODE_DEFAULT: Config = {"use_tensor_cores": False, "flashinfer_backend": "auto", "fixed_split_size": None,
                          "disable_split_kv": False}
PREFILL_DEFAULT: Config = {"flashinfer_backend": "auto", "fixed_split_size": None, "disable_split_kv": False}
SPLIT_COUNTS = (2, 4, 8, 16, 32)  # fixed_split_size candidates: kv split into this many chunks


@functools.cache
def _flashinfer() -> Any:
    import flashinfer

    return flashinfer


def unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed (pip install 'tuner[gpu]')"
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


def default_config(shape: DecodeShape) -> Config:
    return dict(DECODE_DEFAULT if shape.q_len == 1 else PREFILL_DEFAULT)


def _dtype(value: Any, fallback: torch.dtype) -> torch.dtype:
    if value is None:
        return fallback
    return getattr(torch, value) if isinstance(value, str) else value


def _static_json(static: tuple) -> str:
    q_dtype, kv_dtype, q_heads, kv_heads, head_dim, page_size, causal, window_left, softcap = static
    return static_key_from_parts(
        q_dtype=q_dtype, k_dtype=kv_dtype, v_dtype=kv_dtype, num_q_heads=q_heads, num_kv_heads=kv_heads,
        head_dim_qk=head_dim, head_dim_v=head_dim, page_size=page_size, causal=causal,
        window_size=(-1, -1) if window_left < 0 else (window_left, 0), softcap=softcap or None,
        sinks=False, k_descale=False, v_descale=False,
    ).to_json()


_LOOKUP = ConfigLookup(OP_NAME, _static_json)


@dataclass
class _Plan:
    """The last plan: the call it was made for, and the kv lengths (lo, hi] it stays valid for."""

    inner: Any
    call: tuple  # plan()'s arguments other than the lengths, as the caller gave them
    lo: np.ndarray
    hi: np.ndarray

    def fits(self, call: tuple, seq_lens: np.ndarray) -> bool:
        return (call == self.call and len(seq_lens) == len(self.lo)
                and bool((seq_lens > self.lo).all()) and bool((seq_lens <= self.hi).all()))


class _TunedWrapper:
    """What the decode and prefill wrappers share: inner FlashInfer wrappers per config,
    plan reuse, and the buffers a CUDA graph reads."""

    _config_keys: tuple[str, ...]

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str, use_cuda_graph: bool,
                 buffers: dict[str, torch.Tensor | None], config: Config | None) -> None:
        self._workspace = float_workspace_buffer
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        self._buffers = buffers
        self._config = dict(config) if config is not None else None  # fixed: no DB lookup
        self._inners: dict[tuple, Any] = {}
        self._plan: _Plan | None = None
        self._active: Any = None
        self._explicit: Config = {}
        self.plans = 0  # plans made (FlashInfer's plan ran)
        self.plans_reused = 0  # plan() calls that kept the previous plan
        self.standard_plans = 0  # plans made without host lengths

    def _explicit_args(self, fixed_split_size: Any, disable_split_kv: Any) -> Config:
        """The plan arguments the caller chose (constructor and plan()); they beat the DB."""
        explicit = dict(self._explicit)
        if fixed_split_size is not TUNED:
            explicit["fixed_split_size"] = fixed_split_size
        if disable_split_kv is not TUNED:
            explicit["disable_split_kv"] = disable_split_kv
        return explicit

    def _choose(self, static: tuple, batch: int, q_len: int, kv_len: int, default: Config) -> Config:
        if self._config is not None:
            return self._config
        config = _LOOKUP.get(static, batch, q_len, kv_len, default)
        if set(config) != set(self._config_keys):  # a record of the other wrapper's kind
            config = default
        if self._use_cuda_graph:
            # one config for the wrapper's life: a captured graph holds one inner wrapper's
            # buffers; FlashInfer does not promise fixed_split_size under graphs
            config = self._config = dict(config, fixed_split_size=None)
        return config

    def _point_buffers(self, inner: Any, indptr: torch.Tensor, indices: torch.Tensor,
                       last_page_len: torch.Tensor) -> None:
        """Make the inner wrapper read the caller's current tensors: by reference when
        eager, by copy into the captured buffers under a CUDA graph."""
        device = self._workspace.device
        for attr, tensor in (("_paged_kv_indptr_buf", indptr), ("_paged_kv_indices_buf", indices),
                             ("_paged_kv_last_page_len_buf", last_page_len)):
            if self._use_cuda_graph:
                buf = getattr(inner, attr)
                if buf.data_ptr() != tensor.data_ptr():
                    buf[: len(tensor)].copy_(tensor, non_blocking=True)
            else:  # host metadata (FlashInfer takes indptr on the CPU) goes to the device
                setattr(inner, attr, tensor if tensor.device == device else tensor.to(device, non_blocking=True))

    def _reuse(self, call: tuple, lens: np.ndarray, indptr: torch.Tensor, indices: torch.Tensor,
               last_page_len: torch.Tensor) -> bool:
        """Keep the last plan if it covers this call; the hot path of plan()."""
        plan = self._plan
        if plan is None or not plan.fits(call, lens):
            return False
        self._point_buffers(plan.inner, indptr, indices, last_page_len)
        self.plans_reused += 1
        self._active = plan.inner
        return True

    def _planned(self, inner: Any, call: tuple, lens: np.ndarray, kv_max: int, indptr: torch.Tensor,
                 indices: torch.Tensor, last_page_len: torch.Tensor, qo_lens: np.ndarray | None) -> None:
        """After FlashInfer planned: record how long the plan stays valid."""
        self._point_buffers(inner, indptr, indices, last_page_len)
        coverage = None
        if self._plan_backend(inner) == "fa2":
            coverage = coverage_from_plan(inner._plan_info, inner._pin_memory_int_workspace_buffer.numpy(),
                                          len(lens), qo_lens)
        lo, hi = valid_bounds(coverage, lens.copy(), kv_len_bucket(max(kv_max, 1)))
        self._plan = _Plan(inner, call, lo, hi)
        self._active = inner
        self.plans += 1

    @staticmethod
    def _plan_backend(inner: Any) -> str:
        """Which scheduler planned: FA2's (decode kernel or FA2 prefill) or another."""
        use_tc = getattr(inner, "use_tensor_cores", True)
        return "fa2" if not use_tc or getattr(inner, "_backend", None) == "fa2" else "other"

    def _standard(self, inner: Any) -> None:
        self._plan = None
        self._active = inner
        self.plans += 1
        self.standard_plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache: Any, *args: Any, **kwargs: Any) -> Any:
        if self._active is None:
            raise RuntimeError("plan() must be called before run()")
        return self._active.run(q, paged_kv_cache, *args, **kwargs)

    forward = run


class BatchDecodeWithPagedKVCacheWrapper(_TunedWrapper):
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper with tuned plan arguments.

    use_tensor_cores and backend left as TUNED come from the DB per plan (per kv-length
    bucket), as do fixed_split_size and disable_split_kv in plan(); a value the caller
    passes wins. Under use_cuda_graph the config is fixed by the first plan.
    """

    _config_keys = tuple(DECODE_DEFAULT)

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: Any = TUNED, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: Any = TUNED,
                 *, config: Config | None = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, {
            "paged_kv_indptr_buffer": paged_kv_indptr_buffer, "paged_kv_indices_buffer": paged_kv_indices_buffer,
            "paged_kv_last_page_len_buffer": paged_kv_last_page_len_buffer}, config)
        self._explicit = {k: v for k, v in (("use_tensor_cores", use_tensor_cores), ("flashinfer_backend", backend))
                          if v is not TUNED}

    def _inner(self, use_tensor_cores: bool, backend: str) -> Any:
        key = (use_tensor_cores, backend)
        inner = self._inners.get(key)
        if inner is None:
            inner = self._inners[key] = _flashinfer().BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, self._kv_layout, use_cuda_graph=self._use_cuda_graph,
                use_tensor_cores=use_tensor_cores, backend=backend, **self._buffers)
        return inner

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type: Any = "float16", kv_data_type: Any = None,
             sm_scale: float | None = None, non_blocking: bool = True, seq_lens: Any = None,
             fixed_split_size: Any = TUNED, disable_split_kv: Any = TUNED, **kwargs: Any) -> None:
        """FlashInfer's plan() arguments; seq_lens on the host (CPU tensor or array) make it
        cheap. Other FlashInfer keywords (pos_encoding_mode, rope_*, ...) take the standard path."""
        lens = None if kwargs else host_seq_lens(seq_lens, indptr, last_page_len, page_size)
        call = (num_qo_heads, num_kv_heads, head_dim, page_size, window_left, logits_soft_cap, q_data_type,
                kv_data_type, sm_scale, fixed_split_size, disable_split_kv)
        if lens is not None and self._reuse(call, lens, indptr, indices, last_page_len):
            return
        q_dtype = _dtype(q_data_type, torch.float16)
        kv_dtype = _dtype(kv_data_type, q_dtype)
        common = dict(window_left=window_left, logits_soft_cap=logits_soft_cap, q_data_type=q_dtype,
                      kv_data_type=kv_dtype, sm_scale=sm_scale, non_blocking=non_blocking)
        explicit = self._explicit_args(fixed_split_size, disable_split_kv)
        if lens is None:  # no host lengths: FlashInfer's default config, its standard plan
            config = {**DECODE_DEFAULT, **explicit}
            inner = self._inner(config["use_tensor_cores"], config["flashinfer_backend"])
            inner.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                       seq_lens=seq_lens, **self._split_args(config), **common, **kwargs)
            self._standard(inner)
            return
        static = (q_dtype, kv_dtype, num_qo_heads, num_kv_heads, head_dim, page_size, True, window_left,
                  logits_soft_cap or 0.0)
        kv_max = int(lens.max()) if len(lens) else 0
        config = {**self._choose(static, len(lens), 1, kv_max, DECODE_DEFAULT), **explicit}
        inner = self._inner(config["use_tensor_cores"], config["flashinfer_backend"])
        indptr_h, last_h = paged_metadata(lens, page_size)
        inner.plan(torch.from_numpy(indptr_h), indices, torch.from_numpy(last_h), num_qo_heads, num_kv_heads,
                   head_dim, page_size, seq_lens=torch.from_numpy(lens.astype(np.int32)),
                   **self._split_args(config), **common)
        self._planned(inner, call, lens, kv_max, indptr, indices, last_page_len, None)

    @staticmethod
    def _split_args(config: Config) -> dict[str, Any]:
        if not config["use_tensor_cores"]:  # FlashInfer takes these for tensor-core decode only
            return {}
        return {"fixed_split_size": config["fixed_split_size"], "disable_split_kv": config["disable_split_kv"]}


class BatchPrefillWithPagedKVCacheWrapper(_TunedWrapper):
    """flashinfer.BatchPrefillWithPagedKVCacheWrapper with tuned plan arguments (backend,
    fixed_split_size, disable_split_kv), for few query tokens per request over a paged kv
    cache, e.g. speculative-decoding verification. Host lengths: seq_lens (kv) and
    qo_indptr on the CPU."""

    _config_keys = tuple(PREFILL_DEFAULT)

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None, paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None, backend: Any = TUNED,
                 *, config: Config | None = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, {
            "qo_indptr_buf": qo_indptr_buf, "paged_kv_indptr_buf": paged_kv_indptr_buf,
            "paged_kv_indices_buf": paged_kv_indices_buf, "paged_kv_last_page_len_buf": paged_kv_last_page_len_buf},
            config)
        self._explicit = {} if backend is TUNED else {"flashinfer_backend": backend}

    def _inner(self, backend: str) -> Any:
        inner = self._inners.get(backend)
        if inner is None:
            inner = self._inners[backend] = _flashinfer().BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, self._kv_layout, use_cuda_graph=self._use_cuda_graph, backend=backend,
                **self._buffers)
        return inner

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, *, causal: bool = False, window_left: int = -1, logits_soft_cap: float | None = None,
             q_data_type: Any = "float16", kv_data_type: Any = None, sm_scale: float | None = None,
             non_blocking: bool = True, seq_lens: Any = None, fixed_split_size: Any = TUNED,
             disable_split_kv: Any = TUNED, **kwargs: Any) -> None:
        qo_h = None if qo_indptr.is_cuda else qo_indptr.numpy().astype(np.int64)
        lens = None if kwargs or qo_h is None else host_seq_lens(seq_lens, paged_kv_indptr, paged_kv_last_page_len,
                                                                  page_size)
        call = (num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, window_left, logits_soft_cap,
                q_data_type, kv_data_type, sm_scale, fixed_split_size, disable_split_kv,
                None if qo_h is None else qo_h.tobytes())
        if lens is not None and self._reuse(call, lens, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
            return
        q_dtype = _dtype(q_data_type, torch.float16)
        kv_dtype = _dtype(kv_data_type, q_dtype)
        common = dict(causal=causal, window_left=window_left, logits_soft_cap=logits_soft_cap, q_data_type=q_dtype,
                      kv_data_type=kv_dtype, sm_scale=sm_scale, non_blocking=non_blocking)
        explicit = self._explicit_args(fixed_split_size, disable_split_kv)
        if lens is None:
            config = {**PREFILL_DEFAULT, **explicit}
            inner = self._inner(config["flashinfer_backend"])
            inner.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                       num_kv_heads, head_dim_qk, page_size, seq_lens=seq_lens,
                       fixed_split_size=config["fixed_split_size"], disable_split_kv=config["disable_split_kv"],
                       **common, **kwargs)
            self._standard(inner)
            return
        qo_lens = np.diff(qo_h)
        q_max = int(qo_lens.max()) if len(qo_lens) else 1
        static = (q_dtype, kv_dtype, num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, window_left,
                  logits_soft_cap or 0.0)
        kv_max = int(lens.max()) if len(lens) else 0
        config = {**self._choose(static, len(lens), q_max, kv_max, PREFILL_DEFAULT), **explicit}
        inner = self._inner(config["flashinfer_backend"])
        indptr_h, last_h = paged_metadata(lens, page_size)
        inner.plan(qo_indptr, torch.from_numpy(indptr_h), paged_kv_indices, torch.from_numpy(last_h),
                   num_qo_heads, num_kv_heads, head_dim_qk, page_size,
                   seq_lens=torch.from_numpy(lens.astype(np.int32)), fixed_split_size=config["fixed_split_size"],
                   disable_split_kv=config["disable_split_kv"], **common)
        self._planned(inner, call, lens, kv_max, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, qo_lens)


# -- the sweepable op -----------------------------------------------------------------------


@functools.cache
def _workspace(device: str) -> torch.Tensor:
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


@functools.lru_cache(maxsize=64)
def _op_wrapper(device: str, q_len_is_one: bool, config_json: str, config_items: tuple) -> _TunedWrapper:
    cls = BatchDecodeWithPagedKVCacheWrapper if q_len_is_one else BatchPrefillWithPagedKVCacheWrapper
    return cls(_workspace(device), "NHD", config=dict(config_items))


@dataclass
class _PagedLayout:
    """A page table and host kv lengths in FlashInfer's layout."""

    seq_lens: np.ndarray
    qo_indptr: torch.Tensor  # host
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


def _paged_layout(page_table: torch.Tensor, seq_lens: np.ndarray, page_size: int, q_len: int) -> _PagedLayout:
    """FlashInfer's indptr/indices/last_page_len for a [batch, max_pages] page table."""
    indptr_h, last_h = paged_metadata(seq_lens, page_size)
    device = page_table.device
    pages = np.diff(indptr_h)
    if len(pages) and np.all(pages == pages[0]):
        indices = page_table[:, : int(pages[0])].reshape(-1)
    else:
        width = page_table.shape[1]
        flat = np.concatenate([i * width + np.arange(n) for i, n in enumerate(pages)]) if len(pages) else np.zeros(0)
        indices = page_table.reshape(-1)[torch.from_numpy(flat.astype(np.int64)).to(device)]
    return _PagedLayout(
        seq_lens=seq_lens,
        qo_indptr=torch.arange(len(seq_lens) + 1, dtype=torch.int32) * q_len,
        indptr=torch.from_numpy(indptr_h).to(device),
        indices=indices.contiguous(),
        last_page_len=torch.from_numpy(last_h).to(device),
    )


# one layout per live page table (by identity: a sweep's KV copies share one table, and so
# do the layers of one decode step); tensors cannot key a WeakKeyDictionary (== is elementwise)
_LAYOUTS: dict[int, tuple[weakref.ref, bytes, int, _PagedLayout]] = {}


def _layout(page_table: torch.Tensor, seq_lens: np.ndarray, page_size: int, q_len: int) -> _PagedLayout:
    key = seq_lens.tobytes()
    cached = _LAYOUTS.get(id(page_table))
    if cached is not None and cached[0]() is page_table and cached[1] == key and cached[2] == q_len:
        return cached[3]
    layout = _paged_layout(page_table, seq_lens, page_size, q_len)
    if len(_LAYOUTS) >= 16:
        for ident in [i for i, c in _LAYOUTS.items() if c[0]() is None] or list(_LAYOUTS)[:1]:
            del _LAYOUTS[ident]
    _LAYOUTS[id(page_table)] = (weakref.ref(page_table), key, q_len, layout)
    return layout


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    seq_lens: np.ndarray, config: Config, causal: bool = True, window_left: int = -1,
                    softcap: float | None = None) -> torch.Tensor:
    """Paged attention in tuner's layouts (q [batch, q_len, heads, dim], k/v caches
    [pages, page_size, kv_heads, dim], page_table [batch, max_pages]) on FlashInfer with an
    explicit config; seq_lens: each request's kv length, on the host."""
    batch, q_len, heads, dim = q.shape
    layout = _layout(page_table, seq_lens, k_cache.shape[1], q_len)
    wrapper = _op_wrapper(str(q.device), q_len == 1, canonical_json(config), tuple(config.items()))
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
    lens = _UNIFORM_LENS.get((s.batch, s.kv_len))
    if lens is None:
        lens = _UNIFORM_LENS[(s.batch, s.kv_len)] = np.full(s.batch, s.kv_len, dtype=np.int64)
    return paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, lens, config,
                           causal=s.causal, window_left=s.window[0], softcap=s.softcap or None)


FLASHINFER = Op(
    name=OP_NAME,
    description="FlashInfer paged decode/prefill wrappers; tunes use_tensor_cores, backend, split size (GPU)",
    configs=config_space,
    default=default_config,
    run=_run,
    grids={"decode": _decode_grid(), "mtp": _mtp_grid(), "smoke": grid([1, 64], [512, 8192])},
    unavailable=unavailable,
    device=lambda: "cuda",
)
