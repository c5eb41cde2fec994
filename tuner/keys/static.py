"""The static key of an attention call: everything that selects a different kernel."""

from __future__ import annotations

import json
import math
import operator
from dataclasses import asdict, dataclass, fields
from typing import Any

from tuner.keys.canonical import canonical_json, count


def _dtype_name(tensor: Any, arg: str) -> str:
    dtype = getattr(tensor, "dtype", None)
    if dtype is None:
        raise ValueError(f"{arg} must be a tensor (got {type(tensor).__name__})")
    return str(dtype).removeprefix("torch.")


def _shape(tensor: Any, arg: str, ndim: tuple[int, ...]) -> tuple[int, ...]:
    shape = getattr(tensor, "shape", None)
    if shape is None:
        raise ValueError(f"{arg} must be a tensor (got {type(tensor).__name__})")
    if len(shape) not in ndim:
        want = " or ".join(str(n) for n in ndim)
        raise ValueError(f"{arg} must have {want} dimensions, got shape {tuple(shape)}")
    return tuple(int(s) for s in shape)


def _window_side(value: Any) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"window_size entries must be integers, got {type(value).__name__}")
    value = operator.index(value)
    if value < -1:
        raise ValueError(f"window_size entries must be -1 (unbounded) or >= 0, got {value}")
    return int(value)


def normalize_window(window_size: Any) -> tuple[int, int]:
    """None -> (-1, -1); an int w -> (w, w); a 2-tuple, 2-list or 2-element array as is.
    -1 means unbounded."""
    if window_size is None:
        return (-1, -1)
    if not isinstance(window_size, (list, tuple, str, bytes)) and hasattr(window_size, "__len__") and hasattr(
            window_size, "tolist"):  # a numpy array (or a CPU tensor): its values as a list
        window_size = window_size.tolist()
    if isinstance(window_size, (list, tuple)):
        if len(window_size) != 2:
            raise ValueError(f"window_size must have 2 entries, got {len(window_size)}")
        return (_window_side(window_size[0]), _window_side(window_size[1]))
    if isinstance(window_size, bool) or not hasattr(window_size, "__index__"):
        raise ValueError(
            f"window_size must be None, an int or a pair of ints, got {type(window_size).__name__}"
        )
    side = _window_side(window_size)
    return (side, side)


def _count(value: Any, arg: str, minimum: int) -> int:
    return count(value, arg, minimum, 2**31)


def _softcap_on(softcap: Any) -> bool:
    if softcap is None:
        return False
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(f"softcap must be None or a number, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0, got {softcap!r}")
    return softcap > 0


# bytes per element of the dtypes a KV cache holds
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class AttentionStaticKey:
    """Fields that select a kernel; two calls with equal static keys run the same code."""

    q_dtype: str
    k_dtype: str
    v_dtype: str
    num_q_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    page_size: int
    causal: bool
    window_left: int
    window_right: int
    softcap: bool
    sinks: bool
    k_descale: bool
    v_descale: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        """Short and human: dtype, heads, head dim, page size, and the features that are on."""
        dtype = self.q_dtype if self.q_dtype == self.k_dtype == self.v_dtype else (
            f"{self.q_dtype}/{self.k_dtype}/{self.v_dtype}")
        dims = f"d{self.head_dim_qk}" if self.head_dim_qk == self.head_dim_v else f"d{self.head_dim_qk}/{self.head_dim_v}"
        label = f"{dtype} h{self.num_q_heads}/{self.num_kv_heads} {dims} p{self.page_size}"
        if not self.causal:
            label += " noncausal"
        if (self.window_left, self.window_right) != (-1, -1):
            label += f" win{self.window_left},{self.window_right}"
        for flag in ("softcap", "sinks", "k_descale", "v_descale"):
            if getattr(self, flag):
                label += f" {flag}"
        return label

    def to_json(self) -> str:
        return canonical_json(self.to_dict())

    def kv_bytes_per_token(self) -> int | None:
        """Bytes of K and V one token of one sequence holds (None for a dtype of unknown size):
        the one KV-bytes computation (a sweep's allocation, a report's roofline)."""
        k, v = DTYPE_BYTES.get(self.k_dtype), DTYPE_BYTES.get(self.v_dtype)
        if k is None or v is None:
            return None
        return self.num_kv_heads * (self.head_dim_qk * k + self.head_dim_v * v)

    @staticmethod
    def label_of(static_json: str) -> str:
        """The label of a stored static key, or the JSON itself when it is not an attention
        key (a function of the user's own keys its kernels otherwise)."""
        try:
            return AttentionStaticKey.from_json(static_json).label()
        except (ValueError, TypeError):
            return static_json

    @classmethod
    def from_json(cls, text: str) -> "AttentionStaticKey":
        data = json.loads(text)
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ValueError("not an attention static key: fields differ")
        return cls(**data)


def attention_static_key(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    causal: bool,
    window_size: Any = None,
    softcap: float | None = None,
    sinks: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
) -> AttentionStaticKey:
    """Static key of a paged attention call.

    q is (..., num_q_heads, head_dim); k_cache and v_cache are paged,
    (num_pages, page_size, num_kv_heads, head_dim). Only shapes and dtypes are read.
    """
    q_shape = _shape(q, "q", (3, 4))
    k_shape = _shape(k_cache, "k_cache", (4,))
    v_shape = _shape(v_cache, "v_cache", (4,))
    if k_shape[:3] != v_shape[:3]:
        raise ValueError(
            f"k_cache {k_shape} and v_cache {v_shape} differ in pages, page size or heads"
        )
    num_q_heads, num_kv_heads = q_shape[-2], k_shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})"
        )
    if q_shape[-1] != k_shape[-1]:
        raise ValueError(f"q head dim {q_shape[-1]} differs from k_cache's {k_shape[-1]}")
    for arg, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _dtype_name(tensor, arg)
    return static_key_from_parts(
        q_dtype=q.dtype, k_dtype=k_cache.dtype, v_dtype=v_cache.dtype,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim_qk=q_shape[-1],
        head_dim_v=v_shape[-1], page_size=k_shape[1], causal=causal, window_size=window_size,
        softcap=softcap, sinks=sinks is not None, k_descale=k_descale is not None,
        v_descale=v_descale is not None,
    )


def static_key_from_parts(
    *,
    q_dtype: Any,
    k_dtype: Any,
    v_dtype: Any,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim_qk: int,
    head_dim_v: int,
    page_size: int,
    causal: bool,
    window_size: Any,
    softcap: float | None,
    sinks: bool,
    k_descale: bool,
    v_descale: bool,
) -> AttentionStaticKey:
    """The static key from values a wrapper already read (dtypes may be torch dtypes or
    names; window_size and softcap as the kernel takes them). page_size 0: not paged."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {type(causal).__name__}")
    left, right = normalize_window(window_size)
    return AttentionStaticKey(
        q_dtype=str(q_dtype).removeprefix("torch."),
        k_dtype=str(k_dtype).removeprefix("torch."),
        v_dtype=str(v_dtype).removeprefix("torch."),
        num_q_heads=_count(num_q_heads, "num_q_heads", 1),
        num_kv_heads=_count(num_kv_heads, "num_kv_heads", 1),
        head_dim_qk=_count(head_dim_qk, "head_dim_qk", 1),
        head_dim_v=_count(head_dim_v, "head_dim_v", 1),
        page_size=_count(page_size, "page_size", 0),
        causal=causal,
        window_left=left,
        window_right=right,
        softcap=_softcap_on(softcap),
        sinks=bool(sinks),
        k_descale=bool(k_descale),
        v_descale=bool(v_descale),
    )
