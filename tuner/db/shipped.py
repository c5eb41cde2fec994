"""Shipped tunings: reviewed JSON (tuner's export schema) read as a read-only layer beneath
the user's DB.

Where: $TUNER_SHIPPED (a file, a directory of *.tunings.json, or "off"), else the
*.tunings.json files of tuning_cache/ in a source checkout, or of tuner/shipped/ in an
installed wheel (pyproject.toml packages tuning_cache/ as tuner.shipped). Nothing here writes.

Which records apply: those measured on the same GPU (name, SM count, capability) with the
same CUDA, torch, Triton, sgl-kernel and FlashInfer versions as this process (local build
tags such as torch's "+cu130" aside); the GPU driver and tuner's own version may differ
(neither changes which kernel code runs).
Any other difference, a library upgrade above all, leaves the record unused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.db.jsonio import load_document, parse_document
from tuner.db.location import default_db_path
from tuner.db.store import winner_gain
from tuner.errors import TunerError
from tuner.keys import AttentionRunKey

SHIPPED_ENV = "TUNER_SHIPPED"
SHIPPED_GLOB = "*.tunings.json"
OFF = ("off", "0", "none", "false", "no")
# fingerprint fields that may differ between the shipped record's environment and this one
MAY_DIFFER = frozenset({"driver", "tuner"})


@dataclass
class ShippedFile:
    path: Path
    records: int = 0
    applied: int = 0
    # fingerprint id -> why its records do not apply here (one line)
    mismatches: dict[str, str] = field(default_factory=dict)


@dataclass
class ShippedLayer:
    """The winners that apply here, (op, static key JSON) -> {run key: config}, and per file
    how many records it held and how many apply."""

    table: dict[tuple[str, str], dict[AttentionRunKey, dict[str, Any]]] = field(default_factory=dict)
    gains: dict[tuple[str, str], dict[AttentionRunKey, float]] = field(default_factory=dict)  # winner_gain
    files: list[ShippedFile] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # files that could not be used, one line each

    @property
    def applied(self) -> int:
        return sum(f.applied for f in self.files)


# versions compared without a local build tag: torch "2.11.0+cu130" from PyTorch's index is
# the "2.11.0" of PyPI's wheel for the same CUDA, which the fingerprint's cuda field names
_VERSIONS = ("torch", "triton", "sgl_kernel", "flashinfer")


def _comparable(field_name: str, value: Any) -> Any:
    if field_name in _VERSIONS and isinstance(value, str):
        return value.split("+", 1)[0]
    return value


def differing_fields(shipped: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The fingerprint fields that keep a shipped record from applying in `current`."""
    return sorted(k for k in set(shipped) | set(current)
                  if k not in MAY_DIFFER and _comparable(k, shipped.get(k)) != _comparable(k, current.get(k)))


_DEVICE_FIELDS = ("device", "device_kind", "sm_count", "capability")


def why_not(shipped: dict[str, Any], current: dict[str, Any]) -> str:
    """Why records of the `shipped` environment do not apply in `current` ("" if they do)."""
    fields = differing_fields(shipped, current)
    if not fields:
        return ""
    if any(f in fields for f in _DEVICE_FIELDS):
        return f"made on {shipped.get('device')}, this is {current.get('device')}"
    return "; ".join(f"{f} {shipped.get(f)} there, {current.get(f)} here" for f in fields)


def shipped_paths(source: str | os.PathLike | None = None) -> list[Path]:
    """The shipped tunings files: from source (file or directory), else $TUNER_SHIPPED, else
    tuning_cache/ beside the default DB of a checkout. "off" gives none; "" is the default."""
    origin = "shipped tunings"
    if source is None or not str(source).strip():
        source, origin = os.environ.get(SHIPPED_ENV) or None, SHIPPED_ENV
    if source is not None and str(source).strip().lower() in OFF:
        return []
    if source is None:
        folder = default_db_path().parent
        if folder.name != "tuning_cache":  # installed from a wheel: they travel in the package
            folder = Path(__file__).resolve().parents[1] / "shipped"
        return sorted(folder.glob(SHIPPED_GLOB))
    path = Path(source).expanduser()
    if path.is_dir():
        return sorted(path.glob(SHIPPED_GLOB))
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


def load_shipped(current: dict[str, Any], source: str | os.PathLike | None = None) -> ShippedLayer:
    """Read every shipped file and keep the records that apply in `current`, validated.
    A file that cannot be read or fails validation adds nothing and one line to
    layer.errors (naming the file); the other files still count. A file none of whose
    environments applies here is counted, not validated (start-up stays cheap)."""
    layer = ShippedLayer()
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
            table = layer.table.setdefault((problem.op, problem.static_key), {})
            if problem.run_key not in table:  # the first file (sorted by name) wins a clash
                table[problem.run_key] = fields["config"]
                layer.gains.setdefault((problem.op, problem.static_key), {})[problem.run_key] = winner_gain(
                    fields["median_us"], fields["default_median_us"])
                info.applied += 1
        info.mismatches = {k: v for k, v in info.mismatches.items() if v}
        layer.files.append(info)
    return layer
