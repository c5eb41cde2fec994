"""The runtime's process state: where the DB and the shipped tunings are, the mode, the
winners table (loaded once, under a lock), the misses not yet written; configure() and
flush_misses()."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch

from tuner import settings
from tuner.db import TuningDB, current_environment
from tuner.db.location import BusyDBError, DBError
from tuner.errors import TunerError, one_line
from tuner.keys import AttentionRunKey
from tuner.runtime.borrowing import Config, Winner, choose, choose_frozen, graph_record
from tuner.runtime.misses import FlushSoon, MissLog
from tuner.runtime.table import Table, load_table

MODES = settings.MODES
_KEEP: Any = object()  # configure(): a setting not given keeps its value


def mode_from_env() -> str:
    mode = settings.env_mode()
    if mode not in MODES:
        warnings.warn(f"{settings.ENV_MODE}={mode!r} is not one of {', '.join(MODES)}; using "
                      f"{settings.DEFAULT_MODE!r}", stacklevel=3)
        return settings.DEFAULT_MODE
    return mode


def capturing() -> bool:
    """Inside CUDA-graph capture (nothing is tuned then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def stream_capturing() -> bool:
    """capturing() where CUDA is known to be there: the hot path's query, without
    is_available()'s cost."""
    return torch.cuda.is_current_stream_capturing()


class Runtime:
    """Process-wide settings and the winners table, loaded on first need."""

    def __init__(self) -> None:
        self.db_target: str | os.PathLike | None = None
        self.shipped_source: str | os.PathLike | None = None  # None: $TUNER_SHIPPED, else tuning_cache/
        self.mode = mode_from_env()
        self.max_distance = settings.MAX_DISTANCE
        self.declared_lengths: Any = None  # inside tuner.runtime.capture.graph_capture: its DeclaredLengths
        self._table: Table | None = None
        self._db: TuningDB | None = None
        self._db_opened: tuple[Any, tuple[int, int] | None] | None = None  # its target and SQLite file
        self.functions: weakref.WeakSet[Any] = weakref.WeakSet()  # what holds a memo (cleared by configure)
        self.misses = MissLog()
        self.keeps_misses = False  # the DB was read and may be written, or will be created
        self._lock = threading.Lock()
        self._db_lock = threading.Lock()  # (tune mode's and the miss writer's threads)
        self._writing = threading.RLock()  # held through each write to the DB, and by a fork
        self._flush_at_exit = False
        self.flush_soon = FlushSoon(lambda: flush_misses())
        # what calls resolve to changes with configure() and graph_capture: each bumps the
        # epoch (and configure() the generation), under memo_lock, and a slow path that
        # began before keeps nothing in a memo (the hot path reads the memos without a lock)
        self.memo_lock = threading.Lock()
        self.epoch = 0
        self.generation = 0

    def reset(self) -> None:
        self.flush_soon.cancel(wait_s=settings.MISS_EXIT_WAIT_S)
        flush_misses()  # they belong to the DB being left
        with self._writing, self._db_lock:  # (after any write under way)
            if self._db is not None:
                self._db.close()
            self._db = None
        with self._lock, self.memo_lock:
            self.epoch += 1
            self.generation += 1
            self._table = None
            for f in list(self.functions):
                f.memo.clear()
                f.tuned.clear()

    def writable_db(self) -> TuningDB:
        """The DB that tune mode and the miss writer write to (created if missing); never one
        that integrity_check calls malformed, that lacks a core table or holds malformed rows.
        A SQLite file deleted or replaced since it was opened is opened again: the engine
        wrote on into the old file, and misses and tuned winners went nowhere anyone reads."""
        with self._db_lock:
            target = self._pinned_target()
            if self._db is not None and (target, _file_id(self._db)) != self._db_opened:
                self._db.close()  # (or configure() pointed elsewhere while it was being opened)
                self._db = None
            if self._db is None:
                db = TuningDB(target)
                try:
                    db.require_sound("write into")
                except DBError:
                    db.close()
                    raise
                self._db, self._db_opened = db, (target, _file_id(db))
            return self._db

    @contextlib.contextmanager
    def writing(self) -> Iterator[TuningDB]:
        """The writable DB for one write, its log merged into the file after it; a fork waits
        for the write (a child forked in the middle of one hung in SQLite at its own first)."""
        with self._writing:
            db = self.writable_db()
            yield db
            db.merge_log()

    def _pinned_target(self) -> str | os.PathLike | None:
        """The DB target, a relative path (given or in $TUNER_DB) made absolute the first time it
        is used: a server that changed directory later wrote its misses into a new file."""
        target = settings.env_db() if self.db_target is None else self.db_target
        text = None if target is None else os.fspath(target)
        if isinstance(text, str) and text and "://" not in text and not text.startswith("file:"):
            self.db_target = os.path.abspath(os.path.expanduser(text))
        return self.db_target

    def table(self) -> Table:
        """Every winner that applies here (tuner.runtime.table), read once, under a lock:
        threads resolving their first keys at once wait for one load."""
        table = self._table
        if table is not None:
            return table
        with self._lock:
            if self._table is None:
                self._table, self.keeps_misses = load_table(self._pinned_target(), self.shipped_source)
            return self._table

    def lookup(self, name: str, static_json: str, run: AttentionRunKey,
               accepts: Callable[[Config], bool] | None = None, frozen: bool = False,
               captured: Callable[[Config], Config] | None = None) -> tuple[Config | None, str]:
        """The config for a key and how it was found (tuner.runtime.borrowing.choose; frozen:
        for a graph replayed over unknown lengths, its graph record, measured as such graphs
        replay (settings.GRAPH_RECORD_OPS; borrowing.graph_record), else choose_frozen, with
        captured)."""
        winners = self.table().get((name, static_json), {})
        if frozen:
            graph_records = self.table().get((settings.GRAPH_RECORD_OPS.get(name, ""), static_json), {})
            found = graph_record(graph_records, run)
            if found is not None:
                record, how = found
                config = record.config if captured is None else captured(record.config)
                if accepts is None or accepts(config):
                    return config, how
            return choose_frozen(winners, run, accepts=accepts, captured=captured)
        return choose(winners, run, max_distance=self.max_distance, accepts=accepts)

    def store(self, key: tuple[str, str], run: AttentionRunKey, config: Config, gain: float) -> None:
        """A winner tuned in this process, served from now on like a stored one."""
        self.table().setdefault(key, {})[run] = Winner(config, gain)

    def record_miss(self, name: str, static_json: str, run: AttentionRunKey, served: str,
                    lengths: tuple[float, float, float] | None = None) -> None:
        """Off the hot path: once per memo key resolved from the nearest record or the default,
        with the call's length statistics when it had its lengths on the host. Kept only when
        there is a DB to write them to, or none yet (the first flush creates it): never for a
        damaged or read-only one."""
        if not self.keeps_misses:
            return
        self.misses.record(name, static_json, run, served, lengths)
        if not self._flush_at_exit:
            atexit.register(_flush_at_exit)
            # a multiprocessing child ends in os._exit, where atexit does not run; its
            # finalizers do (those a forked child inherits are cleared at its start)
            multiprocessing.util.Finalize(None, _flush_at_exit, exitpriority=0)
            self._flush_at_exit = True
        self.flush_soon.ask(settings.MISS_FLUSH_AFTER_S)

    def before_fork(self) -> None:
        """A fork waits for a read of the winners and a write under way: a child forked in the
        middle of one inherits SQLite's state there, and hung at its own first write."""
        self._lock.acquire()
        self._writing.acquire()

    def after_fork_in_parent(self) -> None:
        self._writing.release()
        self._lock.release()

    def after_fork_in_child(self) -> None:
        """A forked child writes only its own misses, through its own DB connection and lock:
        the parent's pending misses were written twice, and its SQLite connection and file
        lock, inherited, failed the child's first write (filelock refuses an inherited lock)."""
        self.misses.forget()
        self.flush_soon.forget()
        if self._db is not None:
            _INHERITED.append(self._db)  # never closed here: closing would act on the parent's connections
        self._db, self._db_opened = None, None
        self._db_lock, self._writing = threading.Lock(), threading.RLock()
        self._lock, self.memo_lock = threading.Lock(), threading.Lock()  # (held by the fork, or a thread not there)
        self._flush_at_exit = False  # (a multiprocessing child exits without atexit: registered again)
        for f in list(self.functions):
            forget = getattr(f, "forget_claims", None)  # keys a parent's thread was tuning
            if forget is not None:
                forget()


runtime = Runtime()
os.register_at_fork(before=runtime.before_fork, after_in_parent=runtime.after_fork_in_parent,
                    after_in_child=runtime.after_fork_in_child)


def _flush_at_exit() -> None:
    runtime.flush_soon.cancel(wait_s=settings.MISS_EXIT_WAIT_S)
    flush_misses()


_INHERITED: list[TuningDB] = []  # a forked child's copies of its parent's open DB, left alone


def _file_id(db: TuningDB) -> tuple[int, int] | None:
    if db.path is None:
        return None
    try:
        st = os.stat(db.path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def flush_misses() -> int:
    """Write the misses recorded so far to the DB (also done settings.MISS_FLUSH_AFTER_S after
    the first one pending, at exit and by configure());
    returns how many keys were written. A DB that cannot be written gives one warning."""
    rows = runtime.misses.take()
    if not rows:
        return 0
    try:
        with runtime.writing() as db:
            db.save_misses(current_environment(), rows)
    except BusyDBError as e:  # another writer held it: the next flush tries again
        runtime.misses.put_back(rows)
        warnings.warn(f"tuner: could not record {len(rows)} missed keys yet: {e}; kept for the next write",
                      stacklevel=2)
        return 0
    except Exception as e:  # noqa: BLE001 - at exit or on a thread: one line, never a traceback
        # one warning, not one per flush: a DB this process cannot write stays so
        runtime.keeps_misses = False
        warnings.warn(f"tuner: could not record {len(rows)} missed keys: {one_line(e)}; no more are recorded in this "
                      "process until configure()", stacklevel=2)
        return 0
    return len(rows)


def configure(*, db: str | os.PathLike | None = _KEEP, mode: str | None = _KEEP, max_distance: float | None = None,
              shipped: str | os.PathLike | None = _KEEP) -> None:
    """Point the runtime at a DB (None: $TUNER_DB, else the default file) and/or set the
    mode (None: $TUNER_MODE), and choose the shipped tunings beneath the DB: a file, a
    directory, or "off" (None: $TUNER_SHIPPED, else tuning_cache/ in a checkout). A setting
    not given keeps its current value.

    Clears the winners table and every memo, so the next call of each function resolves anew.
    """
    if mode is not _KEEP and mode is not None and mode not in MODES:
        raise TunerError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    runtime.reset()
    if db is not _KEEP:
        runtime.db_target = db
    if shipped is not _KEEP:
        runtime.shipped_source = shipped
    if mode is not _KEEP:
        runtime.mode = mode if mode is not None else mode_from_env()
    if max_distance is not None:
        runtime.max_distance = max_distance
