"""What is wrong in a DB and its removal: damage to the file or schema, malformed rows, and
the environments whose records can no longer apply here (prune)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, func, inspect, select, text
from sqlalchemy.orm import Session

from tuner.db.checked import (
    Malformed, checked_rows, fingerprint_rows, in_fingerprints, measurement_of, miss_of, problem_of, raw_select,
    record_of,
)
from tuner.db.fingerprint import applies
from tuner.db.migration import SchemaGaps
from tuner.db.schema import OPTIONAL_TABLES, Base, Fingerprint, Measurement, Miss, ReplacedRecord, TuningRecord

BadRow = tuple[type, Any, str]  # (table's model, row id, why)


def file_damage(session: Session, backend: str) -> list[str]:
    """What SQLite's integrity_check finds wrong in the file (nothing to check on a server)."""
    if backend != "sqlite":
        return []
    result = [r[0] for r in session.execute(text("PRAGMA integrity_check"))]
    return [] if result == ["ok"] else [f"integrity_check: {r}" for r in result]


def missing_tables(session: Session) -> list[str]:
    """One line naming the core tables the DB lacks (empty when it has them all)."""
    missing = {t.name for t in Base.metadata.sorted_tables} - OPTIONAL_TABLES - set(
        inspect(session.connection()).get_table_names()
    )
    return [f"missing tables: {', '.join(sorted(missing))}"] if missing else []


def malformed_rows(session: Session, gaps: SchemaGaps) -> list[BadRow]:
    """Every row that breaks tuner.db.rows' rules, rows pointing at no stored (or a
    malformed) environment included."""
    fps, bad_fps = fingerprint_rows(session)
    out = [(Fingerprint, m.row_id, f"fingerprints id {m.row_id!r:.40}: data is not a JSON object") for m in bad_fps]
    _, bad = checked_rows(session, raw_select(TuningRecord), lambda row: record_of(row, fps))
    out.extend(_of(TuningRecord, bad))

    def measurement(row: Any) -> None:
        where = f"measurements id {row.id}"
        measurement_of(row)
        in_fingerprints(row, where, fps)
        problem_of(row, where)

    _, bad = checked_rows(session, raw_select(Measurement, missing=gaps.columns_of(Measurement)), measurement)
    out.extend(_of(Measurement, bad))
    if not gaps.lacks_table(Miss):
        def miss(row: Any) -> None:
            miss_of(row)
            in_fingerprints(row, f"misses id {row.id}", fps)

        _, bad = checked_rows(session, raw_select(Miss, missing=gaps.columns_of(Miss)), miss)
        out.extend(_of(Miss, bad))
    return out


def _of(model: type, bad: list[Malformed]) -> list[BadRow]:
    return [(model, m.row_id, m.why) for m in bad]


def summary(bad: list[BadRow]) -> list[str]:
    """One line on the malformed rows (empty when there are none)."""
    if not bad:
        return []
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return [f"{len(bad)} malformed rows ({bad[0][2]}{more}); `tuner prune` removes them"]


def prune(session: Session, environment: dict[str, Any], gaps: SchemaGaps, *,
          dry_run: bool) -> dict[str, dict[str, int]]:
    """What cannot apply in `environment` (tuner.db.fingerprint.applies: another GPU or
    kernel-library version; a newer driver or tuner does not count), with its records,
    measurements and misses, and every malformed row (under the id "malformed"): counted,
    and removed unless dry_run. Read inside the transaction that removes it, so an
    environment a writer adds meanwhile is kept."""
    if session.bind.dialect.name == "postgresql" and not dry_run:  # writers wait for prune
        session.execute(text("LOCK TABLE fingerprints IN SHARE ROW EXCLUSIVE MODE"))
    fps, _ = fingerprint_rows(session)
    stale_ids = sorted(str(fp) for fp in session.scalars(select(Fingerprint.id))
                       if fp not in fps or not applies(fps[fp], environment))
    bad = malformed_rows(session, gaps)
    counts = _stale_counts(session, stale_ids)
    if bad:
        counts["malformed"] = {"records": sum(model is TuningRecord for model, _, _ in bad),
                               "measurements": sum(model is Measurement for model, _, _ in bad), "rows": len(bad)}
    if dry_run or not counts:
        return counts
    for model, rid, _ in bad:
        session.execute(delete(model).where(model.__table__.c.id == rid))
    models = [Measurement, TuningRecord] + [m for m in (Miss, ReplacedRecord) if not gaps.lacks_table(m)]
    for model in models:
        session.execute(delete(model).where(model.fingerprint_id.in_(stale_ids)))
    session.execute(delete(Fingerprint).where(Fingerprint.id.in_(stale_ids)))
    return counts


def _stale_counts(session: Session, stale_ids: list[str]) -> dict[str, dict[str, int]]:
    """{stale environment id: {"records": n, "measurements": m}}."""
    counts: dict[str, dict[str, int]] = {fp: {"records": 0, "measurements": 0} for fp in stale_ids}
    for model, name in ((TuningRecord, "records"), (Measurement, "measurements")):
        query = select(model.fingerprint_id, func.count()).group_by(model.fingerprint_id)
        for fp, n in session.execute(query):
            if str(fp) in counts:
                counts[str(fp)][name] = n
    return counts
