"""What one fixed config per key could reach on a serving benchmark's cases, from the
screen timings serving.py stores (every config of the space on each batch, 3 samples):
for each grouping of the cases (a lookup's key), the config with the least total log time
over the group's cases, chosen in-sample, against FA3's default and the per-case best.

    python benchmarks/serving_bounds.py benchmarks/results/h200/issue12/serving_before.json.xz

(a .json file, or one compressed with xz, as the committed results are)
"""

from __future__ import annotations

import argparse
import collections
import json
import math
from pathlib import Path

from case_runs import read_results

from tuner.settings import DENSE_FILL  # a batch whose mean length is at least this share of its longest is dense

GROUPINGS = {
    "per case (the screen's oracle)": lambda r: id(r),
    "per (head configuration, batch, kv bucket of the batch max)": lambda r: (
        r["model"], r["batch"], (r["kv_max"] - 1).bit_length()),
    # the key a lookup that also reads the batch's fill (mean / longest length, from host-side
    # lengths) would use: dense batches (uniform traffic) apart from skewed ones
    "per (head configuration, batch, kv bucket, fill >= 1/2)": lambda r: (
        r["model"], r["batch"], (r["kv_max"] - 1).bit_length(), r["kv_mean"] >= DENSE_FILL * r["kv_max"]),
    "per (head configuration, batch, length cap)": lambda r: (r["model"], r["batch"], r["cap"]),
    "per (head configuration, batch): one config for every length": lambda r: (r["model"], r["batch"]),
    "per (head configuration, kv bucket): one config for every batch": lambda r: (
        r["model"], (r["kv_max"] - 1).bit_length()),
    "per head configuration": lambda r: r["model"],
}


def bounds(rows: list[dict]) -> dict[str, dict]:
    def times(r: dict) -> dict[str, float]:
        return {json.dumps(c, sort_keys=True): t for t, c in r["screen_us"]}

    def default_us(r: dict) -> float:
        return times(r)[json.dumps(r["default"]["per_call"], sort_keys=True)]

    # a case whose default did not run in the screen has no ratio to give
    usable = [r for r in rows if json.dumps(r["default"]["per_call"], sort_keys=True) in times(r)]
    out = {}
    for name, key in GROUPINGS.items():
        groups = collections.defaultdict(list)
        for r in usable:
            groups[key(r)].append(r)
        logs, left_out = [], 0
        for group in groups.values():
            common = set.intersection(*(set(times(r)) for r in group))
            if not common:  # no config ran on every case of the group
                left_out += len(group)
                continue
            best = min(common, key=lambda c: sum(math.log(times(r)[c] / default_us(r)) for r in group))
            logs += [math.log(default_us(r) / times(r)[best]) for r in group]
        out[name] = {"groups": len(groups), "cases": len(logs), "left_out": len(rows) - len(usable) + left_out,
                     "geomean_over_default": math.exp(sum(logs) / len(logs)) if logs else None,
                     "worst_over_default": math.exp(min(logs)) if logs else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    args = ap.parse_args()
    rows = [r for r in read_results(args.results)["rows"] if "screen_us" in r and "per_call" in r]
    for name, b in bounds(rows).items():
        if b["geomean_over_default"] is None:
            print(f"{name:66} {b['groups']:4} groups  no case with a common config")
            continue
        print(f"{name:66} {b['groups']:4} groups  {b['geomean_over_default']:.3f}x  worst "
              f"{b['worst_over_default']:.3f}x" + (f"  ({b['left_out']} cases left out)" if b["left_out"] else ""))


if __name__ == "__main__":
    main()
