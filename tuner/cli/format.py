"""What the commands print alike: the winners' tables' cells (timings, configs) and counts."""

from __future__ import annotations

from rich.markup import escape


def fmt_us(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def fmt_config(config: dict | None) -> str:
    if not config:
        return "-"
    return escape(" ".join(f"{k}={v}" for k, v in config.items()))


def counted(n: int, noun: str) -> str:
    """"1 winner", "2 winners"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
