"""SGLang decodes through tuner: an attention backend named "tuner", SGLang's FA3 backend with
its plain decode attention run by decode_attention (the tuned backend and config per shape).

Enabled by installing tuner beside SGLang (its `sglang.srt.plugins` entry point registers the
backend in every SGLang process) and starting the server with `--attention-backend tuner`
(or `--decode-attention-backend tuner` beside another prefill backend). Prefill, extend and
every decode this module does not cover (MLA, cross attention, an FP8 KV cache, local or
prefill-aware sliding-window attention, a softmax scale other than 1/sqrt(head dim), scales,
score mods, deterministic inference, any keyword it does not know) run SGLang's FA3 code
unchanged, and so does a call tuner resolves to FA3's default (keeping the scheduler metadata
SGLang precomputes for it). Speculative decoding: SGLang's draft backends do not know the
name (`--speculative-draft-attention-backend fa3` names one), and target verification runs
FA3's code. Where SGLang checks a feature's backend by name (deterministic inference, MLA's
chunked prefix cache), register() lists tuner's beside fa3; its model-specific checks (GPT-OSS,
Llama 4, Exaone 4 with sliding windows) and its switch of fa3 to triton for an FP8 e5m2 cache
cannot be extended: the first refuse the name, the second create_backend refuses itself.

In SGLang's decode CUDA graphs the backend's metadata buffers (page table, cache lengths)
are captured once and rewritten in place before each replay, so the captured call reads
each step's lengths. That call, and the warm-ups before it (whose lengths are the padding
fill), are bounded by the page table's whole width, and tuner serves them the graph record
of their batch size (tuner.runtime) or the frozen rule. Where the per-call records name other
configs for some of the lengths a graph may replay, SGLang's decode graph runner captures a
graph variant for each (tuner.integrations.graph_variants) under the variant labels its
ShapeKey has, and before each replay runs the one for the step's lengths. Each variant's
first replays of each class of lengths alternate with the base graph, and a class on which
it runs slower than that graph replays the base graph from then on
(tuner.integrations.replay_judge); tensor-parallel ranks act on their slowest rank's ratio
(one all-reduce over SGLang's TP CPU group per verdict), and under pipeline parallelism
variants are not judged. With $TUNER_SGLANG_FLASHINFER=1 one more variant per batch size runs
SGLang's own FlashInfer backend (made beside tuner's, over the same KV pool) on the classes of
lengths that would replay the base graph and those whose variant lost, planned on the replay's
view only before its own replays, and judged like the others; where a class's variant was kept,
FlashInfer's then challenges it, judged against it (settings.sglang_flashinfer_variant: off
until measured). Three
hooks of SGLang's plugin HookRegistry, around DecodeCudaGraphRunner.capture_one_shape,
load_batch and execute, which act only where the runner's decode backend is tuner's. SGLang
is imported only when the backend is created or the hooks registered; its 0.5.17 source was
read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from tuner import settings
from tuner.errors import TunerError
from tuner.integrations.decode_attention import declared_branch, decode_attention, graph_runs, wave_resolved
from tuner.integrations.graph_variants import GraphVariants
from tuner.integrations.replay_judge import ReplayJudge
from tuner.ops.fa3_waves import WAVE_FIT
from tuner.runtime.capture import graph_capture
from tuner.runtime.state import runtime, stream_capturing

BACKEND_NAME = "tuner"
FLASHINFER = "flashinfer"  # the graph variant that runs SGLang's FlashInfer backend (flashinfer_beside)
# forward_decode's keyword arguments decode_attention runs; any other one given runs FA3's code,
# but for one given at its no-op value (SGLang 0.5.23's return_lse=False: read in its source)
_COVERED_KWARGS = frozenset({"sinks"})
_NO_OP_KWARGS = {"return_lse": False}
# SGLang 0.5.17's decode CUDA-graph runner, whose capture of a batch size and host step before a
# replay tuner's hooks wrap
_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
_hooks_registered = False
_call_key = decode_attention.tuner.key_functions["_key"]  # (static key, batch, q len, kv len) of a call
log = logging.getLogger("tuner")


def register() -> None:
    """SGLang's plugin hook: registers the "tuner" attention backend (and, where SGLang's
    command line lists its choices, the name there). Idempotent."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    register_attention_backend(BACKEND_NAME)(create_backend)
    register_graph_hooks()
    _listed_beside_fa3()


