"""What the host-cost benchmarks share: a command line (--label, --out), the median and
the minimum of repeated timeit runs, and one JSON entry per run appended to --out (so runs
from two checkouts sit side by side)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any, Callable

import torch


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--label", default="this checkout", help="what this run measured (a checkout, a commit)")
    parser.add_argument("--out", help="a JSON file to append this run to")
    return parser.parse_args()


def ns_per_call(fn: Callable[[], Any], calls: int, repeats: int) -> dict[str, float]:
    runs = [timeit.timeit(fn, number=calls) / calls * 1e9 for _ in range(repeats)]
    return {"median_ns": statistics.median(runs), "min_ns": min(runs)}


def report(args: argparse.Namespace, script: str, result: dict[str, Any]) -> None:
    import tuner

    result = {"label": args.label, "tuner": tuner.__file__, **result,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "python": sys.version.split()[0], "torch": torch.__version__,
              "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:])}
    print(json.dumps(result, indent=1))
    if args.out:
        path = Path(args.out)
        previous = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(previous + [result], indent=1) + "\n")
