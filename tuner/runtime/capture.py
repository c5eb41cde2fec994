"""CUDA-graph capture with declared lengths: a config frozen into a graph at capture is
chosen for the lengths its replays will see, not for the capture-time bound.

A server captures one decode graph per batch size with its max context as the bound
(max_kv_len, page-table width) and replays it over every length mix; keyed on that bound,
the lookup serves what suits the longest possible batch for every replay. Inside
graph_capture(lengths), a tuned call (and the FlashInfer wrappers' plan lookup) keys its kv
length on the declaration instead: an int
(the typical longest sequence of a batch), or sample lengths of the deployment's traffic
(per sequence; for a batch of b the key is the length-weighted median of the
longest of b draws). Inside graph_capture() with no lengths, and in a CUDA-graph capture
outside it (also for a call memoised before it: tuner.runtime.decorator.CaptureSensitive),
the lengths are unknown: a stored config is
kept only where it is the winner at every kv bucket from settings.FROZEN_FROM_KV up to the
bound, else the default runs (tuner.runtime.borrowing.choose_frozen). Every config of the ops tuner ships runs correctly
at any length up to the bound the call passes, so only speed depends on the choice.
"""

from __future__ import annotations

import operator
import random
from collections import Counter
from collections.abc import Mapping, Set as AbstractSet
from contextlib import contextmanager
from itertools import accumulate
from typing import Iterable, Iterator

from tuner.errors import TunerError
from tuner.keys import kv_bucket_low, kv_len_bucket
from tuner.runtime.state import runtime


FILL_DRAWS = 64  # the batches DeclaredLengths.fill_share draws
# sample lengths are kept as distinct values with counts, so a new batch size costs one pass
# over them, not over every sample of a long trace. Past this many distinct values, each kv
# bucket's range is cut into SUMMARY_BINS equal parts held by their longest sample: a bucket
# never mixes with another, and the key stays in its bucket.
MAX_DISTINCT = 4096
SUMMARY_BINS = 128