# SGLang's lists of backends allowed a feature, each with the function that extends it, where
# tuner's backend runs as FA3's does: its command line's choices; deterministic inference
# (FA3's num_splits is then 1, so every decode runs FA3's own code: covers); the chunked prefix
# cache of MLA models (all MLA runs FA3's code). Left out, SGLang refused the name for
# deterministic inference, and silently turned the cache off.
_SGLANG_LISTS = (("ATTENTION_BACKEND_CHOICES", "add_attention_backend_choices", True),
                 ("DETERMINISTIC_ATTENTION_BACKEND_CHOICES", "add_deterministic_attention_backend_choices", True),
                 ("RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND",
                  "add_radix_supported_deterministic_attention_backend_choices", True),
                 ("CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS", "add_chunked_prefix_cache_attention_backend",
                  False))


def _listed_beside_fa3() -> None:
    """The name in each of _SGLANG_LISTS that holds "fa3" and lacks it (a release without
    such a list, or without fa3 in it, is left as it is)."""
    import sglang.srt.server_args as server_args

    for listed, add, takes_list in _SGLANG_LISTS:
        names, extend = getattr(server_args, listed, None), getattr(server_args, add, None)
        if names is not None and extend is not None and "fa3" in names and BACKEND_NAME not in names:
            extend([BACKEND_NAME] if takes_list else BACKEND_NAME)


def register_graph_hooks() -> None:
    """The graph-variant hooks on SGLang's decode graph runner, once; applied now unless
    SGLang is loading its plugins (it applies every plugin's hooks after the last). A release
    without the HookRegistry keeps one graph per batch size."""
    global _hooks_registered
    if _hooks_registered:
        return
    try:
        import sglang.srt.plugins as plugins
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        return
    HookRegistry.register(f"{_RUNNER}.capture_one_shape", capture_with_variants, HookType.AROUND)
    HookRegistry.register(f"{_RUNNER}.load_batch", load_batch_of_variant, HookType.AROUND)
    HookRegistry.register(f"{_RUNNER}.execute", time_judged_replay, HookType.AROUND)
    _hooks_registered = True
    if not getattr(plugins, "_plugins_loaded", False):
        HookRegistry.apply_hooks()


def create_backend(model_runner: Any) -> Any:
    """The registry's factory: the backend for one model runner, where SGLang's FA3 backend
    could run (SGLang's own fa3 factory asks the same, and switches an FP8 e5m2 KV cache to
    triton, a switch that looks for the name "fa3": TunerError else, in one line)."""
    problem = fa3_problem(model_runner, _capability())
    if problem is not None:
        raise TunerError(f"--attention-backend {BACKEND_NAME}: {problem}")
    return backend_class()(model_runner)


def _capability() -> tuple[int, int] | None:
    """This process's GPU's compute capability, or None where it has none to ask."""
    try:
        return torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    except (AssertionError, RuntimeError):  # a torch without CUDA
        return None


def fa3_problem(model_runner: Any, capability: tuple[int, int] | None) -> str | None:
    """Why SGLang's FA3 backend, which tuner's backend is, cannot serve this model runner
    (FA3 needs SM 9.x, or SM 8.x without MLA; its FP8 KV cache is e4m3), or None."""
    args = getattr(model_runner, "server_args", None)
    if getattr(args, "kv_cache_dtype", None) == "fp8_e5m2":
        return "FA3 reads FP8 KV caches as fp8_e4m3 only (SGLang's fa3 runs triton for e5m2); " \
               "use --kv-cache-dtype fp8_e4m3 or another backend"
    if capability is not None:
        major = capability[0]
        if not (major == 9 or (major == 8 and not getattr(model_runner, "use_mla_backend", False))):
            return f"FA3 runs on SM 9.x, or SM 8.x without MLA; this GPU is SM {major}.{capability[1]}: " \
                   "use --attention-backend flashinfer"
    return None


