"""Every knob of tuner and every environment variable it reads, in one place. Imports
nothing of tuner's: any module may read it."""

from __future__ import annotations

import os
from dataclasses import dataclass

# -- environment variables -------------------------------------------------------------------

ENV_DB = "TUNER_DB"  # SQLAlchemy URL or SQLite path of the tuning DB
ENV_MODE = "TUNER_MODE"  # one of MODES
ENV_SHIPPED = "TUNER_SHIPPED"  # a *.tunings.json[.gz] file or directory, or one of SHIPPED_OFF

MODES = ("off", "lookup", "tune", "force")
DEFAULT_MODE = "lookup"
SHIPPED_OFF = ("off", "0", "none", "false", "no")


def env_db() -> str | None:
    """$TUNER_DB, None when unset or empty."""
    return os.environ.get(ENV_DB) or None


def env_mode() -> str:
    """$TUNER_MODE as given, lower-cased ("" when unset): the runtime checks it against MODES."""
    return os.environ.get(ENV_MODE, DEFAULT_MODE).strip().lower() or DEFAULT_MODE


def env_shipped() -> str | None:
    """$TUNER_SHIPPED, None when unset or empty."""
    return os.environ.get(ENV_SHIPPED) or None


# -- choosing winners ------------------------------------------------------------------------

# a winner must beat the library default by more than the noise and by this fraction of the
# default's time (sweep, tune mode, verification, the LightLLM export's pack_gqa stand-in)
MIN_GAIN = 0.01
# a winner on a serving trial's mix of batches must not lose to the default on any one of
# them by more than this (tuner.bench.decide), and up to this many challengers are confirmed
MAX_PART_LOSS = 0.02
CONFIRM_TRIES = 3
# a serving shape's winner is confirmed once more on a second trial, of lengths drawn with
# the sweep's seed plus this, one batch at the bucket's top (tuner.sweep.trials.build_second_trial,
# tuner.search.pipeline.confirm_again), and where it does not
# hold there the default stays: one draw per distribution crowned configs that lost on other
# draws of the same bucket (H200, serving_shipped_043d49c: a Triton config 5.6% ahead on its
# trial ran at 0.89x of the default on serving.py's lengths). Far from serving.py's seeds.
SECOND_TRIAL_SEED = 1_000_003
# a serving trial draws enough batches of each length distribution to hold at least this many
# sequences (batch 1: 4 batches each, 2-3: 2, 4 and up: 1; tuner.workload.traffic.draws_per_distribution),
# the later ones with the seed plus multiples of the stride: one length per distribution
# judged a batch-1 record by luck, since FA3's default time moves by +-5% from one length to
# the next (H200, benchmarks/results/h200/issue12/parts_b1_draws_df9ea65.json: a Triton
# record 3.6% ahead on its trials ran 1.001x of the default over 24 more lengths, 6 of them
# slower by more than 2%)
TRIAL_MIN_SEQUENCES = 4
TRIAL_DRAW_SEED_STRIDE = 7_919
# a batch whose kv lengths sum to at least this share of batch x its longest is dense: a
# decode_attention record may hold a config for dense calls besides the one for the rest
# (tuner.ops.decode_attention.fill_branch), since on the H200 an even-split Triton config
# won dense batches (1.32x, Llama 3.1 8B b3 kv16k) and lost on skewed ones of the same key,
# where one config per key kept FA3's default (serving_shipped_1d9cd51)
DENSE_FILL = 0.5
# inside tuner.graph_capture(lengths), a by_fill config's dense config is captured where at
# least this share of the time of the declared lengths' batches of the captured size (each
# weighted by its longest: tuner.runtime.capture.DeclaredLengths.fill_share) is in dense ones
DECLARED_DENSE_SHARE = 0.5
# the sweep's dense pass (tuner.sweep) draws its dense batches with the seed plus this
DENSE_TRIAL_SEED = 2_000_003
# nearest-key lookup (tuner.keys.run): octaves of batch + kv, and of query length, a stored
# winner may be from the call
MAX_DISTANCE = 2.0
MAX_Q_DISTANCE = 1.0
# a neighbour's winner is borrowed only if every neighbour at the smallest distance beat its
# own default by this much: a config tuned for one batch size can lose to the default an
# octave away (measured: benchmarks/results/h200/mixed_lengths_*.json)
BORROW_MIN_GAIN = 1.10
# the search a sweep runs unless told (tuner.search): halving, since it agreed with a precise
# exhaustive timing as well as exhaustive search did, at under half its GPU time (H200,
# benchmarks/results/h200/issue12/sweep_cost_*.json: within 2% on 12 of 12 serving shapes,
# 9.4 against 20.4 ms per candidate)
DEFAULT_STRATEGY = "halving"
# a config frozen into a graph of unknown lengths must have won at every kv bucket from this
# one up to the bound (tuner.runtime.borrowing.choose_frozen): a serving grid's first bucket
FROZEN_FROM_KV = 1024
# successive halving: the quick rung keeps the default and the configs within this fraction
# of the fastest, at most this many, for the full measurement
HALVING_KEEP = 0.10
HALVING_MAX_KEEP = 6
# guided search (tuner.search.guided): a shape between two anchors is searched over each
# anchor's winner and this many of its fastest configs of the quick rung (and the default)
GUIDED_KEEP = 8
# ... and, for each anchor's fastest this many, the candidate that differs from it only in its
# split count, scaled by anchor batch / shape batch (the nearest such candidate, or the two
# either side): batch x splits, the work items that fill the GPU, carries over where the
# split count itself does not. Seen on the H200 (serving_shipped_ea3ec29): at Llama 3.1 70B
# tp8, batch 24 x kv 64k, FA3 with 6 splits ran 1.23x of the default on serving.py's uniform
# batch, and the dense pass's shortlist there (17 configs, from its anchors at batches 8 and
# 64: FA3 with 0, 3 and 24-64 splits, Triton) held no FA3 config of 4-16 splits; whether
# scaling finds it is not yet measured. The knobs that count splits (a config whose splits
# follow each sequence's length, tokens_per_split > 0, is left as it is)
GUIDED_SCALED = 3
# the dense passes' guide shortlists an anchor too where an anchor of its batch at another kv
# length is recorded (tuner.search.guided.Guide, across_kv): over that one's leaders, its
# family's nearest anchors' (their split counts scaled to its batch, as between anchors) and
# the winner (every dense pass searches it, and hands it on). Replayed offline
# over the H200's stored dense passes (benchmarks/dense_guide_replay.py, six head
# configurations' re-ship DBs, 720 anchors whose passes had searched every candidate; in
# sweep order, each shortlist from what its neighbours' own shortlists found;
# benchmarks/results/h200/issue12/dense_guide_replay_dense.json): 636 shortlisted, 50,228
# configs to measure -> 6,543; the best found 0.26% slower than the best of all in geomean on
# the dense batches (28 over 2%, worst 8.9%), 0.91 of the gain over the winner where there
# was more than 1% to find. The mix's anchors stay exhaustive: replayed alike, the best found
# there ran 1.34x slower than the best in geomean (dense_guide_replay_mix.json)
GUIDED_ACROSS_KV = True
# ... from an anchor at most this many octaves of kv length away (a serving grid's next
# bucket is one): split counts follow the length, and scaled_splits scales them by batch only
GUIDED_ACROSS_KV_OCTAVES = 2
SPLIT_KNOBS = ("num_splits", "num_kv_splits")
# a sweep stores a shape's measurements together, at the latest this long after the oldest
# unstored one (tuner.sweep.MeasurementSink): a write costs ~2 ms on a GPU host, and a
# process killed outright loses no more than this much of its work
STORE_EVERY_S = 5.0
# a missed key whose calls' mean kv length was below this share of their longest was called
# with mixed lengths: `tuner sweep --from-misses` measures it on serving batches
MISS_MIXED_BELOW = 0.9


