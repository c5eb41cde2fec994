"""decode_attention's entry point and dispatch: one paged decode that runs each call on the
backend and config the tuning DB holds for its shape, or the default backend where that one
cannot run the call.

Every call reads the caller's live tensors: page_table and cache_seqlens are usually
persistent buffers updated in place between steps, so nothing here is cached by a
tensor's identity. FlashInfer plans on the host for each call (its page layout is
gathered from the live page table); under CUDA-graph capture, where a plan would freeze
the capture-time pages, a FlashInfer winner is replaced by the default backend (FA3 or
Triton), whose kernels read page_table and cache_seqlens on every replay
(run_call).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import torch

from tuner import settings
from tuner.keys import Untunable, host_flags, host_scalar, host_window, kv_len_bucket, static_key_from_tuple
from tuner.ops.base import Config, sm_count
from tuner.ops.decode_attention import (BACKENDS, BY_FILL, OP_NAME, check_config, config_space, default_config,
                                        dense_call, fill_parts, installed, unavailable)
from tuner.ops.fa3_waves import WAVE_FIT, wave_args, wave_cap
from tuner.runtime import autotune
from tuner.workload.shapes import DecodeShape
from tuner.runtime.capture_watch import CAPTURES
from tuner.runtime.state import runtime, stream_capturing


class Call(NamedTuple):  # a tuple: made on every call, it must cost next to nothing
    """A caller's decode_attention call, as the backends take it."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    max_kv_len: int
    causal: Any = True
    window_size: Any = (-1, -1)
    softcap: Any = 0.0
    sinks: torch.Tensor | None = None
    seq_lens_host: Any = None  # each sequence's kv length, on the host (a CPU tensor or array), when known


def call_shape(c: Call) -> DecodeShape:
    """The call as a DecodeShape, for the backends' config spaces and rules (slow path only).
    Reads no device tensor: a length or flag given as one counts as the page table's capacity,
    no window, no softcap, causal."""
    window = host_window(c.window_size) or (-1, -1)
    kv = host_scalar(c.max_kv_len)
    kv = kv if type(kv) is int else c.page_table.shape[1] * c.k_cache.shape[1]
    softcap, causal = host_scalar(c.softcap), host_scalar(c.causal)
    return DecodeShape(
        batch=max(c.q.shape[0], 1), kv_len=max(kv, c.q.shape[1], 1), q_len=max(c.q.shape[1], 1),
        num_q_heads=c.q.shape[2], num_kv_heads=c.k_cache.shape[2], head_dim=c.q.shape[3],
        page_size=c.k_cache.shape[1], dtype=str(c.q.dtype).removeprefix("torch."),
        causal=causal if type(causal) is bool else True, window=window,
        softcap=float(softcap) if type(softcap) in (int, float) and softcap > 0 else 0.0, sinks=c.sinks is not None,
    )


def can_run(config: Config, c: Call) -> bool:
    """A stored or borrowed config this call can run: its backend is installed here and the
    config passes that backend's rules for this very call's shape (a q_len-2 FlashInfer
    winner is a prefill config, which a q_len-1 call cannot run); a by_fill config: both of
    its configs."""
    if config.get("backend") == BY_FILL:
        return check_config(config, call_shape(c)) is None and all(can_run(p, c) for p in fill_parts(config))
    if config.get("backend") not in {b.name for b in installed()}:
        return False
    return check_config(config, call_shape(c)) is None


_FALLBACKS: dict[tuple, Config] = {}
_FALLBACKS_MAX = 4096


def _fallback(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size, softcap,
              sinks) -> Config:
    """The default backend's config for a call whose own backend cannot run it: the default
    of its kv bucket's top (one config per key, whatever length came first, as a graph
    captured at one length replays at others). Cached by the call's host values, so a
    server that keeps falling back (every capture, no host lengths) builds no shape."""
    plain = type(max_kv_len) is int and type(causal) is bool and type(softcap) in (float, int) and \
        type(window_size) is tuple
    # the kv bucket as its exponent (kv_len_bucket without its checks: the key is all this costs)
    key = (installed(), q.shape, q.dtype, k_cache.shape, v_cache.shape[-1], k_cache.dtype, page_table.shape[1],
           (max(max_kv_len, 1) - 1).bit_length(), causal, window_size, softcap, sinks is None) if plain else None
    config = _FALLBACKS.get(key) if plain else None
    if config is None:
        shape = call_shape(Call(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size,
                                softcap, sinks))
        config = default_config(dataclasses.replace(shape, kv_len=max(kv_len_bucket(shape.kv_len), shape.q_len)))
        if plain:
            if len(_FALLBACKS) >= _FALLBACKS_MAX:
                _FALLBACKS.clear()
            _FALLBACKS[key] = config
    return config


