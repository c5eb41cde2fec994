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
from tuner.ops.decode_attention import (BY_FILL, OP_NAME, Call, _configs, _default, call_shape, can_run, fill_parts,
                                        run_call)
from tuner.runtime import autotune
from tuner.runtime.state import runtime


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


def declared_branch(config: Config, batch: int) -> Config:
    """The config a call runs inside tuner.graph_capture(lengths): a by_fill config's dense
    one where most batches of `batch` of the declared lengths are dense (their replays will
    be), its other one where they are not or the declaration gives no per-sequence lengths;
    any other config, and any config outside graph_capture, as it is."""
    declared = runtime.declared_lengths
    if declared is None or config.get("backend") != BY_FILL:
        return config
    dense, other = fill_parts(config)
    share = declared.fill_share(batch, settings.DENSE_FILL)
    return dense if share is not None and share >= settings.DECLARED_DENSE_SHARE else other


@autotune(OP_NAME, key=_call_key, static_json=_static_json, accepts=_accepts, lengths=_host_lengths,
          configs=lambda *a, **k: _configs(call_shape(_call(*a, **k))),
          default=lambda *a, **k: _default(call_shape(_call(*a, **k))))
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, max_kv_len: int, causal: bool = True,
                     window_size: Any = (-1, -1), softcap: float = 0.0, sinks: torch.Tensor | None = None,
                     seq_lens_host: Any = None, *, config: Config) -> torch.Tensor:
    """Paged decode attention (layouts as tuner.ops.paged_decode_reference) on the backend
    and config the DB holds for this shape. max_kv_len is a host-side upper bound of
    cache_seqlens (never read from the device). seq_lens_host (cache_seqlens on the host,
    a CPU tensor or array) lets FlashInfer run where it won; without it, and under CUDA-graph
    capture, those shapes run the default backend. An empty batch gives an empty output.
    A by_fill config runs its config for the call's fill (run_call), inside
    tuner.graph_capture(lengths) for the declared lengths' (declared_branch)."""
    if runtime.declared_lengths is not None:
        config = declared_branch(config, q.shape[0])
    return run_call(config, q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size, softcap,
                    sinks, seq_lens_host)
