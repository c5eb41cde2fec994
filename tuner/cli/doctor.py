"""`tuner doctor` and `tuner prune`: the environment and the tuning DB checked; what can never apply here removed."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table
from typing_extensions import Annotated

from tuner.cli.base import DbOption, open_db, user_errors, app, console, err, print_table
from tuner.errors import TunerError


@app.command("doctor")
def doctor_command(db: DbOption = None) -> None:
    """Check the environment: fingerprint, shipped tunings, tuning DB, counts, integrity."""
    with user_errors():
        from tuner.db import current_fingerprint, current_fingerprint_id
        from tuner.ops import list_ops

        fp, fp_id = current_fingerprint(), current_fingerprint_id()
        table = Table(title=f"environment fingerprint {fp_id}", show_header=False)
        table.add_column("field")
        table.add_column("value")
        for k, v in fp.items():
            table.add_row(k, "-" if v is None else escape(str(v)))
        print_table(table)
        ops = Table(title="ops")
        ops.add_column("op")
        ops.add_column("runs here")
        for op in list_ops():
            why = op.unavailable()
            ops.add_row(op.name, "yes" if why is None else f"no: {why}")
        print_table(ops)

        shipped_problems = _doctor_shipped(fp)  # before the DB: they apply without one
        from tuner.db import DamagedDBError, DBError, MissingDBError, applies

        try:
            database = open_db(db, create=False)
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
        print_table(envs)
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
    print_table(table)
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
    with user_errors():
        from tuner.db import current_fingerprint

        database = open_db(db, create=False)
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
        print_table(table)
