"""The winners the runtime serves: the user's DB over the shipped tunings (tuner.db.shipped),
read once into memory, the user's winner taking a run key both hold."""

from __future__ import annotations

import os
import warnings
from typing import Any

from tuner.db import MissingDBError, TuningDB, current_fingerprint
from tuner.db import shipped
from tuner.errors import TunerError
from tuner.keys import AttentionRunKey, AttentionStaticKey, attention_run_key, visible_kv_len
from tuner.runtime.borrowing import Winner, winner_gain

# (op, static key JSON) -> {run key: Winner}
Table = dict[tuple[str, str], dict[AttentionRunKey, Winner]]


def _winners(timed: dict) -> Table:
    return {key: _past_the_window(key[1], {run: Winner(t.config, winner_gain(t.median_us, t.default_median_us))
                                           for run, t in runs.items()})
            for key, runs in timed.items()}


def _past_the_window(static_json: str, runs: dict[AttentionRunKey, Winner]) -> dict[AttentionRunKey, Winner]:
    """A windowed key's winners under the run keys calls look up: a record stored before run
    keys bucketed only what the window sees (at a kv bucket past it) measured the same work
    as one at the window's bucket, and serves there unless one is stored there (the one of
    the smallest such bucket, else)."""
    try:
        left = AttentionStaticKey.from_json(static_json).window_left
    except (ValueError, TypeError, KeyError, AttributeError):  # not an attention key: as stored
        return runs
    if left < 0:
        return runs

    def looked_up(run: AttentionRunKey) -> AttentionRunKey:
        return attention_run_key(run.batch, run.max_q_len, visible_kv_len(run.kv_len_bucket, run.max_q_len, left))

    out = {run: w for run, w in runs.items() if looked_up(run) == run}
    for run in sorted((r for r in runs if looked_up(r) != r), key=lambda r: r.kv_len_bucket):
        out.setdefault(looked_up(run), runs[run])
    return out


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
