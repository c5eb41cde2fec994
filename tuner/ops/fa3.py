"""sgl-kernel's FA3 flash_attn_with_kvcache: a tunable op (num_splits, pack_gqa) and a
drop-in replacement that runs each call with the tuned config.

sgl-kernel is imported on first use only; everything else here runs without it.
"""

from __future__ import annotations

import functools
import importlib.util
import operator
from typing import Any

import torch

from tuner.keys import canonical_json, static_key_from_parts
from tuner.ops.base import Config, DecodeInputs, Op
from tuner.ops.rules import config_error, is_int, one_of
from tuner.ops.shapes import DecodeShape, grid
from tuner.runtime import autotune

OP_NAME = "fa3"
NUM_SPLITS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # 0: FA3's own heuristic
DEFAULT: Config = {"num_splits": 0, "pack_gqa": None}  # what sgl-kernel does when not told


@functools.cache
def _kernel() -> Any:
    """sgl-kernel's flash_attn_with_kvcache, taking every argument of the newest signature:
    releases before 0.4.5 (0.4.2.post1, LightLLM's pin) have no only_qv, which is then
    dropped while False and refused when set."""
    import inspect

    from sgl_kernel.flash_attn import flash_attn_with_kvcache as fa3

    if "only_qv" in inspect.signature(fa3).parameters:
        return fa3

    def without_only_qv(*args: Any, only_qv: bool = False, **kwargs: Any) -> Any:
        if only_qv:
            raise TypeError("this sgl-kernel's flash_attn_with_kvcache has no only_qv (sgl-kernel 0.4.5 added it)")
        return fa3(*args, **kwargs)

    return without_only_qv


def unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"FA3 in sgl-kernel needs an SM90 (Hopper) GPU, this one is SM{major}{minor}"
    if importlib.util.find_spec("sgl_kernel") is None:
        return "sgl-kernel is not installed (pip install 'tuner[gpu]')"
    return None


def config_space(num_q_heads: int, num_kv_heads: int) -> list[Config]:
    """num_splits x pack_gqa; pack_gqa only matters when q heads share kv heads."""
    packs = (None, False, True) if num_q_heads > num_kv_heads else (None,)
    return [{"num_splits": n, "pack_gqa": p} for n in NUM_SPLITS for p in packs]


# what FA3 takes: num_splits 0 (its heuristic) or a count, pack_gqa None (its choice) or a bool
RULES = {"num_splits": is_int(0, 1024), "pack_gqa": one_of(None, True, False)}


def check_config(config: Config, shape: DecodeShape | None = None) -> str | None:
    return config_error(config, RULES)


def _run(inputs: DecodeInputs, config: Config) -> torch.Tensor:
    s = inputs.shape
    return _kernel()(
        inputs.q, inputs.k_cache, inputs.v_cache,
        cache_seqlens=inputs.cache_seqlens, page_table=inputs.page_table,
        causal=s.causal, window_size=s.window, softcap=s.softcap, sinks=inputs.sinks,
        num_splits=config["num_splits"], pack_gqa=config["pack_gqa"],
    )


def _decode_grid(**common: Any) -> list[DecodeShape]:
    batches, kvs = [1, 4, 16, 64, 256], [512, 2048, 8192, 32768, 131072]
    return grid(batches, kvs, max_tokens=4 * 2**20, **common) + grid(
        batches, kvs, max_tokens=4 * 2**20, num_q_heads=8, num_kv_heads=1, **common
    )


def _mtp_grid() -> list[DecodeShape]:
    """Speculative-decoding verify: several query tokens per request."""
    return [
        DecodeShape(batch=b, kv_len=kv, q_len=q, num_q_heads=h, num_kv_heads=hk)
        for h, hk in ((32, 8), (8, 1))
        for q in (2, 4)
        for b in (1, 16, 64)
        for kv in (2048, 32768)
    ]


FA3 = Op(
    name=OP_NAME,
    description="sgl-kernel FA3 flash_attn_with_kvcache; tunes num_splits and pack_gqa (SM90 GPU)",
    configs=lambda shape: config_space(shape.num_q_heads, shape.num_kv_heads),
    default=lambda shape: dict(DEFAULT),
    run=_run,
    grids={"decode": _decode_grid(), "mtp": _mtp_grid(), "smoke": grid([1, 64], [512, 8192])},
    unavailable=unavailable,
    device=lambda: "cuda",
    check=check_config,
)


