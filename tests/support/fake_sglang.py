"""A stand-in for the parts of SGLang (0.5.17's names) its attention backends touch, for testing
tuner's SGLang backend on the CPU: the backend registry and command-line choices, an FA3
backend whose forward_decode records that it ran, a KV pool of per-layer token buffers
(page size 1, SGLang's MHATokenToKVPool layout: (slots, kv heads, head dim)), the
metadata, layer and batch objects forward_decode reads, the plugins' HookRegistry, a
FlashInfer backend that records its calls, and a decode CUDA-graph runner that captures and
picks graphs by ShapeKey and calls its backend's graph metadata steps as 0.5.17's does."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

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

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        pass

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        pass


class FlashInferAttnBackend:
    """SGLang's FlashInfer backend as its graph runner sees it: each call recorded, and its
    decode returning "flashinfer"; `fail_plans` makes its replay metadata step raise."""

    made: list["FlashInferAttnBackend"] = []
    fail_plans = False

    def __init__(self, model_runner: Any, skip_prefill: bool = False) -> None:
        self.model_runner, self.skip_prefill = model_runner, skip_prefill
        self.calls: list[tuple] = []
        FlashInferAttnBackend.made.append(self)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.calls.append(("graph_state", max_bs, max_num_tokens))

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        if not in_capture and self.fail_plans:
            raise RuntimeError("plan failed")
        self.calls.append(("capture" if in_capture else "plan", forward_batch))

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self.calls.append(("decode", forward_batch))
        return "flashinfer"


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


@dataclass(frozen=True)
class ShapeKey:
    size: int
    stream_idx: int | None = None
    variant_label: str | None = None


class HookType(Enum):
    AROUND = "around"


class HookRegistry:
    """0.5.17's registry, AROUND hooks only: register, then apply_hooks wraps each target once."""

    def __init__(self) -> None:
        self.hooks: dict[str, list[Callable]] = {}
        self.patched: set[str] = set()

    def register(self, target: str, hook: Callable, hook_type: HookType = HookType.AROUND) -> None:
        assert hook_type is HookType.AROUND
        self.hooks.setdefault(target, []).append(hook)

    def apply_hooks(self) -> None:
        for target, hooks in self.hooks.items():
            if target in self.patched:
                continue
            module, cls, attr = target.rsplit(".", 2)
            owner = getattr(sys.modules[module], cls)
            wrapped = getattr(owner, attr)
            for hook in hooks:
                wrapped = (lambda inner, h: lambda *a, **k: h(inner, *a, **k))(wrapped, hook)
            setattr(owner, attr, wrapped)
            self.patched.add(target)


def runner_class(capturing: list[bool]) -> type:
    """A fresh DecodeCudaGraphRunner class (hooks patch the class, so each test gets its own).
    capture_one_shape runs the step twice as warm-ups and once more as "the capture" (with
    capturing[0] set), keeping what that run returned as the graph of its ShapeKey;
    load_batch pads the batch up to a captured size and names the graph to replay, as
    0.5.17's do."""

    class DecodeCudaGraphRunner:
        def __init__(self, attn_backend: Any, capture_bs: list[int]) -> None:
            self.attn_backend, self.capture_bs = attn_backend, sorted(capture_bs)
            attn_backend.init_cuda_graph_state(self.capture_bs[-1], self.capture_bs[-1])
            self.graphs: dict[ShapeKey, Any] = {}
            # SGLang's graph store: which graphs it holds, and a replay of one (here: its capture's result)
            self.backend = types.SimpleNamespace(can_run=lambda forward_batch, key: key in self.graphs,
                                                 replay=lambda key, forward_batch: self.graphs[key])
            self.ragged_verify_mode = self.require_mlp_sync = False
            self.tp_size = 1

        def capture_one_shape(self, size, forward, stream_idx=None, variant_label=None):
            self.attn_backend.init_forward_metadata_out_graph(types.SimpleNamespace(batch_size=size), in_capture=True)
            for _ in range(2):
                forward()
            capturing[0] = True
            try:
                self.graphs[ShapeKey(size, stream_idx, variant_label)] = forward()
            finally:
                capturing[0] = False

        def load_batch(self, forward_batch, pp_proxy_tensors=None):
            self.bs = next(b for b in self.capture_bs if b >= forward_batch.batch_size)
            # the replay's view of the batch (0.5.17's build_replay_fb_view): the padded size, the step's batch
            self.attn_backend.init_forward_metadata_out_graph(types.SimpleNamespace(batch_size=self.bs,
                                                                                    step=forward_batch))
            self._replay_graph_key = ShapeKey(self.bs, None, getattr(forward_batch, "lora", None))

        def execute(self, forward_batch, pp_proxy_tensors=None):
            self.load_batch(forward_batch, pp_proxy_tensors)
            return self.backend.replay(self._replay_graph_key, forward_batch)

    return DecodeCudaGraphRunner


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
        "sglang.srt.layers.attention.flashinfer_backend": types.ModuleType("flashinfer_backend"),
        "sglang.srt.server_args": types.ModuleType("server_args"),
        "sglang.srt.plugins": types.ModuleType("plugins"),
        "sglang.srt.plugins.hook_registry": types.ModuleType("hook_registry"),
        "sglang.srt.model_executor": types.ModuleType("model_executor"),
        "sglang.srt.model_executor.runner": types.ModuleType("runner"),
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner": types.ModuleType("decode_cuda_graph_runner"),
    }
    hooks = HookRegistry()
    capturing = [False]
    runner = runner_class(capturing)
    modules["sglang.srt.plugins"]._plugins_loaded = False
    modules["sglang.srt.plugins.hook_registry"].HookRegistry = hooks
    modules["sglang.srt.plugins.hook_registry"].HookType = HookType
    modules["sglang.srt.model_executor.runner.decode_cuda_graph_runner"].DecodeCudaGraphRunner = runner
    modules["sglang.srt.layers.attention.attention_registry"].register_attention_backend = register_attention_backend
    modules["sglang.srt.layers.attention.attention_registry"].ATTENTION_BACKENDS = registry
    modules["sglang.srt.layers.attention.flashattention_backend"].FlashAttentionBackend = FlashAttentionBackend
    FlashInferAttnBackend.made, FlashInferAttnBackend.fail_plans = [], False
    modules["sglang.srt.layers.attention.flashinfer_backend"].FlashInferAttnBackend = FlashInferAttnBackend
    # SGLang's other lists of backends allowed a feature, and their functions (0.5.17's server_args)
    lists = dict(DETERMINISTIC_ATTENTION_BACKEND_CHOICES=["flashinfer", "fa3", "triton"],
                 RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND=["ascend", "fa3", "fa4", "triton"],
                 CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS=["flashinfer", "fa3", "fa4"])
    if with_choices:
        server_args = modules["sglang.srt.server_args"]
        server_args.ATTENTION_BACKEND_CHOICES = choices
        server_args.add_attention_backend_choices = choices.extend
        for name, names in lists.items():
            setattr(server_args, name, names)
        server_args.add_deterministic_attention_backend_choices = lists["DETERMINISTIC_ATTENTION_BACKEND_CHOICES"].extend
        server_args.add_radix_supported_deterministic_attention_backend_choices = \
            lists["RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND"].extend
        server_args.add_chunked_prefix_cache_attention_backend = \
            lists["CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS"].append
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(registry=registry, choices=choices, lists=lists, hooks=hooks, runner=runner,
                                 capturing=capturing)
