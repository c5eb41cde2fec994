"""Cells of the winners' tables that `tuner sweep` and `tuner show` both print: timings and configs."""

from __future__ import annotations

from rich.markup import escape


def fmt_us(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def fmt_config(config: dict | None) -> str:
    if not config:
        return "-"
    return escape(" ".join(f"{k}={v}" for k, v in config.items()))
