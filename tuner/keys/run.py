"""The run key of an attention call: (batch, max q len, kv length bucket), each its own field.

Bucketing: a kv length L falls in the bucket ``kv_len_bucket(L)``, the smallest power of
two >= L (0 and 1 both fall in bucket 1); ``kv_bucket_exponent(L)`` is its log2 and
``kv_bucket_low(L)`` its first length. A bucket is therefore an upper bound of every
length in it, and lengths in different buckets never share one. These are the one
spelling of a bucket, but for two hot paths that inline the exponent (the runtime's memo
key, decode_attention's fallback key), which tests hold to it.

Nearest neighbour, used when the DB holds no record for the exact run key of a call whose
static key it does hold: among the records of that static key, take those with the
nearest max q len (the number of query tokens changes the kernel's work the most), then
the smallest ``|log2 batch ratio| + |log2 kv bucket ratio|``; ties go to the larger
batch, then the larger kv bucket (the upper bound), so the choice is deterministic.
A neighbour farther than ``max_distance`` octaves in batch + kv is not used at all.

Borrowing (tuner.runtime.borrowing): a neighbour's config is used only when every neighbour at that
smallest distance beat its own default by at least 10% (tuner.settings.BORROW_MIN_GAIN); else the
call runs the default: split-KV configs tuned for one batch size often lose to the default
one octave away, most of all where the neighbour's own gain was small (docs/decisions.md,
"Borrowing").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tuner import settings
from tuner.keys.canonical import canonical_json, count

# Above this the SQLite/PostgreSQL 64-bit integer columns would overflow.
KV_BUCKET_MAX = 2**62


def _count(value: Any, arg: str, minimum: int) -> int:
    return count(value, arg, minimum, KV_BUCKET_MAX)


def kv_bucket_exponent(kv_len: int) -> int:
    """log2 of kv_len's bucket (0 for 0 and 1): the bit length of kv_len - 1."""
    return max(_count(kv_len, "kv_len", 0) - 1, 0).bit_length()


def kv_len_bucket(kv_len: int) -> int:
    """Smallest power of two >= kv_len (1 for 0 and 1): its bucket's top."""
    return 1 << kv_bucket_exponent(kv_len)


def kv_bucket_low(kv_len: int) -> int:
    """The first length of kv_len's bucket: half its top, plus one (1 in bucket 1)."""
    return kv_len_bucket(kv_len) // 2 + 1


@dataclass(frozen=True, order=True)
class AttentionRunKey:
    batch: int
    max_q_len: int
    kv_len_bucket: int

    def to_dict(self) -> dict[str, int]:
        return {"batch": self.batch, "max_q_len": self.max_q_len, "kv_len_bucket": self.kv_len_bucket}

    def to_json(self) -> str:
        return canonical_json(self.to_dict())


def visible_kv_len(max_kv_len: int, max_q_len: int, window_left: int) -> int:
    """The most keys a call's queries can see: a sliding window of window_left keys left of
    each query caps them at window_left + max_q_len, however long the sequences are (the
    queries are the last tokens: no key lies to their right). What a call reads (kernels
    plan splits by it); run keys bucket the longest sequence instead, since of a mixed batch
    past the window the shorter sequences read less, and one record for every length past
    the window fit none of them (docs/decisions.md, "kv buckets and run keys")."""
    return max_kv_len if window_left < 0 else min(max_kv_len, window_left + max_q_len)


def attention_run_key(batch: int, max_q_len: int, max_kv_len: int) -> AttentionRunKey:
    """Run key from host-side values only (never read a GPU tensor to build one)."""
    return AttentionRunKey(
        batch=_count(batch, "batch", 1),
        max_q_len=_count(max_q_len, "max_q_len", 1),
        kv_len_bucket=kv_len_bucket(max_kv_len),
    )


def run_key_distance(a: AttentionRunKey, b: AttentionRunKey) -> tuple[float, float]:
    """(q len distance, batch + kv distance), in octaves; compare as a tuple."""
    return (
        abs(math.log2(a.max_q_len) - math.log2(b.max_q_len)),
        abs(math.log2(a.batch) - math.log2(b.batch))
        + abs(math.log2(a.kv_len_bucket) - math.log2(b.kv_len_bucket)),
    )


def nearest_run_keys(
    target: AttentionRunKey, candidates: Any, max_distance: float = settings.MAX_DISTANCE,
    max_q_distance: float = settings.MAX_Q_DISTANCE,
) -> list[AttentionRunKey]:
    """Every candidate at the smallest distance from target (nearest q len, then fewest
    octaves of batch + kv), the tie rule's choice first; [] when none is near enough.

    Candidates more than max_q_distance octaves away in max q len, or more than
    max_distance octaves away in batch + kv, are never used.
    """
    near: list[tuple[tuple[float, float], AttentionRunKey]] = []
    for cand in candidates:
        q_dist, dist = run_key_distance(target, cand)
        if q_dist <= max_q_distance and dist <= max_distance:
            near.append(((q_dist, dist), cand))
    if not near:
        return []
    best = min(d for d, _ in near)
    return sorted((c for d, c in near if d == best), key=lambda c: (-c.batch, -c.kv_len_bucket))


def nearest_run_key(
    target: AttentionRunKey, candidates: Any, max_distance: float = settings.MAX_DISTANCE,
    max_q_distance: float = settings.MAX_Q_DISTANCE,
) -> AttentionRunKey | None:
    """The candidate nearest to target by the policy in this module's docstring, or None."""
    near = nearest_run_keys(target, candidates, max_distance, max_q_distance)
    return near[0] if near else None
