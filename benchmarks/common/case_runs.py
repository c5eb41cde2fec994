"""What every case-by-case GPU benchmark shares (serving.py, roofline.py): the command line
(where the JSON goes, how long to start cases for, which cases this run takes) and the
loop over the cases."""

from __future__ import annotations

import argparse
import json
import lzma
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")


def add_run_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seconds", type=float, default=540.0, help="stop starting cases after this long")
    ap.add_argument("--limit", type=int, help="run only the first LIMIT cases (to repeat a run's cases)")
    ap.add_argument("--part", default="0/1", help="K/N: only every N-th case from the K-th (one run per device "
                                                 "or call; a case keeps its seed)")
    ap.add_argument("--smoke", action="store_true", help="a few tiny cases on the CPU (Triton interpreted)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows --out already holds (those without an error) and run only the cases it "
                         "lacks: the same command's cases, in the same order, keep their seeds")


def read_results(path: Path) -> dict:
    """A benchmark's JSON, plain or compressed with xz (as the committed results are)."""
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def done_rows(args: Any) -> list[dict]:
    """The rows of --out that --resume keeps (none without --resume, or before --out exists)."""
    if not args.resume or not args.out.exists():
        return []
    return [row for row in read_results(args.out).get("rows", []) if "error" not in row]


def cases_of_this_run(ap: argparse.ArgumentParser, args: Any, cases: list[T]) -> list[tuple[int, T]]:
    """(index, case) of the cases --limit and --part give this run; a bad --part is a usage error."""
    try:
        part, parts = (int(x) for x in args.part.split("/"))
        assert 0 <= part < parts
    except (ValueError, AssertionError):
        ap.error(f"--part K/N with 0 <= K < N, got {args.part!r}")
    return [(i, c) for i, c in enumerate(cases[:args.limit]) if i % parts == part]


def run_cases(todo: list[tuple[int, T]], seconds: float, device: str, run: Callable[[int, T], dict],
              fields: Callable[[T], dict], describe: Callable[[dict], str],
              write: Callable[[list[dict]], Any], done: list[dict] = ()) -> list[dict]:
    """Each case in turn (run(index, case) gives its row) until `seconds` have passed: a case
    that fails becomes a row of its fields and the error, and the run goes on; a line per case
    (describe(row)), and the rows written after every case, so a run cut short keeps them.
    done: rows of an earlier run (done_rows); a case whose fields one of them holds is kept,
    not run again."""
    kept: dict[int, dict] = {}
    for i, case in todo:
        want = fields(case)
        row = next((r for r in done if all(r.get(k) == v for k, v in want.items())), None)
        if row is not None:
            kept[i] = row
    rows = list(kept.values())
    started = time.perf_counter()
    for i, case in todo:
        if i in kept:
            continue
        if time.perf_counter() - started > seconds:
            break
        case_started = time.perf_counter()
        try:
            row = run(i, case)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row = dict(fields(case), error=f"{type(e).__name__}: {e}"[:300])
        row["seconds"] = round(time.perf_counter() - case_started, 2)  # where a run's time went
        rows.append(row)
        if device == "cuda":
            torch.cuda.empty_cache()
        line = f"{row['model'][:26]:26} b{row['batch']:<4} L{row['cap']:<7} {row['distribution']:9}"
        print(line + (" " + row["error"] if "error" in row else describe(row)), flush=True)
        write(rows)
    return rows
