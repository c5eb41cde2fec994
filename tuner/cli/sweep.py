"""`tuner ops` and `tuner sweep`: the shapes at the user's heads, the sweep with its progress, its plan and table."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from typing_extensions import Annotated

from tuner import settings
from tuner.cli import base  # its _INVOCATION, as main() set it
from tuner.cli.base import DbOption, finite, home_expanded, open_db, user_errors, app, console, err, print_table
from tuner.cli.format import counted, fmt_config, fmt_us
from tuner.errors import TunerError

_SWEEP = settings.TIMERS["sweep-cpu"]  # the sweep's timing options' defaults


def _open_db_to_sweep(db: str | None, force: bool):
    """The DB a sweep writes to. A damaged one is an error, unless --force and the file is
    tuner's own: then it is renamed aside (never deleted) and a new DB started. Malformed
    rows are an error even with --force: `tuner prune` mends them."""
    from tuner.db import DamagedDBError, DBError

    try:
        database = open_db(db)
    except DamagedDBError as e:
        return _set_aside_and_open(db, e, force)
    if database.path is not None and database.path.exists() and not os.access(database.path, os.W_OK):
        database.close()  # (else found at the first store, after minutes of measuring)
        raise DBError(f"cannot write tuning DB {database.display_url}: the file is read-only for this user")
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
    return open_db(db)


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
    print_table(table)
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


@dataclasses.dataclass(frozen=True)
class _HeadsRequest:
    """sweep's "your model" options: the heads every shape is swept at, if any are given."""

    model: str | None
    tp: str | None
    heads: str | None
    head_dim: int | None
    window: int | None
    softcap: float | None
    sinks: bool
    dtype: str | None
    page_size: int | None

    def given(self) -> bool:
        return any(v is not None for v in (self.model, self.tp, self.heads, self.head_dim, self.window, self.softcap,
                                           self.dtype, self.page_size)) or self.sinks

    def apply(self, shapes: list) -> list:
        from tuner.workload.models import apply_heads, attention_from_flags, model_attention, parse_tp, per_gpu_heads

        if self.model is not None and self.heads is not None:
            raise TunerError("give --model or --heads, not both")
        if self.tp is not None and self.model is None:
            raise TunerError("--tp splits a --model's heads; with --heads give each GPU's own")
        hand = self.head_dim is not None or self.window is not None or self.softcap is not None or self.sinks
        if hand and self.heads is None:
            raise TunerError("--head-dim, --window, --softcap and --sinks go with --heads (a --model says its own)")
        if self.dtype is not None and self.dtype not in ("bfloat16", "float16"):
            raise TunerError(f"--dtype must be bfloat16 or float16, got {self.dtype!r:.40}")
        if self.page_size is not None and not (1 <= self.page_size <= 1024 and not self.page_size & (self.page_size - 1)):
            raise TunerError(f"--page-size must be a power of two in [1, 1024], got {self.page_size}")
        if self.model is not None:
            kinds = per_gpu_heads(model_attention(self.model), parse_tp("1" if self.tp is None else self.tp))
        elif self.heads is not None:
            head_dim = 128 if self.head_dim is None else self.head_dim
            kinds = [attention_from_flags(self.heads, head_dim, self.window, self.softcap, self.sinks)]
        else:
            kinds = None
        if kinds is None:  # dtype or page size alone: the grid's own heads
            return [dataclasses.replace(s, dtype=self.dtype or s.dtype, page_size=self.page_size or s.page_size)
                    for s in shapes]
        return apply_heads(shapes, kinds, dtype=self.dtype, page_size=self.page_size)


