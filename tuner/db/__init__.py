"""The tuning DB: schema, store, environment fingerprint, JSON import/export. No kernel library."""

from tuner.db.fingerprint import (
    Environment, applies, current_environment, current_fingerprint, current_fingerprint_id, fingerprint_id, why_not,
)
from tuner.db.jsonio import EXPORT_SCHEMA, EXPORT_VERSION, export_document, import_document, parse_document
from tuner.db.location import (
    BusyDBError, DamagedDBError, DBError, MissingDBError, default_db_path, is_tuners_file, resolve_db_url, set_aside,
)
from tuner.db.checked import MalformedRowsError
from tuner.db.store import TuningDB
from tuner.db.values import MeasurementRow, MissLengths, MissRow, Problem, Record, SaveResult, Snapshot, Timed

__all__ = [
    "BusyDBError",
    "DBError",
    "DamagedDBError",
    "Environment",
    "EXPORT_SCHEMA",
    "EXPORT_VERSION",
    "MalformedRowsError",
    "MeasurementRow",
    "MissLengths",
    "MissRow",
    "MissingDBError",
    "Problem",
    "Record",
    "SaveResult",
    "Snapshot",
    "Timed",
    "TuningDB",
    "applies",
    "current_environment",
    "current_fingerprint",
    "current_fingerprint_id",
    "default_db_path",
    "export_document",
    "fingerprint_id",
    "import_document",
    "parse_document",
    "resolve_db_url",
    "set_aside",
    "is_tuners_file",
    "why_not",
]
