"""A server's own replays judge each graph variant against its batch size's base graph.

A variant's configs won their trials (tuner.sweep) on batches tuner built, and a server's
batches can differ in ways no trial held: one prompt length for a whole batch, the page
table's layout, the kernels of the step around attention. Inside SGLang at batch 8 x 32k a
variant that had won its trials ran the whole decode step ~4% slower than FA3's default
(docs/decisions.md, "Graph variants"). So the server's first replays of each variant decide:
they alternate with the base graph (what the server runs without tuner) over the same class
of lengths, a pair of CUDA events timing each replay; once `pairs` variant replays each have
a base replay just before them, a variant whose median time ratio to those exceeds
1 + tolerance is dropped, and its steps replay the base graph from then on.

Consecutive steps of a server differ by a token per sequence, so a pair compares like with
like. No step waits for the GPU: an event's time is read only once query() says the event
is done, at a later step. While a verdict is pending a step costs two event records on the
host; after, nothing. Only a process that decides alone may judge: ranks that replay one
graph together (tensor parallelism) could reach different verdicts from their own timings.
"""

from __future__ import annotations

import statistics
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tuner import settings

if TYPE_CHECKING:
    from tuner.integrations.graph_variants import GraphVariants

VariantKey = tuple[int, str]  # (batch size, variant label)


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


@dataclass
class Timed:
    """One replay being timed: its variant (or the base graph of that class), its events."""

    key: VariantKey
    variant: bool
    start: Any
    end: Any = None


@dataclass
class _Tally:
    steps: int = 0  # replays of this class so far: even ones run the base graph, odd ones the variant
    last_base_ms: float | None = None
    ratios: list[float] = field(default_factory=list)


class ReplayJudge:
    """Alternates each variant with the base graph over its first replays and gives the
    verdict (on_drop(batch, label, median ratio) for a variant that lost). pairs 0: judges
    nothing, every variant replays as planned."""

    def __init__(self, pairs: int, tolerance: float, on_drop: Callable[[int, str, float], None],
                 event: Callable[[], Any] = _cuda_event) -> None:
        self.pairs, self.tolerance, self._on_drop, self._event = pairs, tolerance, on_drop, event
        self._tallies: dict[VariantKey, _Tally] = {}
        self.verdicts: dict[VariantKey, float] = {}  # each judged variant's median ratio to the base graph
        self._in_flight: deque[Timed] = deque()

    @classmethod
    def for_variants(cls, variants: GraphVariants, event: Callable[[], Any] = _cuda_event) -> ReplayJudge:
        """The judge of a server's graph variants: $TUNER_REPLAY_JUDGE pairs (settings), a
        variant that loses dropped from `variants` with a warning (drop_variant)."""
        return cls(settings.replay_judge_pairs(), settings.REPLAY_JUDGE_TOLERANCE,
                   on_drop=lambda batch, label, ratio: drop_variant(variants, batch, label, ratio), event=event)

    @contextmanager
    def replaying(self, batch: int, label: str | None) -> Iterator[str | None]:
        """Around a replay a server runs itself: gives the label to replay (label, or None for
        the base graph: on every other step while the variant is judged, and once it has been
        dropped) and times the replay where it is judged.

            label = variants.label(bs, seq_lens_cpu)
            with judge.replaying(bs, label) as chosen:
                graphs[bs, chosen].replay()
        """
        if self._in_flight:
            self.collect()
        if label is None or not self.judging(batch, label):
            yield None if label is not None and self.dropped(batch, label) else label
            return
        variant = self.replays_variant(batch, label)
        timed = self.start(batch, label, variant)
        yield label if variant else None
        self.finish(timed)

    def dropped(self, batch: int, label: str) -> bool:
        """Whether the variant was judged slower than the base graph."""
        return self.verdicts.get((batch, label), 0.0) > 1 + self.tolerance

    def replays_variant(self, batch: int, label: str) -> bool:
        """Whether this step of the variant's class replays the variant (else the base graph):
        always once judged; while judged, every other step, the base graph first."""
        key = (batch, label)
        if self.pairs <= 0 or key in self.verdicts:
            return True
        tally = self._tallies.setdefault(key, _Tally())
        tally.steps += 1
        return tally.steps % 2 == 0

    def judging(self, batch: int, label: str) -> bool:
        return self.pairs > 0 and (batch, label) not in self.verdicts

    def start(self, batch: int, label: str, variant: bool) -> Timed:
        """Before the replay: its start event, recorded on the current stream."""
        start = self._event()
        start.record()
        return Timed((batch, label), variant, start)

    def finish(self, timed: Timed) -> None:
        """After the replay: its end event; read at a later step (collect)."""
        timed.end = self._event()
        timed.end.record()
        self._in_flight.append(timed)

    def collect(self) -> None:
        """Read the replays whose events are done, in the order they ran, and give verdicts."""
        while self._in_flight and self._in_flight[0].end.query():
            timed = self._in_flight.popleft()
            if timed.key in self.verdicts:
                continue
            tally = self._tallies[timed.key]
            ms = timed.start.elapsed_time(timed.end)
            if not timed.variant:
                tally.last_base_ms = ms
            elif tally.last_base_ms:
                tally.ratios.append(ms / tally.last_base_ms)
                tally.last_base_ms = None
                if len(tally.ratios) >= self.pairs:
                    self._decide(timed.key, statistics.median(tally.ratios))

    @property
    def in_flight(self) -> bool:
        return bool(self._in_flight)

    def _decide(self, key: VariantKey, ratio: float) -> None:
        self.verdicts[key] = ratio
        del self._tallies[key]
        if ratio > 1 + self.tolerance:
            self._on_drop(*key, ratio)


def drop_variant(variants: GraphVariants, batch: int, label: str, ratio: float) -> None:
    """A verdict against a variant: its steps replay the batch size's graph from now on."""
    variants.drop(batch, label)
    warnings.warn(f"tuner: graph variant {label} of batch size {batch} ran {ratio:.3f}x the time of the batch "
                  "size's graph over its first replays here; its steps replay that graph", RuntimeWarning,
                  stacklevel=2)


__all__ = ["ReplayJudge", "Timed", "drop_variant"]
