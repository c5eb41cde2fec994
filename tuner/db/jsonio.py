"""Tunings as JSON: export in a versioned schema; import validates everything first.

Document (version 1):
    {"schema": "tuner.tunings", "version": 1, "tuner_version": str, "exported_at": str,
     "fingerprints": {id: {...environment...}},
     "records": [{"op": str, "static_key": JSON, "fingerprint": id,
                  "run_key": {"batch": int, "max_q_len": int, "kv_len_bucket": int},
                  "config": {name: scalar}, "method": {...}, "created_at": ISO 8601,
                  "timing": {"median_us": num, "spread_us": num, "samples": int},
                  "default": {"config": {...}, "median_us": num|null, "spread_us": num|null}}]}
A fingerprint's id must be the hash of its data, so an edited environment cannot pass as
the original. Every value passes tuner.db.rows' rules (as the DB's own rows do; every text
has a length bound, exported_at is a time like created_at's, tuner_version a short text),
keys given twice in one object and text with no UTF-8 form are refused, and one record per
key is kept: the newest (newest_per_key).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tuner.version import __version__
from tuner.db import rows as check
from tuner.db.fingerprint import fingerprint_id
from tuner.db.store import TuningDB
from tuner.db.values import Problem, Record, SaveResult
from tuner.errors import TunerError
from tuner.jsonfile import read_json

EXPORT_SCHEMA = "tuner.tunings"
EXPORT_VERSION = 1
MAX_VERSION_CHARS = 64  # a tuner_version: a version string, never more


class DocumentError(TunerError):
    """A tunings document that does not follow the schema (one line, as every TunerError,
    even when it quotes the document's own keys)."""


def export_document(db: TuningDB, *, op: str | None = None) -> dict[str, Any]:
    records = db.records(op=op)
    fingerprints = db.fingerprints()
    return {
        "schema": EXPORT_SCHEMA,
        "version": EXPORT_VERSION,
        "tuner_version": __version__,
        "exported_at": datetime.now(timezone.utc).isoformat(),
        "fingerprints": {fp: fingerprints[fp] for fp in sorted({r.fingerprint_id for r in records})},
        "records": [_record_json(r) for r in records],
    }


def _record_json(r: Record) -> dict[str, Any]:
    return {
        "op": r.problem.op,
        "static_key": json.loads(r.problem.static_key),
        "run_key": r.problem.run_key.to_dict(),
        "config": r.config,
        "timing": {"median_us": r.median_us, "spread_us": r.spread_us, "samples": r.samples},
        "default": {
            "config": r.default_config,
            "median_us": r.default_median_us,
            "spread_us": r.default_spread_us,
        },
        "method": r.method,
        "fingerprint": r.fingerprint_id,
        "created_at": r.created_at.isoformat(),
    }


# -- validation ------------------------------------------------------------------------


class _Object(dict):
    """A JSON object as read by load_document, with the keys it held more than once."""

    duplicates: tuple[str, ...] = ()


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        obj.duplicates = tuple(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
    return obj


def _no_duplicates(value: Any, where: str) -> None:
    """A key given twice in one object: JSON readers keep one of them, silently; refuse."""
    if isinstance(value, dict):
        dup = getattr(value, "duplicates", ())
        if dup:
            raise DocumentError(f"{where}: key {dup[0]!r:.60} appears more than once")
        for k, v in value.items():
            _no_duplicates(v, f"{where}.{k!s:.40}")  # a key may be megabytes long: never copied whole
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_duplicates(v, f"{where}[{i}]")


def _fields(obj: Any, where: str, required: set[str], optional: set[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise DocumentError(f"{where}: expected an object, got {type(obj).__name__}")
    missing = required - set(obj)
    if missing:
        raise DocumentError(f"{where}: missing {', '.join(sorted(missing))}")
    unknown = set(obj) - required - optional
    if unknown:
        names = sorted(map(str, unknown))
        raise DocumentError(f"{where}: unknown field(s) {', '.join(f'{n:.40}' for n in names[:5])}"
                            + (f" and {len(names) - 5} more" if len(names) > 5 else ""))
    return obj


Row = tuple[Problem, tuple[str, dict[str, Any]], dict[str, Any]]


def _record(raw: Any, where: str, fps: dict[str, Any]) -> Row:
    rec = _fields(raw, where, {"op", "static_key", "run_key", "config", "timing", "default", "method", "fingerprint"},
                  {"created_at"})
    run = _fields(rec["run_key"], f"{where}.run_key", {"batch", "max_q_len", "kv_len_bucket"})
    run_key = check.run_key(run["batch"], run["max_q_len"], run["kv_len_bucket"], f"{where}.run_key")
    timing = _fields(rec["timing"], f"{where}.timing", {"median_us", "spread_us", "samples"})
    default = _fields(rec["default"], f"{where}.default", {"config", "median_us", "spread_us"})
    method = rec["method"]
    if not isinstance(method, dict):
        raise DocumentError(f"{where}.method: expected an object")
    check.canonical(method, f"{where}.method")
    fp = rec["fingerprint"]
    if not isinstance(fp, str) or fp not in fps:
        raise DocumentError(f"{where}.fingerprint: {fp!r:.40} is not in fingerprints")
    # undated: as old as a record can be, so it never replaces a dated one (as in the shipped layer)
    created_at = check.EARLIEST
    if rec.get("created_at") is not None:
        created_at = check.created_at(rec["created_at"], f"{where}.created_at")
    problem = Problem(check.text(rec["op"], f"{where}.op"), check.static_key(rec["static_key"], f"{where}.static_key"),
                      run_key)
    fields = dict(
        config=check.config(rec["config"], f"{where}.config"),
        median_us=check.number(timing["median_us"], f"{where}.timing.median_us", positive=True),
        spread_us=check.number(timing["spread_us"], f"{where}.timing.spread_us"),
        samples=check.integer(timing["samples"], f"{where}.timing.samples", 0, 2**31 - 1),
        default_config=check.config(default["config"], f"{where}.default.config"),
        default_median_us=check.number(default["median_us"], f"{where}.default.median_us", positive=True,
                                       nullable=True),
        default_spread_us=check.number(default["spread_us"], f"{where}.default.spread_us", nullable=True),
        method=method,
        created_at=created_at,
    )
    return problem, (fp, fps[fp]), fields


def parse_document(data: Any) -> list[Row]:
    """Validate a whole document; return rows for TuningDB.save_records (one per key: see
    newest_per_key), or raise DocumentError naming the first bad place."""
    _no_duplicates(data, "document")
    doc = _fields(data, "document", {"schema", "version", "fingerprints", "records"},
                  {"tuner_version", "exported_at"})
    if doc["schema"] != EXPORT_SCHEMA:
        raise DocumentError(f"document: schema must be {EXPORT_SCHEMA!r}, got {doc['schema']!r:.60}")
    if doc["version"] != EXPORT_VERSION or isinstance(doc["version"], bool):
        raise DocumentError(f"document: version {doc['version']!r:.20} is not supported (this tuner reads {EXPORT_VERSION})")
    fps = doc["fingerprints"]
    if not isinstance(fps, dict):
        raise DocumentError("fingerprints: expected an object of id to environment")
    if not isinstance(doc["records"], list):
        raise DocumentError("records: expected a list")
    try:
        if doc.get("tuner_version") is not None:
            check.text(doc["tuner_version"], "document.tuner_version", MAX_VERSION_CHARS)
        if doc.get("exported_at") is not None:
            check.created_at(doc["exported_at"], "document.exported_at")
        for fp_id, fp_data in fps.items():
            check.text(fp_id, "fingerprints: an id", 32)  # before it is quoted in a message
            if not isinstance(fp_data, dict):
                raise DocumentError(f"fingerprints.{fp_id}: expected an object")
            check.canonical(fp_data, f"fingerprints.{fp_id}")
            if fingerprint_id(fp_data) != fp_id:
                raise DocumentError(f"fingerprints.{fp_id}: id does not match its data")
        rows = [_record(raw, f"records[{i}]", fps) for i, raw in enumerate(doc["records"])]
    except check.RowError as e:
        raise DocumentError(str(e)) from None
    return newest_per_key(rows)


def newest_per_key(rows: list[Row]) -> list[Row]:
    """One row per (problem, environment): the newest measurement (created_at; a record
    without one is dated the oldest possible), between equally new ones the last. The same
    rule as the DB's (tuner.db.writes) and the shipped layer's."""
    oldest = datetime.min.replace(tzinfo=timezone.utc)
    chosen: dict[tuple[Problem, str], int] = {}
    for i, (problem, (fp, _), fields) in enumerate(rows):
        key = (problem, fp)
        j = chosen.get(key)
        if j is None or (fields["created_at"] or oldest) >= (rows[j][2]["created_at"] or oldest):
            chosen[key] = i
    keep = set(chosen.values())
    return [row for i, row in enumerate(rows) if i in keep]


def load_document(path: str | Path) -> Any:
    """Read and parse a JSON file, with one-line errors (keys given twice are kept track
    of, for parse_document to refuse)."""
    return read_json(path, DocumentError, "tunings file", object_pairs_hook=_object_pairs)


def import_document(db: TuningDB, data: Any, *, replace: bool = False) -> SaveResult:
    """Validate, then write every record in one transaction (a stored record newer than the
    imported one is kept unless replace); what happened to them."""
    rows = parse_document(data)
    return db.save_records(rows, replace=replace)
