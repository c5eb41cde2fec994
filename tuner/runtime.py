"""The runtime: @autotune and its lookup table (the hot path). (Not named autotune.py: a
submodule of that name would shadow the tuner.autotune function.)

A call's static key and run key select a config in O(1): a per-function memo, keyed by
(static key, batch, max q len, kv bucket), holds the config resolved on the first call
with that key. Resolving (the slow path, once per key) reads the in-memory snapshot of
the DB: the exact run key, else the nearest one (tuner.keys.run), else the default.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import warnings
import weakref
from typing import Any, Callable

import torch

from tuner import settings
from tuner.bench import WallClockTimer, decide, measure_configs, same_config, tolerance_for, with_default_first
from tuner.db import MissingDBError, Problem, TuningDB, current_environment, current_fingerprint
from tuner.db.location import DBError
from tuner.db.store import winner_gain
from tuner.errors import TunerError
from tuner.keys import AttentionRunKey, attention_run_key, canonical_json, kv_len_bucket, nearest_run_keys
from tuner.ranks import Ranks, current_ranks

MODES = settings.MODES
Config = dict[str, Any]
_KEEP: Any = object()  # configure(): a setting not given keeps its value


def _mode_from_env() -> str:
    mode = settings.env_mode()
    if mode not in MODES:
        warnings.warn(f"{settings.ENV_MODE}={mode!r} is not one of {', '.join(MODES)}; using "
                      f"{settings.DEFAULT_MODE!r}", stacklevel=3)
        return settings.DEFAULT_MODE
    return mode


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _Runtime:
    """Process-wide settings and the DB snapshot, loaded on first need."""

    def __init__(self) -> None:
        self.db_target: str | os.PathLike | None = None
        self.shipped_source: str | os.PathLike | None = None  # None: $TUNER_SHIPPED, else tuning_cache/
        self.mode = _mode_from_env()
        self.max_distance = settings.MAX_DISTANCE
        self._snapshot: dict[tuple[str, str], dict[AttentionRunKey, Config]] | None = None
        # each snapshot winner's gain over the default at its own key (tuner.db.store.winner_gain)
        self.gains: dict[tuple[str, str], dict[AttentionRunKey, float]] = {}
        self._db: TuningDB | None = None
        self.functions: weakref.WeakSet[AutotunedFunction] = weakref.WeakSet()
        # keys served without an exact winner, not yet written: (op, static json, run key) -> [served, count]
        self.misses: dict[tuple[str, str, AttentionRunKey], list] = {}
        self._flush_at_exit = False
        self.db_readable = False
        self._lock = threading.Lock()

    def record_miss(self, name: str, static_json: str, run: AttentionRunKey, served: str) -> None:
        """Off the hot path: once per memo key resolved from the nearest record or the default.
        Kept only when there is a readable DB to write them to (never a damaged one)."""
        if not self.db_readable:
            return
        entry = self.misses.setdefault((name, static_json, run), [served, 0])
        entry[0], entry[1] = served, entry[1] + 1
        if not self._flush_at_exit:
            import atexit

            atexit.register(flush_misses)
            self._flush_at_exit = True

    def reset(self) -> None:
        flush_misses()  # they belong to the DB being left
        with self._lock:
            self._snapshot = None
            if self._db is not None:
                self._db.close()
            self._db = None
            for f in list(self.functions):
                f.memo.clear()
                f.tuned.clear()

    def writable_db(self) -> TuningDB:
        """The DB that tune mode and the miss writer write to (created if missing); never one
        that integrity_check calls malformed, that lacks a core table or holds malformed rows."""
        if self._db is None:
            db = TuningDB(self.db_target)
            try:
                db.require_sound("write into")
            except DBError:
                db.close()
                raise
            self._db = db
        return self._db

    def snapshot(self) -> dict[tuple[str, str], dict[AttentionRunKey, Config]]:
        """Every winner that applies in this environment, read once: the user's DB over the
        shipped tunings (tuner.db.shipped), the user's winning a run key both hold. A DB
        that is missing is empty; one that cannot be read, like a shipped file that cannot,
        gives one warning and adds nothing (the library defaults run); its malformed rows
        are left out with one warning. Loaded under a lock (threads resolving their first
        keys at once wait for one load) and published with its gains in one step."""
        table = self._snapshot
        if table is not None:
            return table
        with self._lock:
            if self._snapshot is None:
                table, gains, readable = self._load()
                self.gains, self.db_readable = gains, readable
                self._snapshot = table
            return self._snapshot

    def _load(self) -> tuple[dict, dict, bool]:
        table, gains = self._shipped_table()
        try:
            with TuningDB(self.db_target, create=False) as db:
                user = db.snapshot(current_fingerprint())
                where = db.display_url
        except MissingDBError:
            return table, gains, False
        except (TunerError, OSError) as e:
            warnings.warn(f"tuner: {e}; running with library defaults", stacklevel=5)
            return table, gains, False
        if user.skipped:
            warnings.warn(f"tuner: {len(user.skipped)} malformed rows of tuning DB {where} left out "
                          f"({user.skipped[0]}); `tuner doctor` lists them", stacklevel=5)
        for key, runs in user.table.items():
            table.setdefault(key, {}).update(runs)
            gains.setdefault(key, {}).update(user.gains.get(key, {}))
        return table, gains, True

    def _shipped_table(self) -> tuple[dict, dict]:
        """(winners, gains) of the shipped tunings that apply here."""
        from tuner.db.shipped import load_shipped

        try:
            layer = load_shipped(current_fingerprint(), self.shipped_source)
        except (TunerError, OSError) as e:
            warnings.warn(f"tuner: {e}; shipped tunings not used", stacklevel=5)
            return {}, {}
        for error in layer.errors:
            warnings.warn(f"tuner: {error}; that file is not used", stacklevel=5)
        return layer.table, layer.gains

    def store(self, key: tuple[str, str], run: AttentionRunKey, config: Config, gain: float) -> None:
        """A winner tuned in this process, served from now on like a stored one."""
        table = self.snapshot()
        self.gains.setdefault(key, {})[run] = gain
        table.setdefault(key, {})[run] = config


_runtime = _Runtime()


def flush_misses() -> int:
    """Write the misses recorded so far to the DB (also done at exit and by configure());
    returns how many keys were written. A DB that cannot be written gives one warning."""
    pending, _runtime.misses = _runtime.misses, {}
    if not pending:
        return 0
    rows = [(Problem(name, static_json, run), served, count) for (name, static_json, run), (served, count)
            in pending.items()]
    try:
        _runtime.writable_db().save_misses(current_environment(), rows)
    except (TunerError, OSError) as e:
        warnings.warn(f"tuner: could not record {len(rows)} missed keys: {e}", stacklevel=2)
        return 0
    return len(rows)


def configure(*, db: str | os.PathLike | None = _KEEP, mode: str | None = _KEEP, max_distance: float | None = None,
              shipped: str | os.PathLike | None = _KEEP) -> None:
    """Point the runtime at a DB (None: $TUNER_DB, else the default file) and/or set the
    mode (None: $TUNER_MODE), and choose the shipped tunings beneath the DB: a file, a
    directory, or "off" (None: $TUNER_SHIPPED, else tuning_cache/ in a checkout). A setting
    not given keeps its current value.

    Clears the snapshot and every memo, so the next call of each function resolves anew.
    """
    if mode is not _KEEP and mode is not None and mode not in MODES:
        raise TunerError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    _runtime.reset()
    if db is not _KEEP:
        _runtime.db_target = db
    if shipped is not _KEEP:
        _runtime.shipped_source = shipped
    if mode is not _KEEP:
        _runtime.mode = mode if mode is not None else _mode_from_env()
    if max_distance is not None:
        _runtime.max_distance = max_distance


def _stored_config(name: str, static_json: str, run: AttentionRunKey,
                   accepts: Callable[[Config], bool] | None = None) -> tuple[Config | None, str]:
    """The snapshot's config for this key and how it was found: "exact", "nearest" (the
    nearest run key, tuner.keys.run, when the borrowing rule above allows), or "default"
    (None: nothing near, the neighbours' gains too small to carry over, or a config this
    call cannot run: `accepts` says which it can)."""
    key = (name, static_json)
    table = _runtime.snapshot().get(key, {})
    config = table.get(run)
    if config is not None:
        return (config, "exact") if accepts is None or accepts(config) else (None, "default")
    near = nearest_run_keys(run, table, _runtime.max_distance)
    gains = _runtime.gains.get(key, {})
    if near and all(gains.get(k, 1.0) >= settings.BORROW_MIN_GAIN for k in near):
        config = table[near[0]]
        if accepts is None or accepts(config):
            return config, "nearest"
    return None, "default"


def _static_json(value: Any) -> str:
    to_json = getattr(value, "to_json", None)
    return to_json() if callable(to_json) else canonical_json(value)


class AutotunedFunction:
    """Holds a decorated function's settings and memo; the hot path is the closure
    built in autotune(), which reads the memo directly."""

    def __init__(self, fn: Callable, name: str, configs: Any, default: Any,
                 tolerance: tuple[float, float] | None, static_json: Callable[[Any], str] | None = None,
                 accepts: Callable[..., bool] | None = None) -> None:
        self.fn, self.name = fn, name
        self.static_json = static_json or _static_json
        self._configs, self._default = configs, default
        self.tolerance = tolerance
        self._accepts = accepts
        self.memo: dict[tuple, Config] = {}
        self.tuned: set[tuple] = set()  # keys tuned by this process (for force mode)

    def configs(self, args: tuple, kwargs: dict) -> list[Config]:
        return list(self._configs(*args, **kwargs) if callable(self._configs) else self._configs)

    def default(self, args: tuple, kwargs: dict) -> Config:
        return dict(self._default(*args, **kwargs) if callable(self._default) else self._default)

    def resolve(self, memo_key: tuple, kv_len: int, args: tuple, kwargs: dict) -> Config:
        """The slow path, once per memo key (static key, batch, max q len, kv bucket bits).

        The default serves, untouched by the DB: mode off; a static key of None (the key
        function's "not tunable": a feature no config is measured for); a call no run key
        describes (an empty batch); a key with no canonical form."""
        mode = _runtime.mode
        default = self.default(args, kwargs)
        static, batch, q_len, _ = memo_key
        if mode == "off" or static is None:
            self.memo[memo_key] = default
            return default
        try:
            static_json = self.static_json(static)
            run = attention_run_key(batch, q_len, kv_len)
        except (ValueError, TypeError):
            self.memo[memo_key] = default
            return default
        accepts = None if self._accepts is None else (lambda c: bool(self._accepts(c, *args, **kwargs)))
        stored, served = _stored_config(self.name, static_json, run, accepts)
        config = default if stored is None else stored
        exact = served == "exact"
        if not exact and mode == "lookup":  # tune and force modes tune it instead
            _runtime.record_miss(self.name, static_json, run, served)
        wants_tune = (mode == "tune" and not exact) or (mode == "force" and memo_key not in self.tuned)
        ranks = current_ranks() if mode in ("tune", "force") else None
        if ranks is not None and not _capturing():
            # all ranks make the same calls (tensor parallel): they tune together if any
            # rank has to, so a rank with a DB hit never leaves another waiting
            wants_tune = ranks.any(wants_tune)
        if wants_tune:
            if _capturing():
                return config  # never tune inside CUDA-graph capture; resolve again later
            config = self._tune(Problem(self.name, static_json, run), kv_len, default, args, kwargs, ranks) or config
            self.tuned.add(memo_key)
        self.memo[memo_key] = config
        return config

    def _tune(self, problem: Problem, kv_len: int, default: Config, args: tuple, kwargs: dict,
              ranks: Ranks | None = None) -> Config | None:
        """Measure every config on this very call, store the winner, return it. Under a
        process group every rank measures and rank 0's winner is everyone's."""
        configs = with_default_first(default, self.configs(args, kwargs))
        run = lambda c: _output(self.fn(*args, config=c, **kwargs))  # noqa: E731
        # a copy: a kernel writing into the caller's out= returns that one tensor for every
        # config, and each would then be checked against itself
        reference = _output(run(default))
        reference = reference.clone() if isinstance(reference, torch.Tensor) else reference
        tolerance = self.tolerance or tolerance_for(getattr(reference, "dtype", None))
        preset = settings.TIMERS["runtime"]
        timer = WallClockTimer(warmup=preset.warmup, repeats=preset.repeats, min_repeats=preset.min_repeats,
                               max_seconds=preset.max_seconds, cuda_sync=torch.cuda.is_available())
        outcomes = measure_configs(run, configs, reference=reference, tolerance=tolerance, timer=timer)
        winner, default_timing = decide(run, outcomes, default, timer=timer)
        if ranks is not None:  # rank 0's choice, as an index into the configs every rank listed alike
            index = next((i for i, c in enumerate(configs) if winner and same_config(c, winner.config)), -1)
            index = ranks.broadcast(index if ranks.rank == 0 else -1)
            if index < 0:
                return None
            mine = next((o for o in outcomes if same_config(o.config, configs[index])), None)
            if ranks.rank != 0:  # rank 0 stores it; the others serve it (its gain unknown here: never lent)
                _runtime.store((problem.op, problem.static_key), problem.run_key, configs[index], 1.0)
                return configs[index]
            winner = mine
        if winner is None:
            return None
        try:
            _runtime.writable_db().save_winner(
                problem, current_environment(), winner.config, winner.timing,
                default, default_timing, method=dict(timer.method, source="runtime", kv_len=kv_len),
            )
        except (TunerError, OSError) as e:  # the winner still serves this process
            warnings.warn(f"tuner: could not store the tuned config of {self.name}: {e}", stacklevel=5)
        _runtime.store((problem.op, problem.static_key), problem.run_key, winner.config,
                       winner_gain(winner.timing.median_us, default_timing and default_timing.median_us))
        return winner.config


def _output(out: Any) -> Any:
    """What a tuning run checks: the output tensor, the first of a tuple such as
    (out, softmax_lse) as FA3 returns with return_softmax_lse."""
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return out


class ConfigLookup:
    """Lookup only, for callers that choose a config once per plan rather than per kernel
    call (the FlashInfer wrappers): the same snapshot, nearest-key rule, memo and modes as
    @autotune, except that it never tunes (timing a plan says nothing of its kernel)."""

    def __init__(self, name: str, static_json: Callable[[Any], str],
                 accepts: Callable[[Config, Any, int], bool] | None = None) -> None:
        """accepts(config, static key, q_len): whether a stored config is one this lookup's
        caller can run (else its default serves)."""
        self.name, self.static_json, self._accepts = name, static_json, accepts
        self.memo: dict[tuple, Config] = {}
        self.tuned: set[tuple] = set()  # cleared with the memo by configure(); never filled
        _runtime.functions.add(self)  # type: ignore[arg-type]

    def get(self, static: Any, batch: int, q_len: int, kv_len: int, default: Config) -> Config:
        """The stored config for this key (exact, else nearest), else `default`."""
        memo_key = (static, batch, q_len, (kv_len - 1).bit_length() if kv_len > 1 else 0)
        config = self.memo.get(memo_key)
        if config is None:
            config = default
            if _runtime.mode != "off" and batch >= 1 and q_len >= 1:
                static_json = self.static_json(static)
                run = attention_run_key(batch, q_len, kv_len)
                accepts = None if self._accepts is None else (lambda c: bool(self._accepts(c, static, q_len)))
                stored, served = _stored_config(self.name, static_json, run, accepts)
                if stored is not None:
                    config = stored
                if served != "exact":
                    _runtime.record_miss(self.name, static_json, run, served)
            self.memo[memo_key] = config
        return config


def autotune(
    name: str,
    *,
    configs: list[Config] | Callable[..., list[Config]],
    default: Config | Callable[..., Config],
    static_key: Callable[..., Any] | None = None,
    run_key: Callable[..., tuple[int, int, int]] | None = None,
    key: Callable[..., tuple[Any, int, int, int]] | None = None,
    static_json: Callable[[Any], str] | None = None,
    tolerance: tuple[float, float] | None = None,
    accepts: Callable[..., bool] | None = None,
) -> Callable[[Callable], Callable]:
    """Decorate a callable that takes a `config` keyword.

    Called with the decorated function's arguments (config excluded):
      static_key(...) -> a hashable value naming the kernel (a tuple of dtypes and sizes,
                         or a tuner.keys.AttentionStaticKey);
      run_key(...)    -> (batch, max_q_len, max_kv_len), host-side values only;
      or, instead of both, key(...) -> (static key, batch, max_q_len, max_kv_len), which
      saves a call and lets each tensor's shape be read once.
    They run on every call: keep them to attribute reads. configs and default may be
    lists/dicts or functions of the same arguments. A caller's explicit config= always wins.
    static_json(static key) gives the key's canonical JSON in the DB (default: its
    to_json(), else tuner.keys.canonical_json); it runs once per new key, off the hot path.
    A static key of None means "not tunable": the default runs. accepts(config, ...) (the
    call's arguments after the config) says whether a stored or borrowed config is one this
    call can run; one it cannot gives the default. Both run once per new key only.
    """
    if key is None and (static_key is None or run_key is None):
        raise TunerError("autotune needs static_key= and run_key=, or key=")
    if key is not None and (static_key is not None or run_key is not None):
        raise TunerError("autotune takes key=, or static_key= and run_key=, not both")

    def wrap(fn: Callable) -> Callable:
        state = AutotunedFunction(fn, name, configs, default, tolerance, static_json, accepts)
        _runtime.functions.add(state)
        keys = {"_key": key} if key is not None else {"_static_key": static_key, "_run_key": run_key}
        wrapper = _explicit_wrapper(fn, state, keys) or _generic_wrapper(fn, state, keys)
        functools.update_wrapper(wrapper, fn)
        wrapper.tuner = state  # type: ignore[attr-defined]
        return wrapper

    return wrap


# The hot path, as source so it can take the decorated function's own parameter list.
# Memo key: (static key, batch, max q len, bit length of max kv len - 1), i.e. the kv bucket.
# Its locals start with "_": parameters that do are refused (_explicit_wrapper), so no
# parameter is ever shadowed. Integer-likes that are not ints (numpy) take the except branch.
_WRAPPER_SOURCE = """
def wrapper({params}):
    if config is None:
        {keys}
        try:
            _memo_key = (_static, _batch, _q_len, (_kv_len - 1).bit_length() if _kv_len > 1 else 0)
        except AttributeError:
            _memo_key = (_static, _batch, _q_len, _kv_bits(_kv_len))
        config = _memo.get(_memo_key)
        if config is None:
            config = _resolve(_memo_key, _kv_len, {args}, {kwargs})
    return _fn({call_with_config})
"""
_SEPARATE_KEYS = "_batch, _q_len, _kv_len = _run_key({call})\n        _static = _static_key({call})"
_COMBINED_KEY = "_static, _batch, _q_len, _kv_len = _key({call})"


def _kv_bits(kv_len: Any) -> int:
    """The memo's kv bucket for integer-likes (numpy ints); a clear ValueError otherwise."""
    return (kv_len_bucket(kv_len) - 1).bit_length()


def _build(fn: Callable, state: AutotunedFunction, keys: dict[str, Callable], params: str, call: str,
           args: str, kwargs: str, namespace: dict[str, Any] | None = None) -> Callable:
    namespace = dict(namespace or {}, _memo=state.memo, _resolve=state.resolve, _fn=fn, _kv_bits=_kv_bits, **keys)
    key_code = (_COMBINED_KEY if "_key" in keys else _SEPARATE_KEYS).format(call=call)
    source = _WRAPPER_SOURCE.format(
        params=params, keys=key_code, args=args, kwargs=kwargs,
        call_with_config=f"{call}, config=config" if call else "config=config",
    )
    exec(compile(source, f"<tuner.autotune wrapper of {state.name}>", "exec"), namespace)
    return namespace["wrapper"]


def _generic_wrapper(fn: Callable, state: AutotunedFunction, keys: dict[str, Callable]) -> Callable:
    return _build(fn, state, keys, params="*args, config=None, **kwargs", call="*args, **kwargs",
                  args="args", kwargs="kwargs")


def _explicit_wrapper(fn: Callable, state: AutotunedFunction, keys: dict[str, Callable]) -> Callable | None:
    """A wrapper with fn's own parameter list, so a call packs no *args/**kwargs.

    Taken when fn's parameters are plain (positional-or-keyword, then keyword-only, one of
    them `config`); it takes a third off the hot path. Other signatures get the generic one.
    """
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    config = next((p for p in parameters if p.name == "config"), None)
    if config is None or config.kind is not config.KEYWORD_ONLY or any(p.name.startswith("_") for p in parameters):
        return None
    positional = [p for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword = [p for p in parameters if p.kind is p.KEYWORD_ONLY and p.name != "config"]
    if len(positional) + len(keyword) + 1 != len(parameters):
        return None
    defaults: dict[str, Any] = {}

    def declare(p: inspect.Parameter) -> str:
        if p.default is p.empty:
            return p.name
        defaults[f"_default_{p.name}"] = p.default
        return f"{p.name}=_default_{p.name}"

    params = [declare(p) for p in positional] + ["*", "config=None"] + [declare(p) for p in keyword]
    call = [p.name for p in positional] + [f"{p.name}={p.name}" for p in keyword]
    return _build(
        fn, state, keys, params=", ".join(params), call=", ".join(call),
        args="(" + "".join(f"{p.name}, " for p in positional) + ")",
        kwargs="{" + ", ".join(f"{p.name!r}: {p.name}" for p in keyword) + "}",
        namespace=defaults,
    )
