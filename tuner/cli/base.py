"""The `tuner` command's frame: the typer app, its consoles, bad input as one line, the DB options and `main()`."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.markup import escape
from typing_extensions import Annotated

from tuner.version import __version__

try:  # typer from 0.26 on carries its own copy of click
    from typer._click import exceptions as click_exceptions
    from typer._click.globals import get_current_context
except ImportError:
    from click import exceptions as click_exceptions
    from click import get_current_context
from tuner.errors import TunerError


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


def finite(value: float | None) -> float | None:
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


class _Console(Console):
    """In a log a message stays on one line (rich folds at 80 columns where it sees no
    terminal), so that grep finds it; $COLUMNS asks for that width, as print_table takes it."""

    @property
    def soft_wrap(self) -> bool:
        return not (self.is_terminal or os.environ.get("COLUMNS"))

    @soft_wrap.setter
    def soft_wrap(self, value: bool) -> None:  # (Console.__init__ sets it)
        pass


console = _Console()
err = _Console(stderr=True)


def print_table(table: Table) -> None:
    """A table on the terminal's width (or $COLUMNS), or, in a log, on one wide enough that its
    rows do not wrap (rich takes 80 columns where the output is not a terminal, and folds a
    long cell)."""
    if console.is_terminal or os.environ.get("COLUMNS"):
        console.print(table)
        return
    Console(file=console.file, width=max(console.width, 160), no_color=True).print(table)


def home_expanded(value: Path | None) -> Path | None:
    """A path option's ~ expanded: the shell leaves one after = as it is (--out=~/x), and a
    directory named "~" was made in the current one."""
    return value if value is None or str(value) == "-" else value.expanduser()


def _not_empty(value: str | None) -> str | None:
    """--db "" (a script's unset variable, say) would have meant the default DB, silently."""
    if value is not None and not value.strip():
        raise typer.BadParameter("is empty: give a path or URL, or leave --db out for the default")
    return value


DbOption = Annotated[
    Optional[str],
    typer.Option("--db", callback=_not_empty, help="Tuning DB: SQLAlchemy URL or SQLite file path (default: $TUNER_DB, else the embedded SQLite file)."),
]


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Bad input of any kind: one line on stderr, exit code 2."""
    try:
        yield
    except TunerError as e:
        _print_error(str(e))
        raise typer.Exit(2) from None


def _print_error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def open_db(db: str | None, *, create: bool = True):
    """The command's DB, closed when the command ends: an engine left to the garbage collector
    kept SQLite's write-ahead log unmerged for as long as it lived (a file copied meanwhile
    lacked the command's writes)."""
    from tuner.db import TuningDB

    database = TuningDB(db, create=create)
    ctx = get_current_context(silent=True)
    if ctx is not None:
        ctx.call_on_close(database.close)
    return database


def check_op(database, op: str | None) -> None:
    """--op names one of tuner's ops or an op (a user's own @autotune function) the DB holds."""
    if op is None:
        return
    from tuner.ops import list_ops

    known = sorted(o.name for o in list_ops())
    if op not in known and op not in database.op_names():
        raise TunerError(f"unknown op {op!r}: not one of tuner's ops ({', '.join(known)}) and nothing of it "
                         f"in {database.display_url}")


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"tuner {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Sweep ops over shapes into the tuning DB; the runtime picks the winners up."""


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
    if argv is None:  # the console script's own process: a warning is one line, as an error is
        warnings.formatwarning = _one_line_warning
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
    except OSError as e:
        if e.errno not in _FULL:
            raise
        code = _cannot_write(e)
    sys.exit(code if isinstance(code, int) else 0)


def _one_line_warning(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> str:
    """Python's form gives the warning's source file and line, and that line's code."""
    return f"warning: {message}\n"


# a disk (or the log's) that takes no more: what a command writes, its output included, fails so
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _cannot_write(e: OSError) -> int:
    """One line on stderr, where it can still be written, and exit 2 (an unusable resource),
    not a traceback per write."""
    with contextlib.suppress(OSError):
        _print_error(f"cannot write {e.filename or 'the output'}: {e.strerror}")
    return 2