def run_call(config: Config, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             page_table: torch.Tensor, cache_seqlens: torch.Tensor, max_kv_len: int, causal: Any, window_size: Any,
             softcap: Any, sinks: torch.Tensor | None, seq_lens_host: Any,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Run a caller's call (Call's fields) with a plain config (the entry point,
    tuner.integrations.decode_attention, resolves a by_fill one) on its backend; where that backend
    cannot run this call (no host lengths for FlashInfer, or CUDA-graph capture, which would
    freeze its plan and pages), the default backend's config for the call's shape runs
    instead. An empty batch gives an empty output. out (checked by the caller): the tensor
    the output is written into and which is returned."""
    if q.shape[0] == 0:
        return q.new_empty(*q.shape[:3], v_cache.shape[-1]) if out is None else out
    backend = BACKENDS.get(config["backend"])
    if backend is None or not (backend.runs_any_call or backend.runs(
            q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size, softcap, sinks,
            seq_lens_host)):
        config = _fallback(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size,
                           softcap, sinks)
        backend = BACKENDS.get(config["backend"])
        if backend is None:
            raise RuntimeError(f"decode_attention: no backend can run here ({unavailable()})")
    result = backend.call(config, q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size,
                          softcap, sinks, seq_lens_host, out)
    if out is not None and result.data_ptr() != out.data_ptr():  # a backend that cannot write into it
        return out.copy_(result)
    return result


def graph_runs(config: Config, args: tuple) -> Config:
    """The plain config a call with these positional arguments runs when captured into a CUDA
    graph: its own (a wave_fit config, or FA3's default in a cap graph of it, at the cap its
    declaration names), or where its backend cannot run captured or without host lengths (a
    FlashInfer plan), the default backend's (run_call's fallback)."""
    if WAVE_FIT in config or is_fa3_default(config):
        return _as_captured(config)
    backend = BACKENDS.get(config.get("backend"))
    if backend is not None and backend.runs_any_call:
        return config
    call = _call(*args)
    if backend is not None and backend.graph_capturable and backend.takes(*call):
        return config
    return _fallback(*call[:10])


def _call_key(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal=True, window_size=(-1, -1),
              softcap=0.0, sinks=None, seq_lens_host=None, out=None):
    q_shape = q.shape
    if type(max_kv_len) is not int:
        max_kv_len = host_scalar(max_kv_len)
        if type(max_kv_len) is not int:  # the page table's capacity bounds every length
            return _untunable(q, k_cache, v_cache, sinks), q_shape[0], q_shape[1], \
                page_table.shape[1] * k_cache.shape[1]
    flags = host_flags(window_size, softcap, causal)
    if flags is None:  # not readable on the host: the default (of this shape, batch and length) runs
        return _untunable(q, k_cache, v_cache, sinks), q_shape[0], q_shape[1], max_kv_len
    window_size, softcap, causal = flags
    static = (q.dtype, k_cache.dtype, v_cache.dtype, q_shape[2], k_cache.shape[2], q_shape[3], v_cache.shape[3],
              k_cache.shape[1], causal, window_size, softcap, sinks is not None, False, False)
    return static, q_shape[0], q_shape[1], max_kv_len


def _untunable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sinks: Any) -> Untunable:
    """The key of a call whose flags or bound cannot be read on the host: what its default
    depends on (FA3 runs no float32, nor head dims past 256)."""
    return Untunable(q.dtype, k_cache.dtype, v_cache.dtype, q.shape[2], k_cache.shape[2], q.shape[3],
                     v_cache.shape[3], k_cache.shape[1], sinks is not None)


def _static_json(static: tuple) -> str:
    return static_key_from_tuple(static).to_json()


def _call(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal=True, window_size=(-1, -1),
          softcap=0.0, sinks=None, seq_lens_host=None, out=None) -> Call:
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
    its config for any batch (_fill_config), and of a wave_fit config FA3's own choice; for
    the frozen rule (tuner.runtime.borrowing)."""
    return _as_captured(fill_parts(config)[1] if config.get("backend") == BY_FILL else config)


