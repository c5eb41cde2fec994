"""Whether a CUDA-graph capture may be on, for the price of a list read: a count of the
captures begun through torch.cuda.CUDAGraph (torch.cuda.graph, make_graphed_callables,
torch.compile's CUDA graphs) and not yet ended. The hot path asks the stream's capture
status, which costs more host time than the rest of a lookup, only while the count is not zero.
A capture begun another way (cudaStreamBeginCapture outside torch's class), or begun
before the watch was installed (autotune() installs it where CUDA is), is not seen."""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

# [captures begun and not ended]; a list, so the generated hot path reads it without a lookup
CAPTURES = [0]
_lock = threading.Lock()
_watched: set[type] = set()


def watch_captures(graph_class: Any = None) -> None:
    """Count the captures of graph_class (torch.cuda.CUDAGraph) from now on; once per class.
    Where its capture methods cannot be wrapped the count stays above zero, so every hit
    asks the capture status (slower, never wrong)."""
    graph_class = graph_class if graph_class is not None else getattr(torch.cuda, "CUDAGraph", None)
    with _lock:
        if graph_class in _watched:
            return
        _watched.add(graph_class)
        begin = getattr(graph_class, "capture_begin", None)
        end = getattr(graph_class, "capture_end", None)
        if begin is None or end is None:
            CAPTURES[0] += 1
            return

        @functools.wraps(begin)
        def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
            with _lock:
                CAPTURES[0] += 1
            try:
                return begin(self, *args, **kwargs)
            except BaseException:
                _ended_unless_capturing()
                raise

        @functools.wraps(end)
        def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                result = end(self, *args, **kwargs)
            except BaseException:
                _ended_unless_capturing()  # e.g. ended on another stream: still capturing
                raise
            _ended()
            return result

        try:
            graph_class.capture_begin = capture_begin
            graph_class.capture_end = capture_end
        except (AttributeError, TypeError):  # a class that refuses new attributes
            CAPTURES[0] += 1


def _ended() -> None:
    with _lock:
        CAPTURES[0] = max(0, CAPTURES[0] - 1)


def _ended_unless_capturing() -> None:
    """After a capture method raised: the capture ended unless the stream still captures
    (a failed begin or end may leave it on)."""
    try:
        still = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 - no CUDA to ask: nothing captures
        still = False
    if not still:
        _ended()


__all__ = ["CAPTURES", "watch_captures"]
