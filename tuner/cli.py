"""The `tuner` command line: parses, calls the modules below it, prints with rich."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import shlex
import shutil
import sys
import tempfile
import threading
import time
from enum import Enum
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from typing_extensions import Annotated

from tuner import settings
from tuner.version import __version__

try:  # typer from 0.26 on carries its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:
    from click import exceptions as click_exceptions
from tuner.errors import TunerError
from tuner.keys import AttentionStaticKey


def _flags_take_no_value() -> None:
    """typer 0.29's help prints a type beside every option, so a flag reads as taking one
    (`--force <bool>`), which the parser refuses: print none for flags."""
    try:
        from typer.core import TyperOption
    except ImportError:
        return
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_tuner_flags", False):
        return

    def display_type_rich(self, ctx):  # type: ignore[no-untyped-def]
        return None if getattr(self, "is_flag", False) and not getattr(self, "metavar", None) else shown(self, ctx)

    display_type_rich._tuner_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich


_flags_take_no_value()


def _finite(value: float | None) -> float | None:
    """Float options: inf and nan pass typer's ranges (nan compares false to every bound)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"must be a finite number, got {value}")
    return value

app = typer.Typer(
    name="tuner",
    help="Kernel autotuning with a persistent tuning DB for LLM-serving attention kernels.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
console = Console()
err = Console(stderr=True)

_SWEEP = settings.TIMERS["sweep-cpu"]  # the sweep's timing options' defaults

DbOption = Annotated[
    Optional[str],
    typer.Option("--db", help="Tuning DB: SQLAlchemy URL or SQLite file path (default: $TUNER_DB, else the embedded SQLite file)."),
]


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Bad input of any kind: one line on stderr, exit code 2."""
    try:
        yield
    except TunerError as e:
        _print_error(str(e))
        raise typer.Exit(2) from None


def _print_error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _open_db(db: str | None, *, create: bool = True):
    from tuner.db import TuningDB

    return TuningDB(db, create=create)


def _open_db_to_sweep(db: str | None, force: bool):
    """The DB a sweep writes to. A damaged one is an error, unless --force and the file is
    tuner's own: then it is renamed aside (never deleted) and a new DB started. Malformed
    rows are an error even with --force: `tuner prune` mends them."""
    from tuner.db import DamagedDBError, DBError

    try:
        database = _open_db(db)
    except DamagedDBError as e:
        return _set_aside_and_open(db, e, force)
    damage = database.damage()  # a truncated file opens, then fails mid-sweep
    if damage:
        database.close()
        return _set_aside_and_open(db, DamagedDBError(f"tuning DB {database.display_url} is damaged: {damage[0]}"),
                                   force)
    malformed = database.malformed_summary()  # damage() ran above: not integrity_check twice
    if malformed:
        database.close()
        raise DBError(f"will not sweep into tuning DB {database.display_url}: {malformed[0]}")
    return database


def _set_aside_and_open(db: str | None, damage: Exception, force: bool):
    from tuner.db import DBError, is_tuners_file, resolve_db_url, set_aside

    if not force:
        url, _ = resolve_db_url(db)
        if url.get_backend_name() == "sqlite" and url.database and not is_tuners_file(Path(url.database)):
            raise DBError(f"{damage} (not a file tuner made: give another --db)") from None
        hint = "" if "--force" in str(damage) else " (sweep --force renames it aside and starts a new DB)"
        raise DBError(f"{damage}{hint}") from None
    aside = set_aside(db)  # refuses anything that is not tuner's own file
    err.print(f"[yellow]warning:[/] {escape(str(damage))}; renamed it to {escape(str(aside))}", highlight=False,
              soft_wrap=True)
    return _open_db(db)


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"tuner {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Sweep ops over shapes into the tuning DB; the runtime picks the winners up."""


@app.command("ops")
def ops_command() -> None:
    """List the tunable ops, whether they can run here, and their named grids."""
    from tuner.ops import list_ops

    table = Table(title="tunable ops")
    table.add_column("op", no_wrap=True)
    for col in ("runs here", "grids", "description"):
        table.add_column(col)
    for op in list_ops():
        why = op.unavailable()
        table.add_row(
            op.name,
            f"[green]yes[/] ({op.device()})" if why is None else f"[red]no[/]: {why}",
            ", ".join(f"{name} ({len(shapes)}: {_grid_heads(shapes)})" for name, shapes in op.grids.items()),
            op.description,
        )
    console.print(table)
    console.print("a grid is swept at the heads its shapes have; `tuner sweep OP --grid G --model NAME` "
                  "(or `--heads Q/KV`) sweeps it at yours", soft_wrap=True)


def _grid_heads(shapes: list) -> str:
    """A grid's head configurations, as `tuner ops` shows them: the one, or how many."""
    heads = sorted({(s.num_q_heads, s.num_kv_heads) for s in shapes}, reverse=True)
    dims = {(s.head_dim, s.dtype) for s in shapes}
    if len(dims) > 1 or len(heads) > 3:
        return f"{len(heads)} head configurations"
    (d, dtype), = dims
    return f"{', '.join(f'{q}/{kv}' for q, kv in heads)} heads d{d} {dtype}"


def _fmt_us(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _fmt_config(config: dict | None) -> str:
    if not config:
        return "-"
    return escape(" ".join(f"{k}={v}" for k, v in config.items()))


@dataclasses.dataclass(frozen=True)
class _HeadsRequest:
    """sweep's "your model" options: the heads every shape is swept at, if any are given."""

    model: str | None
    tp: str | None
    heads: str | None
    head_dim: int
    window: int | None
    softcap: float | None
    sinks: bool
    dtype: str | None
    page_size: int | None

    def given(self) -> bool:
        return any(v is not None for v in (self.model, self.tp, self.heads, self.window, self.softcap, self.dtype,
                                           self.page_size)) or self.sinks or self.head_dim != 128

    def apply(self, shapes: list) -> list:
        from tuner.workload.models import apply_heads, attention_from_flags, model_attention, parse_tp, per_gpu_heads

        if self.model is not None and self.heads is not None:
            raise TunerError("give --model or --heads, not both")
        if self.tp is not None and self.model is None:
            raise TunerError("--tp splits a --model's heads; with --heads give each GPU's own")
        hand = self.head_dim != 128 or self.window is not None or self.softcap is not None or self.sinks
        if hand and self.heads is None:
            raise TunerError("--head-dim, --window, --softcap and --sinks go with --heads (a --model says its own)")
        if self.dtype is not None and self.dtype not in ("bfloat16", "float16"):
            raise TunerError(f"--dtype must be bfloat16 or float16, got {self.dtype!r:.40}")
        if self.page_size is not None and not (1 <= self.page_size <= 1024 and not self.page_size & (self.page_size - 1)):
            raise TunerError(f"--page-size must be a power of two in [1, 1024], got {self.page_size}")
        if self.model is not None:
            kinds = per_gpu_heads(model_attention(self.model), parse_tp(self.tp or "1"))
        elif self.heads is not None:
            kinds = [attention_from_flags(self.heads, self.head_dim, self.window, self.softcap, self.sinks)]
        else:
            kinds = None
        if kinds is None:  # dtype or page size alone: the grid's own heads
            return [dataclasses.replace(s, dtype=self.dtype or s.dtype, page_size=self.page_size or s.page_size)
                    for s in shapes]
        return apply_heads(shapes, kinds, dtype=self.dtype, page_size=self.page_size)


@app.command("sweep")
def sweep_command(
    op_name: Annotated[str, typer.Argument(metavar="OP", help="Op to tune (see `tuner ops`).")],
    grid: Annotated[Optional[str], typer.Option("--grid", "-g", help="Named grid of shapes of the op, see `tuner ops` (default: cpu-small on CPU, decode on GPU).")] = None,
    shapes_file: Annotated[Optional[Path], typer.Option("--shapes", help="JSON file: a list of shape objects (batch, kv_len, q_len, num_q_heads, ...).")] = None,
    from_misses: Annotated[bool, typer.Option("--from-misses", help="Tune the keys the runtime missed for OP (see `tuner show --misses`), each at the top of its kv bucket; on serving batches (--lengths serving) where the missed calls' lengths were mixed. With --grid: the grid's run keys (e.g. serving: every capture batch size x kv 32-128k) for every static key the runtime missed, a new deployment's whole grid.")] = False,
    lengths: Annotated[Optional[str], typer.Option("--lengths", help="What each shape's batch holds: full (every sequence at kv_len, the grids' default) or serving (a batch per length distribution of serving traffic, more rounds of them at batch 1-3, each with its longest sequence in the kv bucket; timed as their mean). Overrides the shapes'. The same keys as full: --force to re-measure keys that have full-batch winners.")] = None,
    db: DbOption = None,
    force: Annotated[bool, typer.Option("--force", help="Measure again what the DB already holds; an unreadable DB file is renamed aside (kept) and a new one started.")] = False,
    search: Annotated[Optional[str], typer.Option("--search", help="Search strategy (tuner.search): halving times every config quickly first, then only the contenders (the default and those within 10% of the fastest) fully; exhaustive times every config fully; guided halves on power-of-two batch sizes and searches every other batch size over its two nearest ones' fastest configs, and the fastest few with their split count scaled to its batch (for dense grids such as serving). Default: guided where every shape is a serving batch (the serving grid, --lengths serving), else halving.")] = None,
    halving: Annotated[bool, typer.Option("--halving", help="The same as --search halving.")] = False,
    backends: Annotated[Optional[str], typer.Option("--backends", help="decode_attention only: search only these backends, comma-separated. Default: fa3,triton_decode where every shape is a serving batch (FlashInfer's per-call plan cannot be held by a captured decode graph), else every installed one.")] = None,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed calls before timing each config.")] = _SWEEP.warmup,
    repeats: Annotated[int, typer.Option(min=1, help="Timed calls per config (at most).")] = _SWEEP.repeats,
    max_seconds: Annotated[float, typer.Option(min=0.001, callback=_finite, help="CPU only: stop timing a config after this long (once 5 calls are timed).")] = _SWEEP.max_seconds,
    min_gain: Annotated[float, typer.Option(min=0.0, max=1.0, callback=_finite, help="A winner must beat the default by this fraction, and by more than the noise.")] = settings.MIN_GAIN,
    second_trial: Annotated[bool, typer.Option("--second-trial/--no-second-trial", help="Serving shapes: confirm each winner once more, side by side with the default, on a second batch of freshly drawn lengths, and keep the default where it does not hold (one draw of lengths can crown a config that loses on another).")] = True,
    model: Annotated[Optional[str], typer.Option("--model", rich_help_panel="Your model", help="Sweep the grid (or shapes file) at this model's attention heads: a name from the built-in table (e.g. llama-3.1-8b, qwen3-30b-a3b, gemma-2-9b, gpt-oss-20b; an unknown name lists them) or a Hugging Face config.json (or its directory), read offline. Models with sliding-window layers give a static key per layer kind.")] = None,
    tp: Annotated[Optional[str], typer.Option("--tp", rich_help_panel="Your model", help="With --model: tensor-parallel sizes, e.g. 1,2,4,8; each gives its per-GPU heads (default 1).")] = None,
    heads: Annotated[Optional[str], typer.Option("--heads", rich_help_panel="Your model", help="Instead of --model: per-GPU query/kv heads, e.g. 48/8.")] = None,
    head_dim: Annotated[int, typer.Option("--head-dim", rich_help_panel="Your model", help="With --heads: the head dim.")] = 128,
    window: Annotated[Optional[int], typer.Option("--window", rich_help_panel="Your model", help="With --heads: a sliding window of this many tokens.")] = None,
    softcap: Annotated[Optional[float], typer.Option("--softcap", rich_help_panel="Your model", help="With --heads: the attention logit softcap.")] = None,
    sinks: Annotated[bool, typer.Option("--sinks", rich_help_panel="Your model", help="With --heads: attention sinks.")] = False,
    dtype: Annotated[Optional[str], typer.Option("--dtype", rich_help_panel="Your model", help="The q/k/v dtype: bfloat16 or float16 (default: the grid's).")] = None,
    page_size: Annotated[Optional[int], typer.Option("--page-size", rich_help_panel="Your model", help="The KV cache's page size: 1 for SGLang and LightLLM, 16 for vLLM (default: the grid's).")] = None,
    plan_only: Annotated[bool, typer.Option("--plan", help="Say what the sweep would do and stop: its shapes by static key, their candidate configs, and the estimated GPU time; nothing runs and no DB is written.")] = False,
    isolate: Annotated[bool, typer.Option("--isolate/--no-isolate", help="Run the sweep in a worker process that a supervisor restarts after a CUDA fault, a crash or a config hung past $TUNER_CANDIDATE_TIMEOUT_S (default 600 s): the config that was running is stored as refused with its error, and nothing measured is lost. Not under torchrun.")] = True,
    dense_pass: Annotated[bool, typer.Option("--dense-pass/--no-dense-pass", help="Serving shapes of batch > 1 (decode_attention): once a winner is known, search a second config for dense batches (lengths summing to at least half of batch x the longest), kept only where it beats the winner on dense batches and loses to the default nowhere on a second trial; the winner serves the rest. Runs on stored winners that have had none (or whose second trial asked for a gain and refused it). Not in a distributed sweep.")] = True,
) -> None:
    """Benchmark every candidate config of OP over a grid of shapes; store the winners.

    Resumable: rerun the same command after an interruption and only what is missing is measured. Each candidate is checked against the reference before it is timed; a winner must beat the library default by more than the noise.
    """
    with _user_errors(), contextlib.ExitStack() as scope:
        from tuner.bench import timer_for
        from tuner.ops import get_op

        from tuner.ops.decode_attention import BACKEND_OPS, BACKENDS, GRAPH_OP_NAME, backends_only

        op = get_op(op_name)
        if backends is not None:
            if op.name not in BACKEND_OPS:
                raise TunerError(f"--backends is for {' and '.join(BACKEND_OPS)}, not {op.name}")
            scope.enter_context(backends_only(b.strip() for b in backends.split(",") if b.strip()))
            if op.name == GRAPH_OP_NAME and not any(b.graph_capturable for b in BACKENDS.values()):
                raise TunerError(f"--backends {backends}: {op.name} needs one that runs in a captured graph")
        from tuner.search import get_strategy
        from tuner.sweep import default_backends, default_strategy

        chosen = get_strategy("halving" if halving else search).name if halving or search else None
        why = op.unavailable()
        if why is not None:
            raise TunerError(f"op {op.name} cannot run here: {why}")
        yours = _HeadsRequest(model, tp, heads, head_dim, window, softcap, sinks, dtype, page_size)
        shapes, database = _shapes_to_sweep(op, grid, shapes_file, from_misses, lengths, yours, db, force)
        if shapes is None:
            return
        strategy = chosen or default_strategy(shapes)
        if backends is None and (serving_backends := default_backends(op, shapes)) is not None:
            scope.enter_context(backends_only(serving_backends))
        if plan_only:
            _print_plan(op, shapes, strategy, op.device())
            return
        database = database or _open_db_to_sweep(db, force)
        # CUDA-graph replay with a cold L2, timed by CUDA events, on a GPU; the wall clock on a CPU
        preset = settings.TIMERS["sweep-gpu" if op.device() == "cuda" else "sweep-cpu"]
        timer = timer_for(dataclasses.replace(preset, warmup=warmup, repeats=repeats, max_seconds=max_seconds),
                          op.device())
        from tuner.ranks import ranks_from_launcher
        from tuner.sweep.guard import supervise, worker_flight, worker_run

        ranks = ranks_from_launcher()  # under torchrun: share the work, agree on the winners
        flight = worker_flight()
        if isolate and ranks is None and flight is None and _INVOCATION is not None:
            raise typer.Exit(supervise(_INVOCATION, database))
        _run_sweep(op, shapes, database, ranks, force=force,
                   sweep_options=dict(timer=timer, force=force, min_gain=min_gain, strategy=strategy, ranks=ranks,
                                      second_trial=second_trial, dense_pass=dense_pass, flight=flight,
                                      run_id=worker_run()))


def _shapes_to_sweep(op, grid: str | None, shapes_file: Path | None, from_misses: bool, lengths: str | None,
                     yours: "_HeadsRequest", db: Optional[str], force: bool) -> tuple[list | None, object]:
    """The shapes a sweep measures (None: no misses to tune), and the DB where reading the
    misses opened it."""
    from tuner.ops import get_grid
    from tuner.workload import load_shapes
    from tuner.workload.shapes import LENGTHS

    if lengths is not None and lengths not in LENGTHS:
        raise TunerError(f"--lengths must be one of {', '.join(LENGTHS)}, got {lengths!r:.40}")
    if shapes_file is not None and (grid is not None or from_misses):
        raise TunerError("give one of --grid, --shapes, --from-misses (--grid with --from-misses: the grid's run "
                         "keys for the missed static keys)")
    if from_misses and yours.given():
        raise TunerError("--from-misses sweeps the static keys the runtime missed: give no --model or --heads")
    database = None
    if from_misses:
        from tuner.sweep import plan_from_misses

        database = _open_db_to_sweep(db, force)
        missed = plan_from_misses(database, op, grid)
        if missed.warning:
            err.print(f"[yellow]warning:[/] {missed.warning}", highlight=False)
        if not missed.shapes:
            console.print(f"no missed keys to tune for {op.name} (`tuner show --misses`)")
            return None, database
        shapes = missed.shapes
    elif shapes_file is not None:
        shapes = load_shapes(shapes_file)
    else:
        shapes = get_grid(op, grid or ("decode" if op.device() == "cuda" else "cpu-small"))
    if lengths is not None:
        shapes = [dataclasses.replace(s, lengths=lengths) for s in shapes]
    shapes = _graph_lengths(op, shapes)
    return (yours.apply(shapes) if yours.given() else shapes), database


def _graph_lengths(op, shapes: list) -> list:
    """A graph op measures graph replays only (its shapes' kv_len is their capture bound), and
    only a graph op does: a graph-replay timing stored as another op's record would serve
    eager calls."""
    if op.name in settings.GRAPH_RECORD_OPS.values():
        wrong = sorted({s.lengths for s in shapes} - {"graph", "full"})
        if wrong:
            raise TunerError(f"{op.name} measures graph replays (lengths graph), not {', '.join(wrong)} batches")
        return [dataclasses.replace(s, lengths="graph") for s in shapes]
    if any(s.lengths == "graph" for s in shapes):
        graph_ops = ", ".join(settings.GRAPH_RECORD_OPS.values())
        raise TunerError(f"lengths graph (graph replays) are for {graph_ops}, not {op.name}")
    return shapes


def _run_sweep(op, shapes: list, database, ranks, *, force: bool, sweep_options: dict) -> None:
    """Sweep with a progress bar (and progress lines in a log), then the table of winners;
    exit 130 with what was finished where it is interrupted."""
    from tuner.sweep import SweepInterrupted, candidate_configs, sweep

    leader = ranks is None or ranks.rank == 0
    total = sum(len(candidate_configs(op, s)) for s in shapes)
    if leader:
        shared = f" over {ranks.world} ranks" if ranks else ""
        searched = _searched(op, sweep_options["strategy"])
        console.print(f"sweeping [bold]{op.name}[/] on {op.device()}{shared}, {searched}: {len(shapes)} shapes, "
                      f"{total} measurements -> {escape(database.display_url)}")
    interrupted = None
    log = _ProgressLog(len(shapes), total, console, enabled=leader and not console.is_terminal)
    with log, Progress(
        TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False, disable=not leader,
    ) as progress:
        task = progress.add_task(op.name, total=total)

        def advance(n: int, label: str) -> None:
            progress.update(task, advance=n, description=label)
            log.advance(n, label)
        try:
            results = sweep(op, shapes, database, on_advance=advance, **sweep_options)
        except SweepInterrupted as e:  # Ctrl-C, or a deadline's SIGINT: show what is done
            interrupted, results = e, e.done
        progress.update(task, description=op.name)
    if interrupted is not None:
        if leader and results:
            _print_wide(_sweep_table(op.name, results))
        resume = ("the same command without --force resumes the rest (with it, it starts over)" if force
                  else "the same command resumes the rest")
        err.print(f"[yellow]interrupted[/] after {len(results)} of {interrupted.total} shapes; what was "
                  f"measured is stored, and {resume}", highlight=False, soft_wrap=True)
        raise typer.Exit(130)
    if leader:
        _print_wide(_sweep_table(op.name, results))
        if any(r.status == "skipped" for r in results):
            console.print("skipped shapes already have a winner in the DB (see `tuner show`; --force measures again)")
    if ranks is not None:
        winners = json.dumps([r.winner for r in results], sort_keys=True)
        digest = hashlib.sha256(winners.encode()).hexdigest()[:16]
        console.print(f"rank {ranks.rank}/{ranks.world}: {sum(r.winner is not None for r in results)} winners, "
                      f"measured {sum(r.measured for r in results)} here, winners digest {digest}")

class _ProgressLog:
    """Where the output is not a terminal (a log file), a progress line at least every
    settings.PROGRESS_EVERY_S: shapes begun, measurements done, time elapsed and an estimate
    of what is left (a progress bar draws nothing there)."""

    def __init__(self, shapes: int, total: int, out: Console, *, enabled: bool) -> None:
        self.shapes, self.total, self.out, self.enabled = shapes, total, out, enabled
        self.done, self.labels = 0, []
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def advance(self, n: int, label: str) -> None:
        self.done += n
        if not self.labels or self.labels[-1] != label:
            self.labels.append(label)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        left = f", about {_duration(elapsed * (self.total - self.done) / self.done)} left" if self.done else ""
        shape = f" ({self.labels[-1]})" if self.labels else ""
        return (f"progress: shape {min(len(self.labels), self.shapes)} of {self.shapes}{shape}, {self.done} of "
                f"{self.total} measurements, {_duration(elapsed)} elapsed{left}")

    def _run(self) -> None:
        while not self._stop.wait(settings.PROGRESS_EVERY_S):
            self.out.print(self.line(), highlight=False, soft_wrap=True, markup=False)
            self.out.file.flush()

    def __enter__(self) -> "_ProgressLog":
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()  # no line after the sweep's own output


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _searched(op, strategy: str) -> str:
    """What a sweep searches, for its plan and its log: "guided search (fa3, triton_decode)"."""
    from tuner.ops.decode_attention import BACKEND_OPS, BACKENDS, GRAPH_OP_NAME

    if op.name not in BACKEND_OPS:
        return f"{strategy} search"
    names = [name for name, b in BACKENDS.items() if op.name != GRAPH_OP_NAME or b.graph_capturable]
    return f"{strategy} search ({', '.join(names)})"


def _print_plan(op, shapes: list, strategy: str, device: str) -> None:
    """sweep --plan: the shapes by static key, their candidates and the estimated GPU time."""
    from tuner.sweep.plan import SweepPlan

    if not shapes:
        raise TunerError("the plan holds no shapes: give a grid, a shapes file or misses that have some")
    plan = SweepPlan.of(op, shapes, strategy, device)
    table = Table(title=f"plan: {op.name}, {_searched(op, strategy)}, on {device}")
    for col in ("static key", "shapes", "batches", "kv", "lengths"):
        table.add_column(col, justify="right" if col == "shapes" else "left")
    for key, group in plan.by_static_key().items():
        batches, kvs = sorted({s.batch for s in group}), sorted({s.kv_len for s in group})
        table.add_row(escape(key), str(len(group)), f"{batches[0]}-{batches[-1]}", f"{kvs[0]:,}-{kvs[-1]:,}",
                      ", ".join(sorted({s.lengths for s in group})))
    _print_wide(table)
    if plan.estimate_s is None and device == "cuda":
        estimate = "no time estimate for graph replays yet"
    elif plan.estimate_s is None:
        estimate = "no time estimate off a GPU (it depends on the op and the machine)"
    elif plan.fresh_estimate_s is None:
        estimate = (f"about {_duration(plan.estimate_s)} of GPU time at an H200's measured pace with Triton's "
                    "cache warm (a fresh machine compiles its Triton candidates first)")
    else:
        estimate = (f"about {_duration(plan.estimate_s)} of GPU time at an H200's measured pace with Triton's "
                    f"cache warm, about {_duration(plan.fresh_estimate_s)} on a fresh one")
    console.print(f"{len(shapes)} shapes, {plan.candidates} candidate configs; {estimate}. Nothing was run.",
                  soft_wrap=True, highlight=False)


def _print_wide(table: Table) -> None:
    """A table on the terminal's width, or, in a log, on one wide enough that its rows do not
    wrap (rich takes 80 columns where the output is not a terminal)."""
    if console.is_terminal:
        console.print(table)
        return
    Console(file=console.file, width=max(console.width, 160), no_color=True).print(table)


def _sweep_table(op_name: str, results: list) -> Table:
    """One row per shape; the static part goes in the title when all rows share it."""
    statics = {r.shape.static_label() for r in results}
    common = statics.pop() if len(statics) == 1 else None
    table = Table(title=f"{op_name} winners" + (f" ({common})" if common else ""))
    if common is None:
        table.add_column("static")
    for col in ("batch", "q", "kv", "default us", "winner", "us", "speedup", "note"):
        table.add_column(col, justify="left" if col in ("winner", "note") else "right")
    for r in results:
        note = "already in DB" if r.status == "skipped" else escape(r.note)
        if r.failures:
            note = f"{note} {r.failures} failed".strip()
        if r.resumed:
            note = f"{note} {r.resumed} resumed".strip()
        row = [] if common else [r.shape.static_label()]
        row += [
            str(r.shape.batch), str(r.shape.q_len), f"{r.shape.kv_len:,}", _fmt_us(r.default_us),
            _fmt_config(r.winner), _fmt_us(r.winner_us),
            "-" if r.speedup is None else f"{r.speedup:.2f}x", note,
        ]
        table.add_row(*row)
    return table


def _static_label(static_json: str) -> str:
    return escape(AttentionStaticKey.label_of(static_json))


@app.command("show")
def show_command(
    db: DbOption = None,
    op: Annotated[Optional[str], typer.Option("--op", help="Only this op's winners.")] = None,
    all_environments: Annotated[bool, typer.Option("--all", help="Include winners measured in other environments (not used at lookup).")] = False,
    misses: Annotated[bool, typer.Option("--misses", help="Instead: the keys the runtime served from the nearest winner or the default, still untuned (`sweep OP --from-misses` tunes them).")] = False,
) -> None:
    """Show the stored winners that apply in this environment (--all: every environment's)."""
    with _user_errors():
        from tuner.db import current_fingerprint, current_fingerprint_id

        database = _open_db(db, create=False)
        _check_op(database, op)
        fp = current_fingerprint_id()
        if misses:
            _show_misses(database, fp, op, db)
            return
        if all_environments:
            records = database.records(op=op)
        else:
            records = database.records(op=op, environment=current_fingerprint())
        groups: dict[tuple[str, str, str], list] = {}
        for r in records:  # a table per op, static key and (with --all) environment
            groups.setdefault((r.problem.op, r.problem.static_key, r.fingerprint_id if all_environments else ""),
                              []).append(r)
        for (op_name, static, env), rows in groups.items():
            title = f"{op_name} ({_static_label(static)})"
            if all_environments:
                title += f", environment {env}" + (" (this one)" if env == fp else "")
            header = ("batch", "q", "kv <=", "config", "us", "default us", "speedup")
            cells = [[
                str(r.problem.run_key.batch), str(r.problem.run_key.max_q_len), f"{r.problem.run_key.kv_len_bucket:,}",
                _fmt_config(r.config), _fmt_us(r.median_us), _fmt_us(r.default_median_us),
                "-" if r.speedup is None else f"{r.speedup:.2f}x",
            ] for r in rows]
            table = Table(title=title)
            for i, col in enumerate(header):
                # numbers never wrap; the config takes the width they leave (up to its longest
                # line, at most 22) and folds past it, so nothing is cut off in a narrow terminal
                table.add_column(col, justify="left" if col == "config" else "right", overflow="fold",
                                 min_width=_config_width(header, cells) if i == 3 else None)
            for row in cells:
                table.add_row(*row)
            console.print(table)
        scope = "stored" if all_environments else "stored that apply here"
        console.print(f"{len(records)} winners {scope} in {escape(database.display_url)}")
        shipped = _shipped_count()
        if shipped:
            console.print(f"{shipped} shipped winners apply here beneath them (`tuner doctor` lists the files)")
        if not records:
            console.print("run `tuner sweep OP` to tune an op (`tuner ops` lists them)")


def _config_width(header: tuple[str, ...], cells: list[list[str]], config_col: int = 3) -> int:
    """Room for the config column: its longest line, at most 22, at most what the other
    columns (each 1 border + 2 padding) leave of the terminal, at least 8."""
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(header)]
    others = sum(w + 3 for i, w in enumerate(widths) if i != config_col) + 3 + 1
    return max(8, min(22, widths[config_col], console.width - others))


def _shipped_count() -> int:
    """Shipped winners that apply in this environment (0 when none or unreadable: doctor says why)."""
    from tuner.db import current_fingerprint
    from tuner.db.shipped import load_shipped
    from tuner.runtime.table import op_rules

    try:  # the runtime's rules: what it would leave out is not counted (as in doctor)
        return load_shipped(current_fingerprint(), check=op_rules).applied
    except TunerError:
        return 0


def _check_op(database, op: str | None) -> None:
    """--op names one of tuner's ops or an op (a user's own @autotune function) the DB holds."""
    if op is None:
        return
    from tuner.ops import list_ops

    known = sorted(o.name for o in list_ops())
    if op not in known and op not in database.op_names():
        raise TunerError(f"unknown op {op!r}: not one of tuner's ops ({', '.join(known)}) and nothing of it "
                         f"in {database.display_url}")


def _tune_misses_command(op_name: str, db: Optional[str]) -> str:
    """The command that tunes an op's misses: a sweep for tuner's ops; for a function of the
    user's own (which no sweep can call), its program run once in tune mode."""
    from tuner.ops import list_ops

    where = "" if db is None else f" --db {shlex.quote(str(db))}"
    if op_name in {o.name for o in list_ops()}:
        return f"tuner sweep {op_name} --from-misses{where}"
    env = "" if db is None else f" TUNER_DB={shlex.quote(str(db))}"
    return f"TUNER_MODE=tune{env} python YOUR_PROGRAM.py (runs {op_name}'s missed calls, tuning each key once)"


def _show_misses(database, fp: str, op: str | None, db: Optional[str] = None) -> None:
    from tuner.db import current_fingerprint

    rows = database.misses(fp, op=op, environment=current_fingerprint())
    table = Table(title="runtime misses: served without an exact winner")
    for col in ("op", "static key", "batch", "q", "kv <=", "served", "times", "kv mean/max"):
        table.add_column(col, justify="left" if col in ("op", "static key", "served") else "right",
                         overflow="fold", no_wrap=col != "static key")
    for problem, served, count, lengths in rows:
        run = problem.run_key
        # the missed calls' lengths, where they had them on the host: mean and longest per call
        stats = "-" if lengths is None else f"{lengths.mean:,.0f}/{lengths.longest:,.0f}"
        table.add_row(problem.op, _static_label(problem.static_key), str(run.batch), str(run.max_q_len),
                      f"{run.kv_len_bucket:,}", served, str(count), stats)
    if rows:
        console.print(table)
    console.print(f"{len(rows)} missed keys without a winner in {escape(database.display_url)}"
                  + ("; to tune them:" if rows else ""))
    for op_name in dict.fromkeys(problem.op for problem, *_ in rows):
        console.print(f"  {escape(_tune_misses_command(op_name, db))}", soft_wrap=True)


@app.command("report")
def report_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for report.md and the PNG plots.")],
    db: DbOption = None,
    op: Annotated[Optional[str], typer.Option("--op", help="Only this op's winners.")] = None,
    bandwidth_gbps: Annotated[Optional[float], typer.Option("--bandwidth-gbps", min=1.0, callback=_finite, help="HBM bandwidth for the roofline plots (e.g. a measured device copy: 4280 on the H200); none: no roofline.")] = None,
    environment: Annotated[Optional[str], typer.Option("--environment", "-e", help="Report the winners of this environment id (`tuner doctor` lists them), e.g. a GPU's from a laptop; default: those that apply here.")] = None,
) -> None:
    """Plot an environment's winners (speedup over the default, roofline fraction) and write a Markdown summary."""
    with _user_errors():
        from tuner.db import current_fingerprint
        from tuner.report import summary_rows, write_report

        if out.exists() and not out.is_dir():
            raise TunerError(f"--out {out} is a file; the report is a directory")
        database = _open_db(db, create=False)
        _check_op(database, op)
        if environment is not None and environment not in database.fingerprints():
            known = ", ".join(sorted(database.fingerprints())) or "none"
            raise TunerError(f"--environment {environment!r} is not in the DB (it holds: {known})")
        groups = write_report(database, out, environment, op=op, bandwidth_gbps=bandwidth_gbps,
                              environment=None if environment else current_fingerprint())
        table = Table(title="winners by op and static key")
        for col in ("op", "static key", "winners", "geomean speedup", "max"):
            table.add_column(col, justify="left" if col in ("op", "static key") else "right",
                             overflow="fold", no_wrap=col != "static key")
        for op_name, label, n, gm, best in summary_rows(groups):
            table.add_row(op_name, escape(label), str(n), "-" if gm is None else f"{gm:.3f}x",
                          "-" if best is None else f"{best:.2f}x")
        console.print(table)
        console.print(f"wrote {escape(str(out / 'report.md'))} and {sum(len(g.images) for g in groups)} plots")