# -- the drop-in ---------------------------------------------------------------------------
#
# What the caller decided stays decided:
# - num_splits=0 and pack_gqa=None are sgl-kernel's own defaults, "let the library choose"
#   (SGLang's FA3 backend passes num_splits=0 on every call): tuner chooses both then;
# - a num_splits > 0 or a pack_gqa of True/False is the caller's: it is kept, and the other
#   stays the library's choice (a tuned pair is never split);
# - with scheduler_metadata, FA3 skips its scheduler and runs the plan the caller built for
#   its own num_splits and pack_gqa (it sizes the split accumulators from the call's
#   num_splits): both are passed through as given, never tuned;
# - config=DEFAULT (an explicit config) opts a call out: no lookup, FA3's own choice.


class _Tuned:
    """An argument left to tuner (the FlashInfer wrappers' default for plan arguments)."""

    def __repr__(self) -> str:
        return "TUNED"


TUNED: Any = _Tuned()
_PLAIN_FIELDS = 14  # the static key tuple's fields that map to AttentionStaticKey


def _static_json(static: tuple) -> str:
    """The DB's static key for a call: AttentionStaticKey's JSON, plus the features (new
    k/v, rotary, qv, ...) that change FA3's kernel but no sweep measures, if any are on."""
    (q_dtype, k_dtype, v_dtype, q_heads, kv_heads, d_qk, d_v, page_size, causal, window,
     softcap, sinks, k_descale, v_descale) = static[:_PLAIN_FIELDS]
    key = static_key_from_parts(
        q_dtype=q_dtype, k_dtype=k_dtype, v_dtype=v_dtype, num_q_heads=q_heads,
        num_kv_heads=kv_heads, head_dim_qk=d_qk, head_dim_v=d_v, page_size=page_size,
        causal=bool(causal), window_size=window, softcap=softcap or None, sinks=sinks,
        k_descale=k_descale, v_descale=v_descale,
    )
    extras = static[_PLAIN_FIELDS]
    return key.to_json() if not extras else canonical_json(dict(key.to_dict(), extras=list(extras)))


# the static key's "extras": features that select another FA3 kernel (or plan) than any sweep
# measures; a call using one runs FA3's default unless a winner was tuned for exactly it
EXTRAS = ("new_kv", "qv", "rotary", "score_mod", "only_qv", "attention_chunk", "sm_margin", "cache_leftpad",
          "cache_batch_idx", "q_descale", "ver")


def _host_window(window_size: Any) -> tuple[int, int] | None:
    """window_size as a key: a pair of host ints (None, an int, a list or a numpy array are
    normalised); None when it cannot be read without a device tensor."""
    if window_size is None:
        return (-1, -1)
    if isinstance(window_size, torch.Tensor):
        return None
    try:
        try:
            left, right = window_size  # a pair: tuple, list, numpy array
        except TypeError:  # not iterable: one int for both sides
            side = operator.index(window_size)
            return (side, side)
        if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
            return None
        return (operator.index(left), operator.index(right))
    except (TypeError, ValueError):
        return None


def host_flags(window_size: Any, softcap: Any, causal: Any) -> tuple[tuple[int, int], Any, Any] | None:
    """(window, softcap, causal) as key values, off the key functions' fast path (which takes
    a tuple of ints, a float or int and a bool as they are); None when one of them cannot be
    read without a device tensor."""
    window = _host_window(window_size)
    softcap = softcap if type(softcap) is float or type(softcap) is int else _host_scalar(softcap)
    causal = causal if type(causal) is bool else _host_scalar(causal)
    if window is None or softcap is _UNKEYED or causal is _UNKEYED:
        return None
    return window, softcap, causal


def _host_scalar(value: Any) -> Any:
    """A flag or number as a key: host Python values as they are, numpy scalars as Python's;
    _UNKEYED for a tensor (never read back to build a key)."""
    if isinstance(value, torch.Tensor):
        return _UNKEYED
    item = getattr(value, "item", None)
    return item() if callable(item) else value


_UNKEYED: Any = object()