def _as_captured(config: Config) -> Config:
    """A wave_fit config as a capture runs it (no host lengths at replay): FA3's own choice,
    or the cap the active declaration names (a graph variant's, tuner.integrations.graph_variants);
    FA3's plain default at that cap where the declaration caps the default too."""
    if WAVE_FIT in config:
        return dict({k: v for k, v in config.items() if k != WAVE_FIT}, num_splits=_declared_cap())
    if is_fa3_default(config):
        cap = _declared_default_cap()
        return dict(config, num_splits=cap) if cap else config
    return config


def is_fa3_default(config: Config) -> bool:
    """Whether a config is FA3's plain default (the library's own choice of splits and packing)."""
    return config.get("backend") == "fa3" and config.get("num_splits") == 0 and config.get("pack_gqa") is None \
        and WAVE_FIT not in config


def _declared_cap() -> int:
    declared = runtime.declared_lengths
    return 0 if declared is None else declared.fa3_cap


def _declared_default_cap() -> int:
    """The cap FA3's plain default runs at under the active declaration (0: its own choice)."""
    declared = runtime.declared_lengths
    return declared.fa3_cap if declared is not None and declared.default_capped else 0


# the last CPU tensor of host lengths a wave_fit config was resolved for, its version
# counter then, the call's shape, and the cap: every layer of a decode step passes one tensor
_last_cap: tuple[Any, int, tuple, int] = (None, -1, (), 0)
_WAVE_PLAIN: dict[int, tuple[Config, dict[int, Config]]] = {}  # id -> (wave_fit config, cap -> its plain config)


@functools.cache
def _sms(device_index: int | None) -> int:
    return sm_count(device_index)


def _wave_splits(q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor, seq_lens_host: Any) -> int:
    """The num_splits a wave_fit config runs for this call (tuner.ops.fa3_waves.wave_cap): 0,
    FA3's own choice, without host lengths, under a CUDA-graph capture (whose replays may hold
    any lengths) and while torch.compile traces; inside tuner.graph_capture(lengths), the cap
    its declaration names (0 but for a graph variant's)."""
    if runtime.declared_lengths is not None:  # inside graph_capture: the replays' lengths, not the call's
        return runtime.declared_lengths.fa3_cap
    if seq_lens_host is None or torch.compiler.is_compiling() or (CAPTURES[0] and stream_capturing()):
        return 0
    return _host_cap(q, k_cache, page_table, seq_lens_host)


def _host_cap(q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor, seq_lens_host: Any) -> int:
    """wave_cap for the call's host lengths (0 where they are not on the host), kept while
    the same CPU tensor comes again unchanged for a call of the same shape."""
    global _last_cap
    # what the cap depends on besides the lengths, as far as it is cheap to ask (reading the
    # cache's shape too cost 0.4 us a call): calls that share a lengths tensor share their kv
    # heads and page size, and a stale cap would cost time, never a wrong output
    shape = (q.shape, page_table.shape[1])
    if isinstance(seq_lens_host, torch.Tensor):
        last = _last_cap  # (an inference tensor has no version counter: never kept)
        if last[0] is seq_lens_host and last[2] == shape and not seq_lens_host.is_inference() \
                and last[1] == seq_lens_host._version:
            return last[3]
        if not seq_lens_host.is_cpu:
            return 0
        lengths = seq_lens_host.numpy()
    else:
        lengths = seq_lens_host
    try:
        cap = wave_cap(lengths, **wave_args(q, k_cache, page_table, _sms(q.device.index)))
    except (TypeError, ValueError):  # lengths that are not integers: FA3's own choice
        return 0
    if isinstance(seq_lens_host, torch.Tensor) and not seq_lens_host.is_inference():
        _last_cap = (seq_lens_host, seq_lens_host._version, shape, cap)
    return cap


