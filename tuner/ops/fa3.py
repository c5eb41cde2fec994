"""sgl-kernel's FA3 flash_attn_with_kvcache: a tunable op (num_splits, pack_gqa) and a
drop-in replacement that runs each call with the tuned config.

sgl-kernel is imported on first use only; everything else here runs without it.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from tuner.keys import canonical_json, static_key_from_parts
from tuner.ops.base import Config, DecodeInputs, Op
from tuner.ops.shapes import DecodeShape, grid
from tuner.runtime import autotune

OP_NAME = "fa3"
NUM_SPLITS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # 0: FA3's own heuristic
DEFAULT: Config = {"num_splits": 0, "pack_gqa": None}  # what sgl-kernel does when not told


@functools.cache
def _kernel() -> Any:
    from sgl_kernel.flash_attn import flash_attn_with_kvcache as fa3

    return fa3


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
)


# -- the drop-in ---------------------------------------------------------------------------


class _Tuned:
    """Default of num_splits and pack_gqa in the drop-in: let tuner choose."""

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


def _call_key(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
              cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
              cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
              q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
              window_size=(-1, -1), attention_chunk=None, softcap=0.0, rotary_interleaved=True,
              scheduler_metadata=None, num_splits=TUNED, pack_gqa=TUNED, only_qv=False, sm_margin=0,
              return_softmax_lse=False, sinks=None, score_mod=None, aux_tensors=None, ver=3, out=None):
    """(static key tuple, batch, max q len, max kv len) from host-side values only: shapes,
    flags and the page table's width (an upper bound of every sequence's kv length)."""
    q_shape, k_shape = q.shape, k_cache.shape
    if page_table is None:
        page_size, kv_len = 0, k_shape[1]
    else:
        page_size = k_shape[1]
        kv_len = page_table.shape[1] * page_size
    if cu_seqlens_q is None:
        batch, q_len = q_shape[0], q_shape[1]
    else:
        batch, q_len = cu_seqlens_q.shape[0] - 1, max_seqlen_q or 1
    if type(window_size) is list:
        window_size = tuple(window_size)
    extras = ()
    if k is not None or qv is not None or rotary_cos is not None or score_mod is not None or only_qv:
        extras = tuple(name for name, on in (("new_kv", k is not None), ("qv", qv is not None),
                                             ("rotary", rotary_cos is not None),
                                             ("score_mod", score_mod is not None), ("only_qv", only_qv)) if on)
    static = (q.dtype, k_cache.dtype, v_cache.dtype, q_shape[-2], k_shape[2], q_shape[-1], v_cache.shape[-1],
              page_size, causal, window_size, softcap, sinks is not None, k_descale is not None,
              v_descale is not None, extras)
    return static, batch, q_len, kv_len


def _call_configs(q, k_cache, *args, **kwargs) -> list[Config]:
    return config_space(q.shape[-2], k_cache.shape[2])


@autotune(OP_NAME, configs=_call_configs, default=DEFAULT, key=_call_key, static_json=_static_json)
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=None, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=TUNED, pack_gqa=TUNED, only_qv=False,
                            sm_margin=0, return_softmax_lse=False, sinks=None, score_mod=None,
                            aux_tensors=None, ver=3, out=None, *, config):
    """sgl_kernel.flash_attn.flash_attn_with_kvcache, same arguments, with num_splits and
    pack_gqa from the tuning DB (nearest run key, else FA3's default). A num_splits or
    pack_gqa passed by the caller wins: then the other takes FA3's default."""
    if num_splits is TUNED and pack_gqa is TUNED:
        num_splits, pack_gqa = config["num_splits"], config["pack_gqa"]
    else:
        num_splits = 0 if num_splits is TUNED else num_splits
        pack_gqa = None if pack_gqa is TUNED else pack_gqa
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
