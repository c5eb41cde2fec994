"""@autotune: the decorator, its generated wrapper (the hot path) and the slow path that
resolves a key once: the memo, keyed by (static key, batch, max q len, kv bucket), holds the
config resolved on the first call with that key from the winners table (exact run key,
else a neighbour's by the borrowing rule, else the default). ConfigLookup is the same
lookup for callers that choose once per plan (the FlashInfer wrappers)."""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable

import torch

from tuner.db import Problem
from tuner.errors import TunerError
from tuner.keys import AttentionRunKey, Untunable, attention_run_key, canonical_json, kv_bucket_exponent
from tuner.ranks import Ranks, current_ranks
from tuner.runtime.borrowing import Config
from tuner.runtime.capture import declared_kv_len
from tuner.runtime.capture_watch import CAPTURES, watch_captures
from tuner.runtime.misses import length_stats
from tuner.runtime.state import capturing, runtime, stream_capturing
from tuner.runtime.tune import tune_call


def _static_json(value: Any) -> str:
    to_json = getattr(value, "to_json", None)
    return to_json() if callable(to_json) else canonical_json(value)


def _memoise(memo: dict, memo_key: tuple, config: Config, epoch: int) -> Config:
    """Keep config for the hot path, unless configure() or graph_capture changed what calls
    resolve to while it was being resolved (in another thread)."""
    with runtime.memo_lock:
        if runtime.epoch == epoch:
            memo[memo_key] = config
    return config


class CaptureSensitive(dict):
    """A memoised config that a CUDA-graph capture must not freeze: for its key the frozen
    rule (tuner.runtime.borrowing.choose_frozen) picks another. A server's warm-up call at
    the capture bound memoises the bound's winner, which a graph replayed over shorter
    lengths would then run for all of them (docs/decisions.md, "The frozen rule for CUDA
    graphs"); the hot path resolves such a config again under capture, and only such. Only where CUDA is (a capture can happen),
    so the hot path's query needs no is_available(); and it asks only while
    tuner.runtime.capture_watch counts a capture."""


def _resolves_under_capture(config: Config) -> bool:
    """Whether a memo hit resolves again: a CaptureSensitive config inside a capture. The
    hot path (_WRAPPER_SOURCE) inlines the same test."""
    return (config.__class__ is CaptureSensitive and not torch.compiler.is_compiling()
            and bool(CAPTURES[0]) and stream_capturing())


