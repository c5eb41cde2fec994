"""The DB's reads, each inside the caller's one-snapshot session: winners, measurements,
environments, misses, counts, and the runtime's snapshot of what applies."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select, type_coerce
from sqlalchemy.orm import Session
from sqlalchemy.types import NullType

from tuner.db import rows as check
from tuner.db.checked import (
    Malformed, checked_rows, fingerprint_rows, measurement_of, miss_of, problem_of, raw_select, record_of,
)
from tuner.db.fingerprint import applies
from tuner.db.migration import SchemaGaps
from tuner.db.schema import Measurement, Miss, TuningRecord
from tuner.db.values import MeasurementRow, MissRow, Problem, Record, Snapshot, Timed
from tuner.keys import AttentionRunKey

# what the runtime's snapshot reads of a record
_SNAPSHOT_COLUMNS = ("id", "op", "static_key", "batch", "max_q_len", "kv_len_bucket", "config", "median_us",
                     "default_median_us", "created_at", "fingerprint_id")


def applicable_ids(session: Session, environment: dict[str, Any]) -> set[str]:
    """The ids of stored environments whose records apply in `environment`
    (tuner.db.fingerprint.applies: same GPU and kernel-library versions)."""
    fps, _ = fingerprint_rows(session)
    return {fp for fp, data in fps.items() if applies(data, environment)}


def records(session: Session, *, op: str | None = None, fingerprint_id: str | None = None,
            environment: dict[str, Any] | None = None,
            problem: Problem | None = None) -> tuple[list[Record], list[Malformed]]:
    """Stored winners (of one op or problem, one environment id, or those that apply in
    `environment`: the newest per problem), and the malformed rows among them."""
    query = raw_select(TuningRecord).order_by(
        TuningRecord.op, TuningRecord.static_key, TuningRecord.max_q_len,
        TuningRecord.batch, TuningRecord.kv_len_bucket, TuningRecord.id,
    )
    if op is not None:
        query = query.where(TuningRecord.op == op)
    if problem is not None:
        query = query.where(*(getattr(TuningRecord, k) == v for k, v in problem.columns().items()))
    if fingerprint_id is not None:
        query = query.where(TuningRecord.fingerprint_id == fingerprint_id)
    fps, _ = fingerprint_rows(session)
    if environment is not None:
        ids = [fp for fp, data in fps.items() if applies(data, environment)]
        query = query.where(TuningRecord.fingerprint_id.in_(ids))
    found, bad = checked_rows(session, query, lambda row: record_of(row, fps))
    return (found if environment is None else _newest_per_problem(found)), bad


def _newest_per_problem(found: list[Record]) -> list[Record]:
    """Of several environments' winners of one problem, the newest (the last of equals), in found's order."""
    newest: dict[Problem, Record] = {}
    for r in found:
        if r.problem not in newest or r.created_at >= newest[r.problem].created_at:
            newest[r.problem] = r
    return [r for r in found if newest[r.problem] is r]


def measurements(session: Session, problem: Problem, fingerprint_id: str,
                 gaps: SchemaGaps) -> tuple[list[MeasurementRow], list[Malformed]]:
    """One problem's measurements in one environment, in the order stored, and the malformed ones."""
    query = raw_select(Measurement, *(getattr(Measurement, k) == v for k, v in problem.columns().items()),
                       Measurement.fingerprint_id == fingerprint_id, missing=gaps.columns_of(Measurement)
                       ).order_by(Measurement.id)
    return checked_rows(session, query, measurement_of)


def snapshot(session: Session, environment: dict[str, Any]) -> Snapshot:
    """Every winner that applies in `environment` (the newest where several stored
    environments hold one key), malformed rows skipped and counted."""
    snap = Snapshot()
    fps, bad_fps = fingerprint_rows(session)
    snap.skipped.extend(m.why for m in bad_fps)
    ids = [fp for fp, data in fps.items() if applies(data, environment)]
    orphans = session.execute(select(TuningRecord.id, TuningRecord.fingerprint_id).where(
        ~TuningRecord.fingerprint_id.in_(list(fps)))).all()
    snap.skipped.extend(f"records id {rid}: fingerprint {fp!r:.40} is not in the DB" for rid, fp in orphans)
    query = select(*(type_coerce(getattr(TuningRecord, c), NullType()).label(c) for c in _SNAPSHOT_COLUMNS))
    found, bad = checked_rows(session, query.where(TuningRecord.fingerprint_id.in_(ids)), _timed)
    newest: dict[tuple[tuple[str, str], AttentionRunKey], datetime] = {}
    for problem, created, timed in found:
        key, run = (problem.op, problem.static_key), problem.run_key
        if (key, run) in newest and newest[(key, run)] > created:
            continue
        newest[(key, run)] = created
        snap.table.setdefault(key, {})[run] = timed
    snap.skipped.extend(m.why for m in bad)
    return snap


def _timed(row: Any) -> tuple[Problem, datetime, Timed]:
    """What the runtime reads of a records row, checked: its problem, date and times."""
    where = f"records id {row.id}"
    problem = problem_of(row, where)
    config = check.config_text(row.config, f"{where}.config")
    median = check.number(row.median_us, f"{where}.median_us", positive=True)
    default = check.number(row.default_median_us, f"{where}.default_median_us", positive=True, nullable=True)
    created = check.created_at(row.created_at, f"{where}.created_at")
    return problem, created, Timed(config, median, default)


def counts(session: Session) -> dict[str, dict[str, int]]:
    """{fingerprint id: {"records": n, "measurements": m}}."""
    out: dict[str, dict[str, int]] = {}
    for model, name in ((TuningRecord, "records"), (Measurement, "measurements")):
        query = select(model.fingerprint_id, func.count()).group_by(model.fingerprint_id)
        for fp, n in session.execute(query):
            out.setdefault(str(fp), {"records": 0, "measurements": 0})[name] = n
    return out


def op_names(session: Session, gaps: SchemaGaps) -> set[str]:
    """Every op name the DB holds records or misses of (tuner's ops and users' own)."""
    names = set(session.scalars(select(TuningRecord.op).distinct()))
    if not gaps.lacks_table(Miss):
        names |= set(session.scalars(select(Miss.op).distinct()))
    return {str(n) for n in names}


def misses(session: Session, fingerprint_id: str, op: str | None,
           gaps: SchemaGaps) -> tuple[list[MissRow], list[Malformed]]:
    """The misses the runtime recorded in one environment (of one op), and the malformed ones."""
    query = raw_select(Miss, Miss.fingerprint_id == fingerprint_id, missing=gaps.columns_of(Miss))
    if op is not None:
        query = query.where(Miss.op == op)
    return checked_rows(session, query, miss_of)


def unsolved(found: list[MissRow], solved: list[Record]) -> list[MissRow]:
    """The misses no winner in `solved` answers, most frequent first."""
    problems = {r.problem for r in solved}
    return sorted((m for m in found if m.problem not in problems),
                  key=lambda m: (-m.count, m.problem.op, m.problem.static_key))

