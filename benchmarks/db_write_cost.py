"""What a sweep pays per stored measurement: TuningDB.save_measurement into an SQLite file
(or --url, e.g. a PostgreSQL server), median and minimum us per write over repeated runs.

    python benchmarks/db_write_cost.py [--label L] [--out benchmarks/results/issue12/db_write_cost_cpu.json]

A sweep stores every measurement as it is made (a run cut short resumes from them), one
transaction each; on the H200's host that cost 1.7-2.9 ms per write (a cProfile of a
serving-grid sweep, benchmarks/results/h200/issue12/sweep_profile_28b10f1.txt).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_cost import arguments, report  # noqa: E402

from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id  # noqa: E402
from tuner.keys import attention_run_key  # noqa: E402

WRITES = 200
REPEATS = 7
CONFIGS = 50  # distinct configs per shape: later writes replace earlier ones, as a later rung does


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    url = os.environ.get("TUNER_BENCH_DB_URL") or Path(tempfile.mkdtemp()) / "bench.db"
    db = TuningDB(url)
    fingerprint = (current_fingerprint_id(), current_fingerprint())
    runs = []
    for r in range(REPEATS):  # a shape per run
        problem = Problem("bench_op", '{"num_kv_heads":8}', attention_run_key(r + 1, 1, 4096))
        start = time.perf_counter()
        for i in range(WRITES):
            db.save_measurement(problem, fingerprint, {"c": i % CONFIGS}, kv_len=4096, status="ok",
                                method={"timer": "bench"}, median_us=5.0 + i, spread_us=0.1, samples=3)
        runs.append((time.perf_counter() - start) / WRITES * 1e6)
    report(args, "db_write_cost.py", {"db": "TUNER_BENCH_DB_URL" if "TUNER_BENCH_DB_URL" in os.environ else "sqlite file",
                                      "writes_per_run": WRITES, "runs": REPEATS,
                                      "median_us_per_write": statistics.median(runs), "min_us_per_write": min(runs)})


if __name__ == "__main__":
    main()
