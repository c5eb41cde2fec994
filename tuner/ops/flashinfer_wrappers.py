"""FlashInfer's paged decode and prefill wrappers with cheap plans and chosen plan arguments
(use_tensor_cores, backend, fixed_split_size, disable_split_kv): whoever builds one passes a
`choose` callable (tuner.integrations.flashinfer passes the tuning DB's lookup); without it
a wrapper plans with FlashInfer's defaults, or the config it was given.

The wrappers here take FlashInfer's own arguments. Given kv lengths on the host (`seq_lens`
as a CPU tensor or array, or indptr and last_page_len on the CPU), a plan:
- reads nothing back from the device;
- is skipped while the previous plan stays valid (tuner.ops.flashinfer_plan says when): same
  config, same kv-length bucket, and every request keeps its planned kv chunk count;
- still points the kernel at the caller's current indptr/indices/last_page_len, and under
  CUDA graphs copies them into the captured buffers, so a replay never reads stale pages.
Without host lengths, it plans the standard way with FlashInfer's default config.
FlashInfer is imported on first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from tuner.keys import kv_len_bucket
from tuner.ops.base import TUNED, Config, stream_capturing
from tuner.ops.flashinfer_plan import coverage_from_plan, host_seq_lens, paged_metadata, valid_bounds

# FlashInfer's defaults: what a caller gets without tuner
# (FlashInfer's `backend` argument is `flashinfer_backend` here: decode_attention's configs
# carry their own "backend", the library that runs)
DECODE_DEFAULT: Config = {"use_tensor_cores": False, "flashinfer_backend": "auto", "fixed_split_size": None,
                          "disable_split_kv": False}
PREFILL_DEFAULT: Config = {"flashinfer_backend": "auto", "fixed_split_size": None, "disable_split_kv": False}


@functools.cache
def library() -> Any:
    """The flashinfer module, imported on first use (tests put a stand-in in its place)."""
    import flashinfer

    return flashinfer


def _dtype(value: Any, fallback: torch.dtype) -> torch.dtype:
    if value is None:
        return fallback
    return getattr(torch, value) if isinstance(value, str) else value


def _window(window_left: int) -> tuple[int, int]:
    """FlashInfer's window_left as the static key's window: a sliding window looks back only."""
    return (-1, -1) if window_left < 0 else (window_left, 0)


# chooses a plan's config: (static tuple, batch, q len, kv len, default) -> config
Choose = Callable[[tuple, int, int, int, Config], Config]


# FlashInfer's plan() arguments, in its positional order (decode: its deprecated positional
# optionals, FlashInfer's _BATCH_DECODE_PLAN_LEGACY_POS_ARGS; prefill: its signature). Every
# one is forwarded as given; keywords a later FlashInfer adds (is_causal, uniform_q_len, ...)
# are forwarded too.
DECODE_REQUIRED = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size")
DECODE_OPTIONAL = ("pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type", "o_data_type",
                   "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking", "block_tables", "seq_lens",
                   "fixed_split_size", "disable_split_kv", "q_len_per_req")
PREFILL_REQUIRED = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads",
                    "num_kv_heads", "head_dim_qk", "page_size")
PREFILL_OPTIONAL = ("head_dim_vo", "custom_mask", "packed_custom_mask", "causal", "pos_encoding_mode",
                    "use_fp16_qk_reduction", "sm_scale", "window_left", "logits_soft_cap", "rope_scale", "rope_theta",
                    "q_data_type", "kv_data_type", "o_data_type", "non_blocking", "prefix_len_ptr",
                    "token_pos_in_items_ptr", "token_pos_in_items_len", "max_item_len_ptr", "seq_lens", "seq_lens_q",
                    "block_tables", "max_token_per_sequence", "max_sequence_kv", "fixed_split_size",
                    "disable_split_kv")
# plan keywords whose other values select kernels no sweep measured (rotary inside the
# kernel, masks, several query tokens per request in the decode wrapper, ...): a plan
# with one of them runs FlashInfer's default config (or the wrapper's fixed one)
DECODE_MEASURED = {"pos_encoding_mode": ("NONE",), "window_right": (0,), "block_tables": (None,),
                   "q_len_per_req": (1,), "is_causal": (None, False)}
PREFILL_MEASURED = {"pos_encoding_mode": ("NONE",), "custom_mask": (None,), "packed_custom_mask": (None,),
                    "use_fp16_qk_reduction": (False,), "prefix_len_ptr": (None,), "token_pos_in_items_ptr": (None,),
                    "max_item_len_ptr": (None,), "block_tables": (None,)}
_PLAIN = (str, int, float, bool, type(None), torch.dtype)


def _measured(rest: dict[str, Any], measured: dict[str, tuple]) -> bool:
    return all(any(rest[k] is v or (type(rest[k]) is type(v) and rest[k] == v) for v in values)
               for k, values in measured.items() if k in rest)


def _reuse_key(fixed: tuple, rest: dict[str, Any]) -> tuple | None:
    """What must match for a plan to be reused; None when a tensor (block_tables, masks, ...)
    is among the arguments: a tensor is never compared by identity, so such plans are made
    every time."""
    if any(not isinstance(v, _PLAIN) for v in rest.values()):
        return None
    return fixed + tuple(sorted(rest.items(), key=lambda kv: kv[0]))


@dataclass
class _Plan:
    """The last plan: the call it was made for, the kv lengths (lo, hi] it stays valid for,
    and the bucket its config was chosen for: the longest length must stay above
    kv_floor, since a shorter batch is another bucket's, with a record of its own."""

    inner: Any
    call: tuple  # plan()'s arguments other than the lengths, as the caller gave them
    lo: np.ndarray
    hi: np.ndarray
    kv_floor: int

    def fits(self, call: tuple, seq_lens: np.ndarray) -> bool:
        return (call == self.call and len(seq_lens) == len(self.lo)
                and (not len(seq_lens) or bool(seq_lens.max() > self.kv_floor))
                and bool((seq_lens > self.lo).all()) and bool((seq_lens <= self.hi).all()))


