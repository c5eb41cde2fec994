"""Config rules: which configs an op can run, as data (a field name -> a value test), so a
stored, imported or borrowed config is checked before any kernel sees it."""

from __future__ import annotations

from typing import Any, Callable

Rule = Callable[[Any], bool]


def is_int(lo: int, hi: int) -> Rule:
    return lambda v: type(v) is int and lo <= v <= hi


def is_pow2(lo: int, hi: int) -> Rule:
    return lambda v: type(v) is int and lo <= v <= hi and not v & (v - 1)


def one_of(*values: Any) -> Rule:
    # `is` for None/bools (True == 1 must not pass for a bool field), == for strings and ints
    return lambda v: any(v is x if x is None or isinstance(x, bool) else (type(v) is type(x) and v == x)
                         for x in values)


def optional(rule: Rule) -> Rule:
    return lambda v: v is None or rule(v)


IS_BOOL = one_of(True, False)


def config_error(config: Any, rules: dict[str, Rule], optional_fields: dict[str, Rule] | None = None) -> str | None:
    """Why `config` breaks `rules` (exactly these fields, each value passing its test, plus
    any of `optional_fields`: knobs added later, absent from configs stored before), or None."""
    if not isinstance(config, dict):
        return f"a config is an object, got {type(config).__name__}"
    optional_fields = optional_fields or {}
    missing = sorted(set(rules) - set(config))
    if missing:
        return f"missing {', '.join(missing)}"
    unknown = sorted(set(config) - set(rules) - set(optional_fields))
    if unknown:
        return f"unknown field(s) {', '.join(map(str, unknown))}"
    for name, rule in [*rules.items(), *((n, r) for n, r in optional_fields.items() if n in config)]:
        if not rule(config[name]):
            return f"{name}={config[name]!r:.40} is not a value this op takes"
    return None