@functools.cache
def backend_class() -> type:
    """TunerAttnBackend, a subclass of the installed SGLang's FlashAttentionBackend (made on
    first use: SGLang is imported only then)."""
    from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend

    class TunerAttnBackend(FlashAttentionBackend):
        """SGLang's FA3 backend whose plain decode runs tuner's decode_attention."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.tuner_model_runner = args[0] if args else kwargs.get("model_runner")
            self.tuner_on_cuda = torch.cuda.is_available()
            self.tuner_variants = GraphVariants()
            self.tuner_variant_keys: dict[tuple, Any] = {}  # (ShapeKey, variant label) -> the variant's ShapeKey
            # (CUDA events time the replays: no judge without CUDA)
            self.tuner_judge = ReplayJudge.for_variants(self.tuner_variants) if self.tuner_on_cuda else None
            # per captured batch size, one decode_attention call of each static key its graph holds
            self.tuner_graph_calls: dict[int, dict[Any, tuple]] = {}
            # SGLang's FlashInfer backend for a graph variant (flashinfer_beside), the label of that
            # variant per batch size, whether it is being captured, and the last replay's view
            self.tuner_flashinfer: Any = None
            self.tuner_flashinfer_asked = False  # (flashinfer_of: made once, on first need)
            self.tuner_graph_sizes: tuple[int, int] | None = None  # the runner's (max batch, max tokens)
            self.tuner_flashinfer_labels: dict[int, str] = {}
            self.tuner_capturing_flashinfer = False
            self.tuner_replay_view: Any = None

        def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args: Any, **kwargs: Any) -> None:
            super().init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
            self.tuner_graph_sizes = (max_bs, max_num_tokens)

        def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
            super().init_forward_metadata_out_graph(forward_batch, in_capture)
            if self.tuner_flashinfer is not None and _decodes(forward_batch):
                if not in_capture:  # a replay's view: FlashInfer plans on it if the step replays its graph
                    self.tuner_replay_view = forward_batch
                elif self.tuner_capturing_flashinfer:
                    self.tuner_flashinfer.init_forward_metadata_out_graph(forward_batch, in_capture=True)

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if self.tuner_capturing_flashinfer and runs_flashinfer(self, q, layer, forward_batch, kwargs):
                return self.tuner_flashinfer.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            if covers(self, q, layer, forward_batch, kwargs):
                in_graph = _in_graph(self, forward_batch, self.forward_metadata)
                call = decode_call(self, q, layer, forward_batch, kwargs.get("sinks"), in_graph)
                if in_graph:
                    note_graph_call(self, call)
                config = runs_of(resolve_config(call), call, in_graph)
                if not is_fa3_default(config):
                    return tuned_decode(self, k, v, layer, forward_batch, save_kv_cache, call, config)
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    return TunerAttnBackend


def covers(backend: Any, q: Any, layer: Any, forward_batch: Any, kwargs: dict[str, Any]) -> bool:
    """Whether decode_attention may run this decode call: plain paged self-attention of one
    query token (see the module docstring for what it leaves to FA3)."""
    metadata = backend.forward_metadata
    return (not backend.use_mla and forward_batch.spec_info is None and _cache_read_as_is(backend, q, layer)
            and getattr(backend, "num_splits", 0) == 0 and getattr(backend, "fa_impl_ver", 3) == 3
            and not layer.is_cross_attention and _is_decoder(layer)
            and not getattr(backend, "has_local_attention", False)
            and not getattr(backend, "use_sliding_window_kv_pool", False)
            and not getattr(backend, "is_prefill_aware_swa", False)
            and getattr(metadata, "max_seq_len_q", 1) == 1
            and math.isclose(layer.scaling, layer.head_dim ** -0.5, rel_tol=1e-6)
            and all(value is None or (name in _NO_OP_KWARGS and value is _NO_OP_KWARGS[name])
                    for name, value in kwargs.items() if name not in _COVERED_KWARGS))


def _cache_read_as_is(backend: Any, q: Any, layer: Any) -> bool:
    """A KV cache SGLang's FA3 code reads as it is: "auto", or one named as q's own dtype
    (--kv-cache-dtype bf16 for a BF16 model) without scales, where that code's cast of q to
    the cache's dtype changes nothing and it passes no descale. (Named so, such a cache ran
    SGLang's FA3 code, silently.)"""
    name = backend.kv_cache_dtype_str
    return name == "auto" or (name in ("bf16", "bfloat16") and getattr(layer, "k_scale", None) is None
                              and q.dtype == getattr(backend, "kv_cache_dtype", None))


