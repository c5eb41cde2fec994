"""`tuner report`, `export` and `import`: the stored winners written out to files (whole or none) and read back in."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table
from typing_extensions import Annotated

from tuner.cli.base import (DbOption, check_op, finite, home_expanded, open_db, user_errors, app, console, err,
                             print_table)
from tuner.cli.format import counted
from tuner.errors import TunerError
from tuner.files import refuse_special
from tuner.jsonfile import is_stdio


@app.command("report")
def report_command(
    out: Annotated[Path, typer.Option("--out", "-o", callback=home_expanded, help="Directory for report.md and the PNG plots (an earlier report's plots there are removed).")],
    db: DbOption = None,
    op: Annotated[Optional[str], typer.Option("--op", help="Only this op's winners.")] = None,
    bandwidth_gbps: Annotated[Optional[float], typer.Option("--bandwidth-gbps", min=1.0, callback=finite, help="HBM bandwidth for the roofline plots (e.g. a measured device copy: 4280 on the H200); none: no roofline.")] = None,
    environment: Annotated[Optional[str], typer.Option("--environment", "-e", help="Report the winners of this environment id (`tuner doctor` lists them), e.g. a GPU's from a laptop; default: those that apply here.")] = None,
) -> None:
    """Plot an environment's winners (speedup over the default, roofline fraction) and write a Markdown summary."""
    with user_errors():
        from tuner.db import current_fingerprint
        from tuner.report import summary_rows, write_report

        if out.exists() and not out.is_dir():
            raise TunerError(f"--out {out} is a file; the report is a directory")
        database = open_db(db, create=False)
        check_op(database, op)
        if environment is not None and environment not in database.fingerprints():
            known = ", ".join(sorted(database.fingerprints())) or "none"
            raise TunerError(f"--environment {environment!r} is not in the DB (it holds: {known})")
        groups = write_report(database, out, environment, op=op, bandwidth_gbps=bandwidth_gbps,
                              environment=None if environment else current_fingerprint())
        if not groups:
            console.print(f"no winners{f' of {escape(op)}' if op else ''} apply here: wrote "
                          f"{escape(str(out / 'report.md'))}, which says so")
            return
        table = Table(title="winners by op and static key")
        for col in ("op", "static key", "winners", "geomean speedup", "max"):
            table.add_column(col, justify="left" if col in ("op", "static key") else "right",
                             overflow="fold", no_wrap=col != "static key")
        for op_name, label, n, gm, best in summary_rows(groups):
            table.add_row(escape(op_name), escape(label), str(n), "-" if gm is None else f"{gm:.3f}x",
                          "-" if best is None else f"{best:.2f}x")
        print_table(table)
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
    for target in targets.values():
        refuse_special(target)
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
            moved.append((target, backup))  # (before the move in: a failed one still has its file put back)
            (staging / f"{i}.json").replace(target)
    except OSError as e:
        for target, backup in reversed(moved):
            with contextlib.suppress(OSError):
                target.unlink(missing_ok=True)
            if backup is not None:
                with contextlib.suppress(OSError):
                    backup.replace(target)
        raise TunerError(f"cannot write under {out}: {e.strerror or e}; nothing was written") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return len(existing)


@app.command("export")
def export_command(
    out: Annotated[Path, typer.Option("--out", "-o", callback=home_expanded, help="File to write (json; gzip-compressed where the name ends in .gz, as for shipped tunings; - for standard output), or LightLLM's config directory (lightllm): lightllm/common/triton_utils/autotune_kernel_configs.")],
    format: Annotated[ExportFormat, typer.Option("--format", "-f", help="json: tuner's versioned schema, every environment. lightllm: FA3 winners as the files LightLLM's FA3 wrapper (kernel sgl_fa3_kvcache_ns:v1) reads.")] = ExportFormat.json,
    db: DbOption = None,
    op: Annotated[Optional[str], typer.Option("--op", help="Only this op's winners (lightllm: fa3, the only op LightLLM reads).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a file (json) or LightLLM config files that exist already.")] = False,
) -> None:
    """Write the stored winners (with their environments) to a file or, for LightLLM, a directory."""
    with user_errors():
        database = open_db(db, create=False)
        check_op(database, op)
        if format is ExportFormat.lightllm:
            from tuner.integrations.lightllm import KERNEL, lightllm_export

            if is_stdio(out) or (out.exists() and not out.is_dir()):
                raise TunerError(f"--out {out} is {'standard output' if is_stdio(out) else 'a file'}; "
                                 "--format lightllm writes a directory")
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
        if not document["records"]:
            raise TunerError(f"no winners{f' of {op}' if op else ''} in {database.display_url}: nothing to export")
        text = json.dumps(document, indent=1, sort_keys=True) + "\n"
        exported = counted(len(document["records"]), "winner")
        if is_stdio(out):  # the document alone on standard output (a pipe into `tuner import -`)
            _write_stdout(text)
            err.print(f"exported {exported} to standard output")
            return
        if out.is_dir():
            raise TunerError(f"--out {out} is a directory; give a file path")
        if database.path is not None and out.exists() and out.resolve() == database.path.resolve():
            raise TunerError(f"--out {out} is the tuning DB itself; give another file")
        if (out.is_file() or out.is_symlink()) and not force:
            raise TunerError(f"--out {out} exists; --force replaces it")
        _write_atomically(out, text)
        console.print(f"exported {exported} to {escape(str(out))}")


def _write_stdout(text: str) -> None:
    """text to standard output; a reader that stopped early (`| head`) ends the command with
    one line, exit 1, not a traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the interpreter's own flush at exit)
        err.print("export: standard output closed before the whole document was written")
        raise typer.Exit(1) from None


def _left_out(reasons: dict[str, int]) -> str:
    return "; ".join(f"{n} {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]))


@app.command("import")
def import_command(
    file: Annotated[Path, typer.Argument(callback=home_expanded, help="A JSON file written by `tuner export --format json` (gzip-compressed where its name ends in .gz; - reads standard input).")],
    db: DbOption = None,
    replace: Annotated[bool, typer.Option("--replace", help="Replace stored winners even where the stored one is newer (what is replaced is kept in the DB's history).")] = False,
) -> None:
    """Load winners from a JSON export. The whole file is validated first (each config against its op's rules); on any error nothing is written. A stored winner newer than the imported one is kept, unless --replace."""
    with user_errors():
        from tuner.db.jsonio import DocumentError, load_document, parse_document
        from tuner.ops import check_record

        rows = parse_document(load_document(file))  # all checked before the DB is touched
        for i, (problem, _, fields) in enumerate(rows):
            why = check_record(problem.op, problem.static_key, problem.run_key, fields["config"])
            if why is not None:
                raise DocumentError(f"{file}: the record of {problem.op} at {problem.run_key.to_json()}: {why}")
        database = open_db(db)
        database.require_sound("import into")
        result = database.save_records(rows, replace=replace)
        imported = counted(result.written + result.replaced, "winner")
        console.print(f"imported {imported} into {escape(database.display_url)} "
                      f"({result.written} new, {result.replaced} replaced an older one, {result.same} unchanged"
                      + (f", {result.kept} kept the DB's newer one: --replace replaces them" if result.kept else "")
                      + ")")
