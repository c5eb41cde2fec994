"""Where a few decode steps' time went, from the torch profiler's chrome trace of them
(bench_one_batch's --profile): the GPU's kernel time and its idle time within the steps, the
kernels that took it, and the host's graph launches. A benchmark's diagnosis, beside its
step latencies: two backends whose steps differ in time differ on the GPU or on the host."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

# what the GPU ran: kernels, and the copies and memsets between them
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
GRAPH_LAUNCHES = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})
NAME_CHARS = 160  # a kernel's name kept this long (template arguments run to thousands)


def read_trace(path: Path) -> list[dict]:
    """The trace's events (a .gz file read as gzip)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc.get("traceEvents", []) if isinstance(doc, dict) else doc


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The time covered by these (start, end) intervals, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize_trace(events: list[dict], steps: int, top: int = 12) -> dict:
    """Per decode step (the trace holds `steps`): the GPU's busy time (its work's union), the
    span from its first work to its last and the idle time within it, its kernels and graph
    launches; and the `top` kernels by time, each with its count and time per step."""
    work = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and "dur" in e]
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in work]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals) if intervals else 0.0
    busy = busy_us(intervals)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in work:
        entry = by_name[str(e.get("name", ""))[:NAME_CHARS]]
        entry[0] += 1
        entry[1] += float(e["dur"])
    launches = [float(e.get("dur", 0.0)) for e in events if e.get("ph") == "X" and e.get("name") in GRAPH_LAUNCHES]
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    per = max(steps, 1)
    return dict(steps=steps, gpu_busy_us=busy / per, gpu_span_us=span / per, gpu_idle_us=(span - busy) / per,
                gpu_ops=len(work) / per, graph_launches=len(launches) / per,
                graph_launch_host_us=sum(launches) / per,
                top=[dict(name=name, count=count / per, us=us / per) for name, (count, us) in ranked])


__all__ = ["busy_us", "read_trace", "summarize_trace"]