def runs_flashinfer(backend: Any, q: Any, layer: Any, forward_batch: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a call in the FlashInfer variant's capture runs SGLang's FlashInfer backend: a
    covered call with no keyword FlashInfer's forward_decode lacks (sinks) and no window
    (whose wrappers that backend dispatches apart). A keyword passed as None is one not passed."""
    return (all(value is None for value in kwargs.values()) and getattr(layer, "sliding_window_size", -1) in (None, -1)
            and covers(backend, q, layer, forward_batch, kwargs))


def _flashinfer_runs(call: tuple) -> bool:
    """Whether a graph's decode_attention call (decode_call's arguments) is one the FlashInfer
    variant's capture gives SGLang's FlashInfer backend (runs_flashinfer): no sinks, no window.
    Where no call of a graph is, no such variant: it would hold the base graph's kernels and
    add FlashInfer's plan before each of its replays."""
    return call[9] is None and tuple(call[7]) == (-1, -1)


def _decodes(forward_batch: Any) -> bool:
    """Whether a graph's metadata step is a decode's (the prefill graphs' steps come here too)."""
    mode = getattr(forward_batch, "forward_mode", None)
    return mode is None or mode.is_decode_or_idle()


def flashinfer_of(backend: Any) -> Any:
    """The backend's FlashInfer backend (flashinfer_beside), made when a graph first could hold
    a variant of it: a backend whose graphs never get variants (two-batch overlap's children,
    pdmux, a pool FlashInfer's variant cannot serve) allocates nothing for it."""
    if not backend.tuner_flashinfer_asked and backend.tuner_graph_sizes is not None:
        backend.tuner_flashinfer_asked = True
        backend.tuner_flashinfer = flashinfer_beside(backend, *backend.tuner_graph_sizes)
    return backend.tuner_flashinfer


