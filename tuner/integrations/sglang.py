"""SGLang decodes through tuner: an attention backend named "tuner", SGLang's FA3 backend with
its plain decode attention run by decode_attention (the tuned backend and config per shape).

Enabled by installing tuner beside SGLang (its `sglang.srt.plugins` entry point registers the
backend in every SGLang process) and starting the server with `--attention-backend tuner`
(or `--decode-attention-backend tuner` beside another prefill backend). Prefill, extend and
every decode this module does not cover (MLA, cross attention, speculative decoding, an FP8
KV cache, local or prefill-aware sliding-window attention, a softmax scale other than
1/sqrt(head dim), scales, score mods) run SGLang's FA3 code unchanged.

In SGLang's decode CUDA graphs the backend's metadata buffers (page table, cache lengths)
are captured once and rewritten in place before each replay, so the captured call reads
each step's lengths; it is captured with the page table's whole width as its bound, and
tuner serves it the graph record of its batch size (tuner.runtime) or the frozen rule.
SGLang is imported only when the backend is created; versions read: 0.5.12-0.5.17.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from tuner.integrations.decode_attention import decode_attention

BACKEND_NAME = "tuner"
# keyword arguments of SGLang's forward_decode that select work decode_attention does not do
_UNCOVERED_KWARGS = ("q_rope", "k_rope", "q_descale", "k_descale", "v_descale", "score_mod", "aux_tensors",
                     "rel_bias")


def register() -> None:
    """SGLang's plugin hook: registers the "tuner" attention backend (and, where SGLang's
    command line lists its choices, the name there). Idempotent."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    register_attention_backend(BACKEND_NAME)(create_backend)
    try:
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    except ImportError:  # a release without a choices list: nothing to extend
        return
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])


def create_backend(model_runner: Any) -> Any:
    """The registry's factory: the backend for one model runner."""
    return backend_class()(model_runner)


@functools.cache
def backend_class() -> type:
    """TunerAttnBackend, a subclass of the installed SGLang's FlashAttentionBackend (made on
    first use: SGLang is imported only then)."""
    from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend

    class TunerAttnBackend(FlashAttentionBackend):
        """SGLang's FA3 backend whose plain decode runs tuner's decode_attention."""

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if not covers(self, layer, forward_batch, kwargs):
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            return tuned_decode(self, q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("sinks"))

    return TunerAttnBackend


def covers(backend: Any, layer: Any, forward_batch: Any, kwargs: dict[str, Any]) -> bool:
    """Whether decode_attention runs this decode call: plain paged self-attention of one
    query token (see the module docstring for what it leaves to FA3)."""
    metadata = backend.forward_metadata
    return (not backend.use_mla and forward_batch.spec_info is None and backend.kv_cache_dtype_str == "auto"
            and not layer.is_cross_attention and _is_decoder(layer)
            and not getattr(backend, "has_local_attention", False)
            and not getattr(backend, "use_sliding_window_kv_pool", False)
            and not getattr(backend, "is_prefill_aware_swa", False)
            and getattr(metadata, "max_seq_len_q", 1) == 1
            and math.isclose(layer.scaling, layer.head_dim ** -0.5, rel_tol=1e-6)
            and all(kwargs.get(name) is None for name in _UNCOVERED_KWARGS))


def _is_decoder(layer: Any) -> bool:
    kind = getattr(layer, "attn_type", None)
    return kind is None or getattr(kind, "name", str(kind)).upper().endswith("DECODER")


def tuned_decode(backend: Any, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: Any,
                 forward_batch: Any, save_kv_cache: bool, sinks: torch.Tensor | None) -> torch.Tensor:
    """What FA3's forward_decode does for a covered call, with decode_attention as the kernel:
    the new token's K and V written to the pool, then attention over the backend's page table
    and cache lengths (rewritten in place before each graph replay)."""
    if k is not None and save_kv_cache:
        backend.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, layer.k_scale,
                                               layer.v_scale)
    metadata = backend.forward_metadata
    key_cache, value_cache = backend.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    page = backend.page_size
    k_cache = key_cache.view(-1, page, layer.tp_k_head_num, layer.head_dim)
    v_cache = value_cache.view(-1, page, layer.tp_v_head_num, layer.v_head_dim)
    window = layer.sliding_window_size
    window_size = (window, 0) if window is not None and window > -1 else (-1, -1)
    table = metadata.page_table
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    # under capture the launch is replayed over every later step's lengths: bound it by the
    # table's width (the max context), never by the capture batch's own lengths
    eager_max = metadata.max_seq_len_k
    max_kv_len = table.shape[1] * page if capturing or not isinstance(eager_max, int) or eager_max < 1 else eager_max
    out = decode_attention(q.contiguous().view(-1, 1, layer.tp_q_head_num, layer.head_dim), k_cache, v_cache,
                           table, metadata.cache_seqlens_int32, max_kv_len, True, window_size,
                           float(layer.logit_cap or 0.0), sinks, None if capturing else forward_batch.seq_lens_cpu)
    out = out.view(-1, layer.tp_q_head_num * layer.v_head_dim)
    given = getattr(forward_batch, "_attn_output", None)
    if given is not None:
        given.view(out.shape).copy_(out)
        return given.view(out.shape)
    return out
