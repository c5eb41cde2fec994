"""What every GPU benchmark's JSON opens with: which benchmark, the command that made it,
when, where (the environment fingerprint) and how long it has run."""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from typing import Any

from tuner.db import current_fingerprint


def header(benchmark: str, started: float) -> dict[str, Any]:
    """started: time.perf_counter() when the run began."""
    return {
        "benchmark": benchmark,
        "command": "python " + " ".join(sys.argv),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": current_fingerprint(),
        "seconds": round(time.perf_counter() - started, 1),
    }
