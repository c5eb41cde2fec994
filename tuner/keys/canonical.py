"""Canonical JSON: one text per value, so equal keys are equal strings in the DB."""

from __future__ import annotations

import json
import math
import operator
from typing import Any

# a config: names to scalar values (str, int, float, bool, None), as stored and run
Config = dict[str, Any]


def count(value: Any, arg: str, minimum: int, maximum: int) -> int:
    """An integer in [minimum, maximum] (numpy integers too, never a bool), or a ValueError
    naming the argument."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{arg} must be an integer, got {type(value).__name__}")
    value = operator.index(value)
    if value < minimum:
        raise ValueError(f"{arg} must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{arg} must be <= {_power(maximum)}, got {value}")
    return int(value)


def _power(n: int) -> str:
    return f"2**{n.bit_length() - 1}" if n > 1 and not n & (n - 1) else str(n)


def _plain(value: Any) -> Any:
    """Turn tuples, dtypes and key objects into JSON values, rejecting what has no one form."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"non-finite number {value!r} has no canonical JSON form")
        # 2.0 and 2 are the same config value; keep integers integral
        return int(value) if value.is_integer() and abs(value) < 2**53 else value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"key {k!r} must be a string")
            out[k] = _plain(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _plain(to_dict())
    if type(value).__name__ == "dtype":  # torch.dtype / numpy dtype, without importing them
        return str(value).removeprefix("torch.")
    raise ValueError(f"{type(value).__name__} value {value!r} has no canonical JSON form")


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces, tuples as lists, integral floats as ints."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), allow_nan=False)
