"""Tunable ops and their registry. Ops know no DB; GPU libraries are imported lazily."""

from __future__ import annotations

from tuner.errors import TunerError
from tuner.ops.base import Config, DecodeInputs, Op, make_decode_inputs
from tuner.ops.reference import paged_decode_reference
from tuner.ops.shapes import DecodeShape, ShapeError, load_shapes, shape_from_dict
from tuner.ops.decode_attention import DECODE_ATTENTION
from tuner.ops.fa3 import FA3
from tuner.ops.flashinfer import FLASHINFER
from tuner.ops.torch_split import TORCH_SPLIT_DECODE
from tuner.ops.triton_decode import TRITON_DECODE

_REGISTRY: dict[str, Op] = {op.name: op for op in (TORCH_SPLIT_DECODE, TRITON_DECODE, FA3, FLASHINFER, DECODE_ATTENTION)}


def list_ops() -> list[Op]:
    return list(_REGISTRY.values())


def get_op(name: str) -> Op:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise TunerError(f"unknown op {name!r}; known ops: {', '.join(_REGISTRY)}") from None


def get_grid(op: Op, name: str) -> list[DecodeShape]:
    try:
        return op.grids[name]
    except KeyError:
        raise TunerError(
            f"op {op.name} has no grid {name!r}; its grids: {', '.join(op.grids)}"
        ) from None


__all__ = [
    "Config", "DecodeInputs", "DecodeShape", "Op", "ShapeError",
    "get_grid", "get_op", "list_ops", "load_shapes", "make_decode_inputs",
    "paged_decode_reference", "shape_from_dict",
]
