"""How a shipped tunings file's configs fare on serving batches, from the measurements a
serving sweep stored: for every key both hold, the sweep's timing of the shipped config,
of the default and of the sweep's own winner, on the same serving trial (one batch per
length distribution, tuner.workload.traffic; each config's stored median, of its quick or its
full rung). No GPU: it reads the sweep's DB.

    python benchmarks/shipped_on_serving.py --db serving.db --shipped tuning_cache/h200.tunings.json.gz \\
        --out benchmarks/results/h200/issue12/shipped_on_serving_66030f2.json [--op fa3 --as-backend fa3]

--op fa3 --as-backend fa3: the FA3 drop-in's records, looked up among a decode_attention
sweep's FA3 configs (the same calls: decode_attention's {"backend": "fa3", ...}); the
"winner" is then the fastest FA3 config the sweep timed.

--defaults-out FILE: a tunings file (`tuner import --replace` takes it) that keeps the
op's default at every key where the shipped config ran slower than the default by more
than settings.MAX_PART_LOSS on the serving trial, with the default's timing there: what
never runs slower than doing nothing, until a sweep of that op on serving batches.

Not a side-by-side benchmark: each timing is the sweep's, taken one config after another.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from stats import geomean

from tuner import settings
from tuner.db import Problem, TuningDB, export_document
from tuner.db.jsonio import load_document
from tuner.jsonfile import file_bytes
from tuner.keys import AttentionRunKey, canonical_json


def compare(db: TuningDB, shipped: dict, op: str = "decode_attention", as_backend: str | None = None,
            sweep_op: str = "decode_attention") -> list[dict]:
    def as_swept(config: dict) -> str:
        return canonical_json({"backend": as_backend, **config} if as_backend else config)

    rows = []
    for r in shipped["records"]:
        if r["op"] != op:
            continue
        run_key = AttentionRunKey(**r["run_key"])
        problem = Problem(sweep_op, canonical_json(r["static_key"]), run_key)
        winner = db.record(problem, r["fingerprint"])
        if winner is None:
            continue
        timed = {canonical_json(m.config): m for m in db.measurements(problem, r["fingerprint"])
                 if m.status == "ok" and m.method.get("lengths") == "serving"}
        us = {c: m.median_us for c, m in timed.items()}
        default = timed.get(as_swept(r["default"]["config"]))
        if as_backend:  # the fastest config of that backend the sweep timed
            own = {c: t for c, t in us.items() if json.loads(c).get("backend") == as_backend}
            best = min(own, key=own.get, default=None)
            winner_config, winner_us = (json.loads(best), own[best]) if best else (None, None)
        else:
            winner_config, winner_us = winner.config, us.get(canonical_json(winner.config))
        rows.append(dict(op=op, fingerprint=r["fingerprint"], static_key=r["static_key"], run_key=r["run_key"],
                         shipped_config=r["config"], default_config=r["default"]["config"],
                         sweep_winner=winner_config, shipped_us=us.get(as_swept(r["config"])),
                         default_us=default and default.median_us, default_spread_us=default and default.spread_us,
                         default_samples=default and default.samples, winner_us=winner_us))
    return rows


def losing(rows: list[dict]) -> list[dict]:
    """The rows whose shipped config ran slower than the default by more than MAX_PART_LOSS."""
    return [r for r in rows if r["shipped_us"] and r["default_us"]
            and r["default_us"] / r["shipped_us"] < 1 - settings.MAX_PART_LOSS]


def defaults_document(rows: list[dict], environments: dict[str, dict], scratch: Path) -> dict:
    """A tunings document keeping the default at each of rows' keys, timed as the sweep timed it."""
    with TuningDB(scratch) as db:
        for r in rows:
            problem = Problem(r["op"], canonical_json(r["static_key"]), AttentionRunKey(**r["run_key"]))
            db.save_record(problem, (r["fingerprint"], environments[r["fingerprint"]]), r["default_config"],
                           median_us=r["default_us"], spread_us=r["default_spread_us"], samples=r["default_samples"],
                           default_config=r["default_config"], default_median_us=r["default_us"],
                           default_spread_us=r["default_spread_us"],
                           method={"lengths": "serving", "kept_default": "the shipped config ran "
                                   f"{r['default_us'] / r['shipped_us']:.3f}x of it on a serving sweep's trial"})
        return export_document(db)


def summary(rows: list[dict]) -> dict:
    full = [r for r in rows if r["shipped_us"] and r["default_us"] and r["winner_us"]]
    over_default = [r["default_us"] / r["shipped_us"] for r in full]
    return dict(
        keys_in_both=len(rows), compared=len(full),
        shipped_over_default_geomean=geomean(over_default),
        shipped_worst_over_default=min(over_default, default=None),
        shipped_slower_than_default_by_2pct=len(losing(full)),
        winner_over_shipped_geomean=geomean([r["shipped_us"] / r["winner_us"] for r in full]),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True, help="the serving sweep's DB")
    ap.add_argument("--shipped", required=True, type=Path, help="a *.tunings.json[.gz] file")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--op", default="decode_attention", help="the shipped records of this op")
    ap.add_argument("--as-backend", help="their configs as this backend's in a decode_attention sweep (fa3)")
    ap.add_argument("--defaults-out", type=Path, help="write the default at the keys it beat the shipped config")
    args = ap.parse_args()
    shipped = load_document(args.shipped)
    with TuningDB(args.db) as db:
        rows = compare(db, shipped, args.op, args.as_backend)
    if args.defaults_out:
        with tempfile.TemporaryDirectory() as scratch:
            document = defaults_document(losing(rows), shipped["fingerprints"], Path(scratch) / "defaults.db")
        args.defaults_out.write_bytes(file_bytes(args.defaults_out, json.dumps(document, indent=1, sort_keys=True) + "\n"))
        print(f"wrote the default at {len(document['records'])} keys to {args.defaults_out}")
    doc = dict(benchmark="shipped_on_serving", command="python benchmarks/shipped_on_serving.py " + " ".join(sys.argv[1:]),
               summary=summary(rows), rows=rows)
    print(json.dumps(doc["summary"], indent=1))
    if args.out:
        args.out.write_bytes(file_bytes(args.out, json.dumps(doc, indent=1, sort_keys=True) + "\n"))


if __name__ == "__main__":
    main()
