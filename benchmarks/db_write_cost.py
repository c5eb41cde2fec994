"""What a sweep pays per stored measurement: TuningDB.save_measurement (one transaction a
measurement) and TuningDB.save_measurements (a shape's together) into an SQLite file (or
TUNER_BENCH_DB_URL, e.g. a PostgreSQL server), median and minimum us per measurement over
repeated runs.

    python benchmarks/db_write_cost.py [--label L] [--out $OUT/db_write_cost.json]

Why a sweep stores a shape's measurements together: docs/decisions.md, "The DB".
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from common.host_cost import arguments, report

from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
from tuner.keys import attention_run_key

WRITES = 200
REPEATS = 7
CONFIGS = 50  # distinct configs per shape: later writes replace earlier ones, as a later rung does
PER_SHAPE = 40  # measurements a shape stores at once (a guided sweep's serving shapes: 15-90)


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    url = os.environ.get("TUNER_BENCH_DB_URL") or Path(tempfile.mkdtemp()) / "bench.db"
    db = TuningDB(url)
    fingerprint = (current_fingerprint_id(), current_fingerprint())
    one, together = [], []
    for r in range(REPEATS):  # a shape per run, and per way of writing
        problem = Problem("bench_op", '{"num_kv_heads":8}', attention_run_key(r + 1, 1, 4096))
        start = time.perf_counter()
        for i in range(WRITES):
            db.save_measurement(problem, fingerprint, {"c": i % CONFIGS}, kv_len=4096, status="ok",
                                method={"timer": "bench"}, median_us=5.0 + i, spread_us=0.1, samples=3)
        one.append((time.perf_counter() - start) / WRITES * 1e6)
        problem = Problem("bench_op", '{"num_kv_heads":8}', attention_run_key(r + 1, 1, 8192))
        start = time.perf_counter()
        for first in range(0, WRITES, PER_SHAPE):
            db.save_measurements(problem, fingerprint, [
                dict(config={"c": i % CONFIGS}, kv_len=8192, status="ok", method={"timer": "bench"},
                     median_us=5.0 + i, spread_us=0.1, samples=3) for i in range(first, first + PER_SHAPE)])
        together.append((time.perf_counter() - start) / WRITES * 1e6)
    report(args, "db_write_cost.py", {"db": "TUNER_BENCH_DB_URL" if "TUNER_BENCH_DB_URL" in os.environ else "sqlite file",
                                      "writes_per_run": WRITES, "runs": REPEATS,
                                      "median_us_per_write": statistics.median(one), "min_us_per_write": min(one),
                                      "per_shape": PER_SHAPE,
                                      "median_us_per_measurement_per_shape": statistics.median(together),
                                      "min_us_per_measurement_per_shape": min(together)})


if __name__ == "__main__":
    main()
