"""TuningDB, the tuning DB's one entry point: opens it (engines, sessions, the SQLite write
lock, the schema brought to a usable state) and hands each read, write and repair to the
module that does it, in one transaction each."""

from __future__ import annotations

import os
import sqlite3
import warnings
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, TypeVar

from filelock import FileLock, Timeout
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session

from tuner.db import migration, reads, repair, writes
from tuner.db.checked import Malformed, fingerprint_rows, malformed_error
from tuner.db.location import (
    BusyDBError, DamagedDBError, DBError, MissingDBError, is_read_only_url, on_read_only_media, read_only_url,
    resolve_db_url, sqlite_file,
)
from tuner.db.migration import SchemaGaps
from tuner.db.schema import Measurement, Miss
from tuner.db.values import MeasurementRow, MissRow, Problem, Record, SaveResult, Snapshot

POSTGRES_HINT = "PostgreSQL needs its driver: pip install 'tuner-attn[postgres]'"
WRITE_LOCK_TIMEOUT_S = 120.0
_WRITE_OPTION = "tuner_write"  # an execution option: this connection's transaction will write
T = TypeVar("T")


# how long a statement waits on another connection's lock (30 s); constant SQL text, as all of it
_WAIT_WHEN_BUSY = "PRAGMA busy_timeout=30000"


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # pysqlite begins a transaction only before a data change, so each read and each DDL
    # statement would see its own state; _sqlite_begin starts every transaction instead
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute(_WAIT_WHEN_BUSY)
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _sqlite_begin(conn: Any) -> None:
    """A read is one snapshot from its first statement to its end; a write takes SQLite's
    write lock at once (a deferred one that read first could not always upgrade)."""
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE_OPTION) else "BEGIN")


def _short(exc: BaseException) -> str:
    """The first line of a driver error, without SQLAlchemy's background link."""
    orig = getattr(exc, "orig", None) or exc
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__


