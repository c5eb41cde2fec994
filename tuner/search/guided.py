"""Guided search, for dense grids (a serving grid's every capture batch size): shapes whose
batch is a power of two are the anchors, searched as halving searches, over every candidate;
every other shape only over the configs that ranked best in the quick rung at its nearest
anchors below and above its batch (same static key, query length, kv length and kind of
batch) and the default, halving among those. A winner moves slowly with the
batch size (the split count roughly halves as the batch doubles), so the anchors' leaders
hold the in-between shapes' winners at a fraction of the measurements; where a family has
no anchor measured, a shape is searched over every candidate."""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING, Sequence

from tuner import settings
from tuner.bench import OK, Outcome, with_default_first
from tuner.keys import canonical_json
from tuner.search.base import Config
from tuner.search.halving import Halving

if TYPE_CHECKING:  # search composes ops, never imports them to run
    from tuner.workload.shapes import DecodeShape

# (static key, query length, kv length, kind of batch): the shapes a guide compares
Family = tuple[str, int, int, str]
# (static key, query length, kind of batch, batch): one batch size's anchors at every kv length
BatchRow = tuple[str, int, str, int]


def is_anchor(batch: int) -> bool:
    return batch >= 1 and batch & (batch - 1) == 0


def _family(shape: DecodeShape) -> Family:
    return shape.static_key().to_json(), shape.q_len, shape.kv_len, shape.lengths


def _batch_row(shape: DecodeShape) -> BatchRow:
    return shape.static_key().to_json(), shape.q_len, shape.lengths, shape.batch


def _split_knob(config: Config) -> str | None:
    """The knob that counts a config's splits (settings.SPLIT_KNOBS), if it has a fixed count."""
    if config.get("tokens_per_split") or config.get("items_per_sm"):
        return None
    for knob in settings.SPLIT_KNOBS:
        value = config.get(knob)
        if type(value) is int and 0 < value <= 1 << 20:  # beyond any rule's range: not scaled
            return knob
    return None


def _without(config: Config, knob: str) -> str:
    return canonical_json({k: v for k, v in config.items() if k != knob})


def scaled_splits(leader: Config, from_batch: int, to_batch: int, configs: list[Config]) -> list[Config]:
    """The configs that differ from leader only in its split count, nearest (in octaves) to
    its count x from_batch / to_batch: one, or the two either side of it where they lie within
    0.1 octave of equally far; none where
    leader has no fixed split count or configs hold no such sibling."""
    knob = _split_knob(leader)
    if knob is None:
        return []
    rest = _without(leader, knob)
    siblings = sorted(((c[knob], c) for c in configs if _split_knob(c) == knob and _without(c, knob) == rest),
                      key=lambda pair: pair[0])
    if not siblings:
        return []
    target = math.log2(leader[knob] * from_batch / to_batch)
    lower = [c for s, c in siblings if math.log2(s) <= target]
    upper = [c for s, c in siblings if math.log2(s) >= target]
    if lower and upper and lower[-1] is not upper[0]:
        a, b = lower[-1], upper[0]
        gap_a, gap_b = target - math.log2(a[knob]), math.log2(b[knob]) - target
        return [a, b] if abs(gap_a - gap_b) < 0.1 else [a if gap_a < gap_b else b]
    return [lower[-1]] if lower else [upper[0]]


def _distinct(configs: list[Config]) -> list[Config]:
    """configs without repeats (a stored anchor's winner leads its list and is often also its
    fastest timed one)."""
    unique: dict[str, Config] = {}
    for config in configs:
        unique.setdefault(canonical_json(config), config)
    return list(unique.values())