def flashinfer_beside(backend: Any, max_bs: int, max_num_tokens: int) -> Any:
    """SGLang's own FlashInfer backend (decode only) over tuner's backend's KV pool, its CUDA-graph
    state made for the runner's sizes, where settings.sglang_flashinfer_variant() asks for one
    and the pool is of pages of one token; else None, and None with a warning where it cannot
    be made (FlashInfer missing, say): graphs then hold no FlashInfer variant."""
    if not settings.sglang_flashinfer_variant() or backend.use_mla or backend.page_size != 1:
        return None
    try:
        from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

        beside = FlashInferAttnBackend(backend.tuner_model_runner, skip_prefill=True)
        beside.init_cuda_graph_state(max_bs, max_num_tokens)
    except Exception as e:  # noqa: BLE001 - the variant is optional; SGLang's start-up goes on
        warnings.warn(f"tuner: no FlashInfer graph variant ({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)
        return None
    return beside


@contextlib.contextmanager
def capturing(backend: Any, variant: Any) -> Iterator[None]:
    """Within it, a variant's capture: the FlashInfer one's calls run SGLang's FlashInfer backend."""
    backend.tuner_capturing_flashinfer = variant.alternative == FLASHINFER
    try:
        yield
    finally:
        backend.tuner_capturing_flashinfer = False


def _is_decoder(layer: Any) -> bool:
    kind = getattr(layer, "attn_type", None)
    return kind is None or getattr(kind, "name", str(kind)).upper().endswith("DECODER")


def _in_graph(backend: Any, forward_batch: Any, metadata: Any) -> bool:
    """Whether the call belongs to a decode graph: its capture, or a warm-up before it, whose
    metadata are the graph's own buffers (filled with the padding's lengths)."""
    if backend.tuner_on_cuda and stream_capturing():
        return True
    buffers = getattr(backend, "decode_cuda_graph_metadata", None)
    return isinstance(buffers, dict) and buffers.get(getattr(forward_batch, "batch_size", None)) is metadata


def decode_call(backend: Any, q: torch.Tensor, layer: Any, forward_batch: Any, sinks: torch.Tensor | None,
                in_graph: bool | None = None) -> tuple:
    """decode_attention's positional arguments for the call: the pool's K and V as pages, the
    backend's page table and cache lengths (rewritten in place before each graph replay).
    in_graph: whether the call belongs to a decode graph (_in_graph, if not given)."""
    metadata = backend.forward_metadata
    key_cache, value_cache = backend.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    page = backend.page_size
    k_cache = key_cache.view(-1, page, layer.tp_k_head_num, layer.head_dim)
    v_cache = value_cache.view(-1, page, layer.tp_v_head_num, layer.v_head_dim)
    window = layer.sliding_window_size
    window_size = (window, 0) if window is not None and window > -1 else (-1, -1)
    table = metadata.page_table
    if in_graph is None:
        in_graph = _in_graph(backend, forward_batch, metadata)
    # a graph's launch replays over every later step's lengths: bounded by the table's width
    # (the max context), never by the capture batch's own lengths
    eager_max = metadata.max_seq_len_k
    eager = not in_graph and isinstance(eager_max, int) and eager_max > 0
    # a view where q's strides allow (SGLang's q is a slice of the qkv projection's rows): a copy
    # here would be one more kernel a layer in a graph that then runs SGLang's own FA3 code
    return (q.reshape(-1, 1, layer.tp_q_head_num, layer.head_dim), k_cache, v_cache, table,
            metadata.cache_seqlens_int32, eager_max if eager else table.shape[1] * page, True, window_size,
            float(layer.logit_cap or 0.0), sinks, forward_batch.seq_lens_cpu if eager else None)


def resolve_config(call: tuple) -> dict[str, Any]:
    """The config decode_attention runs for the call (its DB record, graph record, or default)."""
    return decode_attention.tuner.config_for(*call)


def runs_of(config: dict[str, Any], call: tuple, in_graph: bool) -> dict[str, Any]:
    """The FA3 config a covered call runs: a wave_fit config at the cap of the step's host
    lengths (eager) or of the graph variant being captured (a cap graph, which caps FA3's
    default too: tuner.integrations.graph_variants), FA3's own choice elsewhere; any other
    config as resolved (decode_attention runs it)."""
    if config.get("backend") != "fa3":
        return config
    if in_graph:
        return graph_runs(config, call)
    return wave_resolved(config, call) if WAVE_FIT in config else config


def is_fa3_default(config: dict[str, Any]) -> bool:
    return config.get("backend") == "fa3" and config.get("num_splits") == 0 and config.get("pack_gqa") is None


def tuned_decode(backend: Any, k: torch.Tensor | None, v: torch.Tensor | None, layer: Any, forward_batch: Any,
                 save_kv_cache: bool, call: tuple, config: dict[str, Any]) -> torch.Tensor:
    """What FA3's forward_decode does for a covered call, with decode_attention as the kernel:
    the new token's K and V written to the pool, then attention."""
    if k is not None and save_kv_cache:
        backend.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, layer.k_scale,
                                               layer.v_scale)
    given = getattr(forward_batch, "_attn_output", None)  # SGLang's buffer, which its FA3 writes through out=
    into = None if given is None else given.view(-1, 1, layer.tp_q_head_num, layer.v_head_dim)
    # (q as SGLang's layer gives it: decode_attention copies it only for a backend that needs it)
    return decode_attention(*call, config=config, out=into).view(-1, layer.tp_q_head_num * layer.v_head_dim)


def note_graph_call(backend: Any, call: tuple) -> None:
    """Keep the first call of each static key a graph of this batch size makes (its warm-ups
    come first): the calls GraphVariants.plan asks the records about."""
    static = _call_key(*call)[0]
    calls = backend.tuner_graph_calls.setdefault(call[0].shape[0], {})
    if static not in calls:
        calls[static] = call


def tuner_backend(runner: Any) -> Any:
    """The runner's decode attention backend if it is tuner's (directly, or as a hybrid's
    decode backend), else None."""
    backend = getattr(runner, "attn_backend", None)
    backend = getattr(backend, "decode_backend", backend)
    return backend if isinstance(getattr(backend, "tuner_variants", None), GraphVariants) else None