class TuningDB:
    """The tuning DB at a SQLAlchemy URL or SQLite path (default: $TUNER_DB, then the
    embedded SQLite file). Writes are one transaction each; writers of one SQLite file
    are serialised across processes by a file lock beside it.

    Reads check each row (tuner.db.checked): a malformed row (tampered, or written by
    something else) is an error naming it for the CLI, is skipped and counted by the
    runtime's snapshot, and is listed by integrity() and removed by prune()."""

    def __init__(self, target: str | os.PathLike | None = None, *, create: bool = True) -> None:
        """create=False: open for reading only; nothing is written, not even the schema,
        and a missing DB raises MissingDBError."""
        url, is_default = resolve_db_url(target)
        self.path: Path | None = sqlite_file(url)
        self.read_only = self.path is not None and is_read_only_url(url)
        self._lock: FileLock | None = None
        self._gaps = SchemaGaps()
        if self.path is not None:
            try:
                self._check_sqlite_path(self.path, create=create and not self.read_only, make_parent=is_default)
                if on_read_only_media(self.path) and url.query.get("immutable") not in ("1", "true"):
                    url, self.read_only = read_only_url(self.path), True
                if url.query.get("immutable") in ("1", "true"):
                    self._check_wal_merged(self.path)
            except OSError as e:  # a name too long, a path through a file, ...
                raise DBError(f"unusable tuning DB path {self.path}: {e.strerror or e}") from None
            if self.read_only and create:
                raise self._read_only_error("write")
            self._lock = FileLock(str(self.path) + ".lock", timeout=WRITE_LOCK_TIMEOUT_S)
        self.url = url
        try:
            self.engine: Engine = create_engine(url)
        except ImportError as e:  # the backend's driver is not installed
            hint = f"; {POSTGRES_HINT}" if url.get_backend_name() == "postgresql" else ""
            raise DBError(f"cannot open tuning DB {self.display_url}: {_short(e)}{hint}") from None
        except (SQLAlchemyError, ValueError) as e:
            raise DBError(f"cannot open tuning DB {self.display_url}: {_short(e)}") from None
        # reads see one committed state: one SQLite transaction, a PostgreSQL snapshot
        # (its default, read committed, gives each statement its own)
        self._read_engine = self.engine
        self._write_engine = self.engine.execution_options(**{_WRITE_OPTION: True})
        if url.get_backend_name() == "sqlite":
            event.listen(self.engine, "connect", _sqlite_connect)
            event.listen(self.engine, "begin", _sqlite_begin)
        elif url.get_backend_name() == "postgresql":
            self._read_engine = self.engine.execution_options(isolation_level="REPEATABLE READ")
        self._init_schema(create)

    # -- opening -----------------------------------------------------------------------

    @property
    def display_url(self) -> str:
        return str(self.path) if self.path else self.url.render_as_string(hide_password=True)

    @property
    def _backend(self) -> str:
        return self.url.get_backend_name()

    def _read_only_error(self, action: str) -> DBError:
        return DBError(f"cannot {action} tuning DB {self.display_url}: it is read-only (read-only media or a "
                       "mode=ro/immutable URI); give a writable --db")

    @staticmethod
    def _check_wal_merged(path: Path) -> None:
        """An immutable read skips the write-ahead log: a DB with writes in it cannot be read so."""
        wal = path.with_name(path.name + "-wal")
        if wal.exists() and wal.stat().st_size > 0:
            raise DBError(f"tuning DB {path} is read as immutable with writes not merged into it ({wal.name}); "
                          "open it once where it is writable (any tuner command merges them), then copy it")

    @staticmethod
    def _check_sqlite_path(path: Path, *, create: bool, make_parent: bool) -> None:
        if path.is_dir():
            raise DBError(f"tuning DB path {path} is a directory, not a file")
        if path.exists():
            if not path.is_file():  # a device or a pipe: SQLite would read or write it as a DB
                raise DBError(f"tuning DB path {path} is not a regular file")
            if not os.access(path, os.R_OK):
                raise DBError(f"tuning DB {path} is not readable")
            return
        if not create:
            raise MissingDBError(f"no tuning DB at {path} yet (`tuner sweep OP` makes one)")
        if make_parent:
            path.parent.mkdir(parents=True, exist_ok=True)
        if not path.parent.is_dir():
            raise DBError(f"cannot create tuning DB {path}: directory {path.parent} does not exist")
        if not os.access(path.parent, os.W_OK):
            raise DBError(f"cannot create tuning DB {path}: directory {path.parent} is not writable")

    def _init_schema(self, create: bool) -> None:
        """Check the schema with reads; write it only into an empty DB, and only if create.

        Creation is one transaction (tables, version row, SQLite's application id), so a
        creation cut short leaves nothing or tables without a row in them; such an
        unfinished DB is finished by the next writer and is "no DB yet" to a reader. Tables
        with rows but no schema version are damage: nothing reads or writes them."""
        state = self._settled_schema_state()
        if state == "partial":
            raise migration.partial_error(self.display_url)
        if state == "ready":
            if create:
                self._bring_up_to_date()
            return
        if not create:
            raise MissingDBError(f"no tuning DB at {self.display_url} yet (`tuner sweep OP` makes one)")
        with self._locked("create"):  # another process may be creating it too
            state = self._settled_schema_state()
            if state == "ready":
                return
            if state == "partial":
                raise migration.partial_error(self.display_url)
            self._create()

    def _create(self) -> None:
        """Create the schema in an empty or unfinished DB, in one transaction."""
        if self._backend == "sqlite":
            raw = None
            try:  # WAL is a property of the file, and cannot be set inside a transaction
                raw = self.engine.raw_connection()
                raw.driver_connection.execute("PRAGMA journal_mode=WAL")
            except (DBAPIError, sqlite3.Error) as e:
                raise DBError(f"cannot create tuning DB {self.display_url}: {_short(e)}") from None
            finally:
                if raw is not None:
                    raw.close()
        with self._write(action="create") as session:  # the lock is reentrant
            migration.create(session, self._backend)
        self._gaps = SchemaGaps()

    def _bring_up_to_date(self) -> None:
        """Add what a DB made by an older tuner lacks, for a writer; one that may not (a
        fleet DB's row-only role) still writes, without it."""
        gaps = self._gaps
        if gaps.tables or gaps.columns or gaps.unstamped:
            try:
                with self._write(action="upgrade") as session:
                    migration.upgrade(session, self._backend, gaps)
                gaps.tables, gaps.columns, gaps.unstamped = set(), set(), False
            except DBError as e:
                # without what the DB lacks: misses' lengths, a measurement's rung column (it
                # is in method too), the replaced-records history
                warnings.warn(f"tuner: {e}; writing without the newer tables and columns", stacklevel=5)
        if gaps.indexes:
            try:  # on its own: one it may not build must not undo the tables and columns
                with self._write(action="add an index to") as session:
                    migration.add_indexes(session, self._backend, gaps)
                gaps.indexes = set()
            except DBError as e:
                warnings.warn(f"tuner: {e}; without index {', '.join(n for _, n in sorted(gaps.indexes))} "
                              "a problem's measurements are read by a scan", stacklevel=5)

    def _settled_schema_state(self) -> str:
        """The schema's state, looked at again after any creator in flight has finished: a
        look that straddles a creator's commit (no tuner_meta table when it read the version,
        every table when it listed them) sees tables without a version."""
        state = self._schema_state()
        if state not in ("partial", "unfinished"):
            return state
        if self._backend == "postgresql":  # creators hold this lock to their commit
            with Session(self.engine) as session, session.begin():
                migration.lock_schema(session)
                return self._schema_state()
        if self._lock is not None:
            with self._locked_if_possible():
                return self._schema_state()
        return state

    def _schema_state(self) -> str:
        """migration.schema_state, in a read of its own; remembers what the DB lacks."""
        with self._read() as session:
            state, self._gaps = migration.schema_state(session, self._backend, self.display_url)
        return state

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> "TuningDB":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- sessions ----------------------------------------------------------------------

    @contextmanager
    def _locked(self, action: str) -> Iterator[None]:
        """The cross-process write lock of a SQLite file (nothing for server DBs)."""
        if self._lock is None:
            yield
            return
        try:
            self._lock.acquire()
        except Timeout:
            raise BusyDBError(f"tuning DB {self.display_url} stayed locked by another writer") from None
        except OSError as e:  # the lock file cannot be made: a read-only directory
            raise DBError(f"cannot {action} tuning DB {self.display_url}: {e.strerror or e}") from None
        try:
            yield
        finally:
            self._lock.release()

    @contextmanager
    def _locked_if_possible(self) -> Iterator[None]:
        """The write lock for a reader that only waits for a creator to finish: where the
        lock file cannot be made (a read-only directory), no creator can be writing."""
        try:
            self._lock.acquire()  # type: ignore[union-attr]
        except (Timeout, OSError):
            yield
            return
        try:
            yield
        finally:
            self._lock.release()  # type: ignore[union-attr]

    @contextmanager
    def _write(self, action: str = "write") -> Iterator[Session]:
        """One transaction, under the cross-process file lock for SQLite files."""
        if self.read_only:
            raise self._read_only_error(action)
        with self._locked(action):
            try:
                with Session(self._write_engine) as session, session.begin():
                    yield session
            except DBAPIError as e:
                error = self._read_error(e)
                raise type(error)(f"cannot {action} tuning DB {self.display_url}: {_short(e)}") from None

    @contextmanager
    def _read(self) -> Iterator[Session]:
        try:
            with Session(self._read_engine) as session, session.begin():
                yield session
        except DBAPIError as e:
            raise self._read_error(e) from None

    def _read_error(self, e: DBAPIError) -> DBError:
        """A file SQLite calls malformed or not a database is damage; other errors (a lock,
        a server down) are not."""
        orig = getattr(e, "orig", None)
        damaged = isinstance(orig, sqlite3.DatabaseError) and not isinstance(orig, sqlite3.OperationalError)
        return (DamagedDBError if damaged else DBError)(f"cannot read tuning DB {self.display_url}: {_short(e)}")

    def _all_well_formed(self, what: str, found: T, bad: list[Malformed]) -> T:
        """What a read found, or MalformedRowsError where it found malformed rows."""
        if bad:
            raise malformed_error(self.display_url, what, bad)
        return found

    # -- writes ------------------------------------------------------------------------

    def save_measurement(
        self,
        problem: Problem,
        fingerprint: tuple[str, dict[str, Any]],
        config: dict[str, Any],
        *,
        kv_len: int,
        status: str,
        method: dict[str, Any],
        median_us: float | None = None,
        spread_us: float | None = None,
        samples: int = 0,
        max_error: float | None = None,
        error: str | None = None,
        rung: int = 1,
    ) -> None:
        self.save_measurements(problem, fingerprint, [dict(
            config=config, kv_len=kv_len, status=status, method=method, median_us=median_us,
            spread_us=spread_us, samples=samples, max_error=max_error, error=error, rung=rung,
        )])

    def save_measurements(self, problem: Problem, fingerprint: tuple[str, dict[str, Any]],
                          measurements: list[dict[str, Any]]) -> None:
        """Several measurements of one problem (each save_measurement's keywords, config
        included) in one transaction; of two of one config, the later is kept."""
        rows = writes.measurement_rows(problem, fingerprint[0], measurements, self._gaps.columns_of(Measurement))
        if not rows:
            return
        with self._write() as session:
            writes.save_measurements(session, fingerprint, rows)

    def save_record(
        self,
        problem: Problem,
        fingerprint: tuple[str, dict[str, Any]],
        config: dict[str, Any],
        *,
        median_us: float,
        spread_us: float,
        samples: int,
        default_config: dict[str, Any],
        default_median_us: float | None,
        default_spread_us: float | None,
        method: dict[str, Any],
        created_at: datetime | None = None,
    ) -> SaveResult:
        return self.save_records([
            (problem, fingerprint, dict(
                config=config, median_us=median_us, spread_us=spread_us, samples=samples,
                default_config=default_config, default_median_us=default_median_us,
                default_spread_us=default_spread_us, method=method, created_at=created_at,
            ))
        ])

    def save_winner(
        self,
        problem: Problem,
        fingerprint: tuple[str, dict[str, Any]],
        config: dict[str, Any],
        timing: Any,
        default_config: dict[str, Any],
        default_timing: Any | None,
        method: dict[str, Any],
    ) -> SaveResult:
        """save_record from timings (anything with median_us, spread_us and samples)."""
        return self.save_record(
            problem, fingerprint, config,
            median_us=timing.median_us, spread_us=timing.spread_us, samples=timing.samples,
            default_config=default_config,
            default_median_us=default_timing.median_us if default_timing else None,
            default_spread_us=default_timing.spread_us if default_timing else None,
            method=method,
        )

    def save_records(self, rows: list[tuple[Problem, tuple[str, dict[str, Any]], dict[str, Any]]], *,
                     replace: bool = False) -> SaveResult:
        """Write many records in ONE transaction: all land or none (used by import).

        A record replaces the stored one of its key only when it is at least as new
        (created_at; a record without one is dated now), or with replace=True; the replaced
        one goes to replaced_records. Returns what happened to them."""
        with self._write() as session:
            return writes.save_records(session, rows, replace, self._gaps)

    def save_misses(self, fingerprint: tuple[str, dict[str, Any]], misses: list[MissRow]) -> None:
        """Add each miss (its count and its calls' lengths, to what is stored) to the misses
        table, in one transaction."""
        if not misses:
            return
        if self._gaps.lacks_table(Miss):  # an older DB this writer may not upgrade
            raise DBError(f"cannot record misses in tuning DB {self.display_url}: it has no misses table (made by "
                          "an older tuner; a role that may create tables adds it)")
        with self._write(action="record misses in") as session:
            writes.save_misses(session, fingerprint, misses, self._gaps.columns_of(Miss))

    # -- reads -------------------------------------------------------------------------

    def applicable_ids(self, environment: dict[str, Any]) -> set[str]:
        """The ids of stored environments whose records apply in `environment`
        (tuner.db.fingerprint.applies: same GPU and kernel-library versions)."""
        with self._read() as session:
            return reads.applicable_ids(session, environment)

    def records(self, *, op: str | None = None, fingerprint_id: str | None = None,
                environment: dict[str, Any] | None = None, problem: Problem | None = None) -> list[Record]:
        """Stored winners (of one op or problem, one environment id, or those that apply in
        `environment`: the newest per problem). MalformedRowsError on a malformed row."""
        with self._read() as session:
            found, bad = reads.records(session, op=op, fingerprint_id=fingerprint_id, environment=environment,
                                       problem=problem)
        return self._all_well_formed("records", found, bad)

    def record(self, problem: Problem, fingerprint_id: str | None = None, *,
               environment: dict[str, Any] | None = None) -> Record | None:
        """The winner of a problem in one environment id, or the newest that applies in `environment`."""
        found = self.records(problem=problem, fingerprint_id=fingerprint_id, environment=environment)
        return max(found, key=lambda r: r.created_at) if found else None

    def measurements(self, problem: Problem, fingerprint_id: str) -> list[MeasurementRow]:
        """One problem's measurements in one environment. MalformedRowsError on a malformed row."""
        with self._read() as session:
            found, bad = reads.measurements(session, problem, fingerprint_id, self._gaps)
        return self._all_well_formed("measurements", found, bad)

    def fingerprints(self) -> dict[str, dict[str, Any]]:
        """Every stored environment, id -> data. MalformedRowsError on a malformed one."""
        with self._read() as session:
            found, bad = fingerprint_rows(session)
        return self._all_well_formed("fingerprints", found, bad)

    def snapshot(self, environment: dict[str, Any]) -> Snapshot:
        """Every winner that applies in `environment` (the newest where several stored
        environments hold one key), malformed rows skipped and counted, never raised."""
        with self._read() as session:
            return reads.snapshot(session, environment)

    def counts(self) -> dict[str, dict[str, int]]:
        """{fingerprint id: {"records": n, "measurements": m}}."""
        with self._read() as session:
            return reads.counts(session)

    def op_names(self) -> set[str]:
        """Every op name the DB holds records or misses of (tuner's ops and users' own)."""
        with self._read() as session:
            return reads.op_names(session, self._gaps)

    def misses(self, fingerprint_id: str, *, op: str | None = None,
               environment: dict[str, Any] | None = None) -> list[MissRow]:
        """The misses the runtime recorded in this environment and that still have no
        winner applying in `environment` (default: none of this id), most frequent first."""
        if self._gaps.lacks_table(Miss):
            return []
        with self._read() as session:
            found, bad = reads.misses(session, fingerprint_id, op, self._gaps)
        found = self._all_well_formed("misses", found, bad)
        solved = (self.records(op=op, environment=environment) if environment is not None
                  else self.records(op=op, fingerprint_id=fingerprint_id))
        return reads.unsolved(found, solved)

    # -- damage ------------------------------------------------------------------------

    def malformed_rows(self) -> list[tuple[type, Any, str]]:
        """(table's model, row id, why) for every row that breaks tuner.db.rows' rules,
        records pointing at no fingerprint included."""
        with self._read() as session:
            return repair.malformed_rows(session, self._gaps)

    def prune(self, environment: dict[str, Any], *, dry_run: bool = False) -> dict[str, dict[str, int]]:
        """Remove, in one transaction, what cannot apply in `environment` (tuner.db.repair.prune):
        environments whose records never apply here, with their rows, and every malformed row.
        Returns what was (or, with dry_run, would be) removed."""
        with (self._read() if dry_run else self._write(action="prune")) as session:
            return repair.prune(session, environment, self._gaps, dry_run=dry_run)

    def merge_log(self) -> None:
        """Merge SQLite's write-ahead log into the file and empty it, as far as readers allow
        (best effort; nothing for a server DB): a file copied, moved or deleted while this
        process keeps it open then holds everything written, and leaves no log behind that
        SQLite would lay over a new file at that path."""
        if self._backend != "sqlite" or self.read_only:
            return
        try:
            with self.engine.connect() as conn:
                # no wait: TRUNCATE otherwise waits out busy_timeout (30 s) behind any reader
                conn.exec_driver_sql("PRAGMA busy_timeout=0")
                try:
                    conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
                finally:
                    conn.exec_driver_sql(_WAIT_WHEN_BUSY)
        except (SQLAlchemyError, sqlite3.Error):
            pass

    def require_sound(self, action: str) -> None:
        """Refuse to write into a damaged DB (integrity_check, a missing core table,
        malformed rows): one line naming the first problem."""
        problems = self.integrity()
        if problems:
            raise DamagedDBError(f"will not {action} tuning DB {self.display_url}: it is damaged ({problems[0]}); "
                                 "`tuner doctor` lists the problems")

    def damage(self) -> list[str]:
        """Damage to the file or the schema (empty when there is none): SQLite's
        integrity_check, missing core tables, a read that fails. Malformed rows are not
        damage: `tuner prune` mends them (integrity() lists both)."""
        problems: list[str] = []
        try:
            with self._read() as session:
                problems.extend(repair.file_damage(session, self._backend))
                problems.extend(repair.missing_tables(session))
        except DBError as e:
            problems.append(str(e))
        return problems

    def integrity(self) -> list[str]:
        """Problems found (empty when the DB is sound): damage(), then malformed rows
        (tuner.db.rows)."""
        return self.damage() or self.malformed_summary()

    def malformed_summary(self) -> list[str]:
        """One line on the malformed rows (empty when there are none), for a DB known to be
        free of damage."""
        try:
            return repair.summary(self.malformed_rows())
        except DBError as e:
            return [str(e)]
