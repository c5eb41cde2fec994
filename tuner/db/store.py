"""TuningDB: records, measurements and fingerprints, read and written through SQLAlchemy.

Reads take raw column values and check each row against tuner.db.rows: a malformed row
(tampered, or written by something else) is an error naming it for the CLI, is skipped and
counted by the runtime's snapshot, and is listed by integrity() and removed by prune().

Replacing a winner: a record replaces the stored one of the same key and environment only
when it is at least as new (created_at), unless the writer asks to replace regardless
(`tuner import --replace`); what it replaces is kept in the replaced_records table.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from filelock import FileLock, Timeout
from sqlalchemy import (
    Engine, bindparam, create_engine, delete, event, func, inspect, insert, literal, select, text, type_coerce, update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.types import NullType

from tuner.db import rows as check
from tuner.db.fingerprint import applies
from tuner.db.location import (
    APPLICATION_ID, DamagedDBError, DBError, MissingDBError, is_read_only_url, on_read_only_media, read_only_url,
    resolve_db_url, sqlite_file,
)
from tuner.db.schema import (
    MISS_LENGTH_COLUMNS, OPTIONAL_COLUMNS, OPTIONAL_INDEXES, OPTIONAL_TABLES, RECORD_FIELDS, SCHEMA_VERSION, Base, Fingerprint, Measurement, Meta, Miss,
    ReplacedRecord, TuningRecord, utcnow,
)
from tuner.keys import AttentionRunKey, canonical_json

WRITE_LOCK_TIMEOUT_S = 120.0


@functools.lru_cache(maxsize=64)
def _upsert_statement(dialect: str, model: type, columns: tuple[str, ...], key: tuple[str, ...], replace: bool,
                      add: tuple[str, ...]) -> Any:
    """The upsert of a row of these columns, values bound at execution: built once, since
    building a statement costs more than running it (a sweep writes every measurement)."""
    stmt = (sqlite if dialect == "sqlite" else postgresql).insert(model)
    if not replace:
        return stmt.on_conflict_do_nothing(index_elements=list(key))
    # coalesced: a column added after a row was written is null there
    set_ = {k: func.coalesce(getattr(model, k), 0) + func.coalesce(getattr(stmt.excluded, k), 0)
            if k in add else getattr(stmt.excluded, k) for k in columns if k not in key}
    return stmt.on_conflict_do_update(index_elements=list(key), set_=set_)


PROBLEM_COLUMNS = ("op", "static_key", "batch", "max_q_len", "kv_len_bucket")
RECORD_KEY = [*PROBLEM_COLUMNS, "fingerprint_id"]
STATUSES = ("ok", "wrong", "error", "oom")
# what TuningDB.save_measurements takes of each measurement (save_measurement's keywords)
MEASUREMENT_FIELDS = frozenset({"config", "kv_len", "status", "method", "median_us", "spread_us", "samples",
                                "max_error", "error", "rung"})
SERVED = ("nearest", "default")


class MissLengths(NamedTuple):
    """The kv lengths of a missed key's calls that had them on the host: how many calls,
    and over those calls the mean of their mean length, longest and spread (std)."""

    calls: int
    mean: float
    longest: float
    spread: float


class MissRow(NamedTuple):
    """A key the runtime served without an exact winner: how (nearest or default), how many
    times, and its calls' lengths where known (None: no call had them on the host)."""

    problem: "Problem"
    served: str
    count: int
    lengths: MissLengths | None = None


@dataclass(frozen=True)
class Problem:
    """Which problem a row is about: op, canonical static key JSON, run key."""

    op: str
    static_key: str
    run_key: AttentionRunKey

    def columns(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "static_key": self.static_key,
            "batch": self.run_key.batch,
            "max_q_len": self.run_key.max_q_len,
            "kv_len_bucket": self.run_key.kv_len_bucket,
        }


@dataclass(frozen=True)
class Record:
    """A stored winner, with JSON fields parsed."""

    problem: Problem
    fingerprint_id: str
    config: dict[str, Any]
    median_us: float
    spread_us: float
    samples: int
    default_config: dict[str, Any]
    default_median_us: float | None
    default_spread_us: float | None
    method: dict[str, Any]
    created_at: datetime

    @property
    def speedup(self) -> float | None:
        """Default time over winner time (1.0 when the default won)."""
        if not self.default_median_us or not self.median_us:
            return None
        return self.default_median_us / self.median_us


@dataclass(frozen=True)
class MeasurementRow:
    config: dict[str, Any]
    status: str
    median_us: float | None
    spread_us: float | None
    samples: int
    max_error: float | None
    error: str | None
    method: dict[str, Any] = field(default_factory=dict)
    kv_len: int | None = None  # the kv length actually measured
    rung: int = 1  # the search's rung it was measured at (tuner.search)


class Timed(NamedTuple):
    """A winner as the runtime reads it: its config, and its and the default's times at its
    own key (the default's None when the default did not run right)."""

    config: dict[str, Any]
    median_us: float
    default_median_us: float | None


