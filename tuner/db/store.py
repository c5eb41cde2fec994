"""TuningDB: records, measurements and fingerprints, read and written through SQLAlchemy."""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock, Timeout
from sqlalchemy import Engine, create_engine, delete, event, func, inspect, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session

from tuner.db.location import DBError, MissingDBError, resolve_db_url
from tuner.db.schema import (
    OPTIONAL_TABLES, SCHEMA_VERSION, Base, Fingerprint, Measurement, Meta, Miss, TuningRecord, utcnow,
)
from tuner.keys import AttentionRunKey, canonical_json

WRITE_LOCK_TIMEOUT_S = 120.0


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


def _problem(row: Any) -> Problem:
    return Problem(row.op, row.static_key, AttentionRunKey(row.batch, row.max_q_len, row.kv_len_bucket))


def _record(row: TuningRecord) -> Record:
    return Record(
        problem=_problem(row),
        fingerprint_id=row.fingerprint_id,
        config=json.loads(row.config),
        median_us=row.median_us,
        spread_us=row.spread_us,
        samples=row.samples,
        default_config=json.loads(row.default_config),
        default_median_us=row.default_median_us,
        default_spread_us=row.default_spread_us,
        method=json.loads(row.method),
        # SQLite keeps no time zone; every time stored is UTC
        created_at=row.created_at if row.created_at.tzinfo else row.created_at.replace(tzinfo=timezone.utc),
    )


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


_CREATE_LOCK_KEY = 0x74756E6572  # "tuner": the advisory lock that serialises schema creation