def eager_config(config: Config, *args: Any, **kwargs: Any) -> Config:
    """The plain config an eager call with decode_attention's arguments runs: a by_fill
    config's branch for its host lengths, a wave_fit config's cap for them (a benchmark that
    times calls inside CUDA graphs, which replay only these lengths, resolves them first)."""
    c = _call(*args, **kwargs)
    if config.get("backend") == BY_FILL:
        dense, other = fill_parts(config)
        config = dense if dense_call(c.seq_lens_host, c.max_kv_len, c.q.shape[0]) else other
    if WAVE_FIT in config:
        cap = 0 if c.seq_lens_host is None else _host_cap(c.q, c.k_cache, c.page_table, c.seq_lens_host)
        config = dict(_as_captured(config), num_splits=cap)
    return config


def _wave_config(config: Config, q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor,
                 seq_lens_host: Any) -> Config:
    """The plain FA3 config a wave_fit config runs for this call: num_splits from _wave_splits
    (one dict per config and cap, made once)."""
    cap = _wave_splits(q, k_cache, page_table, seq_lens_host)
    entry = _WAVE_PLAIN.get(id(config))
    if entry is None or entry[0] is not config:
        if len(_WAVE_PLAIN) >= 4096:
            _WAVE_PLAIN.clear()
        entry = _WAVE_PLAIN[id(config)] = (config, {})  # holds config: its id stays its own
    plain = entry[1].get(cap)
    if plain is None:
        plain = entry[1][cap] = dict(_as_captured(config), num_splits=cap)
    return plain


def wave_resolved(config: Config, call: tuple) -> Config:
    """The plain FA3 config a wave_fit config runs for a call with these positional arguments,
    as decode_attention runs it (_wave_splits: its host lengths' cap, kept while the same CPU
    tensor comes again unchanged; FA3's own choice without them)."""
    c = _call(*call)
    return _wave_config(config, c.q, c.k_cache, c.page_table, c.seq_lens_host)


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
          configs=lambda *a, **k: config_space(call_shape(_call(*a, **k))),
          default=lambda *a, **k: default_config(call_shape(_call(*a, **k))))
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, max_kv_len: int, causal: bool = True,
                     window_size: Any = (-1, -1), softcap: float = 0.0, sinks: torch.Tensor | None = None,
                     seq_lens_host: Any = None, *, config: Config, out: torch.Tensor | None = None) -> torch.Tensor:
    """Paged decode attention (layouts as tuner.workload.paged_decode_reference; q may be
    strided over its batch, as a slice of a qkv projection is) on the backend and config the
    DB holds for this shape. max_kv_len is a host-side upper bound of
    cache_seqlens (never read from the device). seq_lens_host (cache_seqlens on the host,
    a CPU tensor or array) lets FlashInfer run where it won; without it, and under CUDA-graph
    capture, those shapes run the default backend. An empty batch gives an empty output.
    A by_fill record runs its dense config where seq_lens_host shows a dense batch (lengths
    summing to at least settings.DENSE_FILL of batch x max_kv_len, which must then be a
    host int and the longest's bound), its other config elsewhere (_fill_config). A wave_fit
    FA3 config caps FA3's split counts from seq_lens_host where its tiles would spill past one
    wave of the GPU (tuner.ops.fa3_waves), FA3's own choice elsewhere (_wave_splits). out: a
    (batch, q_len, q heads, head_dim_v) tensor of q's dtype and device, its last dim of unit
    stride, to write the output into and return (as FA3's out=: a server's buffer, no copy
    where the backend writes there itself)."""
    if out is not None:
        _check_out(out, q, v_cache)
    if config["backend"] == BY_FILL:
        config = _fill_config(config, q.shape[0], max_kv_len, seq_lens_host)
    if WAVE_FIT in config:
        config = _wave_config(config, q, k_cache, page_table, seq_lens_host)
    elif runtime.declared_lengths is not None and config["backend"] == "fa3":  # (a cap graph's capture)
        config = _as_captured(config)
    return run_call(config, q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size, softcap,
                    sinks, seq_lens_host, out)


def _check_out(out: torch.Tensor, q: torch.Tensor, v_cache: torch.Tensor) -> None:
    shape = (*q.shape[:3], v_cache.shape[-1])
    if tuple(out.shape) != shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"decode_attention: out must be {shape} of {q.dtype} on {q.device} with a unit-stride "
                         f"last dim, not {tuple(out.shape)} of {out.dtype} on {out.device} (strides {out.stride()})")
