"""The DB's writes, each inside the caller's one transaction: environments, measurements,
winners (a stored one is replaced only by one at least as new, and kept in replaced_records)
and misses."""

from __future__ import annotations

import functools
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tuner.db import rows as check
from tuner.db.checked import raw_select, record_of
from tuner.db.migration import SchemaGaps
from tuner.db.schema import (
    MISS_LENGTH_COLUMNS, RECORD_FIELDS, Fingerprint, Measurement, Miss, ReplacedRecord, TuningRecord, utcnow,
)
from tuner.db.values import MissRow, Problem, SaveResult
from tuner.keys import canonical_json

PROBLEM_COLUMNS = ("op", "static_key", "batch", "max_q_len", "kv_len_bucket")
RECORD_KEY = [*PROBLEM_COLUMNS, "fingerprint_id"]
# what TuningDB.save_measurements takes of each measurement (save_measurement's keywords)
MEASUREMENT_FIELDS = frozenset({"config", "kv_len", "status", "method", "median_us", "spread_us", "samples",
                                "max_error", "error", "rung"})
RecordRow = tuple[Problem, tuple[str, dict[str, Any]], dict[str, Any]]  # (problem, (fingerprint id, data), fields)


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


def upsert(session: Session, model: type, values: dict[str, Any], key: list[str],
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


def _upsert_many(session: Session, model: type, rows: list[dict[str, Any]], key: list[str]) -> None:
    """upsert of rows of one set of columns and distinct keys: one executemany where the
    dialect has an upsert statement."""
    dialect = session.bind.dialect.name
    if dialect in ("sqlite", "postgresql"):
        session.execute(_upsert_statement(dialect, model, tuple(rows[0]), tuple(key), True, ()), rows)
        return
    for values in rows:
        upsert(session, model, values, key)


def ensure_fingerprint(session: Session, fingerprint_id: str, data: dict[str, Any]) -> None:
    """Store an environment unless it is stored already."""
    # an insert that keeps a row already there: one statement, and no race between writers
    # to a server DB (a look first would cost a query on every measurement of a sweep)
    if session.bind.dialect.name in ("sqlite", "postgresql") or session.get(Fingerprint, fingerprint_id) is None:
        values = {"id": fingerprint_id, "data": canonical_json(data), "created_at": utcnow()}
        upsert(session, Fingerprint, values, ["id"], replace=False)


def measurement_rows(problem: Problem, fingerprint_id: str, measurements: list[dict[str, Any]],
                     missing: frozenset[str]) -> list[dict[str, Any]]:
    """The rows of several measurements of one problem (each save_measurement's keywords),
    without the columns the DB lacks; of two of one config, the later. TypeError on a bad one."""
    by_config: dict[str, dict[str, Any]] = {}
    for m in measurements:
        unknown = set(m) - MEASUREMENT_FIELDS
        if unknown or not {"config", "kv_len", "status", "method"} <= set(m):
            raise TypeError(f"a measurement takes {', '.join(sorted(MEASUREMENT_FIELDS))} "
                            f"(config, kv_len, status and method required), got {', '.join(sorted(m))}")
        values = dict(
            problem.columns(),
            fingerprint_id=fingerprint_id,
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
        for column in missing:  # a DB this writer could not upgrade
            values.pop(column, None)
        by_config[values["config"]] = values
    return list(by_config.values())


def save_measurements(session: Session, fingerprint: tuple[str, dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """measurement_rows of one problem, with their environment."""
    ensure_fingerprint(session, *fingerprint)
    _upsert_many(session, Measurement, rows, [*RECORD_KEY, "config"])


def save_records(session: Session, rows: list[RecordRow], replace: bool, gaps: SchemaGaps) -> SaveResult:
    """Records, with their environments. A record replaces the stored one of its key only
    when it is at least as new (created_at; a record without one is dated now), or with
    replace=True; the replaced one goes to replaced_records. Each key's first record is
    decided against the rows read in one query and written in batches (docs/decisions.md,
    "The DB"); a key given again, or taken by another writer meanwhile, is decided row by
    row after them."""
    counts = dict(written=0, replaced=0, kept=0, same=0)
    keep_history = not gaps.lacks_table(ReplacedRecord)
    for fp_id, fp_data in {fp[0]: fp for _, fp, _ in rows}.values():
        ensure_fingerprint(session, fp_id, fp_data)
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
        again[:0] = _put_records(session, first, replace, keep_history, counts)
    else:
        again[:0] = first.values()
    for values in again:
        counts[_put_record(session, values, replace, keep_history)] += 1
    return SaveResult(**counts)


def _put_records(session: Session, first: dict[tuple, dict[str, Any]], replace: bool, keep_history: bool,
                 counts: dict[str, int]) -> list[dict[str, Any]]:
    """Records of distinct keys, decided against the stored rows read at once and written
    in batches; returns those a concurrent writer's insert took (for _put_record)."""
    query = raw_select(TuningRecord, TuningRecord.fingerprint_id.in_({k[-1] for k in first}))
    if session.bind.dialect.name == "postgresql":
        query = query.with_for_update()
    stored = {tuple(getattr(row, k) for k in RECORD_KEY): row for row in session.execute(query)}
    fresh, updates, history = [], [], []
    for key, values in first.items():
        row = stored.get(key)
        if row is None:
            fresh.append(values)
            continue
        outcome, old = _decide(row, values, replace, keep_history)
        counts[outcome] += 1
        if outcome == "replaced":
            updates.append(dict({k: values[k] for k in RECORD_FIELDS}, row_id=row.id))
            if old is not None:
                history.append(old)
    taken = _insert_fresh(session, fresh, counts) if fresh else []
    if history:
        session.connection().execute(insert(ReplacedRecord), history)
    if updates:
        session.connection().execute(
            update(TuningRecord).where(TuningRecord.id == bindparam("row_id")).values(
                {k: bindparam(k) for k in RECORD_FIELDS}), updates)
    return taken


def _insert_fresh(session: Session, fresh: list[dict[str, Any]], counts: dict[str, int]) -> list[dict[str, Any]]:
    """Insert records of keys none was stored at; returns those another writer took meanwhile."""
    dialect = sqlite if session.bind.dialect.name == "sqlite" else postgresql
    insert_new = dialect.insert(TuningRecord).on_conflict_do_nothing(index_elements=RECORD_KEY).returning(
        *(getattr(TuningRecord, k) for k in RECORD_KEY))
    written = {tuple(r) for r in session.connection().execute(insert_new, fresh)}
    taken = [v for v in fresh if tuple(v[k] for k in RECORD_KEY) not in written]
    counts["written"] += len(fresh) - len(taken)
    return taken


def _decide(existing: Any, values: dict[str, Any], replace: bool,
            keep_history: bool) -> tuple[str, dict[str, Any] | None]:
    """What a record does to the stored row of its key: "same", "kept" (the stored one
    is newer) or "replaced", with the replaced_records row that keeps the old one (None
    where that table is missing or the old row is malformed: nothing in it can be used)."""
    try:
        old = record_of(existing, {existing.fingerprint_id})
    except check.RowError:
        return "replaced", None
    same = all(getattr(existing, k) == values[k] for k in RECORD_FIELDS if k != "created_at")
    if same and old.created_at == _utc(values["created_at"]):
        return "same", None
    if not replace and old.created_at > _utc(values["created_at"]):
        return "kept", None
    if not keep_history:
        return "replaced", None
    return "replaced", dict(
        **{k: getattr(existing, k) for k in RECORD_KEY}, config=existing.config, median_us=old.median_us,
        spread_us=old.spread_us, samples=old.samples, default_config=existing.default_config,
        default_median_us=old.default_median_us, default_spread_us=old.default_spread_us,
        method=existing.method, created_at=old.created_at, replaced_at=utcnow())


def _put_record(session: Session, values: dict[str, Any], replace: bool, keep_history: bool) -> str:
    """One record, decided against the stored row of its key (read under a row lock on PostgreSQL)."""
    where = [getattr(TuningRecord, k) == values[k] for k in RECORD_KEY]
    stmt = raw_select(TuningRecord, *where)
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
    outcome, old = _decide(existing, values, replace, keep_history)
    if outcome != "replaced":
        return outcome
    if old is not None:
        session.execute(insert(ReplacedRecord).values(**old))
    session.execute(update(TuningRecord).where(TuningRecord.id == existing.id).values(
        **{k: values[k] for k in RECORD_FIELDS}))
    return "replaced"


def save_misses(session: Session, fingerprint: tuple[str, dict[str, Any]], misses: list[MissRow],
                missing: frozenset[str]) -> None:
    """Add each miss (its count and its calls' lengths) to what is stored of its key,
    without the columns the DB lacks."""
    ensure_fingerprint(session, *fingerprint)
    for problem, served, count, lengths in (MissRow(*m) for m in misses):
        n = lengths.calls if lengths else 0
        values = dict(problem.columns(), fingerprint_id=fingerprint[0], served=served, count=count,
                      last_seen=utcnow(), length_calls=n,
                      length_mean_sum=lengths.mean * n if lengths else 0.0,
                      length_max_sum=lengths.longest * n if lengths else 0.0,
                      length_spread_sum=lengths.spread * n if lengths else 0.0)
        for column in missing:
            values.pop(column)
        upsert(session, Miss, values, RECORD_KEY, add=("count",) + tuple(c for c in MISS_LENGTH_COLUMNS
                                                                          if c not in missing))


def _utc(value: datetime) -> datetime:
    return value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)
