"""decode_attention's entry point: one paged decode that runs each call on the backend and
config the tuning DB holds for its shape (also importable as
tuner.ops.decode_attention.decode_attention).

Every call reads the caller's live tensors: page_table and cache_seqlens are usually
persistent buffers updated in place between steps, so nothing here is cached by a
tensor's identity. FlashInfer plans on the host for each call (its page layout is
gathered from the live page table); under CUDA-graph capture, where a plan would freeze
the capture-time pages, a FlashInfer winner is replaced by the default backend (FA3 or
Triton), whose kernels read page_table and cache_seqlens on every replay
(tuner.ops.decode_attention.run_call).
"""

from __future__ import annotations

from typing import Any

import torch

from tuner import settings
from tuner.keys import host_flags, host_scalar, host_window, static_key_from_tuple
from tuner.ops.base import Config
from tuner.ops.decode_attention import (BACKENDS, BY_FILL, OP_NAME, Call, _configs, _default, call_shape, can_run,
                                        dense_call, fill_parts, run_call)
from tuner.runtime import autotune
from tuner.runtime.capture_watch import CAPTURES
from tuner.runtime.state import runtime, stream_capturing


def _call_key(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal=True, window_size=(-1, -1),
              softcap=0.0, sinks=None, seq_lens_host=None):
    q_shape = q.shape
    if type(max_kv_len) is not int:
        max_kv_len = host_scalar(max_kv_len)
        if type(max_kv_len) is not int:  # the page table's capacity bounds every length
            return None, q_shape[0], q_shape[1], page_table.shape[1] * k_cache.shape[1]
    if (type(window_size) is not tuple or type(window_size[0]) is not int or type(window_size[1]) is not int
            or (type(softcap) is not float and type(softcap) is not int) or type(causal) is not bool):
        flags = host_flags(window_size, softcap, causal)
        if flags is None:  # not readable on the host: the default (of this batch and length) runs
            return None, q_shape[0], q_shape[1], max_kv_len
        window_size, softcap, causal = flags
    static = (q.dtype, k_cache.dtype, v_cache.dtype, q_shape[2], k_cache.shape[2], q_shape[3], v_cache.shape[3],
              k_cache.shape[1], causal, window_size, softcap, sinks is not None, False, False)
    return static, q_shape[0], q_shape[1], max_kv_len


def _static_json(static: tuple) -> str:
    return static_key_from_tuple(static).to_json()


def _call(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal=True, window_size=(-1, -1),
          softcap=0.0, sinks=None, seq_lens_host=None) -> Call:
    return Call(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size, softcap, sinks,
                seq_lens_host)


def _accepts(config: Config, *args: Any, **kwargs: Any) -> bool:
    return can_run(config, _call(*args, **kwargs))


def _host_lengths(*args: Any, **kwargs: Any) -> Any:
    """seq_lens_host, when it is on the host (a device tensor is never read back), as the keys
    each sequence's queries see: a sliding window caps them (tuner.keys.visible_kv_len), so a
    miss whose sequences all reach past the window reads as one of full batches, and
    `tuner sweep --from-misses` measures it so."""
    call = _call(*args, **kwargs)
    lengths = call.seq_lens_host
    if lengths is None or (isinstance(lengths, torch.Tensor) and lengths.device.type != "cpu"):
        return None
    window = host_window(call.window_size)
    if window is not None and window[0] >= 0:
        lengths = torch.as_tensor(lengths).clamp(max=window[0] + call.q.shape[1])  # as in visible_kv_len
    return lengths


def _captured(config: Config) -> Config:
    """The config a CUDA-graph capture runs of a stored one: a by_fill config's other one,
    its config for any batch (_fill_config); for the frozen rule (tuner.runtime.borrowing)."""
    return fill_parts(config)[1] if config.get("backend") == BY_FILL else config


def declared_branch(config: Config, batch: int) -> Config:
    """The config a call runs inside tuner.graph_capture(lengths): a by_fill config's dense
    one where at least settings.DECLARED_DENSE_SHARE of the time of the declared lengths'
    batches of `batch` is in dense ones (DeclaredLengths.fill_share: their replays will be
    dense) and its backend can be captured (a FlashInfer plan cannot: the default would
    run instead), else its other one, also where the declaration gives no per-sequence
    lengths; any other config, and any config outside graph_capture, as it is."""
    declared = runtime.declared_lengths
    if declared is None or config.get("backend") != BY_FILL:
        return config
    dense, other = fill_parts(config)
    share = declared.fill_share(batch, settings.DENSE_FILL)
    if share is not None and share >= settings.DECLARED_DENSE_SHARE and BACKENDS[dense["backend"]].graph_capturable:
        return dense
    return other


def _fill_config(config: Config, batch: int, max_kv_len: Any, seq_lens_host: Any) -> Config:
    """The plain config a by_fill config runs for this call: the declared lengths' inside
    tuner.graph_capture(lengths); its other one while torch.compile traces (a traced graph
    would keep its first call's branch) and under a CUDA-graph capture (which replays any
    lengths; asked only while tuner.runtime.capture_watch counts one); else the one of the
    call's host lengths (tuner.ops.decode_attention.dense_call)."""
    if runtime.declared_lengths is not None:
        return declared_branch(config, batch)
    dense, other = fill_parts(config)
    if torch.compiler.is_compiling() or not dense_call(seq_lens_host, max_kv_len, batch):
        return other
    return other if CAPTURES[0] and stream_capturing() else dense


@autotune(OP_NAME, key=_call_key, static_json=_static_json, accepts=_accepts, lengths=_host_lengths, captured=_captured,
          configs=lambda *a, **k: _configs(call_shape(_call(*a, **k))),
          default=lambda *a, **k: _default(call_shape(_call(*a, **k))))
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, max_kv_len: int, causal: bool = True,
                     window_size: Any = (-1, -1), softcap: float = 0.0, sinks: torch.Tensor | None = None,
                     seq_lens_host: Any = None, *, config: Config) -> torch.Tensor:
    """Paged decode attention (layouts as tuner.workload.paged_decode_reference) on the backend
    and config the DB holds for this shape. max_kv_len is a host-side upper bound of
    cache_seqlens (never read from the device). seq_lens_host (cache_seqlens on the host,
    a CPU tensor or array) lets FlashInfer run where it won; without it, and under CUDA-graph
    capture, those shapes run the default backend. An empty batch gives an empty output.
    A by_fill record runs its dense config where seq_lens_host shows a dense batch (lengths
    summing to at least settings.DENSE_FILL of batch x max_kv_len, which must then be a
    host int and the longest's bound), its other config elsewhere (_fill_config)."""
    if config["backend"] == BY_FILL:
        config = _fill_config(config, q.shape[0], max_kv_len, seq_lens_host)
    return run_call(config, q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size, softcap,
                    sinks, seq_lens_host)
