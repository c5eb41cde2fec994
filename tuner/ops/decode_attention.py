"""decode_attention: one paged decode op that runs, per shape, the fastest backend installed
(FA3, FlashInfer or our Triton kernel) with that backend's fastest config, as the sweep measured.

A config is {"backend": name, **that backend's config}; the sweep measures the union of
the backends' spaces, so the winner is chosen across backends and knobs at once.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tuner.keys import kv_len_bucket, static_key_from_parts
from tuner.ops.base import Config, DecodeInputs, Op
from tuner.ops.fa3 import FA3, _decode_grid, _host_scalar, _host_window, _mtp_grid, host_flags
from tuner.ops.fa3 import _kernel as _fa3_kernel
from tuner.ops.flashinfer import FLASHINFER, paged_attention
from tuner.ops.flashinfer_plan import host_seq_lens
from tuner.ops.shapes import DecodeShape
from tuner.ops.triton_decode import TRITON_DECODE, triton_paged_decode
from tuner.runtime import autotune

OP_NAME = "decode_attention"
# the default's preference order; the default never needs host lengths (FlashInfer does)
BACKENDS: dict[str, Op] = {"fa3": FA3, "triton_decode": TRITON_DECODE, "flashinfer": FLASHINFER}


@functools.cache
def _installed_backends() -> tuple[Op, ...]:
    """The backends that run here, found once per process (probing imports costs
    milliseconds, and an install does not change under a running server)."""
    return tuple(op for op in BACKENDS.values() if op.unavailable() is None)


def _installed() -> list[Op]:
    return list(_installed_backends())


def _configs(shape: DecodeShape) -> list[Config]:
    return [{"backend": op.name, **c} for op in _installed() for c in op.configs(shape)]


def _default(shape: DecodeShape) -> Config:
    """The first installed backend's own default: what a caller gets without tuner."""
    installed = _installed()
    if not installed:
        return {"backend": "none"}
    return {"backend": installed[0].name, **installed[0].default(shape)}


def check_config(config: Config, shape: DecodeShape) -> str | None:
    """A config names a backend and passes that backend's own rules for the shape."""
    if not isinstance(config, dict):
        return f"a config is an object, got {type(config).__name__}"
    backend = config.get("backend")
    if backend not in BACKENDS:
        return f"backend={backend!r:.40} is not one of {', '.join(BACKENDS)}"
    return BACKENDS[backend].check({k: v for k, v in config.items() if k != "backend"}, shape)


def _split(config: Config) -> tuple[Op, Config]:
    rest = {k: v for k, v in config.items() if k != "backend"}
    return BACKENDS[config["backend"]], rest


def _run(inputs: DecodeInputs, config: Config) -> torch.Tensor:
    op, rest = _split(config)
    return op.run(inputs, rest)


def _unavailable() -> str | None:
    if _installed():
        return None
    return "; ".join(f"{name}: {op.unavailable()}" for name, op in BACKENDS.items())


DECODE_ATTENTION = Op(
    name=OP_NAME,
    description="paged decode on the fastest installed backend per shape (FA3, FlashInfer or Triton), best config",
    configs=_configs,
    default=_default,
    run=_run,
    grids={"decode": _decode_grid(), "mtp": _mtp_grid(), "cpu-tiny": TRITON_DECODE.grids["cpu-tiny"]},
    unavailable=_unavailable,
    device=lambda: "cuda" if torch.cuda.is_available() else "cpu",
    check=check_config,
)


# -- the runtime entry point ---------------------------------------------------------------
#
# Every call reads the caller's live tensors: page_table and cache_seqlens are usually
# persistent buffers updated in place between steps, so nothing here is cached by a
# tensor's identity. FlashInfer plans on the host for each call (its page layout is
# gathered from the live page table); under CUDA-graph capture, where a plan would freeze
# the capture-time pages, a FlashInfer winner is replaced by the default backend (FA3 or
# Triton), whose kernels read page_table and cache_seqlens on every replay.


def _call_key(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal=True, window_size=(-1, -1),
              softcap=0.0, sinks=None, seq_lens_host=None):
    q_shape = q.shape
    if type(max_kv_len) is not int:
        max_kv_len = _host_scalar(max_kv_len)
        if type(max_kv_len) is not int:  # the page table's capacity bounds every length
            return None, q_shape[0], q_shape[1], page_table.shape[1] * k_cache.shape[1]
    if (type(window_size) is not tuple or type(window_size[0]) is not int or type(window_size[1]) is not int
            or (type(softcap) is not float and type(softcap) is not int) or type(causal) is not bool):
        flags = host_flags(window_size, softcap, causal)
        if flags is None:  # not readable on the host: the default (of this batch and length) runs
            return None, q_shape[0], q_shape[1], max_kv_len
        window_size, softcap, causal = flags
    static = (q.dtype, k_cache.dtype, v_cache.dtype, q_shape[2], k_cache.shape[2], q_shape[3], v_cache.shape[3],
              k_cache.shape[1], causal, window_size, softcap, sinks is not None)
    return static, q_shape[0], q_shape[1], max_kv_len


