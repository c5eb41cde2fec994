"""Which stored winner serves a call: its exact run key's, else a neighbour's by the
borrowing rule, else none (the default runs).

The rule: among the winners of the call's static key, those at the nearest run key
(tuner.keys.run: nearest query length, then fewest octaves of batch + kv, at most
settings.MAX_DISTANCE away) are the neighbours; one is borrowed only if every neighbour at
that distance beat its own default by settings.BORROW_MIN_GAIN. A config tuned for one
batch size can lose to the default an octave away, most of all where its own gain was
small (docs/decisions.md, "Borrowing"). A config the call cannot run (`accepts` says so)
serves no call.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

from tuner import settings
from tuner.keys import AttentionRunKey, Config, canonical_json, nearest_run_keys



class Winner(NamedTuple):
    """A stored winner as the runtime serves it: its config and its gain over the default
    at its own key (winner_gain)."""

    config: Config
    gain: float


def winner_gain(median_us: float | None, default_median_us: float | None) -> float:
    """How much faster a winner ran than the default at its own key: default / winner time;
    infinite when the default did not run right (nothing to lose), 1.0 when unknown."""
    if default_median_us is None:
        return math.inf
    if not median_us or median_us <= 0:
        return 1.0
    return default_median_us / median_us


def choose(table: dict[AttentionRunKey, Winner], run: AttentionRunKey, *,
           max_distance: float = settings.MAX_DISTANCE,
           accepts: Callable[[Config], bool] | None = None) -> tuple[Config | None, str]:
    """The config for `run` from one static key's winners and how it was found: "exact",
    "nearest" (borrowed by the rule above) or "default" (None)."""
    winner = table.get(run)
    if winner is not None:
        return (winner.config, "exact") if accepts is None or accepts(winner.config) else (None, "default")
    near = nearest_run_keys(run, table, max_distance)
    if near and all(table[k].gain >= settings.BORROW_MIN_GAIN for k in near):
        config = table[near[0]].config
        if accepts is None or accepts(config):
            return config, "nearest"
    return None, "default"


def graph_record(table: dict[AttentionRunKey, Winner], run: AttentionRunKey) -> tuple[Winner, str] | None:
    """The graph record for a graph captured at run's bound: its own kv bucket's ("exact"),
    else the nearest larger bound's of the same batch and query length, at most
    settings.GRAPH_BORROW_OCTAVES above ("nearest"); None if neither. Only a larger bound
    lends: its record held against the default on every octave of lengths up to that bound,
    which holds all but the lowest of the smaller bound's; a smaller bound's never met the
    longer lengths a larger one replays."""
    for octave in range(settings.GRAPH_BORROW_OCTAVES + 1):
        winner = table.get(AttentionRunKey(run.batch, run.max_q_len, run.kv_len_bucket << octave))
        if winner is not None:
            return winner, "exact" if octave == 0 else "nearest"
    return None


def choose_frozen(table: dict[AttentionRunKey, Winner], run: AttentionRunKey, *,
                  accepts: Callable[[Config], bool] | None = None,
                  captured: Callable[[Config], Config] | None = None) -> tuple[Config | None, str]:
    """The config for a call frozen into a CUDA graph whose lengths are unknown (captured with
    only a bound: every length up to it will replay): the one config stored as the winner
    for the call's batch and query length at every kv bucket from settings.FROZEN_FROM_KV
    (or the call's own bucket, if lower) up to the call's own; none (the default) if the
    winners differ or any of those buckets has none, since an unmeasured length may be
    where it loses. How it was found is "exact" when the call's own key has a winner, else
    "default". The bound's winner frozen for all lengths can run at half the default's speed
    on short batches (docs/decisions.md, "The frozen rule for CUDA graphs").
    captured(config): the config a capture runs of a stored one (decode_attention's by_fill
    records run their config for any batch there); the winners are compared, and the one
    chosen returned, as captured."""
    found = "exact" if run in table else "default"
    top = run.kv_len_bucket
    bucket = min(settings.FROZEN_FROM_KV, top)
    configs = set()
    chosen: Config | None = None
    while bucket <= top:
        winner = table.get(AttentionRunKey(run.batch, run.max_q_len, bucket))
        if winner is None:
            return None, found
        chosen = winner.config if captured is None else captured(winner.config)
        configs.add(canonical_json(chosen))
        bucket *= 2
    if len(configs) != 1 or chosen is None or (accepts is not None and not accepts(chosen)):
        return None, found
    return chosen, found
