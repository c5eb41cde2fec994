"""Decode problem shapes: what a sweep iterates over, parsed and validated from JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tuner.errors import TunerError
from tuner.jsonfile import read_json
from tuner.keys import (
    AttentionRunKey, AttentionStaticKey, attention_run_key, normalize_window, static_key_from_parts,
)

DTYPES = ("float32", "float16", "bfloat16")
# what a shape's batch holds: "full", every sequence at kv_len (the grid's uniform batches);
# "serving", batches of each length distribution of tuner.workload.traffic (serving_draws), each with its longest
# sequence in kv_len's bucket, timed in turn (the mean is the expected time over the mix);
# "graph", the batches a CUDA graph captured at kv_len (its bound: max_kv_len and page-table
# width) replays, lengths of every octave up to it (graph_draws), run with no host lengths
LENGTHS = ("full", "serving", "graph")


class ShapeError(TunerError, ValueError):
    """A shape (or shapes file) that cannot be used; the message is one line."""


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    kv_len: int
    q_len: int = 1
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 1
    dtype: str = "bfloat16"
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    lengths: str = "full"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["window"] = list(self.window)
        return d

    def static_key(self) -> AttentionStaticKey:
        """The static key of this shape's calls (as tuner.workload.DecodeInputs reads it off the
        tensors): no sinks tensor means no sinks, no descales."""
        return static_key_from_parts(
            q_dtype=self.dtype, k_dtype=self.dtype, v_dtype=self.dtype, num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads, head_dim_qk=self.head_dim, head_dim_v=self.head_dim,
            page_size=self.page_size, causal=self.causal, window_size=self.window,
            softcap=self.softcap or None, sinks=self.sinks, k_descale=False, v_descale=False,
        )

    def run_key(self) -> AttentionRunKey:
        """The key its calls run under: the kv bucket of its longest sequence, window or not."""
        return attention_run_key(self.batch, self.q_len, self.kv_len)

    def kv_bytes(self) -> int:
        """Bytes of K and V cache a sweep allocates for this shape (whole pages)."""
        pages = -(-self.kv_len // self.page_size)
        return self.batch * pages * self.page_size * self.static_key().kv_bytes_per_token()

    def static_label(self) -> str:
        return self.static_key().label()

    def label(self) -> str:
        mix = "" if self.lengths == "full" else f" ({self.lengths} lengths)"
        return f"b{self.batch} q{self.q_len} kv{self.kv_len}{mix} {self.static_label()}"


# upper bounds: past these no GPU holds the problem, and a typo should not try to
_INT_LIMITS = {
    "batch": 2**20, "kv_len": 2**40, "q_len": 2**20, "num_q_heads": 1024, "num_kv_heads": 1024,
    "head_dim": 1024, "page_size": 2**20,
}


def shape_from_dict(data: Any, where: str = "shape") -> DecodeShape:
    """Validate one shape object; errors name the field and where it came from."""
    if not isinstance(data, dict):
        raise ShapeError(f"{where}: expected an object, got {type(data).__name__}")
    known = {f.name for f in fields(DecodeShape)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ShapeError(f"{where}: unknown field(s) {', '.join(unknown)}")
    for required in ("batch", "kv_len"):
        if required not in data:
            raise ShapeError(f"{where}: missing field {required}")
    values = dict(data)
    for name, limit in _INT_LIMITS.items():
        if name in values:
            v = values[name]
            if isinstance(v, bool) or not isinstance(v, int):
                raise ShapeError(f"{where}: {name} must be an integer, got {v!r:.40}")
            if v < 1 or v > limit:
                raise ShapeError(f"{where}: {name} must be between 1 and {limit}, got {v:.6g}")
    if "dtype" in values and values["dtype"] not in DTYPES:
        raise ShapeError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {values['dtype']!r}")
    if "lengths" in values and values["lengths"] not in LENGTHS:
        raise ShapeError(f"{where}: lengths must be one of {', '.join(LENGTHS)}, got {values['lengths']!r:.40}")
    if "causal" in values and not isinstance(values["causal"], bool):
        raise ShapeError(f"{where}: causal must be true or false")
    if "sinks" in values and not isinstance(values["sinks"], bool):
        raise ShapeError(f"{where}: sinks must be true or false")
    if "softcap" in values:
        v = values["softcap"]
        if v is None:
            values["softcap"] = 0.0
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ShapeError(f"{where}: softcap must be a number >= 0, got {v!r}")
        else:
            values["softcap"] = float(v)
    if "window" in values:
        try:
            values["window"] = normalize_window(values["window"])
        except ValueError as e:
            raise ShapeError(f"{where}: {e}") from None
    shape = DecodeShape(**values)
    if shape.num_q_heads % shape.num_kv_heads:
        raise ShapeError(
            f"{where}: num_q_heads ({shape.num_q_heads}) must be a multiple of "
            f"num_kv_heads ({shape.num_kv_heads})"
        )
    if shape.q_len > shape.kv_len:
        raise ShapeError(f"{where}: q_len ({shape.q_len}) exceeds kv_len ({shape.kv_len})")
    return shape


def load_shapes(path: str | Path) -> list[DecodeShape]:
    """Shapes from a JSON file: a list of shape objects, or {"shapes": [...]}."""
    data = read_json(path, ShapeError, "shapes file")
    if isinstance(data, dict) and set(data) == {"shapes"}:
        data = data["shapes"]
    if not isinstance(data, list) or not data:
        raise ShapeError(f"shapes file {path}: expected a non-empty list of shapes")
    return [shape_from_dict(item, f"{path} shape {i}") for i, item in enumerate(data)]


def grid(batches: list[int], kv_lens: list[int], max_tokens: int | None = None, **common: Any) -> list[DecodeShape]:
    """The batch x kv product, keeping batch * kv <= max_tokens when given."""
    return [
        DecodeShape(batch=b, kv_len=kv, **common)
        for b in batches
        for kv in kv_lens
        if max_tokens is None or b * kv <= max_tokens
    ]


def shape_for_checks(key: AttentionStaticKey, run_key: AttentionRunKey) -> DecodeShape:
    """The DecodeShape an op's config rules see for a stored key: what they read (query
    length, heads, sinks, causal, page size) as stored; what a DecodeShape cannot say
    (mixed dtypes, descales) approximated."""
    return DecodeShape(
        batch=run_key.batch, kv_len=max(run_key.kv_len_bucket, run_key.max_q_len), q_len=run_key.max_q_len,
        num_q_heads=key.num_q_heads, num_kv_heads=key.num_kv_heads, head_dim=key.head_dim_qk,
        page_size=max(key.page_size, 1), dtype=key.q_dtype if key.q_dtype in DTYPES else "bfloat16",
        causal=key.causal, window=(key.window_left, key.window_right), softcap=SOFTCAP_WHEN_ON if key.softcap else 0.0,
        sinks=key.sinks,
    )


SOFTCAP_WHEN_ON = 50.0  # a static key says only that softcap is on; the kernels do not care how much


def shape_from_keys(static_key_json: str, run_key: AttentionRunKey) -> DecodeShape | None:
    """The DecodeShape a sweep measures for a stored (static key, run key), at the top of the
    kv bucket; None when the key is not one a sweep can build (mixed dtypes, head dims or
    descales, no paging)."""
    try:
        key = AttentionStaticKey.from_json(static_key_json)
    except (ValueError, TypeError, KeyError):
        return None
    if (len({key.q_dtype, key.k_dtype, key.v_dtype}) != 1 or key.q_dtype not in DTYPES
            or key.head_dim_qk != key.head_dim_v or key.k_descale or key.v_descale or key.page_size < 1):
        return None
    try:
        return DecodeShape(
            batch=run_key.batch, kv_len=max(run_key.kv_len_bucket, run_key.max_q_len), q_len=run_key.max_q_len,
            num_q_heads=key.num_q_heads, num_kv_heads=key.num_kv_heads, head_dim=key.head_dim_qk,
            page_size=key.page_size, dtype=key.q_dtype, causal=key.causal,
            window=(key.window_left, key.window_right), softcap=SOFTCAP_WHEN_ON if key.softcap else 0.0,
            sinks=key.sinks,
        )
    except (TypeError, ValueError):
        return None
