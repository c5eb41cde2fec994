"""Which part of a by_fill record this checkout captures in serving.py's graph_declared mode,
for each case of a committed serving run whose capture looked one up: the declaration is
redrawn as serving.py draws it (4096 lengths of the case's distribution and cap, seed = the
case's index + 10**6), the part chosen by tuner.integrations.decode_attention's rule
(DeclaredLengths.fill_share against settings.DECLARED_DENSE_SHARE), beside the part the
run captured. No GPU and no timing: a changed rule's choices, before a GPU run times them.

    python benchmarks/declared_choice.py benchmarks/results/h200/issue12/serving_shipped_dense_1eb95f3.json.xz

The run must be of all cases of its head configurations (no --models or --limit), so that
each case's index is the run's own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import serving
from case_runs import read_results
from serving_compare import case_key

from tuner import settings
from tuner.ops.decode_attention import BY_FILL, fill_parts
from tuner.workload.traffic import draw_lengths
from tuner.runtime.capture import DeclaredLengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a serving.py JSON (.json or .json.xz)")
    args = ap.parse_args()
    doc = read_results(args.run)
    rows = {case_key(r): r for r in doc["rows"]}
    heads = doc["models"]  # name -> head configuration, as the run had them
    changed = looked_up = 0
    for index, case in enumerate(serving.cases(False, heads, serving.CAP_SETS["issue"])):
        row = rows.get(case_key(case))
        record = row and row.get("tuner_record", {}).get("graph_declared")
        if not record or record.get("backend") != BY_FILL:
            continue
        looked_up += 1
        declared = DeclaredLengths(draw_lengths(case["distribution"], 4096, case["cap"], index + 10**6))
        share = declared.fill_share(case["batch"], settings.DENSE_FILL)
        dense, other = fill_parts(record)
        now = dense if share is not None and share >= settings.DECLARED_DENSE_SHARE else other
        ran = row["tuner"]["graph_declared"]
        if now != ran:
            changed += 1
            print(json.dumps(dict(case=case, dense_share=share, ran="dense" if ran == dense else "other",
                                  now="dense" if now == dense else "other",
                                  graph_declared_speedup=round(row["graph_declared"]["tuner_speedup"], 3))))
    print(f"{looked_up} cases captured a {BY_FILL} record; this checkout captures another part in {changed}")


if __name__ == "__main__":
    main()
