"""decode_attention: one paged decode op that runs, per shape, the fastest backend installed
(FA3, FlashInfer or our Triton kernel) with that backend's fastest config, as the sweep measured.

A config is {"backend": name, **that backend's config}; the sweep measures the union of
the backends' spaces, so the winner is chosen across backends and knobs at once. A record
may also hold a by_fill config (flat: "dense.*" and "other.*" knobs): one
config for dense batches (tuner.workload.traffic.is_dense), one for the rest, chosen per call
from host values (fill_branch), which the sweep's dense pass measures. Each
backend is a record (Backend): its op (configs, default, rules, run on a sweep's inputs),
how to run a caller's call with a config, and what a call must offer it (host lengths,
no CUDA-graph capture). The sweep and the serving entry point
(tuner.integrations.decode_attention) both go through BACKENDS; tests replace entries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from tuner.errors import TunerError
from tuner.keys import host_flags, host_scalar
from tuner.ops import fa3 as fa3_op
from tuner.ops.base import Config, Op, stream_capturing
from tuner.ops.fa3 import _decode_grid, _mtp_grid
from tuner.ops.fa3_waves import FA3_WITH_WAVES, WAVE_FIT
from tuner.ops.flashinfer import FLASHINFER, paged_attention
from tuner.ops.flashinfer_plan import host_seq_lens
from tuner.ops.triton_decode import TRITON_DECODE, triton_paged_decode
from tuner.workload.inputs import DecodeInputs
from tuner.workload.shapes import DecodeShape
from tuner.workload.traffic import graph_grid, is_dense, serving_grid

OP_NAME = "decode_attention"


@dataclass(frozen=True, eq=False)  # hashed by identity (its op holds dicts)
class Backend:
    """One library decode_attention can run on."""

    op: Op  # its configs, default, rules; how a sweep runs it
    # a caller's call with a config (its "backend" key too): call(config, *Call's fields, out=None)
    call: Callable[..., torch.Tensor]
    takes: Callable[..., bool] | None = None  # what a call must offer it (host lengths, ...): takes(*Call)
    graph_capturable: bool = True  # its kernels read the live tensors on every replay

    @property
    def name(self) -> str:
        return self.op.name

    @functools.cached_property
    def runs_any_call(self) -> bool:
        """It takes every call, captured or not (the hot path then asks nothing more)."""
        return self.takes is None and self.graph_capturable

    def runs(self, *call: Any) -> bool:
        """Whether this backend can run this call (Call's fields) now (else the default runs)."""
        return (self.takes is None or self.takes(*call)) and (self.graph_capturable or not _capturing())


_capturing = stream_capturing  # (a module name of its own: tests fake a capture here)



# the backends' calls take the config and Call's fields, positionally (no object per call)
# (out: where to write the output, or None; a backend that cannot writes a new tensor and the
# caller copies it there). q may be strided over its batch (a server's slice of its qkv
# projection): Triton and FA3 read its strides; FlashInfer gets a copy
def _fa3_call(config, q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size, softcap,
              sinks, seq_lens_host, out=None):
    # (sgl-kernel's FA3 copies only a q whose last dim is strided: a server's slice of its qkv
    # rows costs no copy kernel)
    return fa3_op.kernel()(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table, causal=causal,
        window_size=window_size, softcap=softcap or 0.0, sinks=sinks,
        num_splits=config["num_splits"], pack_gqa=config["pack_gqa"], **({} if out is None else {"out": out}),
    )


def _triton_call(config, q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size, softcap,
                 sinks, seq_lens_host, out=None):
    # the window as the keys take it (None, one int, numpy values crashed the launch); flags
    # given as tensors are passed as they are
    flags = host_flags(window_size, softcap, causal)
    if flags is None:  # the kernels are built for the flags: a tensor's value would be read back (a sync)
        raise ValueError("the Triton backend takes causal, window_size and softcap as host values, not tensors")
    window, softcap, causal = flags
    # a numpy int as Python's; a tensor is not read back (a sync, or an error under capture):
    # the table's capacity bounds every length, and a looser bound only splits more
    capacity = page_table.shape[1] * k_cache.shape[1]
    if type(max_kv_len) is not int:
        max_kv_len = host_scalar(max_kv_len)
    max_kv_len = min(max_kv_len, capacity) if type(max_kv_len) is int else capacity
    return triton_paged_decode(
        q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len=max_kv_len, causal=causal,
        window=window, softcap=softcap or None, sinks=sinks,
        block_n=config["block_n"], num_kv_splits=config["num_kv_splits"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
        tokens_per_split=config.get("tokens_per_split", 0), items_per_sm=config.get("items_per_sm", 0), out=out,
    )


def _flashinfer_takes(q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size, softcap,
                      sinks, seq_lens_host):
    """FlashInfer plans on the host: from each sequence's length (on the host, never read
    back from the device) and host flags; its wrappers take no sinks, and several query
    tokens causal only (a config given for such a call dropped them silently)."""
    on_device = isinstance(seq_lens_host, torch.Tensor) and seq_lens_host.device.type != "cpu"
    if seq_lens_host is None or on_device or sinks is not None:
        return False
    flags = host_flags(window_size, softcap, causal)
    return flags is not None and (q.shape[1] == 1 or bool(flags[2]))


def _flashinfer_call(config, q, k_cache, v_cache, page_table, cache_seqlens, max_kv_len, causal, window_size,
                     softcap, sinks, seq_lens_host, out=None):
    # plain host values: numpy ones would keep FlashInfer from reusing its plan
    (window_left, _), softcap, causal = host_flags(window_size, softcap, causal)
    lens = host_seq_lens(seq_lens_host, None, None, k_cache.shape[1])
    if lens is None or lens.ndim != 1:
        raise ValueError(f"seq_lens_host must be a vector of integer kv lengths, got {_described(seq_lens_host)}")
    return paged_attention(q.contiguous(), k_cache, v_cache, page_table, lens, _rest(config), causal=bool(causal),
                           window_left=int(window_left), softcap=float(softcap) if softcap else None)


def _described(value: Any) -> str:
    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    return f"{type(value).__name__}" + (f" of {dtype}" if dtype is not None else "") + \
        (f" {tuple(shape)}" if shape is not None else "")


# in the default's preference order: the default never needs host lengths (FlashInfer does)
# and is always graph-capturable (FlashInfer's plan would freeze the capture-time pages)
BACKENDS: dict[str, Backend] = {
    "fa3": Backend(FA3_WITH_WAVES, _fa3_call),  # FA3's space and its wave_fit config (resolved by the entry point)
    "triton_decode": Backend(TRITON_DECODE, _triton_call),
    "flashinfer": Backend(FLASHINFER, _flashinfer_call, takes=_flashinfer_takes, graph_capturable=False),
}


@contextlib.contextmanager
def backends_only(names: Iterable[str]) -> Iterator[None]:
    """Within it, decode_attention knows only these backends (its config space, default and
    calls): a sweep for CUDA-graph serving leaves out FlashInfer, whose plan is host work
    per call that a captured graph cannot hold."""
    keep = list(dict.fromkeys(names))
    unknown = [n for n in keep if n not in BACKENDS]
    if unknown or not keep:
        raise TunerError(f"backends: {', '.join(unknown) or 'none given'}; known: {', '.join(BACKENDS)}")
    saved = dict(BACKENDS)
    for name in saved:
        if name not in keep:
            del BACKENDS[name]
    try:
        yield
    finally:
        BACKENDS.clear()
        BACKENDS.update(saved)


def installed() -> tuple[Backend, ...]:
    """The backends that run here, in BACKENDS' order (probed once per set of backends:
    probing imports costs milliseconds, and an install does not change under a server)."""
    return _installed(tuple(BACKENDS.values()))


@functools.lru_cache(maxsize=8)
def _installed(backends: tuple[Backend, ...]) -> tuple[Backend, ...]:
    return tuple(b for b in backends if b.op.unavailable() is None)


def config_space(shape: DecodeShape) -> list[Config]:
    return [{"backend": b.name, **c} for b in _running(shape) for c in b.op.configs(shape)]


def default_config(shape: DecodeShape) -> Config:
    """The first installed backend's own default that runs the shape (FA3 runs no float32):
    what a caller gets without tuner."""
    backends = _running(shape) or installed()
    if not backends:
        return {"backend": "none"}
    return {"backend": backends[0].name, **backends[0].op.default(shape)}


def _running(shape: DecodeShape) -> list[Backend]:
    """The installed backends whose own default passes their rules for the shape."""
    return [b for b in installed() if b.op.check(b.op.default(shape), shape) is None]


BY_FILL = "by_fill"
_PARTS = ("dense", "other")


def by_fill(dense: Config, other: Config) -> Config:
    """One config that runs `dense` on dense batches and `other` on the rest (fill_branch),
    flat as every stored config is ({"backend": "by_fill", "dense.backend": ..., "other.num_splits": ...}).
    The two may be one config: a dense pass's baseline, which runs `other` on every batch
    (its measurement must not take the place of the plain config's on the shape's mix)."""
    return {"backend": BY_FILL, **{f"dense.{k}": v for k, v in dense.items()},
            **{f"other.{k}": v for k, v in other.items()}}


_UNPACKED: dict[int, tuple[Config, Config, Config]] = {}  # id -> (the by_fill config, dense, other)
_UNPACKED_MAX = 4096


def fill_parts(config: Config) -> tuple[Config, Config]:
    """A by_fill config's (dense, other) configs, unpacked once per config object (a memo's
    config is one object for every call of its key)."""
    entry = _UNPACKED.get(id(config))
    if entry is not None and entry[0] is config:
        return entry[1], entry[2]
    parts: dict[str, Config] = {p: {} for p in _PARTS}
    for name, value in config.items():
        part, _, knob = name.partition(".")
        if part in parts and knob:
            parts[part][knob] = value
    if len(_UNPACKED) >= _UNPACKED_MAX:
        _UNPACKED.clear()
    _UNPACKED[id(config)] = (config, parts["dense"], parts["other"])  # holds config: its id stays its own
    return parts["dense"], parts["other"]


# the last CPU tensor of host lengths summed, its version counter then, and its sum: a server
# passes one lengths tensor to every layer of a decode step, and a torch sum costs ~2-4 us
_last_sum: tuple[Any, int, int] = (None, -1, 0)


def _tensor_sum(lengths: torch.Tensor) -> int:
    try:
        return int(lengths.numpy().sum())  # about half a torch sum's host time
    except (RuntimeError, TypeError):  # a tensor NumPy cannot view
        return int(lengths.sum())


def _lengths_sum(seq_lens_host: Any) -> int | None:
    """The sum of a call's host-side lengths (a CPU tensor, an array or a sequence), or None
    when they are not on the host (a device tensor is never read back). A CPU tensor's sum
    is kept while the same tensor comes again with the same version counter, which torch's
    in-place ops advance; writes that bypass torch (through a NumPy view of it, or .data)
    are not seen, so a server that fills one persistent tensor that way should pass a
    fresh one each step (a slice of its buffer is one) or the NumPy array. An inference
    tensor has no version counter and is summed each call."""
    global _last_sum
    if seq_lens_host is None:
        return None
    if isinstance(seq_lens_host, torch.Tensor):
        if not seq_lens_host.is_cpu:
            return None
        if seq_lens_host.is_inference():
            return _tensor_sum(seq_lens_host)
        last, version = _last_sum, seq_lens_host._version
        if last[0] is seq_lens_host and last[1] == version:
            return last[2]
        total = _tensor_sum(seq_lens_host)
        _last_sum = (seq_lens_host, version, total)
        return total
    try:
        total = seq_lens_host.sum() if hasattr(seq_lens_host, "sum") else sum(seq_lens_host)
        return int(total)
    except (TypeError, ValueError):
        return None


def dense_call(seq_lens_host: Any, max_kv_len: Any, batch: int) -> bool:
    """Whether a call's host-side lengths show a dense batch (tuner.workload.traffic.is_dense: their
    sum against batch x max_kv_len, the host bound of the longest); False where the lengths
    are unknown or max_kv_len is not a host integer."""
    if type(max_kv_len) is not int:
        max_kv_len = host_scalar(max_kv_len)  # a NumPy integer as Python's; a tensor: unknown
    if type(max_kv_len) is not int or max_kv_len <= 0 or batch <= 0:
        return False
    total = _lengths_sum(seq_lens_host)
    return total is not None and is_dense(total, batch, max_kv_len)


def fill_branch(config: Config, seq_lens_host: Any, max_kv_len: Any, batch: int) -> Config:
    """The plain config a call runs: a by_fill config's `dense` one on a dense call
    (dense_call), else its `other` one; any other config as it is."""
    if config.get("backend") != BY_FILL:
        return config
    dense, other = fill_parts(config)
    return dense if dense_call(seq_lens_host, max_kv_len, batch) else other


def check_config(config: Config, shape: DecodeShape) -> str | None:
    """A config names a backend and passes that backend's own rules for the shape (a by_fill
    config: both of its configs, each a plain one)."""
    if not isinstance(config, dict):
        return f"a config is an object, got {type(config).__name__}"
    backend = config.get("backend")
    if backend == BY_FILL:
        stray = [k for k in config if k != "backend" and k.partition(".")[0] not in _PARTS]
        if stray:
            return f"a {BY_FILL} config holds dense.* and other.* knobs, got {', '.join(sorted(stray))[:80]}"
        for part, plain in zip(_PARTS, fill_parts(config)):
            if plain.get("backend") == BY_FILL:
                return f"{part}: a {BY_FILL} config cannot nest another"
            why = check_config(plain, shape)
            if why:
                return f"{part}: {why}"
        return None
    if backend not in BACKENDS:
        return f"backend={backend!r:.40} is not one of {', '.join(BACKENDS)}"
    return BACKENDS[backend].op.check(_rest(config), shape)


def _rest(config: Config) -> Config:
    return {k: v for k, v in config.items() if k != "backend"}


def _run(inputs: DecodeInputs, config: Config) -> torch.Tensor:
    # a sweep's batch: its lengths are fixed (a graph captured of it replays them alone)
    config = fill_branch(config, inputs.seq_lens_host if inputs.seq_lens_host is not None
                         else [inputs.shape.kv_len] * inputs.shape.batch, inputs.shape.kv_len, inputs.shape.batch)
    return BACKENDS[config["backend"]].op.run(inputs, _rest(config))


def _precompile(inputs: DecodeInputs, configs: list[Config]) -> None:
    """Each backend that compiles ahead (tuner.ops.base.Op.precompile) builds its configs."""
    plain = [p for c in configs for p in (fill_parts(c) if c.get("backend") == BY_FILL else (c,))]
    for name, backend in BACKENDS.items():
        mine = [_rest(c) for c in plain if c.get("backend") == name]
        if mine and backend.op.precompile is not None:
            backend.op.precompile(inputs, mine)


def unavailable() -> str | None:
    if installed():
        return None
    return "; ".join(f"{name}: {b.op.unavailable()}" for name, b in BACKENDS.items())


DECODE_ATTENTION = Op(
    name=OP_NAME,
    description="paged decode on the fastest installed backend per shape (FA3, FlashInfer or Triton), best config",
    configs=config_space,
    default=default_config,
    run=_run,
    grids={"decode": _decode_grid(), "mtp": _mtp_grid(), "serving": serving_grid(),
           "cpu-tiny": TRITON_DECODE.grids["cpu-tiny"], "cpu-serving": TRITON_DECODE.grids["cpu-serving"]},
    unavailable=unavailable,
    device=lambda: "cuda" if torch.cuda.is_available() else "cpu",
    check=check_config,
    precompile=_precompile,
    by_fill=by_fill,
)


GRAPH_OP_NAME = "decode_attention_graph"
# the ops whose configs name one of BACKENDS (backends_only narrows them)
BACKEND_OPS = (OP_NAME, GRAPH_OP_NAME)


def graph_config_space(shape: DecodeShape) -> list[Config]:
    """decode_attention's configs that a captured graph can hold (no per-call host plan, no
    choice from host lengths: a wave_fit config runs FA3's default there)."""
    return [c for c in config_space(shape) if BACKENDS[c["backend"]].graph_capturable and WAVE_FIT not in c]


def _graph_check(config: Config, shape: DecodeShape) -> str | None:
    backend = BACKENDS.get(config.get("backend")) if isinstance(config, dict) else None
    if backend is not None and not backend.graph_capturable:
        return f"backend={config['backend']} cannot run in a captured graph (its plan is per call)"
    return check_config(config, shape)


# decode_attention's graph records: per capture batch size and bound, the config with the
# least expected time over the lengths its graph replays (DecodeShape.lengths "graph"),
# which a call captured with no declared lengths runs (tuner.runtime.state.Runtime.lookup)
DECODE_ATTENTION_GRAPH = dataclasses.replace(
    DECODE_ATTENTION,
    name=GRAPH_OP_NAME,
    description="decode_attention in CUDA graphs of unknown lengths: the best config over the lengths a graph "
                "captured at a bound replays",
    configs=graph_config_space,
    check=_graph_check,
    grids={"decode": graph_grid(batches=(1, 4, 16, 64, 256)), "serving": graph_grid(),
           "cpu-serving": [dataclasses.replace(s, lengths="graph") for s in TRITON_DECODE.grids["cpu-serving"]]},
    by_fill=None,
)
