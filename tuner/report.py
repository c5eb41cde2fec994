"""`tuner report`: this environment's winners as PNG heat maps (speedup over the library
default, and the fraction of the HBM roofline when a bandwidth is given) by batch and kv
length for each op and static key, plus a Markdown summary. matplotlib is imported on use."""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.db import Record, TuningDB
from tuner.errors import TunerError
from tuner.files import write_atomically
from tuner.keys import AttentionStaticKey, canonical_json



@dataclass
class Group:
    """The winners of one op and static key."""

    op: str
    static_key: str
    label: str
    records: list[Record]
    kv_bytes: dict[int, int] = field(default_factory=dict)  # record index -> KV bytes read, when known
    images: list[str] = field(default_factory=list)

    @property
    def speedups(self) -> list[float]:
        return [r.speedup for r in self.records if r.speedup]

    @property
    def geomean(self) -> float | None:
        s = self.speedups
        return math.exp(sum(map(math.log, s)) / len(s)) if s else None


def _label(static_key: str) -> str:
    return AttentionStaticKey.label_of(static_key)


def _kv_bytes(static_key: str, record: Record, kv_len: int) -> int | None:
    """Bytes of K and V one call reads: batch x kv length x kv heads x head dims x dtype."""
    try:
        per_token = AttentionStaticKey.from_json(static_key).kv_bytes_per_token()
    except (ValueError, TypeError):
        return None
    return None if per_token is None else record.problem.run_key.batch * kv_len * per_token


def collect(db: TuningDB, fingerprint_id: str | None, op: str | None = None,
            environment: dict[str, Any] | None = None) -> list[Group]:
    """The winners of one stored environment id, or (fingerprint_id None) those that apply
    in `environment`, grouped by op and static key."""
    groups: dict[tuple[str, str], Group] = {}
    for r in db.records(op=op, fingerprint_id=fingerprint_id, environment=environment):
        g = groups.setdefault((r.problem.op, r.problem.static_key),
                              Group(r.problem.op, r.problem.static_key, _label(r.problem.static_key), []))
        g.records.append(r)
    for g in groups.values():
        for i, r in enumerate(g.records):
            winner = canonical_json(r.config)
            kv_len = next((m.kv_len for m in db.measurements(r.problem, r.fingerprint_id)
                           if canonical_json(m.config) == winner), None)
            if kv_len is None and isinstance(r.method.get("kv_len"), int):  # a runtime-tuned record
                kv_len = r.method["kv_len"]
            if kv_len is not None:
                nbytes = _kv_bytes(g.static_key, r, kv_len)
                if nbytes is not None:
                    g.kv_bytes[i] = nbytes
    return list(groups.values())


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:120]