class Guide:
    """What one sweep's anchors taught it: per family, per anchor batch, its leading configs.

    across_kv (the dense passes' guide): an anchor too is searched over a shortlist, where an
    anchor of its batch at another kv length is recorded: that one's leaders and those of the
    nearest anchors of its own family (settings.GUIDED_ACROSS_KV says what it cost and saved)."""

    def __init__(self, keep: int | None = None, *, across_kv: bool = False) -> None:
        self.keep = settings.GUIDED_KEEP if keep is None else keep
        self.across_kv = across_kv
        self._leaders: dict[Family, dict[int, list[Config]]] = {}
        self._by_kv: dict[BatchRow, dict[int, list[Config]]] = {}  # -> kv length -> leaders

    @staticmethod
    def order(shapes: Sequence[DecodeShape]) -> list[int]:
        """The shapes' indices, anchors first, each group in the given order."""
        return sorted(range(len(shapes)), key=lambda i: not is_anchor(shapes[i].batch))

    def record(self, shape: DecodeShape, outcomes: Sequence[Outcome], winner: Config | None = None) -> None:
        """An anchor's outcomes (its quick rung, or what a DB stored of it): its leaders are
        its `keep` fastest correct configs, and its winner when given (a stored one; a sweep
        gives none for a shape it measures, since only rank 0 holds that before the ranks
        meet). Other shapes teach nothing."""
        if not is_anchor(shape.batch):
            return
        ok = sorted((o for o in outcomes if o.status == OK and o.timing is not None), key=lambda o: o.timing.median_us)
        leaders = ([winner] if winner is not None else []) + [o.config for o in ok[:self.keep]]
        if leaders:
            self._leaders.setdefault(_family(shape), {})[shape.batch] = leaders
            if self.across_kv:
                self._by_kv.setdefault(_batch_row(shape), {})[shape.kv_len] = leaders

    def shortlist(self, shape: DecodeShape, configs: list[Config]) -> list[Config]:
        """The candidates to search for shape (configs: all of them, the default first): for
        an anchor all (with across_kv: _anchor_shortlist), and for a shape whose family has
        no anchor yet; else the default and the leaders of the nearest anchor on each side
        that are among configs, and for the first settings.GUIDED_SCALED of each, the config
        of its split count scaled to the shape's batch (scaled_splits)."""
        anchors = self._leaders.get(_family(shape), {})
        if is_anchor(shape.batch):
            return self._anchor_shortlist(shape, configs, anchors) if self.across_kv else configs
        if not anchors:
            return configs
        return self._from_leaders(shape, configs, [], anchors)

    def _anchor_shortlist(self, shape: DecodeShape, configs: list[Config],
                          anchors: dict[int, list[Config]]) -> list[Config]:
        """An anchor's shortlist: the leaders of the nearest anchor of its batch at another kv
        length on each side, within settings.GUIDED_ACROSS_KV_OCTAVES of its own, and the
        nearest anchors of its family; all configs where no such anchor is recorded."""
        by_kv = self._by_kv.get(_batch_row(shape), {})
        kvs = sorted(k for k in by_kv if k != shape.kv_len)
        at = bisect.bisect_left(kvs, shape.kv_len)
        across = [by_kv[k] for k in kvs[max(0, at - 1):at + 1]
                  if abs(math.log2(k / shape.kv_len)) <= settings.GUIDED_ACROSS_KV_OCTAVES]
        if not across:
            return configs
        return self._from_leaders(shape, configs, across, {b: c for b, c in anchors.items() if b != shape.batch})

    @staticmethod
    def _from_leaders(shape: DecodeShape, configs: list[Config], across: list[list[Config]],
                      anchors: dict[int, list[Config]]) -> list[Config]:
        """The default, the leaders in across and those of the anchors nearest shape's batch
        on each side, and for the first settings.GUIDED_SCALED of the latter, the config of its
        split count scaled to the shape's batch (scaled_splits); all configs where none of
        them can run the shape."""
        batches = sorted(anchors)
        at = bisect.bisect_left(batches, shape.batch)
        near = batches[max(0, at - 1):at + 1]
        allowed = {canonical_json(c): c for c in configs}
        picked = [allowed[k] for leaders in across + [anchors[b] for b in near]
                  for k in map(canonical_json, leaders) if k in allowed]
        if not picked:  # none of the leaders can run this shape: search it all
            return configs
        scaled = [c for b in near for leader in _distinct(anchors[b])[:settings.GUIDED_SCALED]
                  for c in scaled_splits(leader, b, shape.batch, configs)]
        return with_default_first(configs[0], picked + scaled)


class Guided(Halving):
    """Halving, with a Guide across a sweep's shapes (a tuner.search.base.GuidesShapes)."""

    name = "guided"
    description = "halving on power-of-two batches; other batches over their neighbours' leaders"

    def guide(self, *, across_kv: bool = False) -> Guide:
        return Guide(across_kv=across_kv)


STRATEGY = Guided()
