"""Does tuner's per-call pick keep its gain over FA3's default when the page table is laid out
as a server's allocator lays it out? Every trial of tuner's (sweeps, serving.py) times a
shuffled table; SGLang's token allocator gives a fresh batch runs of consecutive slots. Inside
SGLang at 8 x 32k tuner's graph variant ran about 4% slower than FA3 end to end, where its
sweep had timed the same config 1.15x faster (docs/decisions.md, "Graph variants").

    python benchmarks/page_layout.py --out $OUT/page_layout.json [--heads 32/8] [--batches 8,32] [--seconds 300]

Per case (a batch size, a kind of lengths, a power of two L): the record tuner's lookup gives
the call (the shipped tunings, or --db), resolved as an eager call resolves it (a by_fill
record's branch), against FA3's default, side by side in one interleaved CUDA-graph timing
(cold L2 by the bytes a call reads), on a shuffled and a contiguous table (PAGE_LAYOUTS), each
as wide as the call's longest sequence (as called) and as wide as the max context with that as
max_kv_len, without host lengths (as SGLang's decode graphs capture it: the "bound" columns,
which run the same eager pick: what the step's graph variant runs for a dense batch's class;
a wave_fit pick keeps its eager cap there, where a graph would replay its cap graph). Kinds of lengths: "equal", every
sequence at L + 1 (bench_one_batch's batches: one input length, then decode), and the serving
distributions "uniform" and "few_long" capped at 2L (the same kv bucket).
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

import torch
from common.heads import parse_spec

import tuner
from common.run_info import header
from common.stats import geomean

from tuner.bench import CudaGraphTimer
from tuner.bench.trial import cold_l2_copies
from tuner.integrations.decode_attention import decode_attention, eager_config
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.workload.inputs import PAGE_LAYOUTS
from tuner.workload.rotation import bytes_read, fresh_page_copies
from tuner.workload.traffic import draw_lengths

DEFAULT = {"backend": "fa3", "num_splits": 0, "pack_gqa": None}
SHIPPED = Path(__file__).resolve().parents[1] / "tuning_cache"
KINDS = ("equal", "uniform", "few_long")
TOPS = (4096, 16384, 32768, 65536)
WIDTHS = ("as_called", "bound")


def case_lengths(kind: str, batch: int, top: int, seed: int) -> list[int]:
    """A case's kv lengths: every sequence at top + 1 ("equal"), or a serving distribution's
    draw capped at 2 x top, whose longest falls in the same kv bucket as top + 1 (if the draw
    missed it, the longest is put at 2 x top)."""
    if kind == "equal":
        return [top + 1] * batch
    lengths = draw_lengths(kind, batch, 2 * top, seed)
    if max(lengths) <= top:
        lengths[lengths.index(max(lengths))] = 2 * top
    return lengths


def cases(batches: list[int], seed: int) -> list[tuple[int, str, int, list[int]]]:
    """(batch, kind, top, lengths) of a run, the longest contexts first (where attention is
    most of a decode step)."""
    return [(b, k, t, case_lengths(k, b, t, seed)) for t, b, k in itertools.product(TOPS[::-1], batches, KINDS)]


def _calls(heads: dict, lengths: list[int], layout: str, width: int, bound: bool, seed: int) -> list[tuple]:
    """decode_attention's positional arguments for each cold-L2 copy of the batch."""
    shape = DecodeShape(batch=len(lengths), kv_len=width if bound else max(lengths), dtype="bfloat16", **heads)
    inputs = make_decode_inputs(shape, device="cuda", seed=seed, seq_lens=lengths, table_width=width,
                                layout=layout)
    copies = fresh_page_copies(inputs, cold_l2_copies(bytes_read(inputs), "cuda"), shuffled=layout == "shuffled")
    s = shape
    return [(c.q, c.k_cache, c.v_cache, c.page_table, c.cache_seqlens, s.kv_len, s.causal, s.window,
             s.softcap or 0.0, c.sinks) for c in copies]