def _heatmaps(group: Group, values: dict[int, float], title: str, fmt: str, path: Path, center: float | None,
              limits: tuple[float, float] | None = None) -> None:
    """One heat map per query length: batch down, kv bucket across; colours centred on
    `center` (speedup 1.0) or spanning fixed `limits` (roofline 0..1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q_lens = sorted({r.problem.run_key.max_q_len for r in group.records})
    fig, axes = plt.subplots(1, len(q_lens), figsize=(5.5 * len(q_lens), 4.2), squeeze=False)
    finite = [v for v in values.values() if v is not None]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if center is not None:
        span = max(abs(hi - center), abs(center - lo), 1e-6)
        lo, hi = center - span, center + span
    if limits is not None:
        lo, hi = limits
    for ax, q in zip(axes[0], q_lens):
        rows = [(i, r) for i, r in enumerate(group.records) if r.problem.run_key.max_q_len == q]
        batches = sorted({r.problem.run_key.batch for _, r in rows})
        kvs = sorted({r.problem.run_key.kv_len_bucket for _, r in rows})
        grid = [[float("nan")] * len(kvs) for _ in batches]
        for i, r in rows:
            if values.get(i) is not None:
                grid[batches.index(r.problem.run_key.batch)][kvs.index(r.problem.run_key.kv_len_bucket)] = values[i]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=lo, vmax=hi, aspect="auto")
        for y, row in enumerate(grid):
            for x, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(x, y, fmt.format(v), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(kvs)), [f"{k:,}" for k in kvs], rotation=45, ha="right")
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("kv length (bucket top)")
        ax.set_ylabel("batch")
        ax.set_title(f"q len {q}")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(f"{group.op}: {title}\n{group.label}", fontsize=10)
    fig.tight_layout()
    png = io.BytesIO()  # saved by tuner.files, not by a path savefig would follow through a link
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_atomically(path, png.getvalue())


def write_report(db: TuningDB, out: Path, fingerprint_id: str | None, *, op: str | None = None,
                 bandwidth_gbps: float | None = None, environment: dict[str, Any] | None = None) -> list[Group]:
    """PNG heat maps and report.md under `out` for one environment id's winners, or (id
    None) those that apply in `environment`; returns the groups reported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise TunerError("tuner report draws with matplotlib: pip install 'tuner-attn[report]'") from None
    groups = collect(db, fingerprint_id, op, environment)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TunerError(f"cannot write the report to {out}: {e.strerror or e}") from None
    which = f"Environment `{fingerprint_id}`" if fingerprint_id else "Winners that apply in this environment"
    lines = ["# tuner report", "", f"{which}, DB `{db.display_url}`.", ""]
    if not groups:
        lines.append(f"No winners{f' of {op}' if op else ''} stored for this environment yet (`tuner sweep OP`).")
    for g in groups:
        stem = _slug(f"{g.op}__{g.label}")
        speedup = {i: r.speedup for i, r in enumerate(g.records)}
        _heatmaps(g, speedup, "speedup of the tuned config over the library default", "{:.2f}x",
                  out / f"{stem}__speedup.png", center=1.0)
        g.images.append(f"{stem}__speedup.png")
        roofline: dict[int, float] = {}
        if bandwidth_gbps and g.kv_bytes:  # no plot where no winner's kv length is known
            roofline = {i: g.kv_bytes[i] / (bandwidth_gbps * 1e3) / r.median_us
                        for i, r in enumerate(g.records) if i in g.kv_bytes and r.median_us}
            _heatmaps(g, roofline, f"fraction of the HBM roofline ({bandwidth_gbps:,.0f} GB/s)", "{:.0%}",
                      out / f"{stem}__roofline.png", center=None, limits=(0.0, 1.0))
            g.images.append(f"{stem}__roofline.png")
        gm = g.geomean
        lines += [f"## {g.op}: {g.label}", "",
                  f"{len(g.records)} winners; geometric-mean speedup over the default "
                  f"{'-' if gm is None else f'{gm:.3f}x'}.", ""]
        lines += [f"![{name}]({name})" for name in g.images] + [""]
        header = "| batch | q | kv <= | config | us | default us | speedup |" + (" roofline |" if roofline else "")
        lines += [header, "|" + "---|" * (header.count("|") - 1)]
        for i, r in enumerate(g.records):
            run = r.problem.run_key
            cells = [str(run.batch), str(run.max_q_len), f"{run.kv_len_bucket:,}",
                     "`" + canonical_json(r.config) + "`", f"{r.median_us:,.1f}",
                     "-" if r.default_median_us is None else f"{r.default_median_us:,.1f}",
                     "-" if r.speedup is None else f"{r.speedup:.2f}x"]
            if roofline:
                cells.append("-" if i not in roofline else f"{roofline[i]:.0%}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    write_atomically(out / "report.md", ("\n".join(lines) + "\n").encode("utf-8"))
    _remove_stale_plots(out, {name for g in groups for name in g.images})
    return groups


_PLOT_SUFFIXES = ("__speedup.png", "__roofline.png")


def _remove_stale_plots(out: Path, written: set[str]) -> None:
    """An earlier report's plots in `out` that this report did not draw: left there, they
    read as this report's (the directory is the report)."""
    for path in out.iterdir():
        if path.name.endswith(_PLOT_SUFFIXES) and path.name not in written and path.is_file():
            path.unlink(missing_ok=True)


def summary_rows(groups: list[Group]) -> list[tuple[str, str, int, Any, Any]]:
    return [(g.op, g.label, len(g.records), g.geomean, max(g.speedups, default=None)) for g in groups]