def _call_key(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
              cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
              cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
              q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
              window_size=(-1, -1), attention_chunk=None, softcap=0.0, rotary_interleaved=True,
              scheduler_metadata=None, num_splits=0, pack_gqa=None, only_qv=False, sm_margin=0,
              return_softmax_lse=False, sinks=None, score_mod=None, aux_tensors=None, ver=3, out=None):
    """(static key tuple, batch, max q len, max kv len) from host-side values only: shapes,
    flags and the page table's width (an upper bound of every sequence's kv length). A static
    key of None (the default runs, nothing is looked up or tuned): a call whose key cannot be
    read on the host (q or k_cache None with only_qv, a flag given as a device tensor), or
    whose num_splits and pack_gqa the caller decided (scheduler metadata, set values)."""
    if q is None or k_cache is None:
        return None, 1, 1, 1
    q_shape, k_shape = q.shape, k_cache.shape
    # the caller decided (scheduler metadata, a split count, a pack_gqa): no config is looked
    # up, tuned or recorded as a miss for this call (the body keeps the caller's values)
    caller_decided = scheduler_metadata is not None or (pack_gqa is not None and pack_gqa is not TUNED) or (
        num_splits is not TUNED and (type(num_splits) is not int or num_splits != 0))
    if page_table is None:
        page_size, kv_len = 0, k_shape[1]
    else:
        page_size = k_shape[1]
        kv_len = page_table.shape[1] * page_size
    if cu_seqlens_q is None:
        batch, q_len = q_shape[0], q_shape[1]
    else:
        batch, q_len = cu_seqlens_q.shape[0] - 1, max_seqlen_q or 1
        if type(q_len) is not int:
            q_len = _host_scalar(q_len)
            if type(q_len) is not int:
                return None, max(batch, 1), 1, kv_len
    if (type(window_size) is not tuple or type(window_size[0]) is not int or type(window_size[1]) is not int
            or (type(softcap) is not float and type(softcap) is not int) or type(causal) is not bool):
        flags = host_flags(window_size, softcap, causal)
        if flags is None:
            return None, batch, q_len, kv_len
        window_size, softcap, causal = flags
    if caller_decided:
        return None, batch, q_len, kv_len
    extras = ()
    if (k is not None or qv is not None or rotary_cos is not None or score_mod is not None or only_qv
            or attention_chunk or sm_margin or cache_leftpad is not None or cache_batch_idx is not None
            or q_descale is not None or ver != 3):
        extras = tuple(name for name, on in zip(EXTRAS, (
            k is not None, qv is not None, rotary_cos is not None, score_mod is not None, bool(only_qv),
            bool(attention_chunk), bool(sm_margin), cache_leftpad is not None, cache_batch_idx is not None,
            q_descale is not None, ver != 3)) if on)
    static = (q.dtype, k_cache.dtype, v_cache.dtype, q_shape[-2], k_shape[2], q_shape[-1], v_cache.shape[-1],
              page_size, causal, window_size, softcap, sinks is not None, k_descale is not None,
              v_descale is not None, extras)
    return static, batch, q_len, kv_len


def _call_configs(q, k_cache, *args, **kwargs) -> list[Config]:
    return config_space(q.shape[-2], k_cache.shape[2])


def _accepts(config: Config, *args: Any, **kwargs: Any) -> bool:
    return check_config(config) is None


@autotune(OP_NAME, configs=_call_configs, default=DEFAULT, key=_call_key, static_json=_static_json,
          accepts=_accepts)
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=None, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, only_qv=False,
                            sm_margin=0, return_softmax_lse=False, sinks=None, score_mod=None,
                            aux_tensors=None, ver=3, out=None, *, config):
    """sgl_kernel.flash_attn.flash_attn_with_kvcache, same arguments and defaults. Where the
    caller leaves num_splits=0 and pack_gqa=None (the library's choice), both come from the
    tuning DB (nearest run key, else FA3's default); a num_splits > 0 or a pack_gqa the
    caller sets is kept, as are both whenever scheduler_metadata is given (it was built for
    them). config=tuner.ops.fa3.DEFAULT runs FA3's own choice without a lookup."""
    if scheduler_metadata is None and (pack_gqa is None or pack_gqa is TUNED) and (
            num_splits is TUNED or (type(num_splits) is int and num_splits == 0)):  # the library's choice
        num_splits, pack_gqa = config["num_splits"], config["pack_gqa"]
    elif num_splits is TUNED or pack_gqa is TUNED:  # TUNED, the old default, means the library's choice
        num_splits, pack_gqa = 0 if num_splits is TUNED else num_splits, None if pack_gqa is TUNED else pack_gqa
    return _kernel()(
        q, k_cache, v_cache, k=k, v=v, qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        page_table=page_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new,
        max_seqlen_q=max_seqlen_q, rotary_seqlens=rotary_seqlens, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, attention_chunk=attention_chunk, softcap=softcap,
        rotary_interleaved=rotary_interleaved, scheduler_metadata=scheduler_metadata,
        num_splits=num_splits, pack_gqa=pack_gqa, only_qv=only_qv, sm_margin=sm_margin,
        return_softmax_lse=return_softmax_lse, sinks=sinks, score_mod=score_mod,
        aux_tensors=aux_tensors, ver=ver, out=out,
    )
