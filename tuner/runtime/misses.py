"""Misses: the keys the runtime served without an exact winner (from a neighbour's or the
default), counted in memory off the hot path and written to the DB's misses table (by a
timed thread, FlushSoon, and at exit), with the kv lengths of the calls that had them on the
host, for `tuner show --misses` and `tuner sweep --from-misses`."""

from __future__ import annotations

import math
import threading
import warnings
from typing import Any, Callable

from tuner.db import MissLengths, MissRow, Problem
from tuner.errors import one_line
from tuner.keys import AttentionRunKey

MAX_LENGTH = 2.0**40  # a kv length beyond any cache (tuner.workload.shapes' limit): not a length


def length_stats(lengths: Any) -> tuple[float, float, float] | None:
    """(mean, longest, standard deviation) of a call's host-side kv lengths (a sequence, a
    CPU tensor or an array), or None when there are none, they are not plain numbers, or
    they are on a device."""
    if lengths is None or str(getattr(lengths, "device", "cpu")).split(":")[0] != "cpu":
        return None  # on a device (a CUDA tensor, a CuPy array): reading it would wait for the GPU
    try:
        values = [float(n) for n in (lengths.tolist() if hasattr(lengths, "tolist") else lengths)]
    except (TypeError, ValueError):
        return None
    if not values or not all(math.isfinite(v) and 0 <= v <= MAX_LENGTH for v in values):
        return None
    mean = math.fsum(values) / len(values)
    return mean, max(values), math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


class MissLog:
    """The misses not yet written; recorded by the calls' threads and taken by the writer's
    (a lock: a take while a record changed the pending entries lost or broke them)."""

    def __init__(self) -> None:
        # (op, static json, run key) -> [how it was served, times, calls with lengths, their sums]
        self._pending: dict[tuple[str, str, AttentionRunKey], list] = {}
        self._lock = threading.Lock()

    def record(self, name: str, static_json: str, run: AttentionRunKey, served: str,
               lengths: tuple[float, float, float] | None = None) -> None:
        with self._lock:
            entry = self._pending.setdefault((name, static_json, run), [served, 0, 0, 0.0, 0.0, 0.0])
            entry[0], entry[1] = served, entry[1] + 1
            if lengths is not None:
                entry[2] += 1
                entry[3] += lengths[0]
                entry[4] += lengths[1]
                entry[5] += lengths[2]

    def forget(self) -> None:
        """In a forked child: the parent's misses are the parent's to write (else counted twice)."""
        self._lock = threading.Lock()
        self._pending = {}

    def put_back(self, rows: list[MissRow]) -> None:
        """Misses a write could not take yet, added to those recorded since."""
        with self._lock:
            for row in rows:
                p, lengths = row.problem, row.lengths
                entry = self._pending.setdefault((p.op, p.static_key, p.run_key), [row.served, 0, 0, 0.0, 0.0, 0.0])
                entry[1] += row.count
                if lengths is not None:
                    entry[2] += lengths.calls
                    entry[3] += lengths.mean * lengths.calls
                    entry[4] += lengths.longest * lengths.calls
                    entry[5] += lengths.spread * lengths.calls

    def take(self) -> list[MissRow]:
        """The misses recorded since the last take."""
        with self._lock:
            pending, self._pending = self._pending, {}
        return [MissRow(Problem(name, static_json, run), served, count,
                        MissLengths(calls, mean / calls, longest / calls, spread / calls) if calls else None)
                for (name, static_json, run), (served, count, calls, mean, longest, spread) in pending.items()]


class FlushSoon:
    """Runs a flush once, a while after it is first asked for, on a daemon thread: misses wait
    there for more of them, not for an exit that a killed process never reaches."""

    def __init__(self, flush: Callable[[], Any]) -> None:
        self._flush = flush
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # held while the thread writes: an exit waits for it
        self._timer: threading.Timer | None = None

    def ask(self, after_s: float) -> None:
        with self._lock:
            if self._timer is not None:
                return
            self._timer = threading.Timer(after_s, self._run)
            self._timer.daemon = True
            self._timer.start()

    def _run(self) -> None:
        with self._flushing:
            with self._lock:
                self._timer = None
            try:
                self._flush()
            except Exception as e:  # (a thread's exception would be printed as a traceback)
                warnings.warn(f"tuner: could not record missed keys: {one_line(e)}", stacklevel=1)

    def cancel(self, wait_s: float = 0.0) -> None:
        """No flush from the thread from now on; with wait_s, one under way is waited for."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if wait_s and self._flushing.acquire(timeout=wait_s):
            self._flushing.release()

    def forget(self) -> None:
        """In a forked child: the parent's thread is not there."""
        self._lock, self._flushing, self._timer = threading.Lock(), threading.Lock(), None