def variants_apply(runner: Any, size: int) -> bool:
    """Whether the runner's graphs of this size get variants: not where ranks must replay the
    same graphs while their batches differ (DP attention: a rank's collectives pair its
    buffers with another's), nor under pdmux or ragged verification, nor for a size
    torch.compile traces (a trace may keep the base graph's configs), nor inside the
    caller's own graph_capture (its declaration holds)."""
    return not (getattr(runner, "require_mlp_sync", False) or getattr(runner, "enable_pdmux", False)
                or getattr(runner, "ragged_verify_mode", False)
                or (getattr(runner, "enable_torch_compile", False) and size in getattr(runner, "compile_bs", ()))
                or runtime.declared_lengths is not None)


def _joined(label: str | None, variant: str) -> str:
    return variant if label is None else f"{label}+{variant}"


def capture_with_variants(original: Any, runner: Any, size: int, forward: Any, stream_idx: Any = None,
                          variant_label: str | None = None) -> Any:
    """Around DecodeCudaGraphRunner.capture_one_shape: the batch size's graph as SGLang
    captures it, then a graph for each variant of it (GraphVariants.plan, from the calls that
    capture made), each under its declaration and its label joined to SGLang's own."""
    result = original(runner, size, forward, stream_idx, variant_label)
    backend = tuner_backend(runner)
    if backend is None or not variants_apply(runner, size):
        return result
    calls = list(backend.tuner_graph_calls.get(size, {}).values())
    try:
        runs_it = any(map(_flashinfer_runs, calls)) and flashinfer_of(backend) is not None
        alternative = FLASHINFER if runs_it else None
        planned = backend.tuner_variants.plan(size, calls, alternative=alternative)
        if backend.tuner_judge is not None:  # (new graphs: the old ones' verdicts do not hold)
            backend.tuner_judge.forget(size)
    except Exception as e:  # noqa: BLE001 - tuner's planning never fails SGLang's capture
        warnings.warn(f"tuner: no graph variants for batch size {size} ({type(e).__name__}: {e})", RuntimeWarning,
                      stacklevel=2)
        backend.tuner_variants.forget(size)  # (a plan that failed half-way names no graph)
        planned = []
    # (every rank finds the same: none drops alone)
    if not plan_agreed(runner, size, planned, backend.tuner_variants.described(size)):
        for variant in planned:
            backend.tuner_variants.drop(size, variant.label)
        warnings.warn(f"tuner: the tensor-parallel ranks planned different graph variants for batch size {size} "
                      "(or cannot compare them); none is captured", RuntimeWarning, stacklevel=2)
        planned = []
    log_plan(size, calls, planned)
    # (the label whether or not its capture below succeeds: under another of SGLang's labels
    # this size's FlashInfer graph may be held, and must never replay without its plan)
    backend.tuner_flashinfer_labels.pop(size, None)
    for variant in planned:
        if variant.alternative == FLASHINFER:
            backend.tuner_flashinfer_labels[size] = variant.label
    for variant in planned:
        try:
            with graph_capture(variant.lengths), capturing(backend, variant):
                original(runner, size, forward, stream_idx, _joined(variant_label, variant.label))
        except RuntimeError as e:  # out of memory, say: its steps replay the batch size's graph
            if getattr(runner, "tp_size", 1) > 1:  # one rank cannot drop it alone: ranks replay alike
                raise RuntimeError(f"tuner: graph variant {variant.label} of batch size {size} not captured "
                                   f"({e}); set {settings.ENV_GRAPH_VARIANTS}=0 (or fewer)") from e
            if variant_label is None or not hasattr(getattr(runner, "backend", None), "can_run"):
                backend.tuner_variants.drop(size, variant.label)
            # (else the size is captured under several of SGLang's labels (LoRA) and the variant
            # may be held under another: SGLang's graph store tells which it holds, at each step)
            warnings.warn(f"tuner: graph variant {_joined(variant_label, variant.label)} of batch size {size} not "
                          f"captured ({e}); its steps replay the batch size's graph", RuntimeWarning, stacklevel=2)
    backend.tuner_graph_calls.pop(size, None)  # (its tensors: the next capture of this size notes its own)
    return result


