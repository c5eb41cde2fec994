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
the original.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tuner.db.fingerprint import fingerprint_id
from tuner.db.store import Problem, Record, TuningDB
from tuner.errors import TunerError
from tuner.jsonfile import read_json
from tuner.keys import KV_BUCKET_MAX, AttentionRunKey, canonical_json

EXPORT_SCHEMA = "tuner.tunings"
EXPORT_VERSION = 1
MAX_KEY_CHARS = 4096


class DocumentError(TunerError):
    """A tunings document that does not follow the schema (one line, as every TunerError,
    even when it quotes the document's own keys)."""


def export_document(db: TuningDB, *, op: str | None = None) -> dict[str, Any]:
    records = db.records(op=op)
    fingerprints = db.fingerprints()
    from tuner import __version__

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


def _fields(obj: Any, where: str, required: set[str], optional: set[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise DocumentError(f"{where}: expected an object, got {type(obj).__name__}")
    missing = required - set(obj)
    if missing:
        raise DocumentError(f"{where}: missing {', '.join(sorted(missing))}")
    unknown = set(obj) - required - optional
    if unknown:
        raise DocumentError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    return obj


def _int(value: Any, where: str, minimum: int, maximum: int = KV_BUCKET_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise DocumentError(f"{where}: expected an integer in [{minimum}, {maximum}], got {value!r}")
    return value


def _number(value: Any, where: str, nullable: bool = False) -> float | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise DocumentError(f"{where}: expected a finite number >= 0, got {value!r}")
    return float(value)


def _str(value: Any, where: str, max_len: int = 128) -> str:
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise DocumentError(f"{where}: expected a non-empty string of at most {max_len} characters")
    return value


def _config(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DocumentError(f"{where}: expected an object of names to values")
    for name, v in value.items():
        # null is a real value: "let the library choose" (FA3's pack_gqa, FlashInfer's split size)
        if v is not None and not isinstance(v, (str, int, float, bool)):
            raise DocumentError(f"{where}.{name}: config values must be strings, numbers, booleans or null")
        if isinstance(v, float) and not math.isfinite(v):
            raise DocumentError(f"{where}.{name}: config values must be finite")
    return value


def _canonical(value: Any, where: str, max_chars: int = MAX_KEY_CHARS) -> str:
    try:
        text = canonical_json(value)
    except (ValueError, RecursionError) as e:
        raise DocumentError(f"{where}: {e}") from None
    if len(text) > max_chars:
        raise DocumentError(f"{where}: longer than {max_chars} characters")
    return text


def parse_document(data: Any) -> list[tuple[Problem, tuple[str, dict[str, Any]], dict[str, Any]]]:
    """Validate a whole document; return rows for TuningDB.save_records, or raise DocumentError."""
    doc = _fields(data, "document", {"schema", "version", "fingerprints", "records"},
                  {"tuner_version", "exported_at"})
    if doc["schema"] != EXPORT_SCHEMA:
        raise DocumentError(f"document: schema must be {EXPORT_SCHEMA!r}, got {doc['schema']!r}")
    if doc["version"] != EXPORT_VERSION or isinstance(doc["version"], bool):
        raise DocumentError(f"document: version {doc['version']!r} is not supported (this tuner reads {EXPORT_VERSION})")
    fps = doc["fingerprints"]
    if not isinstance(fps, dict):
        raise DocumentError("fingerprints: expected an object of id to environment")
    for fp_id, fp_data in fps.items():
        if not isinstance(fp_data, dict):
            raise DocumentError(f"fingerprints.{fp_id}: expected an object")
        _canonical(fp_data, f"fingerprints.{fp_id}")
        if fingerprint_id(fp_data) != fp_id:
            raise DocumentError(f"fingerprints.{fp_id}: id does not match its data")
    if not isinstance(doc["records"], list):
        raise DocumentError("records: expected a list")
    rows = []
    for i, raw in enumerate(doc["records"]):
        where = f"records[{i}]"
        rec = _fields(raw, where, {"op", "static_key", "run_key", "config", "timing", "default", "method", "fingerprint"},
                      {"created_at"})
        run = _fields(rec["run_key"], f"{where}.run_key", {"batch", "max_q_len", "kv_len_bucket"})
        bucket = _int(run["kv_len_bucket"], f"{where}.run_key.kv_len_bucket", 1)
        if bucket & (bucket - 1):
            raise DocumentError(f"{where}.run_key.kv_len_bucket: {bucket} is not a power of two")
        run_key = AttentionRunKey(
            _int(run["batch"], f"{where}.run_key.batch", 1),
            _int(run["max_q_len"], f"{where}.run_key.max_q_len", 1),
            bucket,
        )
        timing = _fields(rec["timing"], f"{where}.timing", {"median_us", "spread_us", "samples"})
        default = _fields(rec["default"], f"{where}.default", {"config", "median_us", "spread_us"})
        method = rec["method"]
        if not isinstance(method, dict):
            raise DocumentError(f"{where}.method: expected an object")
        _canonical(method, f"{where}.method")
        fp = rec["fingerprint"]
        if not isinstance(fp, str) or fp not in fps:
            raise DocumentError(f"{where}.fingerprint: {fp!r} is not in fingerprints")
        created_at = None
        if rec.get("created_at") is not None:
            try:
                created_at = datetime.fromisoformat(_str(rec["created_at"], f"{where}.created_at", 64))
            except ValueError:
                raise DocumentError(f"{where}.created_at: not an ISO 8601 time") from None
            # stored as UTC (SQLite keeps no offset); a time without one is taken as UTC
            created_at = created_at.astimezone(timezone.utc) if created_at.tzinfo else created_at.replace(
                tzinfo=timezone.utc)
        # an object (attention keys), or a list (the tuple key of a function of the user's own)
        if not isinstance(rec["static_key"], (dict, list)) or not rec["static_key"]:
            raise DocumentError(f"{where}.static_key: expected a non-empty object or list")
        problem = Problem(
            _str(rec["op"], f"{where}.op"),
            _canonical(rec["static_key"], f"{where}.static_key"),
            run_key,
        )
        fields = dict(
            config=_config(rec["config"], f"{where}.config"),
            median_us=_number(timing["median_us"], f"{where}.timing.median_us"),
            spread_us=_number(timing["spread_us"], f"{where}.timing.spread_us"),
            samples=_int(timing["samples"], f"{where}.timing.samples", 0, 2**31 - 1),
            default_config=_config(default["config"], f"{where}.default.config"),
            default_median_us=_number(default["median_us"], f"{where}.default.median_us", nullable=True),
            default_spread_us=_number(default["spread_us"], f"{where}.default.spread_us", nullable=True),
            method=method,
            created_at=created_at,
        )
        _canonical(fields["config"], f"{where}.config")
        _canonical(fields["default_config"], f"{where}.default.config")
        rows.append((problem, (fp, fps[fp]), fields))
    return rows


def load_document(path: str | Path) -> Any:
    """Read and parse a JSON file, with one-line errors."""
    return read_json(path, DocumentError, "tunings file")


def import_document(db: TuningDB, data: Any) -> int:
    """Validate, then write every record in one transaction; returns the number imported."""
    rows = parse_document(data)
    db.save_records(rows)
    return len(rows)