class AutotunedFunction:
    """Holds a decorated function's settings and memo; the hot path is the closure
    built in autotune(), which reads the memo directly."""

    def __init__(self, fn: Callable, name: str, configs: Any, default: Any,
                 tolerance: tuple[float, float] | None, static_json: Callable[[Any], str] | None = None,
                 accepts: Callable[..., bool] | None = None, lengths: Callable[..., Any] | None = None,
                 captured: Callable[[Config], Config] | None = None) -> None:
        self.fn, self.name = fn, name
        self._captured = captured
        self.static_json = static_json or _static_json
        self._configs, self._default = configs, default
        self.tolerance = tolerance
        self._accepts = accepts
        self._lengths = lengths
        self.memo: dict[tuple, Config] = {}
        self.tuned: set[tuple] = set()  # keys tuned by this process (for force mode)
        # keys a thread is tuning now: another thread's call of one serves the lookup's config
        # meanwhile (threads tuned one key at once, each timing against the others' load)
        self._tuning: set[tuple] = set()
        self._tuning_lock = threading.Lock()
        self.key_functions: dict[str, Callable] = {}  # set by autotune(): "_key", or "_static_key" and "_run_key"

    def config_for(self, *args: Any, **kwargs: Any) -> Config:
        """The config a call with these arguments (config excluded) runs, resolved as the
        wrapper resolves it (memo, then DB, borrowing rule, default), without running it (in
        tune mode a key to tune is not tuned here: the lookup's config is returned, and the
        call tunes): what a server may ask at CUDA-graph capture, or a benchmark to name."""
        keys = self.key_functions
        if "_key" in keys:
            static, batch, q_len, kv_len = keys["_key"](*args, **kwargs)
        else:
            batch, q_len, kv_len = keys["_run_key"](*args, **kwargs)
            static = keys["_static_key"](*args, **kwargs)
        memo_key = (static, batch, q_len, _kv_bits(kv_len))
        config = self.memo.get(memo_key)
        if config is None or _resolves_under_capture(config):
            config = self.resolve(memo_key, kv_len, args, kwargs, tune=False)
        return dict(config)

    def configs(self, args: tuple, kwargs: dict) -> list[Config]:
        return list(self._configs(*args, **kwargs) if callable(self._configs) else self._configs)

    def default(self, args: tuple, kwargs: dict) -> Config:
        return dict(self._default(*args, **kwargs) if callable(self._default) else self._default)

    def resolve(self, memo_key: tuple, kv_len: int, args: tuple, kwargs: dict, tune: bool = True) -> Config:
        """The slow path, once per memo key (static key, batch, max q len, kv bucket bits).

        The default serves, untouched by the DB: mode off; a static key of None (the key
        function's "not tunable": a feature no config is measured for); a call no run key
        describes (an empty batch); a key with no canonical form. Nothing is tuned inside
        CUDA-graph capture or tuner.graph_capture (whose calls are not the declared key's),
        nor with tune=False (config_for): the lookup serves and is not memoised, so a later
        call tunes."""
        epoch = runtime.epoch  # a memo entry resolved before a change of configuration or declaration is dropped
        mode = runtime.mode
        default = self.default(args, kwargs)
        static, batch, q_len, _ = memo_key
        if mode == "off" or static is None or type(static) is Untunable:
            return self._memoise(memo_key, default, epoch)
        declaration = runtime.declared_lengths
        declared = declaration is not None
        # a graph replayed over lengths unknown here: keep only what wins at every length
        frozen = not declaration.known if declared else capturing()
        try:
            static_json = self.static_json(static)
            run = attention_run_key(batch, q_len, declared_kv_len(batch, kv_len))
        except (ValueError, TypeError):
            return self._memoise(memo_key, default, epoch)
        accepts = None if self._accepts is None else (lambda c: bool(self._accepts(c, *args, **kwargs)))
        stored, served = runtime.lookup(self.name, static_json, run, accepts, frozen=frozen, captured=self._captured)
        config = default if stored is None else stored
        if frozen and not declared:
            # not memoised, so the calls after this capture resolve as before; and no miss:
            # a capture at the bound says nothing of the traffic's keys
            return config
        exact = served == "exact"
        may_tune = tune and not capturing()
        # (tune and force modes tune it instead; a made-up declaration says nothing of the traffic)
        made_up = declared and not declaration.records_misses
        if not exact and (mode == "lookup" or declared) and not made_up:
            runtime.record_miss(self.name, static_json, run, served, self._call_lengths(args, kwargs, declared))
        wants_tune, ranks = self._tune_wanted(mode, exact, memo_key, declared)
        if wants_tune:
            if not may_tune or not self._claim(memo_key, ranks):
                return config  # resolve again later, where it may tune
            try:
                config = tune_call(self, Problem(self.name, static_json, run), kv_len, default, args, kwargs,
                                   ranks) or config
                self.tuned.add(memo_key)
            finally:
                self._release(memo_key, ranks)
        if not declared and torch.cuda.is_available():  # (not capturing: that returned above)
            config = self._marked_for_capture(config, default, static_json, run, accepts, mode)
        return self._memoise(memo_key, config, epoch)

    def forget_claims(self) -> None:
        """In a forked child: no thread of it is tuning (a parent's claim kept its key untuned)."""
        self._tuning, self._tuning_lock = set(), threading.Lock()

    def _claim(self, memo_key: tuple, ranks: Ranks | None) -> bool:
        """Whether this thread tunes the key (no other thread of this process is tuning it);
        ranks tuning together are one thread each, and always tune."""
        if ranks is not None:
            return True
        with self._tuning_lock:
            if memo_key in self._tuning:
                return False
            self._tuning.add(memo_key)
            return True

    def _release(self, memo_key: tuple, ranks: Ranks | None) -> None:
        if ranks is None:
            with self._tuning_lock:
                self._tuning.discard(memo_key)

    def _tune_wanted(self, mode: str, exact: bool, memo_key: tuple, declared: bool) -> tuple[bool, Ranks | None]:
        """Whether this key is tuned now, and the ranks that tune it together (if any)."""
        if declared:
            return False, None  # (all ranks declare alike: no rank waits for another)
        wants_tune = (mode == "tune" and not exact) or (mode == "force" and memo_key not in self.tuned)
        ranks = current_ranks() if mode in ("tune", "force") else None
        if ranks is not None and not capturing():
            # all ranks make the same calls (tensor parallel): they tune together if any
            # rank has to, so a rank with a DB hit never leaves another waiting
            wants_tune = ranks.any(wants_tune)
        return wants_tune, ranks

    def _marked_for_capture(self, config: Config, default: Config, static_json: str, run: AttentionRunKey,
                            accepts: Callable[[Config], bool] | None, mode: str) -> Config:
        """config, as CaptureSensitive where a capture must resolve it again (the frozen rule
        picks another for its key)."""
        frozen_stored, _ = runtime.lookup(self.name, static_json, run, accepts, frozen=True, captured=self._captured)
        # in tune and force modes the table changes under the memo: a non-default config
        # the rule keeps now may not be kept after another bucket is tuned
        if config != (default if frozen_stored is None else frozen_stored) or (
                mode in ("tune", "force") and config != default):
            watch_captures()
            return CaptureSensitive(config)
        return config

    def _call_lengths(self, args: tuple, kwargs: dict, declared: bool) -> tuple[float, float, float] | None:
        """The call's length statistics for its miss: none under graph capture or a
        declaration (a capture's lengths are not its traffic's), none where no DB would
        keep them, and a hook that fails costs the call nothing."""
        if self._lengths is None or declared or capturing() or not runtime.keeps_misses:
            return None
        try:
            return length_stats(self._lengths(*args, **kwargs))
        except Exception:  # noqa: BLE001 - statistics for a miss never break the call
            return None

    def _memoise(self, memo_key: tuple, config: Config, epoch: int) -> Config:
        return _memoise(self.memo, memo_key, config, epoch)


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
        runtime.functions.add(self)

    def get(self, static: Any, batch: int, q_len: int, kv_len: int, default: Config) -> Config:
        """The stored config for this key (exact, else nearest), else `default`."""
        memo_key = (static, batch, q_len, (kv_len - 1).bit_length() if kv_len > 1 else 0)
        config = self.memo.get(memo_key)
        if config is None:
            epoch = runtime.epoch
            config = default
            if runtime.mode != "off" and batch >= 1 and q_len >= 1:
                static_json = self.static_json(static)
                run = attention_run_key(batch, q_len, declared_kv_len(batch, kv_len))
                accepts = None if self._accepts is None else (lambda c: bool(self._accepts(c, static, q_len)))
                declaration = runtime.declared_lengths
                stored, served = runtime.lookup(self.name, static_json, run, accepts,
                                                frozen=declaration is not None and not declaration.known)
                if stored is not None:
                    config = stored
                if served != "exact" and (declaration is None or declaration.records_misses):
                    runtime.record_miss(self.name, static_json, run, served)
            _memoise(self.memo, memo_key, config, epoch)
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
    lengths: Callable[..., Any] | None = None,
    captured: Callable[[Config], Config] | None = None,
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
    A static key of None, or a tuner.keys.Untunable one (a key per shape), means "not
    tunable": the default runs. accepts(config, ...) (the
    call's arguments after the config) says whether a stored or borrowed config is one this
    call can run; one it cannot gives the default. Both run once per new key only.
    lengths(...) gives the call's kv lengths when they are on the host (else None): a miss
    records their statistics, so `tuner sweep --from-misses` measures batches like them;
    called only when a miss is recorded. captured(config) gives the config a CUDA-graph
    capture runs of a stored one, for an op whose stored configs choose per call (default:
    the config itself): a capture's rule for unknown lengths compares and freezes those.
    """
    if key is None and (static_key is None or run_key is None):
        raise TunerError("autotune needs static_key= and run_key=, or key=")
    if key is not None and (static_key is not None or run_key is not None):
        raise TunerError("autotune takes key=, or static_key= and run_key=, not both")

    def wrap(fn: Callable) -> Callable:
        if torch.cuda.is_available():
            watch_captures()  # early, so a capture that begins later is counted from its start
        state = AutotunedFunction(fn, name, configs, default, tolerance, static_json, accepts, lengths, captured)
        runtime.functions.add(state)
        keys = {"_key": key} if key is not None else {"_static_key": static_key, "_run_key": run_key}
        state.key_functions = keys
        wrapper = _explicit_wrapper(fn, state, keys) or _generic_wrapper(fn, state, keys)
        functools.update_wrapper(wrapper, fn)
        wrapper.tuner = state  # type: ignore[attr-defined]
        return wrapper

    return wrap


# The hot path, as source so it can take the decorated function's own parameter list.
# Memo key: (static key, batch, max q len, bit length of max kv len - 1), i.e. the kv bucket.
# Its locals start with "_": parameters that do are refused (_explicit_wrapper), so no
# parameter is ever shadowed. A memo hit resolves again only as _resolves_under_capture
# says, inlined: a CaptureSensitive config while a capture may be on
# (tuner.runtime.capture_watch), never while torch.compile traces it (the count would
# become a guard: a recompile per change).
# Integer-likes that are not ints (numpy) take the except branch, and so does what is no
# integer at all (a float's bit_length, a str's comparison), for _kv_bits' one clear error.
_WRAPPER_SOURCE = """
def wrapper({params}):
    if config is None:
        {keys}
        try:
            _memo_key = (_static, _batch, _q_len, (_kv_len - 1).bit_length() if _kv_len > 1 else 0)
        except (AttributeError, TypeError):
            _memo_key = (_static, _batch, _q_len, _kv_bits(_kv_len))
        config = _memo.get(_memo_key)
        if config is None or (config.__class__ is _CaptureSensitive and not _compiling() and _captures[0]
                              and _capturing()):
            config = _resolve(_memo_key, _kv_len, {args}, {kwargs})
    return _fn({call_with_config})
"""
_SEPARATE_KEYS = "_batch, _q_len, _kv_len = _run_key({call})\n        _static = _static_key({call})"
_COMBINED_KEY = "_static, _batch, _q_len, _kv_len = _key({call})"


def _kv_bits(kv_len: Any) -> int:
    """The memo's kv bucket for integer-likes (numpy ints); a clear ValueError otherwise."""
    return kv_bucket_exponent(kv_len)


def _build(fn: Callable, state: AutotunedFunction, keys: dict[str, Callable], params: str, call: str,
           args: str, kwargs: str, namespace: dict[str, Any] | None = None) -> Callable:
    namespace = dict(namespace or {}, _memo=state.memo, _resolve=state.resolve, _fn=fn, _kv_bits=_kv_bits,
                     _CaptureSensitive=CaptureSensitive, _captures=CAPTURES, _capturing=stream_capturing,
                     _compiling=torch.compiler.is_compiling, **keys)
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