@dataclass
class Snapshot:
    """Every winner that applies in one environment, for the runtime: (op, static key JSON)
    -> {run key: Timed}, and the malformed rows left out."""

    table: dict[tuple[str, str], dict[AttentionRunKey, Timed]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # one line per malformed row left out


@dataclass(frozen=True)
class SaveResult:
    """What save_records did with each record: written where none was, replaced an older
    one, kept the stored one (it was newer), or found it identical."""

    written: int = 0
    replaced: int = 0
    kept: int = 0
    same: int = 0

    @property
    def total(self) -> int:
        return self.written + self.replaced + self.kept + self.same


class MalformedRowsError(DBError):
    """Rows that break tuner.db.rows' rules; one line naming the first."""


def _raw(model: type, *criteria: Any, missing: frozenset[str] = frozenset()):
    """SELECT every column of model (but the optional ones the DB lacks) without
    SQLAlchemy's result processing (a bad date in one row must not fail the whole query),
    rows checked by the caller."""
    columns = [type_coerce(c, NullType()).label(c.name) for c in model.__table__.columns if c.name not in missing]
    return select(*columns).where(*criteria)


def _problem(row: Any, where: str) -> Problem:
    check.json_value(row.static_key, f"{where}.static_key")
    return Problem(check.text(row.op, f"{where}.op"), row.static_key,
                   check.run_key(row.batch, row.max_q_len, row.kv_len_bucket, f"{where}.run_key"))


def _record(row: Any, fingerprint_ids: set[str] | dict[str, Any]) -> Record:
    """A records row, checked (RowError names the row and field)."""
    where = f"records id {row.id}"
    if row.fingerprint_id not in fingerprint_ids:
        raise check.RowError(f"{where}: fingerprint {row.fingerprint_id!r} is not in the DB")
    return Record(
        problem=_problem(row, where),
        fingerprint_id=row.fingerprint_id,
        config=check.config_text(row.config, f"{where}.config"),
        median_us=check.number(row.median_us, f"{where}.median_us", positive=True),
        spread_us=check.number(row.spread_us, f"{where}.spread_us"),
        samples=check.integer(row.samples, f"{where}.samples", 0, 2**31 - 1),
        default_config=check.config_text(row.default_config, f"{where}.default_config"),
        default_median_us=check.number(row.default_median_us, f"{where}.default_median_us", positive=True,
                                       nullable=True),
        default_spread_us=check.number(row.default_spread_us, f"{where}.default_spread_us", nullable=True),
        method=check.json_object(row.method, f"{where}.method"),
        created_at=check.created_at(row.created_at, f"{where}.created_at"),
    )


def _miss(row: Any) -> MissRow:
    """A misses row, checked (tuner.db.rows): its key, how it was served, its count and its
    calls' length sums (absent in rows from before those columns)."""
    where = f"misses id {row.id}"
    if row.served not in SERVED:
        raise check.RowError(f"{where}.served: expected nearest or default")
    count = check.integer(row.count, f"{where}.count", 0)
    lengths = None
    calls = getattr(row, "length_calls", None)
    calls = None if calls is None else check.integer(calls, f"{where}.length_calls", 0, count)
    sums = [check.number(getattr(row, c, None), f"{where}.{c}", nullable=not calls)
            for c in ("length_mean_sum", "length_max_sum", "length_spread_sum")]
    if calls:
        mean, longest, spread = (total / calls for total in sums)
        # each call's mean is at most its longest, and its spread at most half its longest
        # (a std of values in [0, longest]): sums that break this were not written by a tuner
        if not (0 <= mean <= longest * (1 + 1e-9) and 0 <= spread <= longest * (0.5 + 1e-9)):
            raise check.RowError(f"{where}: length sums are not a call's (mean {mean:.4g}, longest {longest:.4g}, "
                                 f"spread {spread:.4g})")
        lengths = MissLengths(calls, mean, longest, spread)
    return MissRow(_problem(row, where), row.served, count, lengths)


def _measurement(row: Any) -> MeasurementRow:
    where = f"measurements id {row.id}"
    status = row.status
    method = check.json_object(row.method, f"{where}.method")
    rung = getattr(row, "rung", None)
    if status not in STATUSES:
        raise check.RowError(f"{where}.status: expected one of {', '.join(STATUSES)}, got {status!r:.40}")
    return MeasurementRow(
        config=check.config_text(row.config, f"{where}.config"),
        status=status,
        median_us=check.number(row.median_us, f"{where}.median_us", nullable=True),
        spread_us=check.number(row.spread_us, f"{where}.spread_us", nullable=True),
        samples=check.integer(row.samples, f"{where}.samples", 0, 2**31 - 1),
        max_error=_max_error(row.max_error, f"{where}.max_error"),
        error=row.error if row.error is None or isinstance(row.error, str) else str(row.error),
        method=method,
        kv_len=check.integer(row.kv_len, f"{where}.kv_len", 0),
        rung=check.integer(rung, f"{where}.rung", 0, 2**31 - 1) if rung is not None else _rung_in(method),
    )


def _rung_in(method: dict[str, Any]) -> int:
    """Before the rung column: the rung in the method (halving sweeps), else 1 (a full measurement)."""
    rung = method.get("rung", 1)
    return rung if type(rung) is int and rung >= 0 else 1


def _max_error(value: Any, where: str) -> float | None:
    """A candidate's largest error: any float (inf where it gave non-finite values), or None."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    raise check.RowError(f"{where}: expected a number, got {value!r:.40}")


def _utc(value: datetime) -> datetime:
    return value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)


_WRITE_OPTION = "tuner_write"  # an execution option: this connection's transaction will write


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # pysqlite begins a transaction only before a data change, so each read and each DDL
    # statement would see its own state; _sqlite_begin starts every transaction instead
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _sqlite_begin(conn: Any) -> None:
    """A read is one snapshot from its first statement to its end; a write takes SQLite's
    write lock at once (a deferred one that read first could not always upgrade)."""
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE_OPTION) else "BEGIN")


# the columns added since schema version 1, as constant DDL (SQLite and PostgreSQL alike)
_ADD_COLUMN = {("measurements", "rung"): "ALTER TABLE measurements ADD COLUMN rung INTEGER",
               ("misses", "length_calls"): "ALTER TABLE misses ADD COLUMN length_calls BIGINT",
               **{("misses", c): f"ALTER TABLE misses ADD COLUMN {c} FLOAT"
                  for c in ("length_mean_sum", "length_max_sum", "length_spread_sum")}}
# a PRAGMA takes no bound parameter: the one constant statement that writes tuner's id
_STAMP_APPLICATION_ID = text("PRAGMA application_id = 1953853042")
assert APPLICATION_ID == 1953853042
_CREATE_LOCK_KEY = 0x74756E6572  # "tuner": the advisory lock that serialises schema creation and upgrades


def _short(exc: BaseException) -> str:
    """The first line of a driver error, without SQLAlchemy's background link."""
    orig = getattr(exc, "orig", None) or exc
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__


class TuningDB:
    """The tuning DB at a SQLAlchemy URL or SQLite path (default: $TUNER_DB, then the
    embedded SQLite file). Writes are one transaction each; writers of one SQLite file
    are serialised across processes by a file lock beside it."""

    def __init__(self, target: str | os.PathLike | None = None, *, create: bool = True) -> None:
        """create=False: open for reading only; nothing is written, not even the schema,
        and a missing DB raises MissingDBError."""
        url, is_default = resolve_db_url(target)
        self.path: Path | None = sqlite_file(url)
        self.read_only = self.path is not None and is_read_only_url(url)
        self._lock: FileLock | None = None
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
        except (SQLAlchemyError, ImportError, ValueError) as e:
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
            raise self._partial_error()
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
                raise self._partial_error()
            self._create()

    def _partial_error(self) -> DamagedDBError:
        return DamagedDBError(f"tuning DB {self.display_url} is damaged: it has tuner's tables, with rows, but no "
                              "schema version (sweep --force renames it aside and starts a new DB)")

    def _create(self) -> None:
        """Create the schema in an empty or unfinished DB, in one transaction."""
        if self.url.get_backend_name() == "sqlite":
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
            if self.url.get_backend_name() == "postgresql":
                # no file lock for a server DB: its own lock, held to commit, serialises
                # creators (create_all skips existing tables)
                session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _CREATE_LOCK_KEY})
            Base.metadata.create_all(session.connection())
            if self.url.get_backend_name() == "sqlite":
                session.execute(_STAMP_APPLICATION_ID)
            if session.get(Meta, "schema_version") is None:
                session.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
        self._missing_optional_tables, self._missing_columns, self._missing_indexes = set(), set(), set()
        self._unstamped = False

    def _bring_up_to_date(self) -> None:
        """Add what a DB made by an older tuner lacks, for a writer; one that may not (a
        fleet DB's row-only role) still writes, without it."""
        if self._missing_optional_tables or self._missing_columns or self._unstamped:
            try:
                self._upgrade()
            except DBError as e:
                # without what the DB lacks: misses' lengths, a measurement's rung column (it
                # is in method too), the replaced-records history
                warnings.warn(f"tuner: {e}; writing without the newer tables and columns", stacklevel=5)
        if self._missing_indexes:
            try:  # on its own: one it may not build must not undo the tables and columns
                self._add_indexes()
            except DBError as e:
                warnings.warn(f"tuner: {e}; without index {', '.join(n for _, n in sorted(self._missing_indexes))} "
                              "a problem's measurements are read by a scan", stacklevel=5)

    def _upgrade(self) -> None:
        """Add the tables and columns added since schema version 1 (one upgrader at a time)."""
        with self._write(action="upgrade") as session:
            if self.url.get_backend_name() == "postgresql":  # as creation: one upgrader at a time
                session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _CREATE_LOCK_KEY})
            Base.metadata.create_all(session.connection(), tables=[
                Base.metadata.tables[t] for t in sorted(self._missing_optional_tables)])
            if self._unstamped:  # made before tuner named its files: --force can tell them now
                session.execute(_STAMP_APPLICATION_ID)
            for table, column in sorted(self._missing_columns):  # looked at again: another writer
                present = {c["name"] for c in inspect(session.connection()).get_columns(table)}
                if column in present:
                    continue
                session.execute(text(_ADD_COLUMN[(table, column)]))
        self._missing_optional_tables, self._missing_columns, self._unstamped = set(), set(), False

    def _add_indexes(self) -> None:
        """Build the indexes added since schema version 1 (one builder at a time)."""
        with self._write(action="add an index to") as session:
            if self.url.get_backend_name() == "postgresql":
                session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _CREATE_LOCK_KEY})
            for table, name in sorted(self._missing_indexes):
                index = next(i for i in Base.metadata.tables[table].indexes if i.name == name)
                index.create(session.connection(), checkfirst=True)
        self._missing_indexes = set()

    def _settled_schema_state(self) -> str:
        """_schema_state, looked at again after any creator in flight has finished: a look
        that straddles a creator's commit (no tuner_meta table when it read the version,
        every table when it listed them) sees tables without a version."""
        state = self._schema_state()
        if state not in ("partial", "unfinished"):
            return state
        if self.url.get_backend_name() == "postgresql":  # creators hold this lock to their commit
            with Session(self.engine) as session, session.begin():
                session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _CREATE_LOCK_KEY})
                return self._schema_state()
        if self._lock is not None:
            with self._locked_if_possible():
                return self._schema_state()
        return state

    def _schema_state(self) -> str:
        """"ready" (our schema version, every core table), "empty" (no tables), "unfinished"
        (only our tables, empty, no version row: a creation cut short), "partial" (only our
        tables, rows in them, no version row); DBError for anything else."""
        with self._read() as session:
            inspector = inspect(session.connection())
            version = None
            if Meta.__tablename__ in inspector.get_table_names():
                version = session.execute(
                    select(type_coerce(Meta.value, NullType())).where(Meta.key == "schema_version")).scalar()
            # the tables after the version: a creator commits the version row after its last
            # table, so once the row is seen every table is (listing them first races it)
            inspector = inspect(session.connection())
            tables = set(inspector.get_table_names())
            self._missing_optional_tables = OPTIONAL_TABLES - tables
            columns = {t: {c["name"] for c in inspector.get_columns(t)} for t in tables}
            self._missing_columns = {(t, c) for t, optional in OPTIONAL_COLUMNS.items() if t in columns
                                     for c in optional if c not in columns[t]}
            indexes = {t: {i["name"] for i in inspector.get_indexes(t)} for t in OPTIONAL_INDEXES if t in tables}
            self._missing_indexes = {(t, i) for t, names in OPTIONAL_INDEXES.items() if t in indexes
                                     for i in names if i not in indexes[t]}
            foreign = any(t not in Base.metadata.tables or columns[t] != set(Base.metadata.tables[t].columns.keys())
                          - {c for table, c in self._missing_columns if table == t} for t in tables)
            self._unstamped = (self.url.get_backend_name() == "sqlite"
                               and session.execute(text("PRAGMA application_id")).scalar() != APPLICATION_ID)
            has_rows = version is None and not foreign and any(
                session.execute(select(literal(1)).select_from(Base.metadata.tables[t]).limit(1)).first()
                for t in tables)
        if version is not None:
            if str(version) != str(SCHEMA_VERSION):
                raise DBError(
                    f"tuning DB {self.display_url} has schema version {str(version)!r:.20}; "
                    f"this tuner reads version {SCHEMA_VERSION}"
                )
            missing = sorted(set(Base.metadata.tables) - OPTIONAL_TABLES - tables)
            if missing:
                raise DamagedDBError(f"tuning DB {self.display_url} is damaged: table {missing[0]} is missing")
            return "ready"
        if foreign:
            raise DBError(f"{self.display_url} is not a tuning DB (it has other tables); give another --db")
        if not tables:
            return "empty"
        return "partial" if has_rows else "unfinished"

    @property
    def _missing_measurement_columns(self) -> frozenset[str]:
        return frozenset(c for t, c in self._missing_columns if t == Measurement.__tablename__)

    @property
    def _missing_miss_columns(self) -> frozenset[str]:
        return frozenset(c for t, c in self._missing_columns if t == Miss.__tablename__)

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
            raise DBError(f"tuning DB {self.display_url} stayed locked by another writer") from None
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
        import sqlite3

        orig = getattr(e, "orig", None)
        damaged = isinstance(orig, sqlite3.DatabaseError) and not isinstance(orig, sqlite3.OperationalError)
        return (DamagedDBError if damaged else DBError)(f"cannot read tuning DB {self.display_url}: {_short(e)}")

    def _upsert_many(self, session: Session, model: type, rows: list[dict[str, Any]], key: list[str]) -> None:
        """_upsert of rows of one set of columns and distinct keys: one executemany where the
        dialect has an upsert statement."""
        dialect = session.bind.dialect.name
        if dialect in ("sqlite", "postgresql"):
            session.execute(_upsert_statement(dialect, model, tuple(rows[0]), tuple(key), True, ()), rows)
            return
        for values in rows:
            self._upsert(session, model, values, key)

    def _upsert(self, session: Session, model: type, values: dict[str, Any], key: list[str],
                replace: bool = True, add: tuple[str, ...] = ()) -> None:
        """Insert, or on a key conflict replace the other columns (or keep the row: replace=False);
        columns in `add` are added to the stored value instead of replacing it."""
        dialect = session.bind.dialect.name
        if dialect in ("sqlite", "postgresql"):
            session.execute(_upsert_statement(dialect, model, tuple(values), tuple(key), replace, add), values)
            return
        update_values = {k: v for k, v in values.items() if k not in key}
        existing = session.scalars(
            select(model).where(*(getattr(model, k) == values[k] for k in key))
        ).one_or_none()
        if existing is None:
            session.add(model(**values))
            session.flush()
        elif replace:
            for k, v in update_values.items():
                setattr(existing, k, (getattr(existing, k) or 0) + (v or 0) if k in add else v)

    def require_sound(self, action: str) -> None:
        """Refuse to write into a damaged DB (integrity_check, a missing core table,
        malformed rows): one line naming the first problem."""
        problems = self.integrity()
        if problems:
            raise DamagedDBError(f"will not {action} tuning DB {self.display_url}: it is damaged ({problems[0]}); "
                          "`tuner doctor` lists the problems")

    # -- writes ------------------------------------------------------------------------

    def _ensure_fingerprint(self, session: Session, fingerprint_id: str, data: dict[str, Any]) -> None:
        # an insert that keeps a row already there: one statement, and no race between writers
        # to a server DB (a look first would cost a query on every measurement of a sweep)
        if session.bind.dialect.name in ("sqlite", "postgresql") or session.get(Fingerprint, fingerprint_id) is None:
            values = {"id": fingerprint_id, "data": canonical_json(data), "created_at": utcnow()}
            self._upsert(session, Fingerprint, values, ["id"], replace=False)

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
        fp_id, fp_data = fingerprint
        by_config: dict[str, dict[str, Any]] = {}
        for m in measurements:
            unknown = set(m) - MEASUREMENT_FIELDS
            if unknown or not {"config", "kv_len", "status", "method"} <= set(m):
                raise TypeError(f"a measurement takes {', '.join(sorted(MEASUREMENT_FIELDS))} "
                                f"(config, kv_len, status and method required), got {', '.join(sorted(m))}")
            values = dict(
                problem.columns(),
                fingerprint_id=fp_id,
                config=canonical_json(m["config"]),
                kv_len=m["kv_len"],
                status=m["status"],
                median_us=m.get("median_us"),
                spread_us=m.get("spread_us"),
                samples=m.get("samples", 0),
                max_error=m.get("max_error"),
                error=m.get("error"),
                method=canonical_json(m["method"]),
                rung=m.get("rung", 1),
            )
            for column in self._missing_measurement_columns:  # a DB this writer could not upgrade
                values.pop(column, None)
            by_config[values["config"]] = values
        if not by_config:
            return
        key = [*RECORD_KEY, "config"]
        with self._write() as session:
            self._ensure_fingerprint(session, fp_id, fp_data)
            self._upsert_many(session, Measurement, list(by_config.values()), key)

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
        one goes to replaced_records. Returns what happened to them. Each key's first
        record is decided against the rows read in one query and written in batches (an
        import of 100k records took minutes one statement at a time); a key given again,
        or taken by another writer meanwhile, is decided row by row after them."""
        counts = dict(written=0, replaced=0, kept=0, same=0)
        with self._write() as session:
            for fp_id, fp_data in {fp[0]: fp for _, fp, _ in rows}.values():
                self._ensure_fingerprint(session, fp_id, fp_data)
            first: dict[tuple, dict[str, Any]] = {}
            again: list[dict[str, Any]] = []
            for problem, (fp_id, _), fields in rows:
                values = dict(problem.columns(), fingerprint_id=fp_id, **fields)
                for name in ("config", "default_config", "method"):
                    values[name] = canonical_json(values[name])
                if values.get("created_at") is None:
                    values["created_at"] = utcnow()
                key = tuple(values[k] for k in RECORD_KEY)
                (again.append(values) if key in first else first.__setitem__(key, values))
            if session.bind.dialect.name in ("sqlite", "postgresql"):
                again[:0] = self._put_records(session, first, replace, counts)
            else:
                again[:0] = first.values()
            for values in again:
                counts[self._put_record(session, values, replace)] += 1
        return SaveResult(**counts)

    def _put_records(self, session: Session, first: dict[tuple, dict[str, Any]], replace: bool,
                     counts: dict[str, int]) -> list[dict[str, Any]]:
        """Records of distinct keys, decided against the stored rows read at once and written
        in batches; returns those a concurrent writer's insert took (for _put_record)."""
        query = _raw(TuningRecord, TuningRecord.fingerprint_id.in_({k[-1] for k in first}))
        if session.bind.dialect.name == "postgresql":
            query = query.with_for_update()
        stored = {tuple(getattr(row, k) for k in RECORD_KEY): row for row in session.execute(query)}
        fresh, updates, history = [], [], []
        for key, values in first.items():
            row = stored.get(key)
            if row is None:
                fresh.append(values)
                continue
            outcome, old = self._decide(row, values, replace)
            counts[outcome] += 1
            if outcome == "replaced":
                updates.append(dict({k: values[k] for k in RECORD_FIELDS}, row_id=row.id))
                if old is not None:
                    history.append(old)
        taken: list[dict[str, Any]] = []
        if fresh:
            dialect = sqlite if session.bind.dialect.name == "sqlite" else postgresql
            insert_new = dialect.insert(TuningRecord).on_conflict_do_nothing(index_elements=RECORD_KEY).returning(
                *(getattr(TuningRecord, k) for k in RECORD_KEY))
            written = {tuple(r) for r in session.connection().execute(insert_new, fresh)}
            taken = [v for v in fresh if tuple(v[k] for k in RECORD_KEY) not in written]
            counts["written"] += len(fresh) - len(taken)
        if history:
            session.connection().execute(insert(ReplacedRecord), history)
        if updates:
            session.connection().execute(
                update(TuningRecord).where(TuningRecord.id == bindparam("row_id")).values(
                    {k: bindparam(k) for k in RECORD_FIELDS}), updates)
        return taken

    def _decide(self, existing: Any, values: dict[str, Any], replace: bool) -> tuple[str, dict[str, Any] | None]:
        """What a record does to the stored row of its key: "same", "kept" (the stored one
        is newer) or "replaced", with the replaced_records row that keeps the old one (None
        where that table is missing or the old row is malformed: nothing in it can be used)."""
        try:
            old = _record(existing, {existing.fingerprint_id})
        except check.RowError:
            return "replaced", None
        same = all(getattr(existing, k) == values[k] for k in RECORD_FIELDS if k != "created_at")
        if same and old.created_at == _utc(values["created_at"]):
            return "same", None
        if not replace and old.created_at > _utc(values["created_at"]):
            return "kept", None
        if ReplacedRecord.__tablename__ in self._missing_optional_tables:
            return "replaced", None
        return "replaced", dict(
            **{k: getattr(existing, k) for k in RECORD_KEY}, config=existing.config, median_us=old.median_us,
            spread_us=old.spread_us, samples=old.samples, default_config=existing.default_config,
            default_median_us=old.default_median_us, default_spread_us=old.default_spread_us,
            method=existing.method, created_at=old.created_at, replaced_at=utcnow())

    def _put_record(self, session: Session, values: dict[str, Any], replace: bool) -> str:
        where = [getattr(TuningRecord, k) == values[k] for k in RECORD_KEY]
        stmt = _raw(TuningRecord, *where)
        if session.bind.dialect.name == "postgresql":
            stmt = stmt.with_for_update()
        existing = session.execute(stmt).one_or_none()
        if existing is None:
            dialect = session.bind.dialect.name
            if dialect in ("sqlite", "postgresql"):
                ins = (sqlite if dialect == "sqlite" else postgresql).insert(TuningRecord).values(**values)
                if session.execute(ins.on_conflict_do_nothing(index_elements=RECORD_KEY)).rowcount:
                    return "written"
                existing = session.execute(stmt).one()  # another writer's, committed meanwhile
            else:
                try:
                    with session.begin_nested():
                        session.execute(insert(TuningRecord).values(**values))
                    return "written"
                except IntegrityError:
                    existing = session.execute(stmt).one()
        outcome, old = self._decide(existing, values, replace)
        if outcome != "replaced":
            return outcome
        if old is not None:
            session.execute(insert(ReplacedRecord).values(**old))
        session.execute(update(TuningRecord).where(TuningRecord.id == existing.id).values(
            **{k: values[k] for k in RECORD_FIELDS}))
        return "replaced"

    # -- reads -------------------------------------------------------------------------

    def _fingerprint_rows(self, session: Session) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """(id -> data) of the well-formed fingerprints, and one line per malformed one."""
        good: dict[str, dict[str, Any]] = {}
        bad: list[str] = []
        for row in session.execute(_raw(Fingerprint)):
            try:
                good[check.text(row.id, "fingerprints id", 32)] = check.json_object(
                    row.data, f"fingerprints id {row.id!r:.40}.data")
            except check.RowError as e:
                bad.append(str(e))
        return good, bad

    def _malformed(self, what: str, bad: list[str]) -> MalformedRowsError:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        return MalformedRowsError(f"tuning DB {self.display_url} has malformed {what} ({bad[0]}{more}); "
                                  "`tuner doctor` lists them, `tuner prune` removes them")

    def applicable_ids(self, environment: dict[str, Any]) -> set[str]:
        """The ids of stored environments whose records apply in `environment`
        (tuner.db.fingerprint.applies: same GPU and kernel-library versions)."""
        with self._read() as session:
            fps, _ = self._fingerprint_rows(session)
        return {fp for fp, data in fps.items() if applies(data, environment)}

    def records(self, *, op: str | None = None, fingerprint_id: str | None = None,
                environment: dict[str, Any] | None = None, problem: Problem | None = None) -> list[Record]:
        """Stored winners (of one op or problem, one environment id, or those that apply in
        `environment`: the newest per problem). MalformedRowsError on a malformed row."""
        query = _raw(TuningRecord).order_by(
            TuningRecord.op, TuningRecord.static_key, TuningRecord.max_q_len,
            TuningRecord.batch, TuningRecord.kv_len_bucket, TuningRecord.id,
        )
        if op is not None:
            query = query.where(TuningRecord.op == op)
        if problem is not None:
            query = query.where(*(getattr(TuningRecord, k) == v for k, v in problem.columns().items()))
        if fingerprint_id is not None:
            query = query.where(TuningRecord.fingerprint_id == fingerprint_id)
        with self._read() as session:
            fps, _ = self._fingerprint_rows(session)
            if environment is not None:
                ids = [fp for fp, data in fps.items() if applies(data, environment)]
                query = query.where(TuningRecord.fingerprint_id.in_(ids))
            out, bad = [], []
            for row in session.execute(query):
                try:
                    out.append(_record(row, fps))
                except check.RowError as e:
                    bad.append(str(e))
        if bad:
            raise self._malformed("records", bad)
        if environment is None:
            return out
        newest: dict[Problem, Record] = {}
        for r in out:
            if r.problem not in newest or r.created_at >= newest[r.problem].created_at:
                newest[r.problem] = r
        return [r for r in out if newest[r.problem] is r]

    def record(self, problem: Problem, fingerprint_id: str | None = None, *,
               environment: dict[str, Any] | None = None) -> Record | None:
        """The winner of a problem in one environment id, or the newest that applies in `environment`."""
        found = self.records(problem=problem, fingerprint_id=fingerprint_id, environment=environment)
        return max(found, key=lambda r: r.created_at) if found else None

    def measurements(self, problem: Problem, fingerprint_id: str) -> list[MeasurementRow]:
        cols = problem.columns()
        query = _raw(Measurement, *(getattr(Measurement, k) == v for k, v in cols.items()),
                     Measurement.fingerprint_id == fingerprint_id, missing=self._missing_measurement_columns
                     ).order_by(Measurement.id)
        out, bad = [], []
        with self._read() as session:
            for row in session.execute(query):
                try:
                    out.append(_measurement(row))
                except check.RowError as e:
                    bad.append(str(e))
        if bad:
            raise self._malformed("measurements", bad)
        return out

    def fingerprints(self) -> dict[str, dict[str, Any]]:
        """Every stored environment, id -> data. MalformedRowsError on a malformed one."""
        with self._read() as session:
            good, bad = self._fingerprint_rows(session)
        if bad:
            raise self._malformed("fingerprints", bad)
        return good

    def snapshot(self, environment: dict[str, Any]) -> Snapshot:
        """Every winner that applies in `environment` (the newest where several stored
        environments hold one key), malformed rows skipped and counted, never raised."""
        snap = Snapshot()
        newest: dict[tuple[tuple[str, str], AttentionRunKey], datetime] = {}
        query = select(*(type_coerce(getattr(TuningRecord, c), NullType()).label(c) for c in (
            "id", "op", "static_key", "batch", "max_q_len", "kv_len_bucket", "config", "median_us",
            "default_median_us", "created_at", "fingerprint_id")))
        with self._read() as session:
            fps, bad_fps = self._fingerprint_rows(session)
            snap.skipped.extend(bad_fps)
            ids = [fp for fp, data in fps.items() if applies(data, environment)]
            orphans = session.execute(select(TuningRecord.id, TuningRecord.fingerprint_id).where(
                ~TuningRecord.fingerprint_id.in_(list(fps)))).all()
            snap.skipped.extend(f"records id {rid}: fingerprint {fp!r:.40} is not in the DB" for rid, fp in orphans)
            for row in session.execute(query.where(TuningRecord.fingerprint_id.in_(ids))):
                where = f"records id {row.id}"
                try:
                    problem = _problem(row, where)
                    config = check.config_text(row.config, f"{where}.config")
                    median = check.number(row.median_us, f"{where}.median_us", positive=True)
                    default = check.number(row.default_median_us, f"{where}.default_median_us", positive=True,
                                           nullable=True)
                    created = check.created_at(row.created_at, f"{where}.created_at")
                except check.RowError as e:
                    snap.skipped.append(str(e))
                    continue
                key, run = (problem.op, problem.static_key), problem.run_key
                if (key, run) in newest and newest[(key, run)] > created:
                    continue
                newest[(key, run)] = created
                snap.table.setdefault(key, {})[run] = Timed(config, median, default)
        return snap

    def counts(self) -> dict[str, dict[str, int]]:
        """{fingerprint id: {"records": n, "measurements": m}}."""
        out: dict[str, dict[str, int]] = {}
        with self._read() as session:
            for model, name in ((TuningRecord, "records"), (Measurement, "measurements")):
                query = select(model.fingerprint_id, func.count()).group_by(model.fingerprint_id)
                for fp, n in session.execute(query):
                    out.setdefault(str(fp), {"records": 0, "measurements": 0})[name] = n
        return out

    def op_names(self) -> set[str]:
        """Every op name the DB holds records or misses of (tuner's ops and users' own)."""
        with self._read() as session:
            names = set(session.scalars(select(TuningRecord.op).distinct()))
            if Miss.__tablename__ not in self._missing_optional_tables:
                names |= set(session.scalars(select(Miss.op).distinct()))
        return {str(n) for n in names}

    def save_misses(self, fingerprint: tuple[str, dict[str, Any]], misses: list[MissRow]) -> None:
        """Add each miss (its count and its calls' lengths, to what is stored) to the misses
        table, in one transaction."""
        if not misses:
            return
        if Miss.__tablename__ in self._missing_optional_tables:  # an older DB this writer may not upgrade
            raise DBError(f"cannot record misses in tuning DB {self.display_url}: it has no misses table (made by "
                          "an older tuner; a role that may create tables adds it)")
        absent = self._missing_miss_columns
        with self._write(action="record misses in") as session:
            self._ensure_fingerprint(session, *fingerprint)
            for problem, served, count, lengths in (MissRow(*m) for m in misses):
                n = lengths.calls if lengths else 0
                values = dict(problem.columns(), fingerprint_id=fingerprint[0], served=served, count=count,
                              last_seen=utcnow(), length_calls=n,
                              length_mean_sum=lengths.mean * n if lengths else 0.0,
                              length_max_sum=lengths.longest * n if lengths else 0.0,
                              length_spread_sum=lengths.spread * n if lengths else 0.0)
                for column in absent:
                    values.pop(column)
                self._upsert(session, Miss, values, RECORD_KEY,
                             add=("count",) + tuple(c for c in MISS_LENGTH_COLUMNS if c not in absent))

    def misses(self, fingerprint_id: str, *, op: str | None = None,
               environment: dict[str, Any] | None = None) -> list[MissRow]:
        """The misses the runtime recorded in this environment and that still have no
        winner applying in `environment` (default: none of this id), most frequent first."""
        if Miss.__tablename__ in self._missing_optional_tables:
            return []
        query = _raw(Miss, Miss.fingerprint_id == fingerprint_id, missing=self._missing_miss_columns)
        if op is not None:
            query = query.where(Miss.op == op)
        out, bad = [], []
        with self._read() as session:
            for m in session.execute(query):
                try:
                    out.append(_miss(m))
                except check.RowError as e:
                    bad.append(str(e))
        if bad:
            raise self._malformed("misses", bad)
        solved = {r.problem for r in (self.records(op=op, environment=environment) if environment is not None
                                      else self.records(op=op, fingerprint_id=fingerprint_id))}
        unsolved = [m for m in out if m.problem not in solved]
        return sorted(unsolved, key=lambda m: (-m.count, m.problem.op, m.problem.static_key))

    # -- damage ------------------------------------------------------------------------

    def malformed_rows(self) -> list[tuple[type, Any, str]]:
        """(table's model, row id, why) for every row that breaks tuner.db.rows' rules,
        records pointing at no fingerprint included."""
        with self._read() as session:
            return self._malformed_in(session)

    def _malformed_in(self, session: Session) -> list[tuple[type, Any, str]]:
        out: list[tuple[type, Any, str]] = []
        fps, _ = self._fingerprint_rows(session)
        for row in session.execute(_raw(Fingerprint)):
            if row.id not in fps:
                out.append((Fingerprint, row.id, f"fingerprints id {row.id!r:.40}: data is not a JSON object"))
        for row in session.execute(_raw(TuningRecord)):
            try:
                _record(row, fps)
            except check.RowError as e:
                out.append((TuningRecord, row.id, str(e)))
        for row in session.execute(_raw(Measurement, missing=self._missing_measurement_columns)):
            try:
                _measurement(row)
                if row.fingerprint_id not in fps:
                    raise check.RowError(f"measurements id {row.id}: fingerprint {row.fingerprint_id!r} "
                                         "is not in the DB")
                _problem(row, f"measurements id {row.id}")
            except check.RowError as e:
                out.append((Measurement, row.id, str(e)))
        if Miss.__tablename__ not in self._missing_optional_tables:
            for row in session.execute(_raw(Miss, missing=self._missing_miss_columns)):
                try:
                    _miss(row)
                    if row.fingerprint_id not in fps:
                        raise check.RowError(f"misses id {row.id}: fingerprint {row.fingerprint_id!r} is not in the DB")
                except check.RowError as e:
                    out.append((Miss, row.id, str(e)))
        return out

    def prune(self, environment: dict[str, Any], *, dry_run: bool = False) -> dict[str, dict[str, int]]:
        """Remove, in one transaction, what cannot apply in `environment`: every record,
        measurement, miss and fingerprint of environments whose records never apply here
        (tuner.db.fingerprint.applies: another GPU or kernel-library version; a newer
        driver or tuner does not count), and every malformed row (under the id
        "malformed"). Returns what was (or, with dry_run, would be) removed.

        What to remove is read inside the transaction that removes it (under the write lock
        for SQLite), and only the environments found stale are removed: a writer adding a
        new environment meanwhile keeps it."""
        with (self._read() if dry_run else self._write(action="prune")) as session:
            if session.bind.dialect.name == "postgresql" and not dry_run:  # writers wait for prune
                session.execute(text("LOCK TABLE fingerprints IN SHARE ROW EXCLUSIVE MODE"))
            fps, _ = self._fingerprint_rows(session)
            stale_ids = sorted(str(fp) for fp in session.scalars(select(Fingerprint.id))
                               if fp not in fps or not applies(fps[fp], environment))
            bad = self._malformed_in(session)
            counts: dict[str, dict[str, int]] = {fp: {"records": 0, "measurements": 0} for fp in stale_ids}
            for model, name in ((TuningRecord, "records"), (Measurement, "measurements")):
                query = select(model.fingerprint_id, func.count()).group_by(model.fingerprint_id)
                for fp, n in session.execute(query):
                    if str(fp) in counts:
                        counts[str(fp)][name] = n
            bad_records = sum(model is TuningRecord for model, _, _ in bad)
            bad_measurements = sum(model is Measurement for model, _, _ in bad)
            if bad:
                counts["malformed"] = {"records": bad_records, "measurements": bad_measurements, "rows": len(bad)}
            if dry_run or not counts:
                return counts
            for model, rid, _ in bad:
                session.execute(delete(model).where(model.__table__.c.id == rid))
            models = [Measurement, TuningRecord] + [m for m in (Miss, ReplacedRecord)
                                                    if m.__tablename__ not in self._missing_optional_tables]
            for model in models:
                session.execute(delete(model).where(model.fingerprint_id.in_(stale_ids)))
            session.execute(delete(Fingerprint).where(Fingerprint.id.in_(stale_ids)))
        return counts

    def damage(self) -> list[str]:
        """Damage to the file or the schema (empty when there is none): SQLite's
        integrity_check, missing core tables, a read that fails. Malformed rows are not
        damage: `tuner prune` mends them (integrity() lists both)."""
        problems: list[str] = []
        try:
            with self._read() as session:
                if self.url.get_backend_name() == "sqlite":
                    result = [r[0] for r in session.execute(text("PRAGMA integrity_check"))]
                    if result != ["ok"]:
                        problems.extend(f"integrity_check: {r}" for r in result)
                missing = {t.name for t in Base.metadata.sorted_tables} - OPTIONAL_TABLES - set(
                    inspect(session.connection()).get_table_names()
                )
                if missing:
                    problems.append(f"missing tables: {', '.join(sorted(missing))}")
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
            bad = self.malformed_rows()
        except DBError as e:
            return [str(e)]
        if not bad:
            return []
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        return [f"{len(bad)} malformed rows ({bad[0][2]}{more}); `tuner prune` removes them"]
