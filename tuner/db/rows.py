"""The rules every stored or imported value must pass, one place for the DB's reads and the
JSON importer: a row that breaks one is malformed (skipped and counted by the runtime,
refused by import, listed by doctor, removed by prune), never a crash further down."""

from __future__ import annotations

import functools
import json
import math
from datetime import datetime, timedelta, timezone
from typing import Any

from tuner.db.location import DBError
from tuner.keys import KV_BUCKET_MAX, AttentionRunKey, canonical_json

MAX_KEY_CHARS = 4096
# a measurement's date: not before tuner existed, not in the future (a record dated ahead
# would never be replaced by a newer measurement)
EARLIEST = datetime(2020, 1, 1, tzinfo=timezone.utc)
CLOCK_SKEW = timedelta(days=1)


class RowError(DBError):
    """A value that breaks the rules; the message names where (one line)."""


def integer(value: Any, where: str, minimum: int, maximum: int = KV_BUCKET_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise RowError(f"{where}: expected an integer in [{minimum}, {maximum}], got {value!r:.40}")
    return value


def run_key(batch: Any, max_q_len: Any, kv_len_bucket: Any, where: str) -> AttentionRunKey:
    bucket = integer(kv_len_bucket, f"{where}.kv_len_bucket", 1)
    if bucket & (bucket - 1):
        raise RowError(f"{where}.kv_len_bucket: {bucket} is not a power of two")
    return AttentionRunKey(integer(batch, f"{where}.batch", 1), integer(max_q_len, f"{where}.max_q_len", 1), bucket)


def number(value: Any, where: str, *, positive: bool = False, nullable: bool = False) -> float | None:
    """A finite number >= 0 (> 0 when positive); None only when nullable."""
    if value is None and nullable:
        return None
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise RowError(f"{where}: expected a finite number {'> 0' if positive else '>= 0'}, got {value!r:.40}")
    return float(value)


def text(value: Any, where: str, max_len: int = 128) -> str:
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise RowError(f"{where}: expected a non-empty string of at most {max_len} characters")
    try:
        value.encode("utf-8")  # a lone surrogate ("\ud800") has none: the DB's driver would fail on it
    except UnicodeEncodeError:
        raise RowError(f"{where}: {value!r:.40} is not text with a UTF-8 form (a lone surrogate)") from None
    return value


def config(value: Any, where: str) -> dict[str, Any]:
    """A config: an object of names to scalars (null is a real value: "let the library choose")."""
    if not isinstance(value, dict):
        raise RowError(f"{where}: expected an object of names to values, got {type(value).__name__}")
    for name, v in value.items():
        if not isinstance(name, str) or not name:
            raise RowError(f"{where}: config names must be non-empty strings")
        if v is not None and not isinstance(v, (str, int, float, bool)):
            raise RowError(f"{where}.{name}: config values must be strings, numbers, booleans or null")
        if isinstance(v, float) and not math.isfinite(v):
            raise RowError(f"{where}.{name}: config values must be finite")
    canonical(value, where)
    return value


def canonical(value: Any, where: str, max_chars: int = MAX_KEY_CHARS) -> str:
    """The value's canonical JSON, which must exist, be UTF-8 text and fit max_chars."""
    try:
        out = canonical_json(value)
        # a lone surrogate ("\ud800") has no UTF-8 form: printing or a server DB would fail on it
        json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
    except (ValueError, RecursionError, UnicodeEncodeError) as e:
        raise RowError(f"{where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if len(out) > max_chars:
        raise RowError(f"{where}: longer than {max_chars} characters")
    return out


def config_text(raw: Any, where: str) -> dict[str, Any]:
    """A stored config's JSON text, parsed and checked as config(). Configs repeat across a
    DB's rows (a few dozen candidates over thousands of measurements), and the check's
    canonical JSON was most of the time a sweep spent reading them back: a text that passed
    once is only parsed (a fresh dict each time, for the caller to own)."""
    if isinstance(raw, str) and _config_text_passes(raw):
        return json.loads(raw)
    return config(json_value(raw, where), where)


@functools.lru_cache(maxsize=4096)
def _config_text_passes(raw: str) -> bool:
    try:
        config(json_value(raw, ""), "")
    except RowError:
        return False
    return True


def json_value(raw: Any, where: str) -> Any:
    """A stored JSON text, parsed."""
    if not isinstance(raw, str):
        raise RowError(f"{where}: expected JSON text, got {type(raw).__name__}")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise RowError(f"{where}: not valid JSON") from None


def json_object(raw: Any, where: str) -> dict[str, Any]:
    value = json_value(raw, where)
    if not isinstance(value, dict):
        raise RowError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def static_key(value: Any, where: str) -> str:
    """A static key: a non-empty object (attention keys) or list (the tuple key of a user's
    own function), as canonical JSON."""
    if not isinstance(value, (dict, list)) or not value:
        raise RowError(f"{where}: expected a non-empty object or list")
    return canonical(value, where)


def created_at(value: Any, where: str, now: datetime | None = None) -> datetime:
    """A measurement's time, as an aware UTC datetime (SQLite keeps no offset: a naive time
    is UTC), within [EARLIEST, now + a day]."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(text(value, where, 64))
        except ValueError:
            raise RowError(f"{where}: not an ISO 8601 time") from None
    if not isinstance(value, datetime):
        raise RowError(f"{where}: expected a time, got {type(value).__name__}")
    try:
        value = value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)
    except (OverflowError, ValueError):
        raise RowError(f"{where}: {value.isoformat()} is out of range") from None
    latest = (now or datetime.now(timezone.utc)) + CLOCK_SKEW
    if not EARLIEST <= value <= latest:
        raise RowError(f"{where}: {value.isoformat()} is out of range ({EARLIEST.date()} to now)")
    return value