def _summary(values: list[int]) -> tuple[list[int], list[int]]:
    """(distinct lengths ascending, how many samples each stands for), at most about
    SUMMARY_BINS per octave of length once there are over MAX_DISTINCT of them."""
    distinct = sorted(Counter(values).items())
    if len(distinct) <= MAX_DISTINCT:
        return [v for v, _ in distinct], [c for _, c in distinct]
    lengths: list[int] = []
    counts: list[int] = []
    last = None
    for v, c in distinct:
        low, top = kv_bucket_low(v), kv_len_bucket(v)
        width = top - low + 1  # the bucket's lengths, in SUMMARY_BINS bins
        part = (top, -(-(v - low + 1) * SUMMARY_BINS // width))
        if part == last:
            lengths[-1] = v  # ascending: the bin's longest sample holds it
            counts[-1] += c
        else:
            lengths.append(v)
            counts.append(c)
            last = part
    return lengths, counts


class DeclaredLengths:
    """The kv lengths a deployment's graphs will see: one typical batch maximum, or samples
    of per-sequence lengths; or None, unknown (known is False). Samples are held as distinct
    lengths (`lengths`, ascending) with how many samples each stands for (`counts`)."""

    records_misses = True  # calls captured under it record their misses: the lengths are the traffic's
    # the num_splits a wave_fit FA3 config runs in a graph captured under it (0: FA3's own
    # choice); set by a graph variant made for the steps whose FA3 tiles fit that cap
    fa3_cap = 0
    # whether FA3's plain default runs at fa3_cap too (a cap graph of a batch size whose steps
    # run FA3's default: tuner.integrations.graph_variants, which checks the graph's calls
    # first); every FA3-default call under it is capped, a caller's explicit config= too
    default_capped = False

    def __init__(self, lengths: int | Iterable[int] | None) -> None:
        self.known = lengths is not None
        self.per_sequence = False  # an int declares a batch's longest, not its sequences' lengths
        self._by_batch: dict[int, int] = {}
        self._fill_shares: dict[tuple[int, float], float] = {}
        self.lengths: list[int] = []
        self.counts: list[int] = []
        if lengths is None:
            return
        refused = TunerError(f"graph_capture(lengths): an int or integer sample lengths, got {lengths!r:.60}")
        if isinstance(lengths, (bool, str, bytes)):
            raise refused
        if isinstance(lengths, (Mapping, AbstractSet)):  # iterating one gives keys, or each value once
            raise TunerError(f"graph_capture(lengths): sample lengths as a list or array (one entry per "
                             f"sequence), not a {type(lengths).__name__}")
        try:
            values = [operator.index(lengths)]  # an int, or an integer-like (numpy)
        except TypeError:
            try:
                items = list(lengths)  # type: ignore[arg-type]
            except TypeError:
                raise refused from None
            if any(isinstance(n, bool) for n in items):
                raise refused
            try:
                values = [operator.index(n) for n in items]
            except TypeError:
                raise refused from None
            self.per_sequence = True
        if not values or min(values) < 1:
            raise TunerError("graph_capture(lengths): at least one length, each >= 1")
        self.lengths, self.counts = _summary(values)
        self._cumulative = list(accumulate(self.counts))

    def kv_len(self, batch: int) -> int:
        """The kv length a batch of `batch` draws is keyed on: the median of its longest
        sequence (P(max <= x) = F(x)^batch) weighted by that length, since a batch's time
        grows with its longest sequence: the rare long batches, which take the most time,
        get their config rather than the many short ones."""
        kv = self._by_batch.get(batch)
        if kv is None:
            n, b = self._cumulative[-1], max(batch, 1)
            # P(max is one of a length's samples), weighted by the length
            below = [0, *self._cumulative[:-1]]
            weights = [s * ((c / n) ** b - (lo / n) ** b) for s, lo, c in zip(self.lengths, below, self._cumulative)]
            half, total = sum(weights) / 2, 0.0
            kv = self.lengths[-1]
            for s, w in zip(self.lengths, weights):
                total += w
                if total >= half:
                    kv = s
                    break
            self._by_batch[batch] = kv
        return kv

    def fill_share(self, batch: int, fill: float) -> float | None:
        """The share of time spent in batches of `batch` draws whose lengths sum to at least
        fill x batch x their longest, each batch weighted by its longest (as kv_len weights
        them: a batch of short sequences alone, dense as it may be, takes little time), over
        FILL_DRAWS batches drawn alike each time; None where the declaration says nothing of
        each sequence's length (unknown, or an int). Unweighted, a few long among many short
        at batch 3 read as dense (two batches in three hold no long one) and captured a
        config that lost on the batches that do (docs/decisions.md, DECLARED_DENSE_SHARE)."""
        if not self.per_sequence:
            return None
        share = self._fill_shares.get((batch, fill))
        if share is None:
            rng, b = random.Random(batch), max(batch, 1)
            filled = total = 0
            for _ in range(FILL_DRAWS):
                # the same draws as from the samples themselves: sample i is drawn as floor(u n)
                lens = rng.choices(self.lengths, cum_weights=self._cumulative, k=b)
                longest = max(lens)
                total += longest
                filled += longest if sum(lens) >= fill * b * longest else 0
            share = self._fill_shares[(batch, fill)] = filled / total
        return share

    def __repr__(self) -> str:
        if not self.known:
            return "DeclaredLengths(unknown)"
        return f"DeclaredLengths({sum(self.counts)} samples, {self.lengths[0]}..{self.lengths[-1]})"


@contextmanager
def graph_capture(lengths: int | Iterable[int] | DeclaredLengths | None = None
                  ) -> Iterator[DeclaredLengths]:
    """Calls inside resolve their configs for the declared lengths (see the module's
    docstring; a DeclaredLengths is taken as it is), and nothing is tuned there. With no
    lengths (unknown), a call keeps a stored config only if it is the winner for its batch at
    every kv bucket from settings.FROZEN_FROM_KV up to the call's bound
    (tuner.runtime.borrowing.choose_frozen), else the default: a graph replayed
    over any length is never frozen with what suits only the longest; the memos resolved before are set aside and put
    back on exit (unless configure() ran inside: then they resolve anew), so calls outside
    resolve as before. Process-wide, like the runtime's mode: while it is active every
    thread's tuned calls key on the declaration. Not nestable."""
    declared = lengths if isinstance(lengths, DeclaredLengths) else DeclaredLengths(lengths)
    with runtime.memo_lock:
        if runtime.declared_lengths is not None:
            raise TunerError("graph_capture() is already active (it does not nest)")
        saved = {f: dict(f.memo) for f in list(runtime.functions)}
        for f in saved:
            f.memo.clear()
        generation = runtime.generation
        runtime.declared_lengths = declared
        runtime.epoch += 1
    try:
        yield declared
    finally:
        with runtime.memo_lock:
            runtime.declared_lengths = None
            runtime.epoch += 1
            for f in list(runtime.functions):
                f.memo.clear()
                if runtime.generation == generation:
                    f.memo.update(saved.get(f, {}))


def declared_kv_len(batch: int, kv_len: int) -> int:
    """The kv length a call keys on: its own, or inside graph_capture the declared one
    (never more than the call's bound)."""
    declared = runtime.declared_lengths
    return kv_len if declared is None or not declared.known else min(kv_len, declared.kv_len(batch))


__all__ = ["DeclaredLengths", "declared_kv_len", "graph_capture"]