class ExportFormat(str, Enum):
    json = "json"
    lightllm = "lightllm"


def _write_atomically(path: Path, text: str) -> None:
    """text into path (gzip-compressed for a .gz name), whole or not at all, never through a
    link planted beside it (tuner.files)."""
    from tuner.files import write_atomically
    from tuner.jsonfile import file_bytes

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TunerError(f"cannot write {path}: {e.strerror or e}") from None
    write_atomically(path, file_bytes(path, text))


def _write_tree(out: Path, files: dict[str, str], replace: bool) -> int:
    """Write every file under `out`, or none: all are written to a staging directory inside
    `out` first, then moved into place (a failed move puts back what was there). A file
    that exists already is refused unless `replace`. Returns how many existed."""
    targets = {rel: out / rel for rel in files}
    root = out.resolve()
    for rel, target in targets.items():  # names were checked; this is the last word
        if not target.resolve().is_relative_to(root):
            raise TunerError(f"refusing to write {rel}: outside --out {out}")
    existing = [rel for rel, target in targets.items() if target.exists()]
    if existing and not replace:
        raise TunerError(f"{out / existing[0]} exists ({len(existing)} of the {len(files)} files do); "
                         "--force replaces them")
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tuner-export-", dir=out))
    except OSError as e:
        raise TunerError(f"cannot write under {out}: {e.strerror or e}") from None
    moved: list[tuple[Path, Path | None]] = []
    try:
        for i, (rel, text) in enumerate(files.items()):
            (staging / f"{i}.json").write_text(text)
        for i, (rel, target) in enumerate(targets.items()):
            target.parent.mkdir(parents=True, exist_ok=True)
            backup = None
            if target.exists():
                backup = staging / f"{i}.previous"
                target.replace(backup)
            (staging / f"{i}.json").replace(target)
            moved.append((target, backup))
    except OSError as e:
        for target, backup in reversed(moved):
            with contextlib.suppress(OSError):
                target.unlink()
                if backup is not None:
                    backup.replace(target)
        raise TunerError(f"cannot write under {out}: {e.strerror or e}; nothing was written") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return len(existing)