class _PlanReuseWrapper:
    """What the decode and prefill wrappers share: inner FlashInfer wrappers per config,
    plan reuse, the buffers a CUDA graph reads, and FlashInfer's run-side methods.

    Under use_cuda_graph one inner wrapper and one config serve the wrapper's whole life,
    fixed by its first plan, whatever path later plans take: a captured graph replays that
    inner wrapper's kernels and buffers, so a plan may never move to another one."""

    _required: tuple[str, ...]
    _optional: tuple[str, ...]
    _config_keys: tuple[str, ...]

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str, use_cuda_graph: bool,
                 buffers: dict[str, torch.Tensor | None], config: Config | None, choose: Choose | None) -> None:
        self._choose = choose
        self._workspace = float_workspace_buffer
        self._int_workspace: torch.Tensor | None = None
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

    # -- plan ------------------------------------------------------------------------------

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """plan()'s arguments by name, as FlashInfer would bind them."""
        names = self._required + self._optional
        if len(args) > len(names):
            raise TypeError(f"plan() takes at most {len(names)} positional arguments ({len(args)} given)")
        bound = dict(zip(names, args))
        twice = sorted(set(bound) & set(kwargs))
        if twice:
            raise TypeError(f"plan() got multiple values for argument {twice[0]!r}")
        bound.update(kwargs)
        missing = [n for n in self._required if n not in bound]
        if missing:
            raise TypeError(f"plan() missing required argument(s): {', '.join(missing)}")
        return bound

    def _explicit_args(self, fixed_split_size: Any, disable_split_kv: Any) -> Config:
        """The plan arguments the caller chose (constructor and plan()); they beat the DB."""
        explicit = dict(self._explicit)
        if fixed_split_size is not TUNED:
            explicit["fixed_split_size"] = fixed_split_size
        if disable_split_kv is not TUNED:
            explicit["disable_split_kv"] = disable_split_kv
        return explicit

    def _config_for(self, lookup: tuple | None, default: Config, explicit: Config) -> Config:
        """The config of this plan: the wrapper's fixed (or, under CUDA graphs, pinned) one,
        else the chosen one for `lookup` (static tuple, batch, q len, kv len), else `default`;
        the caller's explicit arguments on top."""
        if self._config is not None:
            return {**self._config, **explicit}
        config = default if lookup is None or self._choose is None else self._choose(*lookup, default)
        config = {**config, **explicit}
        if self._use_cuda_graph:
            # FlashInfer does not promise a fixed split size under graphs, unless asked for
            config = self._config = dict(config, fixed_split_size=explicit.get("fixed_split_size"))
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

    def _reuse(self, call: tuple | None, lens: np.ndarray, indptr: torch.Tensor, indices: torch.Tensor,
               last_page_len: torch.Tensor) -> bool:
        """Keep the last plan if it covers this call; the hot path of plan()."""
        plan = self._plan
        if call is None or plan is None or not plan.fits(call, lens):
            return False
        self._point_buffers(plan.inner, indptr, indices, last_page_len)
        self.plans_reused += 1
        self._active = plan.inner
        return True

    def _planned(self, inner: Any, call: tuple | None, lens: np.ndarray, kv_max: int, indptr: torch.Tensor,
                 indices: torch.Tensor, last_page_len: torch.Tensor, qo_lens: np.ndarray | None) -> None:
        """After FlashInfer planned: record how long the plan stays valid."""
        self._point_buffers(inner, indptr, indices, last_page_len)
        coverage = None
        if self._plan_backend(inner) == "fa2":
            coverage = coverage_from_plan(inner._plan_info, inner._pin_memory_int_workspace_buffer.numpy(),
                                          len(lens), qo_lens)
        bucket = kv_len_bucket(max(kv_max, 1))
        lo, hi = valid_bounds(coverage, lens.copy(), bucket)
        # a plan made under capture reaches the device only when the graph replays (its copy
        # is a graph node): should the capture fail, a later call reusing it would read a
        # workspace never written, so the next call plans again
        kept = call is not None and not _capturing()
        self._plan = _Plan(inner, call, lo, hi, bucket // 2) if kept else None
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

    # -- run and FlashInfer's other methods ----------------------------------------------

    def _planned_inner(self) -> Any:
        if self._active is None:
            raise RuntimeError("plan() must be called before run()")
        return self._active

    def run(self, q: torch.Tensor, paged_kv_cache: Any, *args: Any, **kwargs: Any) -> Any:
        return self._planned_inner().run(q, paged_kv_cache, *args, **kwargs)

    def run_return_lse(self, q: torch.Tensor, paged_kv_cache: Any, *args: Any, **kwargs: Any) -> Any:
        return self._planned_inner().run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    def forward(self, q: torch.Tensor, paged_kv_cache: Any, *args: Any, **kwargs: Any) -> Any:
        """FlashInfer's deprecated forward (its own keywords: pos_encoding_mode, sm_scale, ...)."""
        return self._planned_inner().forward(q, paged_kv_cache, *args, **kwargs)

    def forward_return_lse(self, q: torch.Tensor, paged_kv_cache: Any, *args: Any, **kwargs: Any) -> Any:
        return self._planned_inner().forward_return_lse(q, paged_kv_cache, *args, **kwargs)

    def begin_forward(self, *args: Any, **kwargs: Any) -> None:
        """FlashInfer's deprecated name of plan()."""
        self.plan(*args, **kwargs)

    def end_forward(self) -> None:
        """FlashInfer 0.6's deprecated no-op (0.7 removed it)."""

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        """FlashInfer's: new workspace buffers, for every inner wrapper (and later ones)."""
        self._workspace, self._int_workspace = float_workspace_buffer, int_workspace_buffer
        for inner in self._inners.values():
            inner.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)
        self._plan = None  # the old plans live in the old buffers

    def _new_inner(self, inner: Any) -> Any:
        if self._int_workspace is not None:
            inner.reset_workspace_buffer(self._workspace, self._int_workspace)
        return inner

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"tuner's {type(self).__name__} does not offer FlashInfer's {name!r}: it supports plan/begin_forward, "
            "run/forward, run_return_lse/forward_return_lse, reset_workspace_buffer and end_forward")