def plan_agreed(runner: Any, size: int, planned: list, described: str) -> bool:
    """Whether every tensor-parallel rank planned the same variants for this batch size, sends
    each class of steps to the same graph (`described`: GraphVariants.described) and judges
    alike: ranks replay one graph together, and a rank whose planning failed, or read
    another DB or setting, would replay other graphs. One all-reduce of a digest over the TP
    CPU group, during the capture every rank makes together. True for a rank alone; False
    under TP without the group (nothing to compare through)."""
    if getattr(runner, "tp_size", 1) == 1:
        return True
    group = _tp_cpu_group(runner)
    if group is None:
        return False
    digest = zlib.crc32(repr((size, planned, described, settings.replay_judge_pairs(),
                              settings.REPLAY_JUDGE_TOLERANCE)).encode())
    extremes = torch.tensor([digest, -digest], dtype=torch.int64)  # (MAX of both: the largest and the smallest)
    torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(extremes[0]) == digest == -int(extremes[1])


def log_plan(size: int, calls: list[tuple], planned: list) -> None:
    """One info line per captured batch size: whether its graph runs decode_attention's
    default (FA3's, on a GPU), and the variants planned beside it: a benchmark reads from it
    whether tuner ran anything of its own."""
    try:
        with graph_capture():  # what the base graph runs: lengths unknown
            base_default = all(runs_default(c, size) for c in calls)
    except Exception:  # noqa: BLE001 - a log line never fails SGLang's capture
        return
    log.info("tuner: batch size %d: its graph runs %s; %d graph variant(s) beside it%s", size,
             "the default" if base_default else "tuned configs", len(planned),
             "".join(f", {v.label}" + (f" ({v.alternative})" if v.alternative else "") for v in planned))


def runs_default(call: tuple, size: int) -> bool:
    """Whether a graph's call runs the default, as forward_decode runs it: a config FA3's
    default runs SGLang's FA3 code; another runs decode_attention, whose plain config in a
    graph (graph_runs of its declared branch) may still be the default's."""
    config = resolve_config(call)
    if is_fa3_default(config):
        return True
    default = decode_attention.tuner.default(call, {})
    return graph_runs(declared_branch(config, size), call) == graph_runs(default, call)