@app.command("export")
def export_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="File to write (json; gzip-compressed where the name ends in .gz, as for shipped tunings), or LightLLM's config directory (lightllm): lightllm/common/triton_utils/autotune_kernel_configs.")],
    format: Annotated[ExportFormat, typer.Option("--format", "-f", help="json: tuner's versioned schema, every environment. lightllm: FA3 winners as the files LightLLM's FA3 wrapper (kernel sgl_fa3_kvcache_ns:v1) reads.")] = ExportFormat.json,
    db: DbOption = None,
    op: Annotated[Optional[str], typer.Option("--op", help="Only this op's winners (lightllm: fa3, the only op LightLLM reads).")] = None,
    force: Annotated[bool, typer.Option("--force", help="lightllm: replace config files that exist already.")] = False,
) -> None:
    """Write the stored winners (with their environments) to a file or, for LightLLM, a directory."""
    with _user_errors():
        database = _open_db(db, create=False)
        _check_op(database, op)
        if format is ExportFormat.lightllm:
            from tuner.integrations.lightllm import KERNEL, lightllm_export

            if out.exists() and not out.is_dir():
                raise TunerError(f"--out {out} is a file; --format lightllm writes a directory")
            export = lightllm_export(database, op=op)  # names and keys all checked before writing
            if not export.files:
                raise TunerError("no FA3 winners LightLLM can read in the DB"
                                 + (f" ({_left_out(export.left_out)})" if export.left_out else ""))
            texts = {rel: json.dumps(content, indent=2, sort_keys=True) + "\n" for rel, content in export.files.items()}
            replaced = _write_tree(out, texts, force)
            console.print(f"exported {export.written} FA3 winners in {len(texts)} LightLLM files under "
                          f"{escape(str(out))} (kernel {KERNEL}; {replaced} replaced)")
            if export.substituted or export.defaulted:
                console.print(f"{export.substituted + export.defaulted} winners set pack_gqa, which LightLLM's "
                              f"wrapper does not pass: {export.substituted} written as their best measured config "
                              f"without it, {export.defaulted} (no measurements in the DB) as FA3's default "
                              "num_splits 0")
            if export.left_out:
                console.print(f"left out: {escape(_left_out(export.left_out))}")
            return
        from tuner.db import export_document

        document = export_document(database, op=op)
        if out.is_dir():
            raise TunerError(f"--out {out} is a directory; give a file path")
        _write_atomically(out, json.dumps(document, indent=1, sort_keys=True) + "\n")
        console.print(f"exported {len(document['records'])} winners to {escape(str(out))}")


