"""Shipped tunings: reviewed JSON (tuner's export schema) read as a read-only layer beneath
the user's DB.

Where: $TUNER_SHIPPED (a file, a directory of *.tunings.json[.gz], or "off"), else the
*.tunings.json files of tuning_cache/ in a source checkout, or of tuner/shipped/ in an
installed wheel (pyproject.toml packages tuning_cache/ as tuner.shipped). A file may be
gzip-compressed (*.tunings.json.gz): a serving grid's tunings run to megabytes of JSON.
Nothing here writes.

Which records apply: the rule of tuner.db.fingerprint.applies, as for the user's DB (same
GPU, same CUDA, torch, Triton, sgl-kernel and FlashInfer versions; driver and tuner's own
version may differ). Any other difference, a library upgrade above all, leaves the record
unused. A record that applies but that the caller's `check` refuses (its op cannot run its
config: the runtime and `tuner doctor` pass tuner.ops' rules, which this layer cannot
import) is left out and counted. Records of one key in several files (or twice in one):
the newest measurement wins (created_at; one without a date counts as oldest), a tie going
to the one read last.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tuner import settings
from tuner.db.fingerprint import why_not
from tuner.db.jsonio import load_document, parse_document
from tuner.db.location import default_db_path
from tuner.db.values import Problem, Timed
from tuner.errors import TunerError
from tuner.keys import AttentionRunKey

SHIPPED_ENV = settings.ENV_SHIPPED
_OLDEST = datetime.min.replace(tzinfo=timezone.utc)
SHIPPED_GLOBS = ("*.tunings.json", "*.tunings.json.gz")
OFF = settings.SHIPPED_OFF
# why a record's config cannot be its op's winner, or None (tuner.ops.check_record's rules)
Check = Callable[[Problem, dict[str, Any]], str | None]


@dataclass
class ShippedFile:
    path: Path
    records: int = 0
    applied: int = 0
    # fingerprint id -> why its records do not apply here (one line)
    mismatches: dict[str, str] = field(default_factory=dict)
    refused: int = 0  # records that apply here but that the check refused: left out
    refused_why: str = ""  # the first of them and why, one line


@dataclass
class ShippedLayer:
    """The winners that apply here, (op, static key JSON) -> {run key: Timed}, and per file
    how many records it held and how many apply."""

    table: dict[tuple[str, str], dict[AttentionRunKey, Timed]] = field(default_factory=dict)
    files: list[ShippedFile] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # files that could not be used, one line each

    @property
    def applied(self) -> int:
        return sum(f.applied for f in self.files)


def _tunings_files(folder: Path) -> list[Path]:
    return sorted(p for pattern in SHIPPED_GLOBS for p in folder.glob(pattern))


def shipped_paths(source: str | os.PathLike | None = None) -> list[Path]:
    """The shipped tunings files: from source (file or directory), else $TUNER_SHIPPED, else
    tuning_cache/ beside the default DB of a checkout. "off" gives none; "" is the default."""
    origin = "shipped tunings"
    if source is None or not str(source).strip():
        source, origin = settings.env_shipped(), SHIPPED_ENV
    if source is not None and str(source).strip().lower() in OFF:
        return []
    if source is None:
        folder = default_db_path().parent
        if folder.name != "tuning_cache":  # installed from a wheel: they travel in the package
            folder = Path(__file__).resolve().parents[1] / "shipped"
        return _tunings_files(folder)
    path = Path(source).expanduser()
    if path.is_dir():
        return _tunings_files(path)
    if path.is_file():
        return [path]
    raise TunerError(f"{origin}: no such file or directory: {path}")


def _nothing_applies(doc: Any, current: dict[str, Any]) -> dict[str, str] | None:
    """{fingerprint id: why not} when no environment of the document applies in `current`
    (its records need no validating to be left unused), else None."""
    fps = doc.get("fingerprints") if isinstance(doc, dict) else None
    if not isinstance(fps, dict) or not fps or not all(isinstance(v, dict) for v in fps.values()):
        return None
    why = {str(k): why_not(v, current) for k, v in fps.items()}
    return why if all(why.values()) else None


def load_shipped(current: dict[str, Any], source: str | os.PathLike | None = None,
                 check: Check | None = None) -> ShippedLayer:
    """Read every shipped file and keep the records that apply in `current`, validated.
    A file that cannot be read or fails validation adds nothing and one line to
    layer.errors (naming the file); the other files still count. A file none of whose
    environments applies here is counted, not validated (start-up stays cheap). A record
    that applies and that `check` refuses is left out, counted in its file's `refused`."""
    layer = ShippedLayer()
    dated: dict[tuple, tuple[datetime, ShippedFile]] = {}  # (key, run key) -> (created_at, its file)
    for path in shipped_paths(source):
        try:
            doc = load_document(path)
            skipped = _nothing_applies(doc, current)
            if skipped is not None:
                records = doc.get("records")
                layer.files.append(ShippedFile(path, records=len(records) if isinstance(records, list) else 0,
                                               mismatches=skipped))
                continue
            rows = parse_document(doc)
        except TunerError as e:
            text = str(e)
            layer.errors.append(text if str(path) in text else f"shipped tunings {path}: {text}")
            continue
        info = ShippedFile(path, records=len(rows))
        for problem, (fp_id, fp_data), fields in rows:
            if fp_id not in info.mismatches:
                info.mismatches[fp_id] = why_not(fp_data, current)
            if info.mismatches[fp_id]:
                continue
            why = check(problem, fields["config"]) if check is not None else None
            if why is not None:
                info.refused += 1
                info.refused_why = info.refused_why or f"{problem.op} at {problem.run_key.to_json()}: {why}"
                continue
            key, run = (problem.op, problem.static_key), problem.run_key
            created = fields["created_at"] or _OLDEST
            held = dated.get((key, run))
            if held is not None and held[0] > created:
                continue  # the newest measurement wins; a tie goes to the one read last
            if held is not None:
                held[1].applied -= 1
            dated[(key, run)] = (created, info)
            layer.table.setdefault(key, {})[run] = Timed(fields["config"], fields["median_us"],
                                                          fields["default_median_us"])
            info.applied += 1
        info.mismatches = {k: v for k, v in info.mismatches.items() if v}
        layer.files.append(info)
    return layer
