"""How much one config per captured graph could gain at most (issue 37), from serving.py runs
already made: for each head configuration and batch size (one graph replays all of that
batch size's cases), the config of the candidates screened on every one of those cases with
the best geomean over FA3's default, against each case's own best (a per-replay choice).

    python benchmarks/graph_oracle_bounds.py benchmarks/results/h200/serving_shipped_keys.json.xz ...

Screens are per-call timings (true max length); a config that splits by each sequence's own
length runs alike at a graph's bound, and FA3's default ran at 1.003x of its per-call time
there. The maximum over noisy screens leans optimistic. Computed on the CPU; no GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from common.case_runs import read_results
from common.stats import geomean


def ratios(rows: list[dict]) -> tuple[list[float], list[float]]:
    """Per case: the default over the graph's best single config, and over the case's own best."""
    graphs: dict[tuple, list[tuple[dict, str]]] = collections.defaultdict(list)
    for row in rows:
        if "per_call" not in row or not row.get("screen_us"):
            continue
        times = {json.dumps(c, sort_keys=True): us for us, c in row["screen_us"]}
        default = json.dumps(row["default"]["per_call"], sort_keys=True)
        if default in times:
            graphs[(row["model"], row["batch"])].append((times, default))
    single, own = [], []
    for cases in graphs.values():
        common = set.intersection(*(set(times) for times, _ in cases))
        best = max(common, key=lambda c: geomean([times[d] / times[c] for times, d in cases]))
        single += [times[d] / times[best] for times, d in cases]
        own += [times[d] / min(times.values()) for times, d in cases]
    return single, own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="serving.py result files (.json or .json.xz)")
    args = ap.parse_args()
    every_single, every_own = [], []
    for path in args.runs:
        single, own = ratios(read_results(path)["rows"])
        if not single:
            print(f"{path.name}: no screened cases", file=sys.stderr)
            continue
        every_single += single
        every_own += own
        print(f"{path.name:45} {len(single):4} cases  one config per graph {geomean(single):.3f}x "
              f"(slower than the default by more than 2%: {sum(r < 1 / 1.02 for r in single)})  "
              f"each case's own best {geomean(own):.3f}x")
    if every_single:
        print(f"{'all':45} {len(every_single):4} cases  one config per graph {geomean(every_single):.3f}x  "
              f"each case's own best {geomean(every_own):.3f}x")


if __name__ == "__main__":
    main()