@app.command("sweep")
def sweep_command(
    op_name: Annotated[str, typer.Argument(metavar="OP", help="Op to tune (see `tuner ops`).")],
    grid: Annotated[Optional[str], typer.Option("--grid", "-g", help="Named grid of shapes of the op, see `tuner ops` (default: decode on a GPU; on a CPU cpu-small, or the op's first cpu- grid).")] = None,
    shapes_file: Annotated[Optional[Path], typer.Option("--shapes", callback=home_expanded, help="JSON file: a list of shape objects (batch, kv_len, q_len, num_q_heads, ...).")] = None,
    from_misses: Annotated[bool, typer.Option("--from-misses", help="Tune the keys the runtime missed for OP (see `tuner show --misses`), each at the top of its kv bucket; on serving batches (--lengths serving) where the missed calls' lengths were mixed. With --grid: the grid's run keys (e.g. serving: every capture batch size x kv 32-128k) for every static key the runtime missed, a new deployment's whole grid.")] = False,
    lengths: Annotated[Optional[str], typer.Option("--lengths", help="What each shape's batch holds: full (every sequence at kv_len, the grids' default) or serving (a batch per length distribution of serving traffic, more rounds of them at batch 1-3, each with its longest sequence in the kv bucket; timed as their mean), or graph (graph replays at the bound, for decode_attention_graph). Overrides the shapes'. The same keys as full: --force to re-measure keys that have full-batch winners.")] = None,
    db: DbOption = None,
    force: Annotated[bool, typer.Option("--force", help="Measure again what the DB already holds; an unreadable DB file is renamed aside (kept) and a new one started.")] = False,
    search: Annotated[Optional[str], typer.Option("--search", help="Search strategy (tuner.search): halving times every config quickly first, then only the contenders (the default and those within 10% of the fastest) fully; exhaustive times every config fully; guided halves on power-of-two batch sizes and searches every other batch size over its two nearest ones' fastest configs, and the fastest few with their split count scaled to its batch (for dense grids such as serving). Default: guided where every shape is a serving batch (the serving grid, --lengths serving), else halving.")] = None,
    halving: Annotated[bool, typer.Option("--halving", help="The same as --search halving.")] = False,
    backends: Annotated[Optional[str], typer.Option("--backends", help="decode_attention only: search only these backends, comma-separated. Default: fa3,triton_decode where every shape is a serving batch (FlashInfer's per-call plan cannot be held by a captured decode graph), else every installed one.")] = None,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed calls before timing each config.")] = _SWEEP.warmup,
    repeats: Annotated[int, typer.Option(min=1, help="Timed calls per config (at most).")] = _SWEEP.repeats,
    max_seconds: Annotated[float, typer.Option(min=0.001, callback=finite, help="CPU only: stop timing a config after this long (once 5 calls are timed).")] = _SWEEP.max_seconds,
    min_gain: Annotated[float, typer.Option(min=0.0, max=1.0, callback=finite, help="A winner must beat the default by this fraction, and by more than the noise.")] = settings.MIN_GAIN,
    second_trial: Annotated[bool, typer.Option("--second-trial/--no-second-trial", help="Serving shapes: confirm each winner once more, side by side with the default, on a second batch of freshly drawn lengths, and keep the default where it does not hold (one draw of lengths can crown a config that loses on another).")] = True,
    model: Annotated[Optional[str], typer.Option("--model", rich_help_panel="Your model", help="Sweep the grid (or shapes file) at this model's attention heads: a name from the built-in table (e.g. llama-3.1-8b, qwen3-30b-a3b, gemma-2-9b, gpt-oss-20b; an unknown name lists them) or a Hugging Face config.json (or its directory), read offline. Models with sliding-window layers give a static key per layer kind.")] = None,
    tp: Annotated[Optional[str], typer.Option("--tp", rich_help_panel="Your model", help="With --model: tensor-parallel sizes, e.g. 1,2,4,8; each gives its per-GPU heads (default 1).")] = None,
    heads: Annotated[Optional[str], typer.Option("--heads", rich_help_panel="Your model", help="Instead of --model: per-GPU query/kv heads, e.g. 48/8.")] = None,
    head_dim: Annotated[Optional[int], typer.Option("--head-dim", rich_help_panel="Your model", help="With --heads: the head dim (default 128).")] = None,
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
    with user_errors(), contextlib.ExitStack() as scope:
        from tuner.ops import get_op

        from tuner.ops.decode_attention import backends_only

        op = get_op(op_name)
        if backends is not None:
            _restrict_backends(op, backends, scope)
        from tuner.search import get_strategy
        from tuner.sweep import default_backends, default_strategy

        if halving and search is not None and get_strategy(search).name != "halving":
            raise TunerError(f"give --halving or --search {search:.40}, not both")
        chosen = get_strategy("halving" if halving else search).name if halving or search else None
        why = op.unavailable()
        if why is not None and not (plan_only and op.device() == "cuda"):  # (a GPU's plan is made anywhere)
            raise TunerError(f"op {op.name} cannot run here: {why}")
        yours = _HeadsRequest(model, tp, heads, head_dim, window, softcap, sinks, dtype, page_size)
        shapes, database = _shapes_to_sweep(op, grid, shapes_file, from_misses, lengths, yours, db, force,
                                            plan_only)
        if shapes is None:
            return
        strategy = chosen or default_strategy(shapes)
        if backends is None and (serving_backends := default_backends(op, shapes)) is not None:
            scope.enter_context(backends_only(serving_backends))
        if plan_only:
            source = "the misses" if from_misses else f"{shapes_file}" if shapes_file else \
                f"grid {grid or _default_grid(op)}"
            _print_plan(op, shapes, strategy, op.device(), source, None if force else _snapshot(database, db))
            if why is not None:
                console.print(f"({op.name} cannot run here: {escape(why)}; planned as on an H200.)",
                              soft_wrap=True, highlight=False)
            elif op.device() == "cpu" and max(s.batch * s.kv_len for s in shapes) > _CPU_SIZED_KEYS:
                console.print("(On a CPU the kernels run interpreted: shapes of a GPU's size take far longer than "
                              "on one. Plan and sweep them on the GPU that serves.)", soft_wrap=True, highlight=False)
            return
        database = database or _open_db_to_sweep(db, force)
        timer = _sweep_timer(op.device(), warmup, repeats, max_seconds)
        from tuner.ranks import ranks_from_launcher
        from tuner.sweep.guard import supervise, worker_flight, worker_run

        ranks = ranks_from_launcher()  # under torchrun: share the work, agree on the winners
        flight = worker_flight()
        if isolate and ranks is None and flight is None and base._INVOCATION is not None:
            raise typer.Exit(supervise(base._INVOCATION, database))
        _run_sweep(op, shapes, database, ranks, force=force,
                   sweep_options=dict(timer=timer, force=force, min_gain=min_gain, strategy=strategy, ranks=ranks,
                                      second_trial=second_trial, dense_pass=dense_pass, flight=flight,
                                      run_id=worker_run()))


def _restrict_backends(op, backends: str, scope: contextlib.ExitStack) -> None:
    """--backends: decode_attention's search held to the backends named, for the sweep's scope."""
    from tuner.ops.decode_attention import BACKEND_OPS, BACKENDS, GRAPH_OP_NAME, backends_only

    if op.name not in BACKEND_OPS:
        raise TunerError(f"--backends is for {' and '.join(BACKEND_OPS)}, not {op.name}")
    scope.enter_context(backends_only(b.strip() for b in backends.split(",") if b.strip()))
    if op.name == GRAPH_OP_NAME and not any(b.graph_capturable for b in BACKENDS.values()):
        raise TunerError(f"--backends {backends}: {op.name} needs one that runs in a captured graph")


def _sweep_timer(device: str, warmup: int, repeats: int, max_seconds: float):
    """CUDA-graph replay with a cold L2, timed by CUDA events, on a GPU; the wall clock on a CPU."""
    from tuner.bench import timer_for

    preset = settings.TIMERS["sweep-gpu" if device == "cuda" else "sweep-cpu"]
    return timer_for(dataclasses.replace(preset, warmup=warmup, repeats=repeats, max_seconds=max_seconds), device)


def _shapes_to_sweep(op, grid: str | None, shapes_file: Path | None, from_misses: bool, lengths: str | None,
                     yours: "_HeadsRequest", db: Optional[str], force: bool,
                     plan_only: bool = False) -> tuple[list | None, object]:
    """The shapes a sweep measures (None: no misses to tune), and the DB where reading the
    misses opened it (a plan only reads the misses: it creates no DB)."""
    from tuner.ops import get_grid
    from tuner.workload import load_shapes
    from tuner.workload.shapes import LENGTHS

    if lengths is not None and lengths not in LENGTHS:
        raise TunerError(f"--lengths must be one of {', '.join(LENGTHS)}, got {lengths!r:.40}")
    if shapes_file is not None and (grid is not None or from_misses):
        raise TunerError("--shapes goes alone: give --shapes, or --grid, or --from-misses (--grid with "
                         "--from-misses: the grid's run keys for the missed static keys)")
    if from_misses and yours.given():
        raise TunerError("--from-misses sweeps the static keys the runtime missed, as they were: give none of "
                         "--model, --heads and the other heads options (--tp, --head-dim, --dtype, ...)")
    database = None
    if from_misses:
        from tuner.sweep import plan_from_misses

        if db is not None and not plan_only:  # (no misses without a DB: a mistyped --db is an error, not a new one)
            open_db(db, create=False).close()
        database = open_db(db, create=False) if plan_only else _open_db_to_sweep(db, force)
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
        shapes = get_grid(op, grid or _default_grid(op))
    if lengths is not None:
        shapes = [dataclasses.replace(s, lengths=lengths) for s in shapes]
    shapes = _graph_lengths(op, shapes, lengths)
    return (yours.apply(shapes) if yours.given() else shapes), database


def _graph_lengths(op, shapes: list, asked: str | None = None) -> list:
    """A graph op measures graph replays only (its shapes' kv_len is their capture bound), and
    only a graph op does: a graph-replay timing stored as another op's record would serve
    eager calls. A grid's or shapes file's full lengths become graph ones; --lengths full
    (asked) is refused as another kind is."""
    if op.name in settings.GRAPH_RECORD_OPS.values():
        wrong = sorted({s.lengths for s in shapes} - {"graph", "full"} | ({asked} - {None, "graph"}))
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
        console.print(f"sweeping [bold]{op.name}[/] on {op.device()}{shared}, {searched}: "
                      f"{counted(len(shapes), 'shape')}, {counted(total, 'measurement')} -> "
                      f"{escape(database.display_url)}")
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
            print_table(_sweep_table(op.name, results))
        resume = ("the same command without --force resumes the rest (with it, it starts over)" if force
                  else "the same command resumes the rest")
        err.print(f"[yellow]interrupted[/] after {len(results)} of {interrupted.total} shapes; what was "
                  f"measured is stored, and {resume}", highlight=False, soft_wrap=True)
        raise typer.Exit(130)
    if leader:
        print_table(_sweep_table(op.name, results))
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
        self.done, self.labels, self.now = 0, [], ""
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def advance(self, n: int, label: str) -> None:
        """n measurements done, of the shape `label` names; a step that measures none (a dense
        pass names itself so) is the last shape's, not a shape of its own."""
        self.done += n
        if n and (not self.labels or self.labels[-1] != label):
            self.labels.append(label)
        self.now = label

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        if self.done >= self.total:  # what is left is no first-trial measurement: no estimate of it
            left = ", confirming the last winners (second trials, dense passes)"
        else:
            left = f", about {_duration(elapsed * (self.total - self.done) / self.done)} left" if self.done else ""
        shape = f" ({self.now})" if self.now else ""
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


def _default_grid(op) -> str:
    """--grid's default: decode on a GPU; on a CPU the op's cpu-small grid, else its first CPU grid."""
    if op.device() == "cuda":
        return "decode"
    cpu_grids = [name for name in op.grids if name.startswith("cpu-")]
    return "cpu-small" if "cpu-small" in cpu_grids or not cpu_grids else cpu_grids[0]


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _searched(op, strategy: str) -> str:
    """What a sweep searches, for its plan and its log: "guided search (fa3, triton_decode)"."""
    from tuner.ops.decode_attention import BACKEND_OPS, GRAPH_OP_NAME

    if op.name not in BACKEND_OPS:
        return f"{strategy} search"
    from tuner.ops.decode_attention import BACKENDS, installed

    searched = [b for b in BACKENDS.values() if op.name != GRAPH_OP_NAME or b.graph_capturable]
    runs = [b.name for b in installed() if b in searched]
    absent = [b.name for b in searched if b.name not in runs]
    return f"{strategy} search ({', '.join(runs)}" + (f"; {', '.join(absent)} cannot run here)" if absent else ")")


# keys in a batch past which a shape is a GPU's, not a CPU grid's (cpu-small's largest: 4 x 1k)
_CPU_SIZED_KEYS = 16 * 1024


def _snapshot(database, db: Optional[str]):
    """The winners that apply here in the DB a sweep would write, for its plan; None where
    there is no DB yet (a plan creates none)."""
    from tuner.db import MissingDBError, current_fingerprint

    try:
        database = database or open_db(db, create=False)
    except MissingDBError:
        return None
    return database.snapshot(current_fingerprint())


def _pace(op, plan) -> str:
    """Where the estimate's pace comes from: measured for one op on an H200 (settings)."""
    if op.name != settings.PLAN_PACE_OP:
        said = f"at {settings.PLAN_PACE_OP}'s measured pace on an H200 ({op.name}'s own is not measured"
        return said + ("; FlashInfer also compiles each kernel variant on its first run, 15-25 s each)"
                       if op.name == "flashinfer" else ")")
    if plan.fresh_estimate_s is None:
        return ("at an H200's measured pace with Triton's cache warm (a fresh machine compiles its Triton "
                "candidates first)")
    return (f"at an H200's measured pace with Triton's cache warm, about {_duration(plan.fresh_estimate_s)} "
            "on a fresh one")


def _print_plan(op, shapes: list, strategy: str, device: str, source: str = "", snapshot=None) -> None:
    """sweep --plan: the shapes (of source: a grid, a shapes file, the misses) by static key,
    their candidates, the estimated GPU time, and with the DB's snapshot the shapes a sweep
    keeps (their winner is stored) or measures once (one key with another)."""
    from tuner.sweep.plan import SweepPlan

    if not shapes:
        raise TunerError("the plan holds no shapes: give a grid, a shapes file or misses that have some")
    plan = SweepPlan.of(op, shapes, strategy, device)
    of = f" ({escape(source)})" if source else ""
    table = Table(title=f"plan: {op.name}{of}, {_searched(op, strategy)}, on {device}")
    for col in ("static key", "shapes", "batches", "kv", "lengths"):
        table.add_column(col, justify="right" if col == "shapes" else "left")
    for key, group in plan.by_static_key().items():
        batches, kvs = sorted({s.batch for s in group}), sorted({s.kv_len for s in group})
        table.add_row(escape(key), str(len(group)), f"{batches[0]}-{batches[-1]}", f"{kvs[0]:,}-{kvs[-1]:,}",
                      ", ".join(sorted({s.lengths for s in group})))
    print_table(table)
    if plan.estimate_s is None and device == "cuda":
        estimate = "no time estimate for graph replays yet"
    elif plan.estimate_s is None:
        estimate = "no time estimate off a GPU (it depends on the op and the machine)"
    else:
        estimate = f"about {_duration(plan.estimate_s)} of GPU time " + _pace(op, plan)
    console.print(f"{counted(len(shapes), 'shape')}, {counted(plan.candidates, 'candidate config')}; {estimate}. "
                  "Nothing was run.", soft_wrap=True, highlight=False)
    stored, shared = plan.kept(op, snapshot) if snapshot is not None else (0, 0)
    if stored or shared:  # (the estimate counts them all: an upper bound)
        said = [f"{stored} with a winner stored here (kept; --force measures them again)"] if stored else []
        said += [f"{shared} of a key another shape measures"] if shared else []
        console.print(f"Of the shapes, {' and '.join(said)}.", soft_wrap=True, highlight=False)


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
            str(r.shape.batch), str(r.shape.q_len), f"{r.shape.kv_len:,}", fmt_us(r.default_us),
            fmt_config(r.winner), fmt_us(r.winner_us),
            "-" if r.speedup is None else f"{r.speedup:.2f}x", note,
        ]
        table.add_row(*row)
    return table