def load_batch_of_variant(original: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """Around DecodeCudaGraphRunner.load_batch (the host step before a replay): the graph to
    replay becomes the variant for the step's host lengths, where one was captured; while
    the variant is judged, every other such step keeps the base graph, and the replay's start
    is marked for the judge."""
    backend = tuner_backend(runner)
    if backend is not None:  # (SGLang's step gives this step's view; a step it pre-planned, none)
        backend.tuner_replay_view = None
    result = original(runner, forward_batch, *args, **kwargs)
    key = getattr(runner, "_replay_graph_key", None)
    if backend is None or key is None:
        return result
    judge = judge_of(runner, backend)  # (None without CUDA)
    if judge is not None:
        judge.tick()  # (a verdict may drop a variant: before the step's label is asked for)
    raw_batch = getattr(forward_batch, "batch_size", None)
    pick = backend.tuner_variants.pick(key.size, getattr(forward_batch, "seq_lens_cpu", None), raw_batch=raw_batch)
    if pick is None:
        return result
    variant_key = _variant_key(backend, key, pick.label)
    # the graph the pick is judged against, and replayed where it loses: the base graph, or the variant it challenges
    other_key = key if pick.against is None else _variant_key(backend, key, pick.against)
    graphs = getattr(runner, "backend", None)  # SGLang's graph store: replay only a graph it holds
    if graphs is not None and hasattr(graphs, "can_run") and not (graphs.can_run(forward_batch, variant_key) and (
            other_key is key or graphs.can_run(forward_batch, other_key))):
        return result
    runner._replay_graph_key = other_key
    if judge is not None and judge.dropped(key.size, pick):  # (GraphVariants.drop_pick did so already)
        return result
    timed = None
    if judge is not None and judge.judging(key.size, pick):  # (per class of lengths: see replay_judge)
        variant = judge.replays_variant(key.size, pick)
        timed = judge.start(key.size, pick, variant, raw_batch, server_label=key.variant_label)
        if not variant:
            runner._tuner_timed = timed
            return result
    if (backend.tuner_flashinfer_labels.get(key.size) == pick.label
            and not planned_flashinfer(backend, key.size, pick, getattr(runner, "tp_size", 1))):
        return result  # (not timed: no pair without its variant's replay)
    runner._tuner_timed = timed
    runner._replay_graph_key = variant_key
    return result


def planned_flashinfer(backend: Any, size: int, pick: Any, tp_size: int = 1) -> bool:
    """FlashInfer's plan for a step that replays its variant (SGLang's metadata step on the
    replay's view, as its FlashInfer backend runs before each of its own replays); False, and
    that class replays the base graph from then on, where it fails; False alone where SGLang
    gave this step no replay view (its metadata were made ahead: FlashInfer's plan would be
    another step's). Under tensor parallelism a failed plan raises: one rank cannot drop the
    class alone (its peers would replay the variant beside its base graph, and their judges
    count other pairs)."""
    if backend.tuner_replay_view is None:
        return False
    try:
        backend.tuner_flashinfer.init_forward_metadata_out_graph(backend.tuner_replay_view)
    except Exception as e:  # noqa: BLE001 - a stale plan must never replay: the base graph does
        if tp_size > 1:
            raise RuntimeError(f"tuner: FlashInfer's plan failed on this rank ({type(e).__name__}: {e}) for batch "
                               f"size {size}, and ranks must replay alike; set "
                               f"{settings.ENV_SGLANG_FLASHINFER}=0") from e
        backend.tuner_variants.drop_pick(size, pick)
        warnings.warn(f"tuner: FlashInfer's plan failed ({type(e).__name__}: {e}); batch size {size}'s steps of "
                      f"{pick.step_class} replay its graph", RuntimeWarning, stacklevel=2)
        return False
    return True


def _variant_key(backend: Any, key: Any, label: str) -> Any:
    """SGLang's ShapeKey of a variant's graph, made once per graph (a dataclass copy at every
    step cost the host step a few us)."""
    made = backend.tuner_variant_keys.get((key, label))
    if made is None:
        made = backend.tuner_variant_keys[key, label] = dataclasses.replace(
            key, variant_label=_joined(key.variant_label, label))
    return made


def time_judged_replay(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """Around DecodeCudaGraphRunner.execute (load_batch, then the replay): the replay's end
    marked for the judge where load_batch marked its start."""
    runner._tuner_timed = None
    output = original(runner, *args, **kwargs)
    timed, runner._tuner_timed = runner._tuner_timed, None
    if timed is not None:
        tuner_backend(runner).tuner_judge.finish(timed)
    return output


def judge_of(runner: Any, backend: Any) -> ReplayJudge | None:
    """The judge of the runner's variants: the backend's where this process picks its graphs
    alone; under tensor parallelism the same, its verdicts agreed across the TP group
    (tp_slowest); none under pipeline parallelism, or where the TP group is not found.
    Data-parallel replicas decide alone (DP attention, where they replay together, keeps no
    variants: variants_apply); expert and context parallelism live inside TP's ranks."""
    judge = backend.tuner_judge
    if judge is None or getattr(runner, "pp_size", 1) != 1:
        return None
    if getattr(runner, "tp_size", 1) == 1:
        return judge
    if judge.agree is None:
        judge.agree = tp_slowest(runner)
    return judge if judge.agree is not None else None


def _tp_cpu_group(runner: Any) -> Any:
    """SGLang's TP CPU (gloo) group of the runner's model runner, or None."""
    return getattr(getattr(getattr(runner, "model_runner", None), "tp_group", None), "cpu_group", None)


def tp_slowest(runner: Any) -> Any:
    """A function giving the largest of the TP ranks' ratios, each rank passing its own (one
    all-reduce over SGLang's TP CPU group for a tuple of them), or None where the runner has
    no such group."""
    group = _tp_cpu_group(runner)
    if group is None:
        return None

    def slowest(ratios: tuple[float, ...]) -> tuple[float, ...]:
        value = torch.tensor(list(ratios), dtype=torch.float64)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=group)
        return tuple(value.tolist())
    return slowest