def _static_json(static: tuple) -> str:
    q_dtype, k_dtype, v_dtype, q_heads, kv_heads, d_qk, d_v, page_size, causal, window, softcap, sinks = static
    return static_key_from_parts(
        q_dtype=q_dtype, k_dtype=k_dtype, v_dtype=v_dtype, num_q_heads=q_heads, num_kv_heads=kv_heads,
        head_dim_qk=d_qk, head_dim_v=d_v, page_size=page_size, causal=bool(causal), window_size=window,
        softcap=softcap or None, sinks=sinks, k_descale=False, v_descale=False,
    ).to_json()


def _shape_of(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal=True, window_size=(-1, -1),
              softcap=0.0, sinks=None, seq_lens_host=None) -> DecodeShape:
    """The call as a DecodeShape, for the backends' config spaces and rules (slow path only).
    Reads no device tensor: a length or flag given as one counts as the page table's capacity,
    no window, no softcap, causal."""
    window = _host_window(window_size) or (-1, -1)
    kv = _host_scalar(max_kv_len)
    kv = kv if type(kv) is int else page_table.shape[1] * k_cache.shape[1]
    softcap, causal = _host_scalar(softcap), _host_scalar(causal)
    return DecodeShape(
        batch=max(q.shape[0], 1), kv_len=max(kv, q.shape[1], 1), q_len=max(q.shape[1], 1),
        num_q_heads=q.shape[2], num_kv_heads=k_cache.shape[2], head_dim=q.shape[3], page_size=k_cache.shape[1],
        dtype=str(q.dtype).removeprefix("torch."), causal=causal if type(causal) is bool else True, window=window,
        softcap=float(softcap) if type(softcap) in (int, float) and softcap > 0 else 0.0, sinks=sinks is not None,
    )


def _accepts(config: Config, *args: Any, **kwargs: Any) -> bool:
    """A stored or borrowed config this call can run: its backend is installed here and the
    config passes that backend's rules for this very shape (a q_len-2 FlashInfer winner is a
    prefill config, which a q_len-1 call cannot run)."""
    if config.get("backend") not in {op.name for op in _installed_backends()}:
        return False
    return check_config(config, _shape_of(*args, **kwargs)) is None


@functools.lru_cache(maxsize=4096)
def _default_for(static: tuple, batch: int, q_len: int, kv_bucket: int) -> Config:
    """The default backend's config for a key (a FlashInfer winner's fallback), found once."""
    (_, _, _, q_heads, kv_heads, head_dim, _, page_size, causal, window, softcap, sinks) = static
    return _default(DecodeShape(batch=max(batch, 1), kv_len=max(kv_bucket, q_len, 1), q_len=max(q_len, 1),
                                num_q_heads=q_heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                                dtype=str(static[0]).removeprefix("torch."), causal=bool(causal), window=window,
                                softcap=float(softcap or 0.0), sinks=bool(sinks)))


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@autotune(OP_NAME, key=_call_key, static_json=_static_json, accepts=_accepts,
          configs=lambda *a, **k: _configs(_shape_of(*a, **k)), default=lambda *a, **k: _default(_shape_of(*a, **k)))
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, max_kv_len: int, causal: bool = True,
                     window_size: Any = (-1, -1), softcap: float = 0.0, sinks: torch.Tensor | None = None,
                     seq_lens_host: Any = None, *, config: Config) -> torch.Tensor:
    """Paged decode attention (layouts as tuner.ops.paged_decode_reference) on the backend
    and config the DB holds for this shape. max_kv_len is a host-side upper bound of
    cache_seqlens (never read from the device). seq_lens_host (cache_seqlens on the host,
    a CPU tensor or array) lets FlashInfer run where it won; without it, and under CUDA-graph
    capture, those shapes run the default backend. An empty batch gives an empty output."""
    if q.shape[0] == 0:
        return q.new_empty(*q.shape[:3], v_cache.shape[-1])
    if config["backend"] == "flashinfer":
        lens = None
        if seq_lens_host is not None and not _capturing():
            lens = host_seq_lens(seq_lens_host, None, None, k_cache.shape[1])
        flags = host_flags(window_size, softcap, causal) if lens is not None else None
        if flags is not None:  # plain host values: numpy ones would keep FlashInfer from reusing its plan
            (window_left, _), host_softcap, host_causal = flags
            return paged_attention(q, k_cache, v_cache, page_table, lens, {k: v for k, v in config.items()
                                                                          if k != "backend"},
                                   causal=bool(host_causal), window_left=int(window_left),
                                   softcap=float(host_softcap) if host_softcap else None)
        static, batch, q_len, kv_len = _call_key(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal,
                                                 window_size, softcap, sinks)
        config = _default_for(static, batch, q_len, kv_len_bucket(max(kv_len, 1))) if static is not None else \
            _default(_shape_of(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size,
                               softcap, sinks))
    if config["backend"] == "fa3":
        return _fa3_kernel()(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table, causal=causal,
            window_size=window_size, softcap=softcap or 0.0, sinks=sinks,
            num_splits=config["num_splits"], pack_gqa=config["pack_gqa"],
        )
    if config["backend"] == "triton_decode":
        return triton_paged_decode(
            q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len=max_kv_len, causal=causal,
            window=tuple(window_size), softcap=softcap or None, sinks=sinks,
            block_n=config["block_n"], num_kv_splits=config["num_kv_splits"],
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )
    raise RuntimeError(f"decode_attention: no backend can run here ({_unavailable()})")
