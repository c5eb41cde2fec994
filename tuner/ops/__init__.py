"""Tunable ops and their registry. Ops know no DB; GPU libraries are imported lazily."""

from __future__ import annotations

import json

from tuner.errors import TunerError
from tuner.keys import AttentionRunKey, AttentionStaticKey, static_key_from_parts
from tuner.keys.static import DTYPE_BYTES
from tuner.ops.base import Config, Op
from tuner.workload.shapes import DecodeShape, shape_for_checks
from tuner.ops.decode_attention import DECODE_ATTENTION, DECODE_ATTENTION_GRAPH
from tuner.ops.fa3 import EXTRAS as FA3_EXTRAS
from tuner.ops.fa3 import FA3
from tuner.ops.flashinfer import FLASHINFER
from tuner.ops.torch_split import TORCH_SPLIT_DECODE
from tuner.ops.triton_decode import TRITON_DECODE

_REGISTRY: dict[str, Op] = {op.name: op for op in (TORCH_SPLIT_DECODE, TRITON_DECODE, FA3, FLASHINFER, DECODE_ATTENTION,
                                                   DECODE_ATTENTION_GRAPH)}


def list_ops() -> list[Op]:
    return list(_REGISTRY.values())


def get_op(name: str) -> Op:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise TunerError(f"unknown op {name!r}; known ops: {', '.join(_REGISTRY)}") from None


def check_record(op_name: str, static_key_json: str, run_key: AttentionRunKey, config: Config) -> str | None:
    """Why a stored or imported (op, static key, run key, config) cannot be one of that op's
    winners, or None. Ops tuner does not know (a user's own @autotune function) pass: their
    rules live with their code."""
    op = _REGISTRY.get(op_name)
    if op is None:
        return None
    try:
        data = json.loads(static_key_json)
    except ValueError:
        return "its static key is not JSON"
    if op_name == "fa3" and isinstance(data, dict) and "extras" in data:  # FA3 features no sweep measures
        extras = data.pop("extras")
        if not isinstance(extras, list) or not extras or any(e not in FA3_EXTRAS for e in extras):
            return f"its static key's extras must name FA3 features ({', '.join(FA3_EXTRAS)})"
    try:
        key = AttentionStaticKey.from_json(json.dumps(data))
        if static_key_from_parts(
                q_dtype=key.q_dtype, k_dtype=key.k_dtype, v_dtype=key.v_dtype, num_q_heads=key.num_q_heads,
                num_kv_heads=key.num_kv_heads, head_dim_qk=key.head_dim_qk, head_dim_v=key.head_dim_v,
                page_size=key.page_size, causal=key.causal, window_size=(key.window_left, key.window_right),
                softcap=1.0 if key.softcap is True else None if key.softcap is False else key.softcap,
                sinks=key.sinks, k_descale=key.k_descale, v_descale=key.v_descale) != key:
            raise ValueError("a field has the wrong type")
        unknown = [d for d in (key.q_dtype, key.k_dtype, key.v_dtype) if d not in DTYPE_BYTES]
        if unknown:
            raise ValueError(f"dtype {unknown[0]!r:.40} is not one of {', '.join(DTYPE_BYTES)}")
        if key.num_q_heads % key.num_kv_heads:
            raise ValueError(f"{key.num_kv_heads} kv heads do not divide {key.num_q_heads} query heads")
        shape = shape_for_checks(key, run_key)
    except (ValueError, TypeError) as e:
        return f"its static key is not an attention static key ({e})"
    return op.check(config, shape)


def get_grid(op: Op, name: str) -> list[DecodeShape]:
    try:
        return op.grids[name]
    except KeyError:
        raise TunerError(
            f"op {op.name} has no grid {name!r}; its grids: {', '.join(op.grids)}"
        ) from None


__all__ = ["Config", "Op", "check_record", "get_grid", "get_op", "list_ops"]
