"""The FA3 drop-in: tuner.integrations.fa3.flash_attn_with_kvcache takes sgl-kernel's
arguments and defaults and runs each call with the tuned num_splits and pack_gqa."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tuner.keys import STATIC_FIELDS, canonical_json, host_flags, host_scalar, static_key_from_tuple
from tuner.ops.base import TUNED
from tuner.ops import fa3 as fa3_op
from tuner.ops.fa3 import DEFAULT, EXTRAS, OP_NAME, Config, check_config, config_space
from tuner.runtime import autotune

if TYPE_CHECKING:
    from torch import Tensor

# What the caller decided stays decided:
# - num_splits=0 and pack_gqa=None are sgl-kernel's own defaults, "let the library choose"
#   (SGLang's FA3 backend passes num_splits=0 on every call): tuner chooses both then;
# - a num_splits > 0 or a pack_gqa of True/False is the caller's: it is kept, and the other
#   stays the library's choice (a tuned pair is never split);
# - with scheduler_metadata, FA3 skips its scheduler and runs the plan the caller built for
#   its own num_splits and pack_gqa (it sizes the split accumulators from the call's
#   num_splits): both are passed through as given, never tuned;
# - config=DEFAULT (an explicit config) opts a call out: no lookup, FA3's own choice.


def _static_json(static: tuple) -> str:
    """The DB's static key for a call: AttentionStaticKey's JSON, plus the features (new
    k/v, rotary, qv, ...) that change FA3's kernel but no sweep measures, if any are on."""
    key = static_key_from_tuple(static)
    extras = static[len(STATIC_FIELDS)]
    return key.to_json() if not extras else canonical_json(dict(key.to_dict(), extras=list(extras)))


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
            q_len = host_scalar(q_len)
            if type(q_len) is not int:
                return None, max(batch, 1), 1, kv_len
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
def flash_attn_with_kvcache(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None, v: Tensor | None = None,
    qv: Tensor | None = None, rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None, cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None, page_table: Tensor | None = None, cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k_new: Tensor | None = None, max_seqlen_q: int | None = None, rotary_seqlens: Tensor | None = None,
    q_descale: Tensor | None = None, k_descale: Tensor | None = None, v_descale: Tensor | None = None,
    softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int | None = None, softcap: float = 0.0, rotary_interleaved: bool = True,
    scheduler_metadata: Tensor | None = None, num_splits: int = 0, pack_gqa: bool | None = None,
    only_qv: bool = False, sm_margin: int = 0, return_softmax_lse: bool = False, sinks: Tensor | None = None,
    score_mod: Any = None, aux_tensors: Any = None, ver: int = 3, out: Tensor | None = None, *, config: Config,
) -> Tensor | tuple[Tensor, ...]:
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
    return fa3_op.kernel()(
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
