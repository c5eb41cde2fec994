"""Two or more serving.py runs side by side on the cases they all hold: per mode, over all
those cases and per length distribution, tuner's geomean over FA3's default, the oracle's,
the share of the oracle's gain tuner captures, the worst case and how many cases ran slower
than the default by more than 2%. No GPU: it reads the runs' JSON.

    python benchmarks/serving_compare.py before=BEFORE.json.xz after=AFTER.json \\
        [--modes per_call,graph_declared]

(NAME=PATH; a .json file, or one compressed with xz, as the committed results are)
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from common.case_runs import read_results
from common.stats import geomean

SLOWER = 0.98  # a case below this share of the default's speed is "slower by more than 2%"


def case_key(row: dict) -> tuple:
    return row["model"], row["batch"], row["cap"], row["distribution"]


def summary(rows: list[dict], mode: str) -> str:
    tuned = [r[mode]["tuner_speedup"] for r in rows]
    oracle = geomean(r[mode]["oracle_speedup"] for r in rows)
    mine = geomean(tuned)
    share = math.log(mine) / math.log(oracle) if oracle > 1 else float("nan")
    return (f"{mine:.3f}x of {oracle:.3f}x, share {share:.3f}, worst {min(tuned):.3f}, "
            f"{sum(t < SLOWER for t in tuned)} slower")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="NAME=PATH of a serving.py JSON (.json or .json.xz)")
    ap.add_argument("--modes", default="per_call,graph_declared", help="comma-separated modes of serving.py")
    args = ap.parse_args()
    runs = {}
    for spec in args.runs:
        name, sep, path = spec.partition("=")
        if not sep:
            ap.error(f"{spec!r}: give NAME=PATH")
        runs[name] = {case_key(r): r for r in read_results(Path(path))["rows"]}
    common = set.intersection(*(set(rows) for rows in runs.values()))
    if not common:
        ap.error("the runs share no case")
    print(f"{len(common)} cases in all of {', '.join(runs)}")
    distributions = sorted({k[3] for k in common})
    for mode in args.modes.split(","):
        for name, rows in runs.items():
            chosen = [rows[k] for k in sorted(common)]
            if mode not in chosen[0]:
                ap.error(f"{name} has no mode {mode!r}")
            print(f"{mode:<22} {name:<12} all: {summary(chosen, mode)}")
            for d in distributions:
                print(f"{'':<35} {d}: {summary([r for r in chosen if r['distribution'] == d], mode)}")


if __name__ == "__main__":
    main()
