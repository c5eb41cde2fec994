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
# (the measurements behind each value: docs/decisions.md, under the setting's name)

# a winner must beat the default by more than the noise and by this share of its time, so a
# tie never replaces the library's choice (sweep, tune mode, verification, LightLLM export)
MIN_GAIN = 0.01
# a winner of a serving trial's mix may lose to the default by at most this on any one batch,
# since the mix's mean can hide a large loss on one distribution (tuner.bench.decide) ...
MAX_PART_LOSS = 0.02
# ... and up to this many challengers are tried before the default stays
CONFIRM_TRIES = 3
# a serving winner is confirmed on a second trial (tuner.sweep.trials.build_second_trial) seeded
# the sweep's seed plus this: one draw of lengths can crown a config that loses on another
SECOND_TRIAL_SEED = 1_000_003
# a serving trial holds at least this many sequences of each distribution, its batches seeded
# a stride apart (tuner.workload.traffic.draws_per_distribution): one length is luck at batch 1
TRIAL_MIN_SEQUENCES = 4
TRIAL_DRAW_SEED_STRIDE = 7_919
# a batch whose kv lengths sum to at least this share of batch x its longest is dense and may
# run a config of its own (tuner.ops.decode_attention.fill_branch): even splits win only there
DENSE_FILL = 0.5
# inside graph_capture(lengths), a by_fill record's dense config is captured where at least
# this share of the declared batches' time (each weighted by its longest) is in dense ones
DECLARED_DENSE_SHARE = 0.5
# the sweep's dense pass (tuner.sweep) draws its dense batches with the seed plus this
DENSE_TRIAL_SEED = 2_000_003
# nearest-key lookup (tuner.keys.run): octaves of batch + kv, and of query length, a stored
# winner may be from the call
MAX_DISTANCE = 2.0
MAX_Q_DISTANCE = 1.0
# a neighbour's winner is borrowed only if every neighbour at that distance beat its own
# default by this much: a config tuned for one batch size can lose to the default an octave away
BORROW_MIN_GAIN = 1.10
# the search a sweep runs unless told (tuner.search): halving agrees with a precise exhaustive
# timing as well as exhaustive search does, at under half its GPU time
DEFAULT_STRATEGY = "halving"
# ... and where every shape is a serving batch (a serving grid's every capture batch size):
# guided search, which measures about half as many configs there, agreeing within 1%
# (docs/decisions.md, "Search")
SERVING_STRATEGY = "guided"
# ... and searches these decode_attention backends: a captured decode graph cannot hold
# FlashInfer's per-call plan, so a serving record of FlashInfer would run the default there
SERVING_BACKENDS = ("fa3", "triton_decode")
# a config frozen into a graph of unknown lengths must have won at every kv bucket from this
# one up to the bound (tuner.runtime.borrowing.choose_frozen): a serving grid's first bucket
FROZEN_FROM_KV = 1024
# a graph record's trial (DecodeShape.lengths "graph"): the replayed batches' caps span this
# many octaves up to the capture bound, each batch holding at most this many tokens (a
# trial of 3 distributions x 8 octaves stays within about 4.5M tokens); first choices, not
# yet compared with others
GRAPH_OCTAVES = 8
GRAPH_MAX_TOKENS = 2 * 2**20
# the op whose records serve an op's calls captured into a graph of unknown lengths (its
# graph records: tuner sweep decode_attention_graph), before the frozen rule
GRAPH_RECORD_OPS = {"decode_attention": "decode_attention_graph"}
# a graph captured at a bound with no graph record of its own takes the record of its batch
# size at the nearest larger bound this many octaves above at most (a graph grid's bounds,
# 8k, 32k and 128k, then serve every bound from 2k up)
GRAPH_BORROW_OCTAVES = 2
# a server that keeps several graphs per batch size (tuner.integrations.graph_variants) captures
# at most this many beside each batch size's base graph ($TUNER_GRAPH_VARIANTS; 0: none), the
# longest lengths' first: each costs a capture at start. The shipped keys name 2-11 config sets
# per batch size at a 128k bound; a cap of 8 sent batch 1's shortest steps to the base graph,
# where a variant ran 3x faster per call (docs/decisions.md, "Graph variants")
ENV_GRAPH_VARIANTS = "TUNER_GRAPH_VARIANTS"
GRAPH_VARIANTS = 12


def graph_variants_max() -> int:
    """$TUNER_GRAPH_VARIANTS if a whole number >= 0, else GRAPH_VARIANTS."""
    value = os.environ.get(ENV_GRAPH_VARIANTS, "").strip()
    return int(value) if value.isdigit() else GRAPH_VARIANTS


