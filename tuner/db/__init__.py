"""The tuning DB: schema, store, environment fingerprint, JSON import/export. No kernel library."""

from tuner.db.fingerprint import current_fingerprint, current_fingerprint_id, fingerprint_id
from tuner.db.jsonio import EXPORT_SCHEMA, EXPORT_VERSION, export_document, import_document, parse_document
from tuner.db.location import DBError, MissingDBError, default_db_path, resolve_db_url, set_aside
from tuner.db.store import MeasurementRow, Problem, Record, TuningDB

__all__ = [
    "DBError",
    "EXPORT_SCHEMA",
    "EXPORT_VERSION",
    "MeasurementRow",
    "MissingDBError",
    "Problem",
    "Record",
    "TuningDB",
    "current_fingerprint",
    "current_fingerprint_id",
    "default_db_path",
    "export_document",
    "fingerprint_id",
    "import_document",
    "parse_document",
    "resolve_db_url",
    "set_aside",
]
