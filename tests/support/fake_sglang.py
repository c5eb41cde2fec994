"""A stand-in for the parts of SGLang (0.5.17's names) its attention backends touch, for testing
tuner's SGLang backend on the CPU: the backend registry and command-line choices, an FA3
backend whose forward_decode records that it ran, a KV pool of per-layer token buffers
(page size 1, SGLang's MHATokenToKVPool layout: (slots, kv heads, head dim)), and the
metadata, layer and batch objects forward_decode reads."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import torch


class FlashAttentionBackend:
    def __init__(self, model_runner: Any) -> None:
        self.model_runner = model_runner
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = model_runner.page_size
        self.use_mla = False
        self.kv_cache_dtype_str = "auto"
        self.has_local_attention = False
        self.use_sliding_window_kv_pool = False
        self.is_prefill_aware_swa = False
        self.forward_metadata: Any = None
        self.fa3_decodes: list[dict] = []

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.fa3_decodes.append(kwargs)
        return "fa3"


class KVPool:
    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, dtype=torch.float32) -> None:
        gen = torch.Generator().manual_seed(0)
        self.k = [torch.randn(slots, kv_heads, head_dim, generator=gen, dtype=dtype) for _ in range(layers)]
        self.v = [torch.randn(slots, kv_heads, head_dim, generator=gen, dtype=dtype) for _ in range(layers)]
        self.writes: list[torch.Tensor] = []

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None) -> None:
        self.writes.append(loc)
        self.k[layer.layer_id][loc] = cache_k.view(-1, *self.k[layer.layer_id].shape[1:])
        self.v[layer.layer_id][loc] = cache_v.view(-1, *self.v[layer.layer_id].shape[1:])

    def get_kv_buffer(self, layer_id: int):
        return self.k[layer_id], self.v[layer_id]


@dataclass
class Metadata:
    page_table: torch.Tensor
    cache_seqlens_int32: torch.Tensor
    max_seq_len_k: int
    max_seq_len_q: int = 1


@dataclass
class Layer:
    tp_q_head_num: int
    tp_k_head_num: int
    head_dim: int
    layer_id: int = 0
    sliding_window_size: int = -1
    logit_cap: float = 0.0
    is_cross_attention: bool = False
    attn_type: Any = None
    k_scale: Any = None
    v_scale: Any = None
    scaling: float = 0.0

    def __post_init__(self) -> None:
        self.tp_v_head_num, self.v_head_dim = self.tp_k_head_num, self.head_dim
        self.scaling = self.scaling or self.head_dim ** -0.5


@dataclass
class ForwardBatch:
    out_cache_loc: torch.Tensor
    seq_lens_cpu: torch.Tensor | None
    spec_info: Any = None

    @property
    def batch_size(self) -> int:
        return self.out_cache_loc.numel()


def install(monkeypatch, with_choices: bool = True) -> types.SimpleNamespace:
    """Put the fake modules in sys.modules; returns the registry and choices to inspect."""
    registry: dict[str, Any] = {}
    choices = ["fa3", "triton"]

    def register_attention_backend(name):
        def decorator(fn):
            registry[name] = fn
            return fn
        return decorator

    modules = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.layers": types.ModuleType("sglang.srt.layers"),
        "sglang.srt.layers.attention": types.ModuleType("sglang.srt.layers.attention"),
        "sglang.srt.layers.attention.attention_registry": types.ModuleType("attention_registry"),
        "sglang.srt.layers.attention.flashattention_backend": types.ModuleType("flashattention_backend"),
        "sglang.srt.server_args": types.ModuleType("server_args"),
    }
    modules["sglang.srt.layers.attention.attention_registry"].register_attention_backend = register_attention_backend
    modules["sglang.srt.layers.attention.attention_registry"].ATTENTION_BACKENDS = registry
    modules["sglang.srt.layers.attention.flashattention_backend"].FlashAttentionBackend = FlashAttentionBackend
    if with_choices:
        modules["sglang.srt.server_args"].ATTENTION_BACKEND_CHOICES = choices
        modules["sglang.srt.server_args"].add_attention_backend_choices = choices.extend
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(registry=registry, choices=choices)
