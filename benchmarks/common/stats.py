"""The summary statistics the benchmarks' JSON reports share."""

from __future__ import annotations

import math
from typing import Iterable


def geomean(xs: Iterable[float]) -> float | None:
    """The geometric mean of positive numbers; None of none."""
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None
