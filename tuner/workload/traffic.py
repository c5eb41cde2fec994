"""Decode batches as servers make them: per-sequence kv lengths drawn from named
distributions, and the batch sizes a server captures CUDA graphs for."""

from __future__ import annotations

import math
import random
from typing import Any, Callable

from tuner import settings
from tuner.keys import kv_bucket_low
from tuner.workload.shapes import DecodeShape

# SGLang's default CUDA-graph batch sizes (its --cuda-graph-bs): 1-8, 12, 16, then every 8 to 256
CAPTURE_BATCHES: tuple[int, ...] = tuple(range(1, 9)) + (12, 16) + tuple(range(24, 257, 8))
MIN_LEN = 16  # a sequence in decode holds at least its prompt
# the kv buckets of a serving grid, 32-128k: below 1k too, since a batch of a few short
# sequences is where FA3's default loses most (docs/decisions.md, "kv buckets and run keys")
SERVING_KV = tuple(2**i for i in range(5, 18))


def _at_least(n: float, cap: int) -> int:
    return int(min(cap, max(MIN_LEN, n)))


def _uniform(rng: random.Random, batch: int, cap: int) -> list[int]:
    """Each length uniform in [cap/2, cap]: a steady load of similar requests."""
    return [rng.randint(_at_least(cap // 2, cap), cap) for _ in range(batch)]


def _long_tail(rng: random.Random, batch: int, cap: int) -> list[int]:
    """Log-normal, median cap/8 (sigma 1.2), clipped to [MIN_LEN, cap]: chat traffic, most
    requests short, a few near the cap."""
    median = math.log(max(cap / 8, MIN_LEN))
    return [_at_least(round(math.exp(rng.gauss(median, 1.2))), cap) for _ in range(batch)]


def _few_long(rng: random.Random, batch: int, cap: int) -> list[int]:
    """One in eight (at least one) long, in [3cap/4, cap]; the rest short, in [cap/64, cap/16]:
    a long-document request among many short ones."""
    long = max(1, batch // 8)
    lens = [rng.randint(_at_least(3 * cap // 4, cap), cap) for _ in range(long)]
    lens += [rng.randint(_at_least(cap // 64, cap), _at_least(cap // 16, cap)) for _ in range(batch - long)]
    rng.shuffle(lens)
    return lens


DISTRIBUTIONS: dict[str, Callable[[random.Random, int, int], list[int]]] = {
    "uniform": _uniform,
    "long_tail": _long_tail,
    "few_long": _few_long,
}


def draw_lengths(distribution: str, batch: int, cap: int, seed: int) -> list[int]:
    """batch kv lengths, each in [min(MIN_LEN, cap), cap], from a named distribution;
    the same arguments give the same lengths."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution {distribution!r} is not one of {', '.join(DISTRIBUTIONS)}")
    if batch < 1 or cap < 1:
        raise ValueError(f"batch and cap must be >= 1, got {batch}, {cap}")
    lens = DISTRIBUTIONS[distribution](random.Random(f"{distribution}/{batch}/{cap}/{seed}"), batch, cap)
    return lens


def is_dense(lengths_sum: int, batch: int, max_kv_len: int) -> bool:
    """Whether a batch is dense: its lengths sum to at least settings.DENSE_FILL of batch x
    its longest (max_kv_len: a bound of the longest; one above it reads as less dense)."""
    return lengths_sum >= settings.DENSE_FILL * batch * max_kv_len


def _into_bucket(lens: list[int], kv_len: int, salt: str) -> list[int]:
    """lens with its longest moved into kv_len's bucket (above half its top) if it fell below."""
    low = kv_bucket_low(kv_len)
    longest = max(range(len(lens)), key=lens.__getitem__)
    if lens[longest] < low:
        lens[longest] = random.Random(f"longest/{salt}").randint(min(low, kv_len), kv_len)
    return lens


def draws_per_distribution(batch: int) -> int:
    """How many batches of each distribution a serving shape's trial draws: enough to hold
    settings.TRIAL_MIN_SEQUENCES sequences (see there)."""
    return max(1, -(-settings.TRIAL_MIN_SEQUENCES // max(batch, 1)))


def _draw_seed(seed: int, j: int) -> int:
    """The seed of a distribution's j-th batch: the first keeps the trial's own seed."""
    return seed + j * settings.TRIAL_DRAW_SEED_STRIDE


def dense_draws(batch: int, kv_len: int, seed: int) -> list[list[int]]:
    """The dense batches (is_dense) of a serving shape's dense pass, their longest in kv_len's
    bucket: one uniform in [kv_len/2, kv_len] (fill about 3/4) and one uniform in
    [kv_len/8, kv_len] (about 9/16), so both ends of the dense range are measured, each
    draws_per_distribution(batch) times; a draw that is not dense is drawn again, at most
    16 times, then taken from the first kind."""
    draws = []
    for j in range(draws_per_distribution(batch)):
        at = _draw_seed(seed, j)
        for low_share in (2, 8):
            rng = random.Random(f"dense/{low_share}/{batch}/{kv_len}/{at}")
            for _ in range(16):
                lens = [rng.randint(_at_least(kv_len // low_share, kv_len), kv_len) for _ in range(batch)]
                lens = _into_bucket(lens, kv_len, f"dense/{low_share}/{batch}/{kv_len}/{at}")
                if is_dense(sum(lens), batch, max(lens)):
                    break
            else:
                lens = _into_bucket(_uniform(rng, batch, kv_len), kv_len, f"dense/{batch}/{kv_len}/{at}")
            draws.append(lens)
    return draws


def equal_draw(batch: int, kv_len: int, seed: int) -> list[int]:
    """A serving shape's guard batch: every sequence at one length, drawn in kv_len's bucket.
    FA3's scheduler gives like sequences like splits, evenly over the SMs, where the
    distributions' spread lengths leave it a ragged last wave; a config that beats FA3 on the
    spread batches can lose to it here (by 14-18% at batch 4 x 32k and 128k on the H200), and
    such batches occur: one prompt length for a whole batch (SGLang's bench_one_batch, offline
    jobs). So a winner must also lose nowhere on it (tuner.bench.trial.Guard)."""
    low = kv_bucket_low(kv_len)
    return [random.Random(f"equal/{batch}/{kv_len}/{seed}").randint(min(low, kv_len), kv_len)] * batch


def serving_draws(batch: int, kv_len: int, seed: int, reach_top: bool = False) -> list[list[int]]:
    """A serving shape's batches (DecodeShape.lengths "serving"): one of each distribution, capped
    at kv_len, each with its longest sequence moved into kv_len's bucket (above half its top)
    if it fell below, so the call keys where the shape does; all of that
    draws_per_distribution(batch) times, the first round with the seed itself. reach_top:
    the first batch's longest at kv_len itself, the bucket's top, which a small batch's
    draws may all miss."""
    low = kv_bucket_low(kv_len)
    draws = []
    for j in range(draws_per_distribution(batch)):
        at = _draw_seed(seed, j)
        for name in DISTRIBUTIONS:
            lens = draw_lengths(name, batch, kv_len, at)
            longest = max(range(batch), key=lens.__getitem__)
            if lens[longest] < low:
                lens[longest] = random.Random(f"longest/{name}/{batch}/{kv_len}/{at}").randint(min(low, kv_len), kv_len)
            if reach_top and not draws:
                lens[longest] = kv_len
            draws.append(lens)
    return draws


def serving_grid(batches: tuple[int, ...] = CAPTURE_BATCHES, kv_lens: tuple[int, ...] = SERVING_KV,
                 max_tokens: int = 4 * 2**20, **common: Any) -> list[DecodeShape]:
    """A static key's serving grid: every capture batch size x kv bucket (batch x kv <=
    max_tokens), each shape a mix of serving batches (DecodeShape.lengths "serving")."""
    return [DecodeShape(batch=b, kv_len=kv, lengths="serving", **common)
            for b in batches for kv in kv_lens if b * kv <= max_tokens]


# the capture bounds of a graph grid (a server's max context): a graph record serves a
# capture whose bound falls in the same kv bucket
GRAPH_BOUNDS = (8192, 32768, 131072)


def graph_caps(batch: int, bound: int) -> list[int]:
    """The caps of the batches a graph captured at `bound` replays: one per octave, the
    bound's and settings.GRAPH_OCTAVES - 1 below it (at least MIN_LEN), each with batch x cap
    within settings.GRAPH_MAX_TOKENS (the smallest cap always). Every octave weighs alike:
    nothing says where a deployment's longest sequences fall."""
    caps = sorted({max(MIN_LEN, bound >> i) for i in range(settings.GRAPH_OCTAVES)} | {bound})
    fitting = [c for c in caps if batch * c <= settings.GRAPH_MAX_TOKENS]
    return fitting or caps[:1]


def graph_draws(batch: int, bound: int, seed: int) -> list[list[int]]:
    """The lengths a graph captured at `bound` for `batch` sequences replays (DecodeShape.lengths
    "graph"): a batch of each distribution at each of graph_caps."""
    return [draw_lengths(name, batch, min(cap, bound), seed) for cap in graph_caps(batch, bound)
            for name in DISTRIBUTIONS]


def graph_grid(batches: tuple[int, ...] = CAPTURE_BATCHES, bounds: tuple[int, ...] = GRAPH_BOUNDS,
               **common: Any) -> list[DecodeShape]:
    """A static key's graph grid: every capture batch size x capture bound, each shape the
    batches its graph replays (DecodeShape.lengths "graph")."""
    return [DecodeShape(batch=b, kv_len=bound, lengths="graph", **common) for b in batches for bound in bounds]
