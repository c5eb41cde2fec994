"""Checked reads: rows selected raw and turned into values by tuner.db.rows' rules, each
malformed one collected with one line saying why, never raised in the middle of a read."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, TypeVar

from sqlalchemy import Select, select, type_coerce
from sqlalchemy.orm import Session
from sqlalchemy.types import NullType

from tuner.db import rows as check
from tuner.db.location import DBError
from tuner.db.schema import Fingerprint
from tuner.db.values import SERVED, STATUSES, MeasurementRow, MissLengths, MissRow, Problem, Record

T = TypeVar("T")


class MalformedRowsError(DBError):
    """Rows that break tuner.db.rows' rules; one line naming the first."""


class Malformed(NamedTuple):
    """A row that breaks tuner.db.rows' rules: its id, and one line naming it and why."""

    row_id: Any
    why: str


def raw_select(model: type, *criteria: Any, missing: frozenset[str] = frozenset()) -> Select:
    """SELECT every column of model (but the optional ones the DB lacks) without
    SQLAlchemy's result processing (a bad date in one row must not fail the whole query),
    rows checked by the caller."""
    columns = [type_coerce(c, NullType()).label(c.name) for c in model.__table__.columns if c.name not in missing]
    return select(*columns).where(*criteria)


def checked_rows(session: Session, query: Select, parse: Callable[[Any], T]) -> tuple[list[T], list[Malformed]]:
    """Every row of `query` (which selects the row's id) parsed: the values of the
    well-formed ones, and the malformed ones (parse raised RowError), in the query's order."""
    good: list[T] = []
    bad: list[Malformed] = []
    for row in session.execute(query):
        try:
            good.append(parse(row))
        except check.RowError as e:
            bad.append(Malformed(row.id, str(e)))
    return good, bad


def malformed_error(display_url: str, what: str, bad: list[Malformed]) -> MalformedRowsError:
    """The error of a read that found malformed rows of one table: the first, and how many more."""
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return MalformedRowsError(f"tuning DB {display_url} has malformed {what} ({bad[0].why}{more}); "
                              "`tuner doctor` lists them, `tuner prune` removes them")


def fingerprint_rows(session: Session) -> tuple[dict[str, dict[str, Any]], list[Malformed]]:
    """(id -> data) of the well-formed stored environments, and the malformed ones."""
    good, bad = checked_rows(session, raw_select(Fingerprint), _fingerprint)
    return dict(good), bad


def _fingerprint(row: Any) -> tuple[str, dict[str, Any]]:
    return check.text(row.id, "fingerprints id", 32), check.json_object(row.data, f"fingerprints id {row.id!r:.40}.data")


def in_fingerprints(row: Any, where: str, fingerprint_ids: set[str] | dict[str, Any]) -> None:
    """RowError where the row's environment is not stored (or is malformed)."""
    if row.fingerprint_id not in fingerprint_ids:
        raise check.RowError(f"{where}: fingerprint {row.fingerprint_id!r} is not in the DB")


def problem_of(row: Any, where: str) -> Problem:
    check.json_value(row.static_key, f"{where}.static_key")
    return Problem(check.text(row.op, f"{where}.op"), row.static_key,
                   check.run_key(row.batch, row.max_q_len, row.kv_len_bucket, f"{where}.run_key"))


def record_of(row: Any, fingerprint_ids: set[str] | dict[str, Any]) -> Record:
    """A records row, checked (RowError names the row and field)."""
    where = f"records id {row.id}"
    in_fingerprints(row, where, fingerprint_ids)
    return Record(
        problem=problem_of(row, where),
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


def miss_of(row: Any) -> MissRow:
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
    return MissRow(problem_of(row, where), row.served, count, lengths)


def measurement_of(row: Any) -> MeasurementRow:
    """A measurements row, checked (RowError names the row and field)."""
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