def _left_out(reasons: dict[str, int]) -> str:
    return "; ".join(f"{n} {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]))


@app.command("import")
def import_command(
    file: Annotated[Path, typer.Argument(help="A JSON file written by `tuner export --format json` (gzip-compressed where its name ends in .gz).")],
    db: DbOption = None,
    replace: Annotated[bool, typer.Option("--replace", help="Replace stored winners even where the stored one is newer (what is replaced is kept in the DB's history).")] = False,
) -> None:
    """Load winners from a JSON export. The whole file is validated first (each config against its op's rules); on any error nothing is written. A stored winner newer than the imported one is kept, unless --replace."""
    with _user_errors():
        from tuner.db.jsonio import DocumentError, load_document, parse_document
        from tuner.ops import check_record

        rows = parse_document(load_document(file))  # all checked before the DB is touched
        for i, (problem, _, fields) in enumerate(rows):
            why = check_record(problem.op, problem.static_key, problem.run_key, fields["config"])
            if why is not None:
                raise DocumentError(f"{file}: the record of {problem.op} at {problem.run_key.to_json()}: {why}")
        database = _open_db(db)
        database.require_sound("import into")
        result = database.save_records(rows, replace=replace)
        console.print(f"imported {result.written + result.replaced} winners into {escape(database.display_url)} "
                      f"({result.written} new, {result.replaced} replaced an older one, {result.same} unchanged"
                      + (f", {result.kept} kept the DB's newer one: --replace replaces them" if result.kept else "")
                      + ")")


@app.command("doctor")
def doctor_command(db: DbOption = None) -> None:
    """Check the environment: fingerprint, shipped tunings, tuning DB, counts, integrity."""
    with _user_errors():
        from tuner.db import current_fingerprint, current_fingerprint_id
        from tuner.ops import list_ops

        fp, fp_id = current_fingerprint(), current_fingerprint_id()
        table = Table(title=f"environment fingerprint {fp_id}", show_header=False)
        table.add_column("field")
        table.add_column("value")
        for k, v in fp.items():
            table.add_row(k, "-" if v is None else escape(str(v)))
        console.print(table)
        ops = Table(title="ops")
        ops.add_column("op")
        ops.add_column("runs here")
        for op in list_ops():
            why = op.unavailable()
            ops.add_row(op.name, "yes" if why is None else f"no: {why}")
        console.print(ops)

        shipped_problems = _doctor_shipped(fp)  # before the DB: they apply without one
        from tuner.db import DamagedDBError, DBError, MissingDBError, applies

        try:
            database = _open_db(db, create=False)
        except MissingDBError as e:  # nothing wrong: nothing tuned here yet
            console.print(f"tuning DB: {escape(str(e))}")
            _print_problems(shipped_problems)
            raise typer.Exit(1 if shipped_problems else 0)
        except DamagedDBError as e:  # damage is a problem found, not bad input (that exits 2)
            _print_problems([str(e)] + shipped_problems)
            raise typer.Exit(1)
        console.print(f"tuning DB: {escape(database.display_url)}")
        try:
            counts = database.counts()
            fps = database.fingerprints()
        except DBError as e:
            _print_problems([str(e)] + database.integrity() + shipped_problems)
            raise typer.Exit(1)
        envs = Table(title="stored per environment (used at lookup where they apply here)")
        envs.add_column("environment", no_wrap=True)
        envs.add_column("device")
        for col in ("records", "measurements", "used"):
            envs.add_column(col, justify="right")
        for env_id in sorted(set(counts) | set(fps)):
            c = counts.get(env_id, {"records": 0, "measurements": 0})
            data = fps.get(env_id, {})
            used = "yes" if env_id == fp_id else "yes (applies)" if data and applies(data, fp) else "no"
            envs.add_row(env_id, escape(str(data.get("device", "?"))), str(c["records"]), str(c["measurements"]), used)
        console.print(envs)
        problems = database.integrity() + shipped_problems
        if problems:
            _print_problems(problems)
            raise typer.Exit(1)
        console.print("[green]integrity: ok[/]")


def _print_problems(problems: list[str]) -> None:
    for p in problems:
        err.print(f"[red]problem:[/] {escape(p)}", highlight=False, soft_wrap=True)


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _doctor_shipped(fp: dict) -> list[str]:
    """Print the shipped tunings and whether they apply here; return the problems found."""
    from tuner.db.shipped import load_shipped, shipped_paths
    from tuner.runtime.table import op_rules

    try:
        if not shipped_paths():
            console.print("shipped tunings: none (tuning_cache/*.tunings.json[.gz] in a checkout, or $TUNER_SHIPPED)")
            return []
        layer = load_shipped(fp, check=op_rules)  # the runtime's rules: what it would leave out is not used
    except TunerError as e:
        return [str(e)]
    if not layer.files:
        return layer.errors
    table = Table(title="shipped tunings (read-only, beneath the DB; the DB wins a key both hold)")
    names = [_display_path(f.path) for f in layer.files]
    table.add_column("file", overflow="fold", min_width=min(40, max(map(len, names), default=4)))
    for col in ("records", "used here"):
        table.add_column(col, justify="right")
    table.add_column("why not", overflow="fold")
    for f, name in zip(layer.files, names):
        why = "; ".join(f.mismatches.values())
        table.add_row(escape(name), str(f.records), str(f.applied), escape(why) or "-")
    console.print(table)
    refused = [f"shipped tunings {name}: {f.refused} records left out, their ops cannot run their configs "
               f"(first: {f.refused_why})" for f, name in zip(layer.files, names) if f.refused]
    return layer.errors + refused


@app.command("prune")
def prune_command(
    db: DbOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Only list what would be removed.")] = False,
) -> None:
    """Remove what can never apply here, in one transaction: other GPUs' and other kernel-library versions' records and measurements, and malformed rows.

    Records of an older tuner or another driver on the same GPU and libraries still apply, and are kept.
    """
    with _user_errors():
        from tuner.db import current_fingerprint

        database = _open_db(db, create=False)
        with contextlib.suppress(TunerError):  # malformed fingerprints: their ids still show
            fps = database.fingerprints()
        fps = locals().get("fps", {})
        removed = database.prune(current_fingerprint(), dry_run=dry_run)
        if not removed:
            console.print(f"nothing to prune in {escape(database.display_url)}: every record can apply here")
            return
        table = Table(title="would remove (dry run)" if dry_run else "removed")
        table.add_column("environment", no_wrap=True)
        table.add_column("device")
        table.add_column("records", justify="right")
        table.add_column("measurements", justify="right")
        for env_id, c in sorted(removed.items()):
            device = "malformed rows" if env_id == "malformed" else str(fps.get(env_id, {}).get("device", "?"))
            table.add_row(env_id, escape(device), str(c["records"]), str(c["measurements"]))
        console.print(table)


# how this process was started, for a sweep's supervisor to start its worker alike: set only
# while main() runs as the console script (from sys.argv); None where the CLI is called
# in-process (with an argv, as tests do), and the sweep then runs in this process
_INVOCATION: list[str] | None = None


def _invocation() -> list[str]:
    program = sys.argv[0]
    start = ["-m", "tuner"] if Path(program).name == "__main__.py" else [program]
    return [sys.executable, *start, *sys.argv[1:]]


def main(argv: list[str] | None = None) -> None:
    """The console script: usage errors, like every other bad input, are one line and exit 2."""
    global _INVOCATION
    _INVOCATION = _invocation() if argv is None else None
    try:
        code = app(args=argv, prog_name="tuner", standalone_mode=False)
    except click_exceptions.NoArgsIsHelpError as e:
        help_text = e.format_message()  # typer's rich help prints itself and leaves this empty
        if help_text.strip():
            console.print(help_text, markup=False, highlight=False)
        code = 0
    except click_exceptions.UsageError as e:
        _print_error(e.format_message().strip().replace("\n", " "))
        code = 2
    except typer.Abort:
        code = 130
    sys.exit(code if isinstance(code, int) else 0)
