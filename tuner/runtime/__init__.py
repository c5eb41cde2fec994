"""The runtime: @autotune and the lookup it serves calls from (the hot path).

- state: where the DB and shipped tunings are, the mode, the winners table; configure()
- table: the winners that apply here, the user's DB over the shipped tunings
- borrowing: which winner serves a call (exact, a neighbour's by the borrowing rule, none)
- misses: keys served without an exact winner, written for `tuner sweep --from-misses`
- decorator: @autotune, its generated wrapper and the slow path; ConfigLookup
- tune: tune on a miss (TUNER_MODE=tune, force)
- capture: graph_capture(lengths), configs for CUDA graphs chosen for the declared lengths
"""

from typing import Callable

from tuner.keys import AttentionRunKey
from tuner.runtime.borrowing import Config, Winner, winner_gain
from tuner.runtime.capture import graph_capture
from tuner.runtime.decorator import AutotunedFunction, ConfigLookup, autotune
from tuner.runtime.state import MODES, configure, flush_misses, runtime

__all__ = ["MODES", "AutotunedFunction", "ConfigLookup", "Winner", "autotune", "configure", "flush_misses",
           "graph_capture", "lookup", "runtime", "winner_gain"]


def lookup(name: str, static_json: str, run: AttentionRunKey,
           accepts: Callable[[Config], bool] | None = None) -> tuple[Config | None, str]:
    """The config the runtime serves for (op name, static key JSON, run key) and how it was
    found: "exact", "nearest" or "default" (None)."""
    return runtime.lookup(name, static_json, run, accepts)
