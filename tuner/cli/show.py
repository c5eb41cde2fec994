"""`tuner show`: the stored winners that apply here (or everywhere), or the runtime's misses and how to tune them."""

from __future__ import annotations

import shlex
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table
from typing_extensions import Annotated

from tuner.cli.base import DbOption, check_op, open_db, user_errors, app, console, print_table
from tuner.cli.format import counted, fmt_config, fmt_us
from tuner.errors import TunerError
from tuner.keys import AttentionStaticKey


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
    with user_errors():
        from tuner.db import MissingDBError, current_fingerprint, current_fingerprint_id

        if misses and all_environments:  # a miss is tuned where it was missed: this environment's
            raise TunerError("--misses lists this environment's misses; --all is for winners")
        try:
            database = open_db(db, create=False)
        except MissingDBError as e:
            if misses:  # the runtime makes the DB as it records its first miss, where its directory exists
                raise TunerError(f"no misses recorded: {e.args[0].partition(' yet')[0]} (a server in lookup "
                                 "mode makes it as it records its first miss, if its directory exists)") from None
            _show_no_db(str(e))  # what the shipped tunings give still applies
            return
        check_op(database, op)
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
            title = f"{escape(op_name)} ({escape(_static_label(static))})"  # (names come from the DB: no markup)
            if all_environments:
                title += f", environment {env}" + (" (this one)" if env == fp else "")
            header = ("batch", "q", "kv <=", "config", "us", "default us", "speedup")
            cells = [[
                str(r.problem.run_key.batch), str(r.problem.run_key.max_q_len), f"{r.problem.run_key.kv_len_bucket:,}",
                fmt_config(r.config), fmt_us(r.median_us), fmt_us(r.default_median_us),
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
            print_table(table)
        scope = "stored" if all_environments else f"stored that appl{'ies' if len(records) == 1 else 'y'} here"
        console.print(f"{counted(len(records), 'winner')} {scope} in {escape(database.display_url)}")
        _show_shipped(swept=bool(records))


def _show_no_db(why: str) -> None:
    console.print(escape(why))
    _show_shipped(swept=False)


def _show_shipped(swept: bool) -> None:
    shipped = _shipped_count()
    if shipped:
        console.print(f"{shipped} shipped winners apply here beneath them (`tuner doctor` lists the files)")
    if not swept:
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
        table.add_row(escape(problem.op), escape(_static_label(problem.static_key)), str(run.batch),
                      str(run.max_q_len), f"{run.kv_len_bucket:,}", escape(served), str(count), stats)
    if rows:
        print_table(table)
    console.print(f"{counted(len(rows), 'missed key')} without a winner in {escape(database.display_url)}"
                  + ("; to tune them:" if rows else ""))
    for op_name in dict.fromkeys(problem.op for problem, *_ in rows):
        console.print(f"  {escape(_tune_misses_command(op_name, db))}", soft_wrap=True)