class PlanReuseDecodeWrapper(_PlanReuseWrapper):
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper with chosen plan arguments.

    use_tensor_cores and backend left as TUNED are chosen per plan (per kv-length bucket),
    as are fixed_split_size and disable_split_kv in plan(); a value the caller passes wins.
    Under use_cuda_graph the config is fixed by the first plan.
    """

    _required, _optional = DECODE_REQUIRED, DECODE_OPTIONAL
    _config_keys = tuple(DECODE_DEFAULT)

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: Any = TUNED, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: Any = TUNED,
                 *, config: Config | None = None, choose: Choose | None = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, {
            "paged_kv_indptr_buffer": paged_kv_indptr_buffer, "paged_kv_indices_buffer": paged_kv_indices_buffer,
            "paged_kv_last_page_len_buffer": paged_kv_last_page_len_buffer}, config, choose)
        self._explicit = {k: v for k, v in (("use_tensor_cores", use_tensor_cores), ("flashinfer_backend", backend))
                          if v is not TUNED}

    def _inner(self, use_tensor_cores: bool, backend: str) -> Any:
        key = (use_tensor_cores, backend)
        inner = self._inners.get(key)
        if inner is None:
            inner = self._inners[key] = self._new_inner(library().BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, self._kv_layout, use_cuda_graph=self._use_cuda_graph,
                use_tensor_cores=use_tensor_cores, backend=backend, **self._buffers))
        return inner

    @property
    def use_tensor_cores(self) -> bool | None:
        """The active plan's (None before the first plan)."""
        return None if self._active is None else self._active.use_tensor_cores

    def plan(self, *args: Any, **kwargs: Any) -> None:
        """FlashInfer's plan(), every argument forwarded. Host kv lengths (seq_lens a CPU
        tensor or array, or indptr and last_page_len on the CPU) make it cheap and let the DB
        choose the config; without them FlashInfer plans the standard way."""
        rest = self._bind(args, kwargs)
        indptr, indices, last_page_len = rest.pop("indptr"), rest.pop("indices"), rest.pop("last_page_len")
        num_qo_heads, num_kv_heads, head_dim, page_size = (rest.pop(k) for k in DECODE_REQUIRED[3:])
        seq_lens = rest.pop("seq_lens", None)
        explicit = self._explicit_args(rest.pop("fixed_split_size", TUNED), rest.pop("disable_split_kv", TUNED))
        lens = host_seq_lens(seq_lens, indptr, last_page_len, page_size)
        if lens is None:  # no host lengths: FlashInfer's default config, its standard plan
            config = self._config_for(None, DECODE_DEFAULT, explicit)
            inner = self._inner(config["use_tensor_cores"], config["flashinfer_backend"])
            inner.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                       seq_lens=seq_lens, **self._split_args(config), **rest)
            self._standard(inner)
            return
        call = _reuse_key((num_qo_heads, num_kv_heads, head_dim, page_size, tuple(sorted(explicit.items()))), rest)
        if self._reuse(call, lens, indptr, indices, last_page_len):
            return
        q_dtype = _dtype(rest.get("data_type") or rest.get("q_data_type"), torch.float16)
        kv_dtype = _dtype(rest.get("kv_data_type") or rest.get("data_type"), q_dtype)
        window_left = rest.get("window_left", -1)
        kv_max = int(lens.max()) if len(lens) else 0
        lookup = None
        if _measured(rest, DECODE_MEASURED) and len(lens) and isinstance(window_left, int):
            static = (q_dtype, kv_dtype, kv_dtype, num_qo_heads, num_kv_heads, head_dim, head_dim, page_size, True,
                      _window(window_left), rest.get("logits_soft_cap") or 0.0, False, False, False)
            lookup = (static, len(lens), 1, kv_max)
        config = self._config_for(lookup, DECODE_DEFAULT, explicit)
        inner = self._inner(config["use_tensor_cores"], config["flashinfer_backend"])
        indptr_h, last_h = paged_metadata(lens, page_size)
        inner.plan(torch.from_numpy(indptr_h), indices, torch.from_numpy(last_h), num_qo_heads, num_kv_heads,
                   head_dim, page_size, seq_lens=torch.from_numpy(lens.astype(np.int32)),
                   **self._split_args(config), **rest)
        self._planned(inner, call, lens, kv_max, indptr, indices, last_page_len, None)

    @staticmethod
    def _split_args(config: Config) -> dict[str, Any]:
        if not config["use_tensor_cores"]:  # FlashInfer takes these for tensor-core decode only
            return {}
        return {"fixed_split_size": config["fixed_split_size"], "disable_split_kv": config["disable_split_kv"]}