# where a batch size's graph runs FA3's plain default, graph variants add graphs of FA3 at the
# caps that fit its tiles in one wave, replayed on the steps whose lengths need one
# (tuner.integrations.graph_variants; $TUNER_GRAPH_WAVE_CAPS=0: none)
ENV_GRAPH_WAVE_CAPS = "TUNER_GRAPH_WAVE_CAPS"


def graph_wave_caps() -> bool:
    """Whether graph variants add FA3 cap graphs where FA3's default runs ($TUNER_GRAPH_WAVE_CAPS)."""
    return os.environ.get(ENV_GRAPH_WAVE_CAPS, "").strip() != "0"


# inside SGLang, one more graph variant per batch size that runs SGLang's own FlashInfer
# backend (its capture and its plan before each replay) on the classes of lengths that would
# replay the base graph, judged per class like any variant; off until measured on a GPU
# ($TUNER_SGLANG_FLASHINFER=1: on; docs/decisions.md, "SGLang (issue 38)")
ENV_SGLANG_FLASHINFER = "TUNER_SGLANG_FLASHINFER"


def sglang_flashinfer_variant() -> bool:
    """Whether tuner's SGLang backend captures a FlashInfer graph variant ($TUNER_SGLANG_FLASHINFER=1)."""
    return os.environ.get(ENV_SGLANG_FLASHINFER, "").strip() == "1"


# a server's first replays of each graph variant alternate with its batch size's base graph,
# and a variant slower than the base graph by more than REPLAY_JUDGE_TOLERANCE (the median of
# this many pairs) is dropped ($TUNER_REPLAY_JUDGE; 0: every variant replays as planned):
# trials missed a ~4% loss inside SGLang (tuner.integrations.replay_judge)
ENV_REPLAY_JUDGE = "TUNER_REPLAY_JUDGE"
REPLAY_JUDGE_PAIRS = 8
REPLAY_JUDGE_TOLERANCE = 0.01
# ... or whose whole steps (its start to the next server step's) are slower by more than this:
# a whole step carries the host's jitter (bench_one_batch's consecutive steps differ by 1-5%),
# and at the replays' 1% the median of 8 pairs of equal graphs would read as a loss often
REPLAY_JUDGE_STEP_TOLERANCE = 0.03
# a kept variant is judged again after this many more replays of its class, then after twice
# as many, and so on: a server's traffic in a class may change after its first replays, and
# a variant must not go on losing (a recheck costs `pairs` base replays)
REPLAY_JUDGE_RECHECK = 4096


def replay_judge_pairs() -> int:
    """$TUNER_REPLAY_JUDGE if a whole number >= 0, else REPLAY_JUDGE_PAIRS."""
    value = os.environ.get(ENV_REPLAY_JUDGE, "").strip()
    return int(value) if value.isdigit() else REPLAY_JUDGE_PAIRS


# successive halving: the quick rung keeps the default and the configs within this fraction
# of the fastest, at most this many, for the full measurement
HALVING_KEEP = 0.10
HALVING_MAX_KEEP = 6
# guided search (tuner.search.guided): a shape between two anchors is searched over each
# anchor's winner and this many of its fastest configs of the quick rung (and the default)
GUIDED_KEEP = 8
# ... and, for each anchor's fastest this many, the candidate whose split count is scaled by
# anchor batch / shape batch: batch x splits fills the GPU, where the split count alone does not
GUIDED_SCALED = 3
# an anchor's dense pass is shortlisted from its batch's anchor at another kv length where one is
# recorded (tuner.search.guided.Guide): most of the gain for a tenth of the measurements
GUIDED_ACROSS_KV = True
# ... from an anchor at most this many octaves of kv length away (a serving grid's next
# bucket is one): split counts follow the length, and scaled_splits scales them by batch only
GUIDED_ACROSS_KV_OCTAVES = 2
# the knobs that count splits (a config whose splits follow each sequence's length or the
# call's load, tokens_per_split or items_per_sm > 0, is left as it is)
SPLIT_KNOBS = ("num_splits", "num_kv_splits")
# a sweep stores a shape's measurements together (tuner.sweep.MeasurementSink), this long after
# the oldest unstored one at most: a write costs milliseconds, a killed sweep loses this at most
STORE_EVERY_S = 5.0
# a missed key whose calls' mean kv length was below this share of their longest was called
# with mixed lengths: `tuner sweep --from-misses` measures it on serving batches
MISS_MIXED_BELOW = 0.9
# misses are written this long after the first one not yet written (and at exit): a server
# ends its workers with SIGKILL (SGLang does), where nothing runs at exit
MISS_FLUSH_AFTER_S = 30.0
# how long an exit (or configure()) waits for that writer, when it is writing
MISS_EXIT_WAIT_S = 10.0


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
    # re-checking winners before they ship (tools/verify_shipped.py)
    "verify-gpu": TimerPreset(warmup=3, repeats=30, min_sample_us=200.0),
    "verify-cpu": TimerPreset(warmup=1, repeats=5, min_repeats=5, max_seconds=2.0),
}
# successive halving's quick rung: at most this many samples (a quarter of the time on the CPU)
QUICK_REPEATS_GPU = 5
# ... and stops after 2 once its samples took this long (calls of milliseconds scatter little)
QUICK_BUDGET_US_GPU = 3000.0
QUICK_REPEATS_CPU = 3

