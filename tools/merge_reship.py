"""The shipped tunings file with a serving re-ship's winners merged in: at every key the
re-ship swept, its winner replaces the shipped one, except where the shipped winner is a
FlashInfer config (a serving sweep leaves FlashInfer out, since a captured decode graph
cannot hold its per-call plan, so nothing timed the re-ship's winners against it there).
No GPU: it reads the re-ship's DB.

    python tools/merge_reship.py --shipped tuning_cache/h200.tunings.json.gz --reship serving.db \\
        --out /tmp/merged.tunings.json.gz [--heads 16/4,16/2]

--heads takes only those head configurations' records from the re-ship (a re-ship DB seeded
with an older shipped file holds that file's other records too, which must not replace what
the shipped file has learnt since).

Prints what it did as one JSON line (records shipped, swept, replaced, kept, written).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tuner.db import TuningDB, export_document
from tuner.db.jsonio import import_document, load_document
from tuner.jsonfile import file_bytes
from tuner.keys import canonical_json

OP = "decode_attention"
KEPT_BACKENDS = ("flashinfer",)  # what a serving sweep does not time


def record_key(r: dict) -> tuple:
    """A record's key, whatever machine of the shipped kind measured it: the fingerprint's
    id hashes the driver too, which may differ between two hosts of one GPU and stack."""
    return r["op"], canonical_json(r["static_key"]), canonical_json(r["run_key"])


def of_heads(record: dict, heads: set[tuple[int, int]] | None) -> bool:
    """Whether record's static key has one of heads' (query heads, kv heads); None: any."""
    key = record["static_key"]
    return heads is None or (key.get("num_q_heads"), key.get("num_kv_heads")) in heads


def parse_heads(text: str | None) -> set[tuple[int, int]] | None:
    """"16/4,16/2" as {(16, 4), (16, 2)}; None or "" as None (every head configuration)."""
    if not text:
        return None
    try:
        return {(int(q), int(kv)) for q, kv in (h.split("/") for h in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"Q/KV pairs, comma-separated (e.g. 16/4,16/2), not {text!r}") from None


def merge(shipped: dict, reship: dict, scratch: Path, heads: set[tuple[int, int]] | None = None
          ) -> tuple[dict, dict]:
    """The merged document, and counts of what went into it: the re-ship's records of heads
    (None: all) at their keys."""
    kept = {record_key(r) for r in shipped["records"]
            if r["op"] == OP and r["config"].get("backend") in KEPT_BACKENDS}
    swept = [r for r in reship["records"] if r["op"] == OP and of_heads(r, heads)]
    taken = [r for r in swept if record_key(r) not in kept]
    taken_keys = {record_key(r) for r in taken}
    staying = [r for r in shipped["records"] if record_key(r) not in taken_keys]
    with TuningDB(scratch / "merge.db") as db:
        import_document(db, dict(shipped, records=staying), replace=True)
        replaced = len(shipped["records"]) - len(staying)
        import_document(db, dict(reship, records=taken), replace=True)
        merged = export_document(db)
    counts = dict(shipped=len(shipped["records"]), swept=len(swept), replaced=replaced,
                  kept_flashinfer=len(swept) - len(taken), added=len(taken) - replaced,
                  written=len(merged["records"]))
    return merged, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shipped", required=True, type=Path, help="the shipped *.tunings.json[.gz]")
    ap.add_argument("--reship", required=True, help="the re-ship's DB (SQLAlchemy URL or SQLite path)")
    ap.add_argument("--out", required=True, type=Path, help="the merged file (gzip-compressed for a .gz name)")
    ap.add_argument("--heads", type=parse_heads,
                    help="only the re-ship's records of these head configurations, Q/KV comma-separated")
    args = ap.parse_args()
    heads = args.heads
    with TuningDB(args.reship, create=False) as db:
        reship = export_document(db, op=OP)
    with tempfile.TemporaryDirectory() as scratch:
        merged, counts = merge(load_document(args.shipped), reship, Path(scratch), heads)
    args.out.write_bytes(file_bytes(args.out, json.dumps(merged, indent=1, sort_keys=True) + "\n"))
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
