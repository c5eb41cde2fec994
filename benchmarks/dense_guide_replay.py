"""Replays a guided sweep's anchor searches offline over the measurements a DB stored: which
configs tuner.search.guided.Guide would have searched at each power-of-two anchor, and how
far the best of those is from the best of every config the DB holds for it. No GPU: the
times are the DB's (a re-ship DB's anchors searched every candidate, on the mix and, for
batch > 1, in a dense pass on dense batches alone).

    python benchmarks/dense_guide_replay.py --out replay.json reship_h4_1.db[.xz] ... [--lengths serving]

The anchors are replayed in a sweep's order (per static key and query length, batch then kv
length ascending). Each anchor's search is the Guide's shortlist of the configs the DB holds
for it (all of them, the library default first), with its winner (a dense pass's baseline,
searched by every pass); its fastest configs among those searched are recorded for the next,
as a sweep records its first rung (here each config's stored time: its full rung's where it
reached one). Only anchors whose pass searched every candidate are replayed (a pass the
guide shortlisted says so in its method). `--lengths serving` replays the mix's searches
instead (no winner forced). Prints one JSON line per variant (across_kv on and off); for dense
passes also the share of the gain over the winner that the shortlisted searches found, over
the anchors where the best config ran more than 1% ahead of the winner on dense batches.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from tuner.bench import OK, Outcome
from tuner.bench.timing import Timing
from tuner.db import TuningDB
from tuner.keys import canonical_json
from tuner.workload.shapes import DecodeShape
from tuner.search.guided import Guide, is_anchor

DENSE, MIX = "serving-dense", "serving"


def _parts(config: dict) -> tuple[dict, dict | None]:
    """A by_fill config's (dense part, other part); a plain one's (itself, None)."""
    if not any(k.startswith("dense.") for k in config):
        return config, None
    return ({k[6:]: v for k, v in config.items() if k.startswith("dense.")},
            {k[6:]: v for k, v in config.items() if k.startswith("other.")})


def _shape(static_key: dict, batch: int, q_len: int, kv_len: int) -> DecodeShape:
    shape = DecodeShape(batch=batch, kv_len=kv_len, q_len=q_len, num_q_heads=static_key["num_q_heads"],
                        num_kv_heads=static_key["num_kv_heads"], head_dim=static_key["head_dim_qk"],
                        page_size=static_key["page_size"], dtype=static_key["q_dtype"], lengths="serving")
    if canonical_json(json.loads(shape.static_key().to_json())) != canonical_json(static_key):
        raise SystemExit(f"a static key this replay cannot rebuild: {canonical_json(static_key)}")
    return shape


class Anchor(NamedTuple):
    shape: DecodeShape
    default: dict
    winner: str  # canonical JSON, as the keys of times
    times: dict[str, float]  # config -> stored time (a dense pass's: of by_fill(config, winner))


def anchors(db: Path, lengths: str, min_configs: int = 20) -> list[Anchor]:
    """The DB's anchors whose search covered every candidate: at least min_configs configs'
    times, and for a dense pass one the guide did not shortlist."""
    out = []
    with TuningDB(db, create=False) as tunings:
        for record in tunings.records():
            run, info = record.problem.run_key, record.method.get("dense_pass") or {}
            if not is_anchor(run.batch) or (lengths == DENSE and (run.batch < 2 or "measured" not in info
                                                                     or "shortlisted" in info)):
                continue
            dense_part, other = _parts(record.config)
            winner = canonical_json(other if other is not None else dense_part)
            times: dict[str, float] = {}
            for m in tunings.measurements(record.problem, record.fingerprint_id):
                if m.status != OK or m.method.get("lengths") != lengths:
                    continue  # failed, or timed on the other kind of batch
                part, m_other = _parts(m.config)
                if lengths == DENSE and (m_other is None or canonical_json(m_other) != winner):
                    continue  # a pass beside another winner
                times[canonical_json(part if lengths == DENSE else m.config)] = m.median_us
            if len(times) >= min_configs and (lengths != DENSE or winner in times):
                shape = _shape(json.loads(record.problem.static_key), run.batch, run.max_q_len, run.kv_len_bucket)
                out.append(Anchor(shape, record.default_config, winner, times))
    return out


def _order(anchor: Anchor) -> tuple:
    shape = anchor.shape
    return shape.static_key().to_json(), shape.q_len, shape.batch, shape.kv_len


def replay(found: list[Anchor], across_kv: bool, lengths: str, keep: int | None = None) -> dict:
    """found's searches as a Guide (across_kv, keep leaders) would have shortlisted them, in
    that order: how many configs they search, and the best found against the best of all."""
    guide = Guide(keep, across_kv=across_kv)
    losses, searched, every, shortlisted = [], 0, 0, 0
    gain_all = gain_found = 0.0  # ln(winner's time / best time) where a dense pass has >1% to find
    to_find = 0
    for shape, default, winner, times in found:
        configs = [default] + [json.loads(k) for k in times if k != canonical_json(default)]
        picked = {canonical_json(c) for c in guide.shortlist(shape, configs)}
        if lengths == DENSE:
            picked.add(winner)
        picked = sorted(picked & set(times))  # (a set's order would break ties between runs)
        if len(picked) < len(times):
            shortlisted += 1
            searched += len(picked)
            every += len(times)
            losses.append(min(times[k] for k in picked) / min(times.values()))
            if lengths == DENSE and times[winner] > 1.01 * min(times.values()):
                to_find += 1
                gain_all += math.log(times[winner] / min(times.values()))
                gain_found += math.log(times[winner] / min(times[k] for k in picked))
        guide.record(shape, [Outcome(json.loads(k), OK, Timing(times[k], 0.0, 1)) for k in picked])
    losses.sort()
    return dict(across_kv=across_kv, lengths=lengths, keep=guide.keep, anchors=len(found), shortlisted=shortlisted,
                configs_of_the_shortlisted=every, configs_searched_there=searched,
                best_found_over_best_geomean=math.exp(sum(map(math.log, losses)) / len(losses)) if losses else None,
                worst=losses[-1] if losses else None, over_1pct=sum(x > 1.01 for x in losses),
                over_2pct=sum(x > 1.02 for x in losses),
                **(dict(shortlisted_with_over_1pct_to_find=to_find,
                        share_of_the_gain_over_the_winner_found=gain_found / gain_all if gain_all else None)
                   if lengths == DENSE else {}))


def _sqlite(path: Path, scratch: Path) -> Path:
    if path.suffix != ".xz":
        return path
    plain = scratch / path.stem
    with lzma.open(path) as src, plain.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dbs", nargs="+", type=Path, help="re-ship DBs (SQLite files, or .xz of them)")
    ap.add_argument("--lengths", choices=(DENSE, MIX), default=DENSE, help="the dense passes' searches, or the mix's")
    ap.add_argument("--min-configs", type=int, default=20,
                    help="an anchor is replayed where the DB holds at least this many configs' times (default 20)")
    ap.add_argument("--keep", type=int, help="leaders an anchor hands on (default: settings.GUIDED_KEEP)")
    ap.add_argument("--out", type=Path, help="the JSON written (default: printed only)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        found: dict[tuple, Anchor] = {}
        for db in args.dbs:  # an anchor two DBs hold: the first one's
            for anchor in anchors(_sqlite(db, Path(scratch)), args.lengths, args.min_configs):
                found.setdefault(_order(anchor), anchor)
    ordered = [found[k] for k in sorted(found)]
    rows = [replay(ordered, across, args.lengths, args.keep) for across in (False, True)]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(dict(benchmark="dense_guide_replay", command=" ".join(["python", *sys.argv]),
                                            dbs=[p.name for p in args.dbs], rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