def run_case(heads: dict, lengths: list[int], max_context: int, timer: CudaGraphTimer, seed: int) -> dict:
    """The pick and FA3's default on each layout and table width, in one interleaved timing."""
    host = torch.tensor(lengths, dtype=torch.int32)
    called_width = -(-max(lengths) // 16) * 16
    probe = _calls(heads, lengths, "contiguous", called_width, False, seed)[0]
    record = decode_attention.tuner.config_for(*probe, seq_lens_host=host)
    pick = eager_config(record, *probe, seq_lens_host=host)
    del probe
    variants = [(layout, width) for layout in PAGE_LAYOUTS for width in WIDTHS]
    calls = {v: _calls(heads, lengths, v[0], called_width if v[1] == "as_called" else max_context,
                       v[1] == "bound", seed) for v in variants}
    rotations, errors = [], {}
    for v in variants:
        # in a graph (bound) the call has no host lengths, as a captured one has none
        kwargs = {} if v[1] == "bound" else {"seq_lens_host": host}
        for config in (DEFAULT, pick):
            rotations.append([lambda a=a, c=config, k=kwargs: decode_attention(*a, config=c, **k) for a in calls[v]])
        reference = decode_attention(*calls[v][0], config=DEFAULT, **kwargs).float()
        errors["/".join(v)] = float((decode_attention(*calls[v][0], config=pick, **kwargs).float()
                                     - reference).abs().max())
    us = [t.median_us for t in timer.interleaved(rotations)]
    eager = timer.last_capture_failed  # a call that cannot be captured was timed eagerly instead
    del calls, rotations
    torch.cuda.empty_cache()
    timed = {}
    for i, v in enumerate(variants):
        default_us, pick_us = us[2 * i], us[2 * i + 1]
        timed["/".join(v)] = dict(default_us=default_us, pick_us=pick_us, speedup=default_us / pick_us)
    return dict(record=record, pick=pick, timed=timed, max_error=errors, timed_eagerly=eager)


def summarize(rows: list[dict]) -> dict:
    """Per layout and width: the pick's geomean over FA3's default where it is not the default,
    and how many such cases ran slower by 2%; the same per kind of lengths (equal lengths are
    FA3's most even case, and a server benchmark's)."""
    tuned = [r for r in rows if r["pick"] != DEFAULT]
    out = {"cases": len(rows), "pick_not_default": len(tuned)}
    for v in itertools.product(PAGE_LAYOUTS, WIDTHS):
        name = "/".join(v)
        out[name] = _gains([r["timed"][name]["speedup"] for r in tuned])
        out[name]["by_kind"] = {kind: _gains([r["timed"][name]["speedup"] for r in tuned if r["kind"] == kind])
                                for kind in KINDS}
    return out


def _gains(speedups: list[float]) -> dict:
    return dict(cases=len(speedups), geomean=geomean(speedups), slower_by_2pct=sum(s < 1 / 1.02 for s in speedups),
                worst=min(speedups, default=None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--heads", default="32/8", help='one head configuration, Q/KV [hdD] ... (default 32/8: '
                    'Llama 3.1 8B at tp1)')
    ap.add_argument("--batches", default="8,32", help="batch sizes, comma-separated")
    ap.add_argument("--max-context", type=int, default=131072,
                    help="the bound's table width and max_kv_len (a server's max context)")
    ap.add_argument("--db", help="TUNER_DB for the lookup (default: the shipped tunings alone)")
    ap.add_argument("--seconds", type=float, default=300.0, help="stop starting cases after this long")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not args.db:  # elsewhere every lookup gives FA3's default, and the run times it against itself
        from tuner.db import current_fingerprint
        from tuner.db.shipped import load_shipped

        layer = load_shipped(current_fingerprint(), SHIPPED)
        if not layer.applied:
            ap.error("the shipped tunings do not apply here (" + "; ".join(
                why for f in layer.files for why in f.mismatches.values()) + "): give --db")
    # lookup only, over the checkout's shipped tunings (and --db): never a tune inside the timing
    tuner.configure(db=args.db or Path(tempfile.mkdtemp()) / "none.db", shipped=SHIPPED, mode="lookup")
    try:
        heads = parse_spec(args.heads)
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError as e:
        ap.error(str(e))
    started, rows = time.perf_counter(), []
    timer = CudaGraphTimer(warmup=2, repeats=15)
    for batch, kind, top, lengths in cases(batches, args.seed):
        if time.perf_counter() - started > args.seconds:
            break
        try:
            timed = run_case(heads, lengths, args.max_context, timer, args.seed)
        except torch.cuda.OutOfMemoryError as e:  # four layouts' pools at once: a large case may not fit
            print(f"b{batch} {kind} {top}: skipped ({str(e).splitlines()[0]})", flush=True)
            torch.cuda.empty_cache()
            continue
        row = dict(heads=args.heads, batch=batch, kind=kind, top=top, lengths=lengths, **timed)
        rows.append(row)
        print(f"b{batch} {kind} {top}: " + ", ".join(f"{k} {t['speedup']:.3f}" for k, t in row["timed"].items())
              + f"  ({json.dumps(row['pick'], sort_keys=True)})", flush=True)
        args.out.write_text(json.dumps({**header("page_layout", started), "summary": summarize(rows),
                                        "rows": rows}, indent=1))
    print(json.dumps(summarize(rows)))


if __name__ == "__main__":
    main()