class PlanReusePrefillWrapper(_PlanReuseWrapper):
    """flashinfer.BatchPrefillWithPagedKVCacheWrapper with chosen plan arguments (backend,
    fixed_split_size, disable_split_kv), for few query tokens per request over a paged kv
    cache, e.g. speculative-decoding verification. Host lengths: seq_lens (kv) and
    qo_indptr on the CPU."""

    _required, _optional = PREFILL_REQUIRED, PREFILL_OPTIONAL
    _config_keys = tuple(PREFILL_DEFAULT)

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None, paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None, backend: Any = TUNED,
                 *, config: Config | None = None, choose: Choose | None = None, **flashinfer_kwargs: Any) -> None:
        """FlashInfer's constructor arguments; others it takes (custom_mask_buf, jit_args,
        ...) are passed on as given."""
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, {
            "qo_indptr_buf": qo_indptr_buf, "paged_kv_indptr_buf": paged_kv_indptr_buf,
            "paged_kv_indices_buf": paged_kv_indices_buf, "paged_kv_last_page_len_buf": paged_kv_last_page_len_buf,
            **flashinfer_kwargs}, config, choose)
        self._explicit = {} if backend is TUNED else {"flashinfer_backend": backend}

    def _inner(self, backend: str) -> Any:
        inner = self._inners.get(backend)
        if inner is None:
            inner = self._inners[backend] = self._new_inner(library().BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, self._kv_layout, use_cuda_graph=self._use_cuda_graph, backend=backend,
                **self._buffers))
        return inner

    def plan(self, *args: Any, **kwargs: Any) -> None:
        """FlashInfer's plan(), every argument forwarded. Host lengths (seq_lens and
        qo_indptr on the CPU) make it cheap and let the DB choose the config."""
        rest = self._bind(args, kwargs)
        qo_indptr, indptr, indices, last_page_len = (rest.pop(k) for k in PREFILL_REQUIRED[:4])
        num_qo_heads, num_kv_heads, head_dim_qk, page_size = (rest.pop(k) for k in PREFILL_REQUIRED[4:])
        seq_lens = rest.pop("seq_lens", None)
        explicit = self._explicit_args(rest.pop("fixed_split_size", TUNED), rest.pop("disable_split_kv", TUNED))
        qo_h = None if qo_indptr.device.type != "cpu" else qo_indptr.numpy().astype(np.int64)
        lens = None if qo_h is None else host_seq_lens(seq_lens, indptr, last_page_len, page_size)
        if lens is None:
            config = self._config_for(None, PREFILL_DEFAULT, explicit)
            inner = self._inner(config["flashinfer_backend"])
            inner.plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
                       seq_lens=seq_lens, fixed_split_size=config["fixed_split_size"],
                       disable_split_kv=config["disable_split_kv"], **rest)
            self._standard(inner)
            return
        call = _reuse_key((num_qo_heads, num_kv_heads, head_dim_qk, page_size, tuple(sorted(explicit.items())),
                           qo_h.tobytes()), rest)
        if self._reuse(call, lens, indptr, indices, last_page_len):
            return
        q_dtype = _dtype(rest.get("q_data_type"), torch.float16)
        kv_dtype = _dtype(rest.get("kv_data_type"), q_dtype)
        qo_lens = np.diff(qo_h)
        q_max = int(qo_lens.max()) if len(qo_lens) else 1
        kv_max = int(lens.max()) if len(lens) else 0
        window_left, causal = rest.get("window_left", -1), rest.get("causal", False)
        lookup = None
        if (_measured(rest, PREFILL_MEASURED) and rest.get("head_dim_vo") in (None, head_dim_qk) and len(lens)
                and isinstance(window_left, int) and isinstance(causal, bool) and q_max >= 1):
            static = (q_dtype, kv_dtype, kv_dtype, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_qk, page_size,
                      causal, _window(window_left), rest.get("logits_soft_cap") or 0.0, False, False, False)
            lookup = (static, len(lens), q_max, kv_max)
        config = self._config_for(lookup, PREFILL_DEFAULT, explicit)
        inner = self._inner(config["flashinfer_backend"])
        indptr_h, last_h = paged_metadata(lens, page_size)
        inner.plan(qo_indptr, torch.from_numpy(indptr_h), indices, torch.from_numpy(last_h),
                   num_qo_heads, num_kv_heads, head_dim_qk, page_size,
                   seq_lens=torch.from_numpy(lens.astype(np.int32)), fixed_split_size=config["fixed_split_size"],
                   disable_split_kv=config["disable_split_kv"], **rest)
        self._planned(inner, call, lens, kv_max, indptr, indices, last_page_len, qo_lens)


_capturing = stream_capturing  # (a module name of its own: tests fake a capture here)
