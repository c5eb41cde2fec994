"""How a shipped tunings file's configs fare on serving batches, from the measurements a
serving sweep stored: for every key both hold, the sweep's timing of the shipped config,
of the default and of the sweep's own winner, on the same serving trial (one batch per
length distribution, tuner.ops.traffic; each config's stored median, of its quick or its
full rung). No GPU: it reads the sweep's DB.

    python benchmarks/shipped_on_serving.py --db serving.db --shipped tuning_cache/h200.tunings.json \\
        --out benchmarks/results/h200/issue12/shipped_on_serving_66030f2.json

Not a side-by-side benchmark: each timing is the sweep's, taken one config after another.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from tuner.db import Problem, TuningDB
from tuner.db.jsonio import load_document
from tuner.keys import AttentionRunKey, canonical_json


def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def compare(db: TuningDB, shipped: dict) -> list[dict]:
    rows = []
    for r in shipped["records"]:
        problem = Problem(r["op"], canonical_json(r["static_key"]), AttentionRunKey(**r["run_key"]))
        winner = db.record(problem, r["fingerprint"])
        if winner is None:
            continue
        us = {canonical_json(m.config): m.median_us for m in db.measurements(problem, r["fingerprint"])
              if m.status == "ok" and m.method.get("lengths") == "serving"}
        shipped_us, default_us = us.get(canonical_json(r["config"])), us.get(canonical_json(winner.default_config))
        winner_us = us.get(canonical_json(winner.config))
        rows.append(dict(static_key=r["static_key"], run_key=r["run_key"], shipped_config=r["config"],
                         sweep_winner=winner.config, shipped_us=shipped_us, default_us=default_us,
                         winner_us=winner_us))
    return rows


def summary(rows: list[dict]) -> dict:
    full = [r for r in rows if r["shipped_us"] and r["default_us"] and r["winner_us"]]
    over_default = [r["default_us"] / r["shipped_us"] for r in full]
    return dict(
        keys_in_both=len(rows), compared=len(full),
        shipped_over_default_geomean=_geomean(over_default),
        shipped_worst_over_default=min(over_default, default=None),
        shipped_slower_than_default_by_2pct=sum(x < 0.98 for x in over_default),
        winner_over_shipped_geomean=_geomean([r["shipped_us"] / r["winner_us"] for r in full]),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True, help="the serving sweep's DB")
    ap.add_argument("--shipped", required=True, type=Path, help="a *.tunings.json[.gz] file")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with TuningDB(args.db) as db:
        rows = compare(db, load_document(args.shipped))
    doc = dict(benchmark="shipped_on_serving", command="python benchmarks/shipped_on_serving.py " + " ".join(sys.argv[1:]),
               summary=summary(rows), rows=rows)
    print(json.dumps(doc["summary"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