# the config space's pruning (docs/decisions.md, "Pruning the config space"): candidates that
# never came near the best in the stored H200 sweeps leave it, so a new key's sweep times
# fewer; TUNER_FULL_SPACE=1 keeps every one (serving.py's oracle does, so what pruning
# costs shows)
FULL_SPACE = os.environ.get("TUNER_FULL_SPACE", "").strip() not in ("", "0")
# FA3 num_splits past this many work items per SM (splits x batch x kv heads) leave the space:
# FA3's time is flat from about one wave of them on full batches, and serving batches'
# winners stayed within it
FA3_SPLIT_ITEMS_PER_SM = 8
# decode_attention's wave_fit FA3 config (tuner.ops.fa3_waves): a work tile's fixed cost in
# kv blocks (its start, its partial result's write), and the modelled gain a cap must bring;
# both fitted to serving.py's per-config screens (docs/decisions.md, "FA3's wave overflow")
FA3_WAVE_TILE_OVERHEAD_BLOCKS = 2
FA3_WAVE_MIN_GAIN = 0.05
# the SM count where no GPU says (an H200's): the CPU-side config space of a GPU op
DEFAULT_SM_COUNT = 132

# threads that compile a shape's Triton candidates ahead of timing them (tuner.ops.triton_decode)
COMPILE_WORKERS = min(16, os.cpu_count() or 1)

# the L2 a cold-cache rotation must exceed twice over when the device does not say (H200's)
DEFAULT_L2_BYTES = 60 * 2**20
# a mix's batch timed alone rotates through at most this many copies of itself (as a whole
# trial does): more would lengthen every sample of a batch of a few short sequences, whose
# calls are bound by their launches more than by their reads (tuner.sweep.trials.build_trial)
PART_MAX_COPIES = 64

# the most JSON text tuner reads from one file, after gzip decompression (tuner.jsonfile): well
# above the shipped tunings' 7.3 MiB; past it a file (/dev/zero, a gzip bomb) is refused
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
# Set in a worker restarted after its predecessor died precompiling a shape's configs (a
# compiler crash or hang): each config is built as it runs, under its own journal entry.
ENV_NO_PRECOMPILE = "TUNER_SWEEP_NO_PRECOMPILE"
# After Ctrl-C is forwarded, a worker stuck in a kernel (the interrupt waits for it to return)
# is killed after this many seconds: the sweep stops with what it stored, as the user asked.
INTERRUPT_GRACE_S = 15.0


def candidate_timeout_s() -> float:
    """$TUNER_CANDIDATE_TIMEOUT_S when it is a positive number, else CANDIDATE_TIMEOUT_S."""
    try:
        value = float(os.environ.get(ENV_CANDIDATE_TIMEOUT, ""))
    except ValueError:
        return CANDIDATE_TIMEOUT_S
    return value if value > 0 else CANDIDATE_TIMEOUT_S

def precompile_enabled() -> bool:
    """Whether a trial's configs are built ahead of their measurements (not after a worker
    died doing so: ENV_NO_PRECOMPILE)."""
    return not os.environ.get(ENV_NO_PRECOMPILE)


# a sweep whose output is not a terminal prints a progress line this often (a log shows the
# sweep is alive, and about how long it has left)
PROGRESS_EVERY_S = 30.0

# `tuner sweep --plan`'s estimate: GPU seconds per candidate config of a shape, by search, on
# an H200 with Triton's cache warm (docs/decisions.md, "Search"); another search: exhaustive's
PLAN_S_PER_CANDIDATE_GPU = {"exhaustive": 0.0204, "halving": 0.0094, "guided": 0.008}
# ... and on a fresh H200 (empty Triton cache, so compiles included), where measured: a whole
# serving grid by default (docs/decisions.md, "Search")
PLAN_FRESH_S_PER_CANDIDATE_GPU = {"guided": 0.0304}
# the op those paces were measured on; another op's plan says it borrows them
PLAN_PACE_OP = "decode_attention"
