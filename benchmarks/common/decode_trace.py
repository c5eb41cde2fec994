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
# decode attention's kernels, by a fragment of the name each library gives them: FA3's main and
# combine kernels and its scheduler's, tuner's Triton kernels, FlashInfer's paged kernels and
# merges, SGLang's Triton backend's stages (writing the KV cache is not counted)
ATTENTION_KERNELS = ("FlashAttnFwd", "prepare_varlen_num_blocks", "_decode_split_kernel", "_decode_by_length_kernel",
                     "_decode_merge_kernel", "WithPagedKVCache", "MergeStates", "_fwd_kernel_stage",
                     "_fwd_grouped_kernel_stage")


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


def is_attention(kernel_name: str) -> bool:
    """Whether a GPU kernel is one of decode attention's (ATTENTION_KERNELS)."""
    return any(fragment in kernel_name for fragment in ATTENTION_KERNELS)


def summarize_trace(events: list[dict], steps: int, top: int = 12) -> dict:
    """Per decode step (the trace holds `steps`): the GPU's busy time (its work's union), the
    span from its first work to its last and the idle time within it, its kernels and graph
    launches; the `top` kernels by time, each with its count and time per step; and
    attention_us, the decode attention kernels' time (ATTENTION_KERNELS, their names in
    attention_kernels): the part of the step an attention backend can change."""
    work = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and "dur" in e]
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in work]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals) if intervals else 0.0
    busy = busy_us(intervals)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in work:
        entry = by_name[str(e.get("name", ""))[:NAME_CHARS]]
        entry[0] += 1
        entry[1] += float(e["dur"])
    attention = {name: us for name, (_, us) in by_name.items() if is_attention(name)}
    launches = [float(e.get("dur", 0.0)) for e in events if e.get("ph") == "X" and e.get("name") in GRAPH_LAUNCHES]
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    per = max(steps, 1)
    return dict(steps=steps, gpu_busy_us=busy / per, gpu_span_us=span / per, gpu_idle_us=(span - busy) / per,
                gpu_ops=len(work) / per, attention_us=sum(attention.values()) / per,
                attention_kernels=sorted(attention), graph_launches=len(launches) / per,
                graph_launch_host_us=sum(launches) / per,
                top=[dict(name=name, count=count / per, us=us / per) for name, (count, us) in ranked])


__all__ = ["busy_us", "is_attention", "read_trace", "summarize_trace"]
