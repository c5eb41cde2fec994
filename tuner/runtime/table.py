"""The winners the runtime serves: the user's DB over the shipped tunings (tuner.db.shipped),
read once into memory, the user's winner taking a run key both hold."""

from __future__ import annotations

import os
import warnings
from typing import Any

from tuner.db import MissingDBError, TuningDB, current_fingerprint
from tuner.db import shipped
from tuner.errors import TunerError
from tuner.keys import AttentionRunKey
from tuner.runtime.borrowing import Winner, winner_gain

# (op, static key JSON) -> {run key: Winner}
Table = dict[tuple[str, str], dict[AttentionRunKey, Winner]]


def _winners(timed: dict) -> Table:
    return {key: {run: Winner(t.config, winner_gain(t.median_us, t.default_median_us)) for run, t in runs.items()}
            for key, runs in timed.items()}


def load_table(db_target: str | os.PathLike | None, shipped_source: Any) -> tuple[Table, bool]:
    """(every winner that applies here, whether the user's DB was read). A DB that is
    missing adds nothing; one that cannot be read, like a shipped file that cannot, gives
    one warning and adds nothing (the library defaults run); its malformed rows are left
    out with one warning."""
    table = _shipped(shipped_source)
    try:
        with TuningDB(db_target, create=False) as db:
            user = db.snapshot(current_fingerprint())
            where = db.display_url
    except MissingDBError:
        return table, False
    except (TunerError, OSError) as e:
        warnings.warn(f"tuner: {e}; running with library defaults", stacklevel=6)
        return table, False
    if user.skipped:
        warnings.warn(f"tuner: {len(user.skipped)} malformed rows of tuning DB {where} left out "
                      f"({user.skipped[0]}); `tuner doctor` lists them", stacklevel=6)
    for key, runs in _winners(user.table).items():
        table.setdefault(key, {}).update(runs)
    return table, True


def _shipped(source: Any) -> Table:
    try:
        layer = shipped.load_shipped(current_fingerprint(), source)
    except (TunerError, OSError) as e:
        warnings.warn(f"tuner: {e}; shipped tunings not used", stacklevel=7)
        return {}
    for error in layer.errors:
        warnings.warn(f"tuner: {error}; that file is not used", stacklevel=7)
    return _winners(layer.table)
