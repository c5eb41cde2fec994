"""sgl-kernel's FA3 flash_attn_with_kvcache as a tunable op: num_splits and pack_gqa, the
rules a config passes, the grids a sweep measures. (The serving drop-in that runs each call
with the tuned config is tuner.integrations.fa3.) sgl-kernel is imported on first use only.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from tuner.workload.inputs import DecodeInputs
from tuner import settings
from tuner.ops.base import Config, Op, sm_count
from tuner.ops.rules import config_error, is_int, one_of
from tuner.workload.shapes import DecodeShape, grid
from tuner.workload.traffic import serving_grid

OP_NAME = "fa3"
NUM_SPLITS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # 0: FA3's own heuristic
DEFAULT: Config = {"num_splits": 0, "pack_gqa": None}  # what sgl-kernel does when not told


@functools.cache
def kernel() -> Any:
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
        return "sgl-kernel is not installed (pip install 'tuner-attn[gpu]')"
    return None


def split_counts(batch: int | None, num_kv_heads: int) -> tuple[int, ...]:
    """NUM_SPLITS, less the counts past settings.FA3_SPLIT_ITEMS_PER_SM work items (splits x
    batch x kv heads) per SM, unless settings.FULL_SPACE; 0 and 1 always stay."""
    if batch is None or settings.FULL_SPACE:
        return NUM_SPLITS
    items = settings.FA3_SPLIT_ITEMS_PER_SM * sm_count()
    return tuple(n for n in NUM_SPLITS if n <= 1 or n * batch * num_kv_heads <= items)


def config_space(num_q_heads: int, num_kv_heads: int, batch: int | None = None) -> list[Config]:
    """num_splits x pack_gqa; pack_gqa only matters when q heads share kv heads. With a
    batch size, the split counts of split_counts."""
    packs = (None, False, True) if num_q_heads > num_kv_heads else (None,)
    return [{"num_splits": n, "pack_gqa": p} for n in split_counts(batch, num_kv_heads) for p in packs]


# what FA3 takes: num_splits 0 (its heuristic) or a count, pack_gqa None (its choice) or a bool
RULES = {"num_splits": is_int(0, 1024), "pack_gqa": one_of(None, True, False)}


# what FA3 runs at all (sgl-kernel's flash_api checks both and raises): a float32 call or a
# head dim it has no kernel for runs another backend by default instead of failing in FA3
DTYPES = ("float16", "bfloat16", "float8_e4m3fn")
MAX_HEAD_DIM = 256


def shape_problem(shape: DecodeShape) -> str | None:
    """Why FA3 cannot run calls of this shape (None: it can)."""
    if shape.dtype not in DTYPES:
        return f"FA3 runs {', '.join(DTYPES)}, not {shape.dtype}"
    if shape.head_dim > MAX_HEAD_DIM or shape.head_dim % 8:
        return f"FA3 runs head dims that are multiples of 8 up to {MAX_HEAD_DIM}, not {shape.head_dim}"
    return None


def check_config(config: Config, shape: DecodeShape | None = None) -> str | None:
    return config_error(config, RULES) or (shape_problem(shape) if shape is not None else None)


def _run(inputs: DecodeInputs, config: Config) -> torch.Tensor:
    s = inputs.shape
    return kernel()(
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
    configs=lambda shape: config_space(shape.num_q_heads, shape.num_kv_heads, shape.batch),
    default=lambda shape: dict(DEFAULT),
    run=_run,
    grids={"decode": _decode_grid(), "mtp": _mtp_grid(), "serving": serving_grid(),
           "smoke": grid([1, 64], [512, 8192])},
    unavailable=unavailable,
    device=lambda: "cuda",
    check=check_config,
)


# the static key's "extras": features that select another FA3 kernel (or plan) than any sweep
# measures; a call using one runs FA3's default unless a winner was tuned for exactly it
EXTRAS = ("new_kv", "qv", "rotary", "score_mod", "only_qv", "attention_chunk", "sm_margin", "cache_leftpad",
          "cache_batch_idx", "q_descale", "ver")
