"""The winners the runtime serves: the user's DB over the shipped tunings (tuner.db.shipped),
read once into memory, the user's winner taking a run key both hold."""

from __future__ import annotations

import os
import warnings
from typing import Any

from tuner.db import MissingDBError, Problem, TuningDB, current_fingerprint
from tuner.db import shipped
from tuner.errors import one_line
from tuner.keys import AttentionRunKey
from tuner.ops import check_record
from tuner.runtime.borrowing import Winner, winner_gain

# (op, static key JSON) -> {run key: Winner}
Table = dict[tuple[str, str], dict[AttentionRunKey, Winner]]


def _winners(timed: dict) -> Table:
    return {key: {run: Winner(t.config, winner_gain(t.median_us, t.default_median_us)) for run, t in runs.items()}
            for key, runs in timed.items()}


def load_table(db_target: str | os.PathLike | None, shipped_source: Any) -> tuple[Table, bool]:
    """(every winner that applies here, whether misses can be written to the user's DB: it
    was read and may be written, or it is missing and its first write creates it). A DB
    that cannot be read, like a shipped file that cannot, gives one warning and adds
    nothing (the library defaults run); its malformed rows are left out with one warning.
    Never raises: whatever fails (a MemoryError under a memory cap too) must not fail the
    tuned call, nor make the next one read it all again."""
    table = _shipped(shipped_source)
    try:
        with TuningDB(db_target, create=False) as db:
            user = db.snapshot(current_fingerprint())
            where, writable = db.display_url, not db.read_only
    except MissingDBError:
        return table, True
    except Exception as e:  # noqa: BLE001 - see the docstring
        # (the shipped tunings that apply here still serve: "library defaults" alone misled)
        serving = "running with the shipped tunings and library defaults" if table else "running with library defaults"
        warnings.warn(f"tuner: {one_line(e)}; {serving}", stacklevel=6)
        return table, False
    if user.skipped:
        warnings.warn(f"tuner: {len(user.skipped)} malformed rows of tuning DB {where} left out "
                      f"({user.skipped[0]}); `tuner doctor` lists them", stacklevel=6)
    for key, runs in _winners(user.table).items():
        table.setdefault(key, {}).update(runs)
    return table, writable


def op_rules(problem: Problem, config: dict[str, Any]) -> str | None:
    """Why a shipped record's config cannot be its op's winner (tuner.ops.check_record), or
    None: tuner.db cannot ask tuner.ops itself."""
    return check_record(problem.op, problem.static_key, problem.run_key, config)


def _shipped(source: Any) -> Table:
    try:
        layer = shipped.load_shipped(current_fingerprint(), source, check=op_rules)
    except Exception as e:  # noqa: BLE001 - as load_table: the library defaults run
        warnings.warn(f"tuner: {one_line(e)}; shipped tunings not used", stacklevel=7)
        return {}
    for error in layer.errors:
        warnings.warn(f"tuner: {error}; that file is not used", stacklevel=7)
    for f in layer.files:
        if f.refused:
            warnings.warn(f"tuner: shipped tunings {f.path}: {f.refused} records left out, their ops cannot run "
                          f"their configs ({f.refused_why}); `tuner doctor` lists them", stacklevel=7)
    return _winners(layer.table)
