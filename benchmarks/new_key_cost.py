"""What a new deployment's sweep costs as a user runs it: `tuner sweep ...` in a subprocess,
with an empty Triton cache (a fresh machine compiles every kernel), timed by the wall clock.

    python benchmarks/new_key_cost.py --out $OUT/cost_h48_8.json --db $OUT/h48_8.db \\
        -- decode_attention --grid serving --heads 48/8

Everything after `--` is the sweep's own command line (the CLI's defaults apply); --db is
added. The sweep's output goes to a log beside --out. Past --seconds the sweep gets SIGINT,
stores what it finished and stops; the same command with --warm then resumes it (the first
run's compiled kernels are gone with its cache, so a resumed run's seconds are not a fresh
machine's). The JSON holds the command, the seconds, the exit code, the DB's records and
measurements, and the sweep's last progress and summary lines.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.run_info import header

from tuner.db import TuningDB


def run_sweep(sweep_args: list[str], db: str, log: Path, seconds: float, warm: bool) -> tuple[int, float]:
    """(exit code, wall seconds) of the sweep, SIGINT at the deadline."""
    env = dict(os.environ)
    if not warm:
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
    command = [sys.executable, "-m", "tuner", "sweep", *sweep_args, "--db", db]
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # it stores what it finished, then exits 130
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    return code, time.monotonic() - started


def db_counts(db: str) -> dict:
    store = TuningDB(db)
    try:
        counts = store.counts()
        records = store.records()
    finally:
        store.close()
    return {"records": sum(c["records"] for c in counts.values()),
            "measurements": sum(c["measurements"] for c in counts.values()),
            "records_by_op": {op: sum(r.problem.op == op for r in records) for op in {r.problem.op for r in records}}}


def main() -> None:
    started = time.perf_counter()
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--db", required=True, help="the DB the sweep writes (resumable)")
    ap.add_argument("--seconds", type=float, default=570.0, help="SIGINT the sweep after this long")
    ap.add_argument("--warm", action="store_true", help="keep Triton's cache (a resumed run)")
    args = ap.parse_args(argv[:split])
    sweep_args = argv[split + 1:]
    if not sweep_args:
        ap.error("give the sweep's arguments after --, e.g. -- decode_attention --grid serving --heads 48/8")
    log = args.out.with_suffix(".log")
    code, seconds = run_sweep(sweep_args, args.db, log, args.seconds, args.warm)
    lines = log.read_text(errors="replace").splitlines()
    doc = {
        **header("new_key_cost", started),
        "sweep_command": "tuner sweep " + " ".join(sweep_args) + f" --db {args.db}",
        "fresh_triton_cache": not args.warm,
        "exit_code": code,
        "sweep_seconds": round(seconds, 1),
        "db": db_counts(args.db),
        "progress": [l for l in lines if l.startswith("progress:")][-3:],
        "first_lines": lines[:3],
        "last_lines": lines[-8:],
    }
    args.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: doc[k] for k in ("exit_code", "sweep_seconds", "db")}))


if __name__ == "__main__":
    main()
