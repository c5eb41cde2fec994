"""Winners in LightLLM's kernel-config layout, for a LightLLM deployment to read as is.

LightLLM's autotuner keeps, under lightllm/common/all_kernel_configs/, one directory per
triton version and device and, in it, a directory per kernel with one JSON file per static
key, named from the key's fields ("name=value,..." sorted by name, spaces and colons as
"_"), holding {run key: config}. Its run key is a single integer that it matches exactly,
else takes the nearest. Ours has three fields (batch, max q len, kv bucket), so the export
names one of them as LightLLM's run key and moves the others into the file's static key
(e.g. --run-key kv_len: a file per static key, batch and max q len, holding {kv bucket:
config}), as LightLLM's own kernels keep their other dimensions. It refuses when two
winners of one file would still share a run key (rather than drop one).
"""

from __future__ import annotations

import json
from typing import Any

from tuner.db.location import DBError
from tuner.db.store import Record, TuningDB

RUN_KEY_FIELDS = {
    "batch": lambda r: r.batch,
    "kv_len": lambda r: r.kv_len_bucket,
    "max_q_len": lambda r: r.max_q_len,
    "tokens": lambda r: r.batch * r.kv_len_bucket,  # batch x kv bucket: the work a call does
}
# the run-key fields each choice leaves to the file's static key
STATIC_PART = {
    "batch": ("max_q_len", "kv_len"),
    "kv_len": ("batch", "max_q_len"),
    "max_q_len": ("batch", "kv_len"),
    "tokens": ("max_q_len",),
}


def _safe(text: Any) -> str:
    return str(text).replace(" ", "_").replace(":", "_").replace("/", "_").replace(",", "_").replace("=", "_")


def static_key_filename(static_key_json: str, extra: dict[str, int] | None = None) -> str:
    """LightLLM's file name for a static key (plus `extra` fields): sorted name=value pairs
    joined by commas."""
    fields = json.loads(static_key_json)
    if not isinstance(fields, dict):
        fields = {"key": fields}
    fields = dict(fields, **(extra or {}))
    return ",".join(f"{_safe(k)}={_safe(v)}" for k, v in sorted(fields.items(), key=lambda kv: str(kv[0]))) + ".json"


def lightllm_files(db: TuningDB, *, run_key: str = "batch", op: str | None = None) -> dict[str, dict[str, Any]]:
    """{relative path: file content} for every stored winner: triton_<version>/<device>/<op>/<static>.json."""
    if run_key not in RUN_KEY_FIELDS:
        raise DBError(f"--run-key must be one of {', '.join(RUN_KEY_FIELDS)}, got {run_key!r}")
    field = RUN_KEY_FIELDS[run_key]
    fingerprints = db.fingerprints()
    files: dict[str, dict[str, Any]] = {}
    owners: dict[tuple[str, str], Record] = {}
    for record in db.records(op=op):
        run = record.problem.run_key
        env = fingerprints.get(record.fingerprint_id, {})
        path = "/".join([f"triton_{_safe(env.get('triton') or 'none')}", _safe(env.get("device") or "unknown"),
                         _safe(record.problem.op), static_key_filename(record.problem.static_key, {
                             name: (run.kv_len_bucket if name == "kv_len" else getattr(run, name))
                             for name in STATIC_PART[run_key]})])
        key = str(field(record.problem.run_key))
        clash = owners.get((path, key))
        if clash is not None:
            raise DBError(
                f"{path}: two winners share LightLLM run key {run_key}={key} "
                f"({clash.problem.run_key.to_json()} and {record.problem.run_key.to_json()}); "
                f"choose another --run-key (batch, kv_len or max_q_len never clash)"
            )
        owners[(path, key)] = record
        files.setdefault(path, {})[key] = record.config
    return {path: dict(sorted(content.items(), key=lambda kv: int(kv[0]))) for path, content in files.items()}