def winner_gain(median_us: float | None, default_median_us: float | None) -> float:
    """How much faster a winner ran than the default at its own key: default / winner time;
    infinite when the default did not run right (nothing to lose), 1.0 when unknown."""
    if default_median_us is None:
        return math.inf
    if not median_us or median_us <= 0:
        return 1.0
    return default_median_us / median_us


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
        self.url = url
        self.path: Path | None = None
        self._lock: FileLock | None = None
        if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
            self.path = Path(url.database)
            try:
                self._check_sqlite_path(self.path, create=create, make_parent=is_default)
            except OSError as e:  # a name too long, a path through a file, ...
                raise DBError(f"unusable tuning DB path {self.path}: {e.strerror or e}") from None
            self._lock = FileLock(str(self.path) + ".lock", timeout=WRITE_LOCK_TIMEOUT_S)
        try:
            self.engine: Engine = create_engine(url)
        except (SQLAlchemyError, ImportError, ValueError) as e:
            raise DBError(f"cannot open tuning DB {self.display_url}: {_short(e)}") from None
        if url.get_backend_name() == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._init_schema(create)

    # -- opening -----------------------------------------------------------------------

    @property
    def display_url(self) -> str:
        return str(self.path) if self.path else self.url.render_as_string(hide_password=True)

    @staticmethod
    def _check_sqlite_path(path: Path, *, create: bool, make_parent: bool) -> None:
        if path.is_dir():
            raise DBError(f"tuning DB path {path} is a directory, not a file")
        if path.exists():
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
        """Check the schema with reads; write it only into an empty (or half-made) DB, and
        only if create. SQLite commits DDL at once, so another process may see our tables
        before the schema version row: such a DB is finished under the lock, not refused."""
        if self._schema_ready():
            if create and self._missing_optional_tables:
                with self._write(action="upgrade") as session:  # tables added since version 1
                    Base.metadata.create_all(session.connection(), tables=[
                        Base.metadata.tables[t] for t in sorted(self._missing_optional_tables)])
                self._missing_optional_tables = set()
            return
        if not create:
            raise MissingDBError(f"no tuning DB at {self.display_url} yet (`tuner sweep OP` makes one)")
        with self._locked("create"):  # another process may be creating it too
            if self._schema_ready():
                return
            if self.url.get_backend_name() == "sqlite":
                try:  # WAL is a property of the file, and cannot be set inside a transaction
                    with self.engine.connect() as conn:
                        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
                except DBAPIError as e:
                    raise DBError(f"cannot create tuning DB {self.display_url}: {_short(e)}") from None
            with self._write(action="create") as session:  # the lock is reentrant
                if self.url.get_backend_name() == "postgresql":
                    # no file lock for a server DB: its own lock, held to commit, serialises
                    # creators (DDL is transactional there; create_all skips existing tables)
                    session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _CREATE_LOCK_KEY})
                Base.metadata.create_all(session.connection())
                if session.get(Meta, "schema_version") is None:
                    session.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
            self._missing_optional_tables = set()

    def _schema_ready(self) -> bool:
        """True for a tuning DB of our schema version; False for an empty or half-made one
        (only our tables, no version yet); DBError for anything else."""
        with self._read() as session:
            inspector = inspect(session.connection())
            tables = set(inspector.get_table_names())
            self._missing_optional_tables = OPTIONAL_TABLES - tables
            version = session.get(Meta, "schema_version") if Meta.__tablename__ in tables else None
            if version is None:  # ours only if every table is one of ours, column for column
                foreign = any(t not in Base.metadata.tables or {c["name"] for c in inspector.get_columns(t)}
                              != set(Base.metadata.tables[t].columns.keys()) for t in tables)
        if version is not None:
            if version.value != str(SCHEMA_VERSION):
                raise DBError(
                    f"tuning DB {self.display_url} has schema version {version.value}; "
                    f"this tuner reads version {SCHEMA_VERSION}"
                )
            return True
        if foreign:
            raise DBError(f"{self.display_url} is not a tuning DB (it has other tables); give another --db")
        return False

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
    def _write(self, action: str = "write") -> Iterator[Session]:
        """One transaction, under the cross-process file lock for SQLite files."""
        with self._locked(action):
            try:
                with Session(self.engine) as session, session.begin():
                    yield session
            except DBAPIError as e:
                raise DBError(f"cannot {action} tuning DB {self.display_url}: {_short(e)}") from None

    @contextmanager
    def _read(self) -> Iterator[Session]:
        try:
            with Session(self.engine) as session:
                yield session
        except DBAPIError as e:
            raise DBError(f"cannot read tuning DB {self.display_url}: {_short(e)}") from None

    def _upsert(self, session: Session, model: type, values: dict[str, Any], key: list[str],
                replace: bool = True, add: tuple[str, ...] = ()) -> None:
        """Insert, or on a key conflict replace the other columns (or keep the row: replace=False);
        columns in `add` are added to the stored value instead of replacing it."""
        dialect = session.bind.dialect.name
        update = {k: v for k, v in values.items() if k not in key}
        if dialect in ("sqlite", "postgresql"):
            insert = (sqlite if dialect == "sqlite" else postgresql).insert(model).values(**values)
            if replace:
                set_ = {k: getattr(model, k) + getattr(insert.excluded, k) if k in add else v for k, v in update.items()}
                session.execute(insert.on_conflict_do_update(index_elements=key, set_=set_))
            else:
                session.execute(insert.on_conflict_do_nothing(index_elements=key))
            return
        existing = session.scalars(
            select(model).where(*(getattr(model, k) == values[k] for k in key))
        ).one_or_none()
        if existing is None:
            session.add(model(**values))
            session.flush()
        elif replace:
            for k, v in update.items():
                setattr(existing, k, getattr(existing, k) + v if k in add else v)

    # -- writes ------------------------------------------------------------------------

    def _ensure_fingerprint(self, session: Session, fingerprint_id: str, data: dict[str, Any]) -> None:
        if session.get(Fingerprint, fingerprint_id) is None:  # writers to a server DB may race here
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
    ) -> None:
        fp_id, fp_data = fingerprint
        values = dict(
            problem.columns(),
            fingerprint_id=fp_id,
            config=canonical_json(config),
            kv_len=kv_len,
            status=status,
            median_us=median_us,
            spread_us=spread_us,
            samples=samples,
            max_error=max_error,
            error=error,
            method=canonical_json(method),
        )
        key = ["op", "static_key", "batch", "max_q_len", "kv_len_bucket", "fingerprint_id", "config"]
        with self._write() as session:
            self._ensure_fingerprint(session, fp_id, fp_data)
            self._upsert(session, Measurement, values, key)

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
    ) -> None:
        self.save_records([
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
    ) -> None:
        """save_record from timings (anything with median_us, spread_us and samples)."""
        self.save_record(
            problem, fingerprint, config,
            median_us=timing.median_us, spread_us=timing.spread_us, samples=timing.samples,
            default_config=default_config,
            default_median_us=default_timing.median_us if default_timing else None,
            default_spread_us=default_timing.spread_us if default_timing else None,
            method=method,
        )

    def save_records(self, rows: list[tuple[Problem, tuple[str, dict[str, Any]], dict[str, Any]]]) -> None:
        """Upsert many records in ONE transaction: all land or none (used by import)."""
        key = ["op", "static_key", "batch", "max_q_len", "kv_len_bucket", "fingerprint_id"]
        with self._write() as session:
            for problem, (fp_id, fp_data), fields in rows:
                self._ensure_fingerprint(session, fp_id, fp_data)
                values = dict(problem.columns(), fingerprint_id=fp_id, **fields)
                for name in ("config", "default_config", "method"):
                    values[name] = canonical_json(values[name])
                if values.get("created_at") is None:
                    values["created_at"] = utcnow()
                self._upsert(session, TuningRecord, values, key)

    # -- reads -------------------------------------------------------------------------

    def measurements(self, problem: Problem, fingerprint_id: str) -> list[MeasurementRow]:
        cols = problem.columns()
        with self._read() as session:
            rows = session.scalars(
                select(Measurement).filter_by(**cols, fingerprint_id=fingerprint_id).order_by(Measurement.id)
            ).all()
            return [
                MeasurementRow(json.loads(r.config), r.status, r.median_us, r.spread_us,
                               r.samples, r.max_error, r.error, json.loads(r.method), r.kv_len)
                for r in rows
            ]

    def record(self, problem: Problem, fingerprint_id: str) -> Record | None:
        with self._read() as session:
            row = session.scalars(
                select(TuningRecord).filter_by(**problem.columns(), fingerprint_id=fingerprint_id)
            ).one_or_none()
            return _record(row) if row else None

    def records(self, *, op: str | None = None, fingerprint_id: str | None = None) -> list[Record]:
        query = select(TuningRecord).order_by(
            TuningRecord.op, TuningRecord.static_key, TuningRecord.max_q_len,
            TuningRecord.batch, TuningRecord.kv_len_bucket,
        )
        if op is not None:
            query = query.where(TuningRecord.op == op)
        if fingerprint_id is not None:
            query = query.where(TuningRecord.fingerprint_id == fingerprint_id)
        with self._read() as session:
            return [_record(r) for r in session.scalars(query)]

    def fingerprints(self) -> dict[str, dict[str, Any]]:
        with self._read() as session:
            return {f.id: json.loads(f.data) for f in session.scalars(select(Fingerprint))}

    def snapshot(self, fingerprint_id: str, gains: dict | None = None,
                 ) -> dict[tuple[str, str], dict[AttentionRunKey, dict[str, Any]]]:
        """Every winner of one environment: (op, static key JSON) -> {run key: config}.
        `gains`, when given, is filled alike with each winner's gain (winner_gain)."""
        table: dict[tuple[str, str], dict[AttentionRunKey, dict[str, Any]]] = {}
        query = select(
            TuningRecord.op, TuningRecord.static_key, TuningRecord.batch, TuningRecord.max_q_len,
            TuningRecord.kv_len_bucket, TuningRecord.config, TuningRecord.median_us, TuningRecord.default_median_us,
        ).where(TuningRecord.fingerprint_id == fingerprint_id)
        with self._read() as session:
            for op, static, batch, q, kv, config, median, default_median in session.execute(query):
                run = AttentionRunKey(batch, q, kv)
                table.setdefault((op, static), {})[run] = json.loads(config)
                if gains is not None:
                    gains.setdefault((op, static), {})[run] = winner_gain(median, default_median)
        return table

    def counts(self) -> dict[str, dict[str, int]]:
        """{fingerprint id: {"records": n, "measurements": m}}."""
        out: dict[str, dict[str, int]] = {}
        with self._read() as session:
            for model, name in ((TuningRecord, "records"), (Measurement, "measurements")):
                query = select(model.fingerprint_id, func.count()).group_by(model.fingerprint_id)
                for fp, n in session.execute(query):
                    out.setdefault(fp, {"records": 0, "measurements": 0})[name] = n
        return out

    def save_misses(self, fingerprint: tuple[str, dict[str, Any]], misses: list[tuple[Problem, str, int]]) -> None:
        """Add (problem, served as "nearest" or "default", times) to the misses table, one transaction."""
        if not misses:
            return
        key = ["op", "static_key", "batch", "max_q_len", "kv_len_bucket", "fingerprint_id"]
        with self._write(action="record misses in") as session:
            self._ensure_fingerprint(session, *fingerprint)
            for problem, served, count in misses:
                values = dict(problem.columns(), fingerprint_id=fingerprint[0], served=served, count=count,
                              last_seen=utcnow())
                self._upsert(session, Miss, values, key, add=("count",))

    def misses(self, fingerprint_id: str, *, op: str | None = None) -> list[tuple[Problem, str, int]]:
        """(problem, served, count) the runtime recorded in this environment and that still
        have no exact winner, most frequent first."""
        if self._missing_optional_tables:
            return []
        query = select(Miss).where(Miss.fingerprint_id == fingerprint_id)
        if op is not None:
            query = query.where(Miss.op == op)
        with self._read() as session:
            rows = [(_problem(m), m.served, m.count) for m in session.scalars(query)]
        solved = {r.problem for r in self.records(op=op, fingerprint_id=fingerprint_id)}
        return sorted((m for m in rows if m[0] not in solved), key=lambda m: (-m[2], m[0].op, m[0].static_key))

    def prune(self, keep_fingerprint_id: str, *, dry_run: bool = False) -> dict[str, dict[str, int]]:
        """Remove every record, measurement and fingerprint of environments other than
        `keep_fingerprint_id` (stale after an upgrade: never used at lookup), in one
        transaction. Returns what was (or, with dry_run, would be) removed, per environment."""
        stale = {fp: c for fp, c in self.counts().items() if fp != keep_fingerprint_id}
        stale.update({fp: {"records": 0, "measurements": 0} for fp in self.fingerprints()
                      if fp != keep_fingerprint_id and fp not in stale})
        if dry_run or not stale:
            return stale
        with self._write(action="prune") as session:
            for model in (Measurement, TuningRecord) + ((Miss,) if not self._missing_optional_tables else ()):
                session.execute(delete(model).where(model.fingerprint_id != keep_fingerprint_id))
            session.execute(delete(Fingerprint).where(Fingerprint.id != keep_fingerprint_id))
        return stale

    def integrity(self) -> list[str]:
        """Problems found (empty when the DB is sound)."""
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
                orphans = session.scalar(
                    select(func.count()).select_from(TuningRecord).where(
                        ~TuningRecord.fingerprint_id.in_(select(Fingerprint.id))
                    )
                )
                if orphans:
                    problems.append(f"{orphans} records point at no fingerprint")
        except DBError as e:
            problems.append(str(e))
        return problems