# -- timers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimerPreset:
    """How a timer measures: warm-up calls and timed samples; the CUDA-graph timer takes
    samples of at least min_sample_us, the wall-clock one stops after max_seconds once
    min_repeats are in."""

    warmup: int
    repeats: int
    min_repeats: int = 1
    max_seconds: float = 2.0
    min_sample_us: float = 200.0


TIMERS = {
    # offline sweeps called as a library (tuner.sweep.sweep without a timer); `tuner sweep`
    # takes its --warmup/--repeats/--max-seconds (default sweep-cpu's) on either device
    "sweep-gpu": TimerPreset(warmup=3, repeats=20, min_sample_us=200.0),
    "sweep-cpu": TimerPreset(warmup=2, repeats=15, min_repeats=5, max_seconds=2.0),
    # tune mode, inside a serving process: short, on wall-clock time
    "runtime": TimerPreset(warmup=1, repeats=7, min_repeats=3, max_seconds=0.5),
    # re-checking winners before they ship (benchmarks/verify_shipped.py)
    "verify-gpu": TimerPreset(warmup=3, repeats=30, min_sample_us=200.0),
    "verify-cpu": TimerPreset(warmup=1, repeats=5, min_repeats=5, max_seconds=2.0),
}
# successive halving's quick rung: at most this many samples (a quarter of the time on the CPU)
QUICK_REPEATS_GPU = 5
# ... and stops after 2 once its samples took this long (calls of milliseconds scatter little)
QUICK_BUDGET_US_GPU = 3000.0
QUICK_REPEATS_CPU = 3

# threads that compile a shape's Triton candidates ahead of timing them (tuner.ops.triton_decode)
COMPILE_WORKERS = min(16, os.cpu_count() or 1)

# the L2 a cold-cache rotation must exceed twice over when the device does not say (H200's)
DEFAULT_L2_BYTES = 60 * 2**20

# the most JSON text tuner reads from one file, after gzip decompression (tuner.jsonfile): the
# shipped H200 tunings are 7.3 MiB of it; past this a file (/dev/zero, a gzip bomb) is refused
MAX_JSON_BYTES = 256 * 2**20

# the torch reference attends this many bytes of float32 work at once (keys and values of
# a batch's sequences, padded to the longest, and their scores): sequences go in chunks,
# not one by one, since a sweep builds a reference per serving batch (three or more per shape)
REFERENCE_CHUNK_BYTES = 1 << 30

# A sweep's worker that runs one config this long without a result is taken for hung: its
# supervisor kills it, refuses the config and goes on (a GPU candidate takes seconds).
ENV_CANDIDATE_TIMEOUT = "TUNER_CANDIDATE_TIMEOUT_S"
CANDIDATE_TIMEOUT_S = 600.0
# A worker that dies this many times in a row outside any config is a fault of its own: stop.
MAX_BLIND_RESTARTS = 2


def candidate_timeout_s() -> float:
    """$TUNER_CANDIDATE_TIMEOUT_S when it is a positive number, else CANDIDATE_TIMEOUT_S."""
    try:
        value = float(os.environ.get(ENV_CANDIDATE_TIMEOUT, ""))
    except ValueError:
        return CANDIDATE_TIMEOUT_S
    return value if value > 0 else CANDIDATE_TIMEOUT_S

# a sweep whose output is not a terminal prints a progress line this often (a log shows the
# sweep is alive, and about how long it has left)
PROGRESS_EVERY_S = 30.0
