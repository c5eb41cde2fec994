"""Keys from a call's own arguments, for the drop-ins' key functions: one static-key tuple
layout, and host-side values only (a flag or length given as a device tensor is never
read back to build a key).

A key function runs on every call: it builds `static_tuple(...)` from attribute reads and
type checks; the static key's JSON is made from that tuple once per new key
(`static_key_from_tuple`), off the hot path.
"""

from __future__ import annotations

import operator
from typing import Any

from tuner.keys.static import AttentionStaticKey, static_key_from_parts

# a value a key cannot hold without reading a device tensor
UNKEYED: Any = object()
# the static tuple's attention fields, in order; a 15th, when present, names extra features
STATIC_FIELDS = ("q_dtype", "k_dtype", "v_dtype", "num_q_heads", "num_kv_heads", "head_dim_qk", "head_dim_v",
                 "page_size", "causal", "window", "softcap", "sinks", "k_descale", "v_descale")


class Untunable(tuple):
    """A static key a call's host values cannot complete (a flag or length given as a device
    tensor): never looked up or tuned, but one per shape, so that each shape's own default
    serves (a None key for them all served the first call's default to every shape)."""

    def __new__(cls, *fields: Any) -> "Untunable":
        # the marker keeps it unequal to any full static tuple of the same fields
        return super().__new__(cls, ("untunable", *fields))


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "data_ptr") and hasattr(value, "dtype")  # a torch tensor, without importing torch


def host_scalar(value: Any) -> Any:
    """A flag or number as a key value: host Python values as they are, numpy scalars as
    Python's; UNKEYED for a tensor."""
    if _is_tensor(value):
        return UNKEYED
    item = getattr(value, "item", None)
    return item() if callable(item) else value


def host_window(window_size: Any) -> tuple[int, int] | None:
    """window_size as a key: a pair of host ints (None, one int, a list or a numpy array
    are normalised); None when it cannot be read without a device tensor."""
    if window_size is None:
        return (-1, -1)
    if _is_tensor(window_size):
        return None
    try:
        try:
            left, right = window_size  # a pair: tuple, list, numpy array
        except TypeError:  # not iterable: one int for both sides
            side = operator.index(window_size)
            return (side, side)
        if _is_tensor(left) or _is_tensor(right):
            return None
        return (operator.index(left), operator.index(right))
    except (TypeError, ValueError):
        return None


def host_flags(window_size: Any, softcap: Any, causal: Any) -> tuple[tuple[int, int], Any, Any] | None:
    """(window, softcap, causal) as key values, for every key function: a tuple of ints, a
    float or int and a bool as they are (the hot path: type checks only), anything else read
    on the host; None when one of them cannot be read without a device tensor."""
    if (type(window_size) is tuple and type(window_size[0]) is int and type(window_size[1]) is int
            and (type(softcap) is float or type(softcap) is int) and type(causal) is bool):
        return window_size, softcap, causal
    window = host_window(window_size)
    softcap = softcap if type(softcap) is float or type(softcap) is int else host_scalar(softcap)
    causal = causal if type(causal) is bool else host_scalar(causal)
    if window is None or softcap is UNKEYED or causal is UNKEYED:
        return None
    return window, softcap, causal


def static_key_from_tuple(static: tuple) -> AttentionStaticKey:
    """The AttentionStaticKey of a key function's static tuple (STATIC_FIELDS order)."""
    (q_dtype, k_dtype, v_dtype, q_heads, kv_heads, d_qk, d_v, page_size, causal, window, softcap, sinks,
     k_descale, v_descale) = static[:len(STATIC_FIELDS)]
    return static_key_from_parts(
        q_dtype=q_dtype, k_dtype=k_dtype, v_dtype=v_dtype, num_q_heads=q_heads, num_kv_heads=kv_heads,
        head_dim_qk=d_qk, head_dim_v=d_v, page_size=page_size, causal=bool(causal), window_size=window,
        softcap=softcap or None, sinks=bool(sinks), k_descale=bool(k_descale), v_descale=bool(v_descale),
    )
