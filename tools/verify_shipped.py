"""Re-check every winner of a sweep before it ships: per record, run the default and the
sweep's winner again (each checked against the torch reference), re-time them side by side
(the sweep's own winner rule, tuner.bench.decide; a record of a sweep's dense pass by its
rule, losing nowhere, its config checked and the default as the sweep checked it:
tuner.sweep.dense), and store what that decides, with this
machine's fingerprint, in a new DB. The shipped tunings are exported from that DB.

    python tools/verify_shipped.py --tunings sweep.tunings.json --db $OUT/verified.db \\
        --out $OUT/verified.json --seconds 500

--seed other than 0 re-times a serving winner on lengths drawn independently of the sweep's
(its trials' seed); --second-trial on the sweep's own second trial (tuner.sweep); --ops,
--heads, --max-batch, --batches and --challengers-only pick which records.

One worker per GPU (CUDA_VISIBLE_DEVICES, else every GPU torch sees), each taking every
n-th record. Resumable: records already in --db for this environment are not re-timed.
--out gets, per record, the sweep's and the re-timing's default and winner in us, and each
config's time on the re-timing's trial.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _records(args: argparse.Namespace) -> list[dict]:
    """The records to re-time: of --ops and --heads' head configurations, and (--challengers-only)
    only those whose winner is not the default, in a fixed order."""
    from shipped_sweeps import only_heads  # a sibling script

    from tuner.db.jsonio import load_document

    ops = set(args.ops.split(",")) if args.ops else None
    records = [r for r in load_document(args.tunings)["records"]
               if (ops is None or r["op"] in ops)
               and not (args.challengers_only and r["config"] == r["default"]["config"])
               and (args.max_batch is None or r["run_key"]["batch"] <= args.max_batch)
               and (not args.batches or r["run_key"]["batch"] in args.batches)]
    records = [r for r in records if only_heads([r["static_key"]], args.heads)]
    return sorted(records, key=lambda r: (r["op"], json.dumps(r["static_key"], sort_keys=True),
                                          sorted(r["run_key"].items())))


def worker(args: argparse.Namespace) -> None:
    import torch

    from tuner import settings
    from tuner.bench import boundary_sync, same_config, timer_for
    from tuner.db import Problem, TuningDB, current_environment
    from tuner.keys import AttentionRunKey, canonical_json
    from tuner.ops import get_op
    from tuner.workload.shapes import shape_from_keys
    from tuner.workload.traffic import draws_per_distribution
    from tuner.sweep.trials import build_second_trial, build_trial
    from tuner.bench import OK, Outcome
    from tuner.search.pipeline import confirm_again, measure
    from tuner.sweep import DENSE_RULE

    deadline = time.monotonic() + args.seconds
    records = _records(args)[args.part::args.parts]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try this script out
    timer = timer_for("verify-gpu" if device == "cuda" else "verify-cpu", device)
    env = current_environment()
    rows = []
    with TuningDB(args.db) as db:
        for r in records:
            if time.monotonic() > deadline:
                break
            static_json = canonical_json(r["static_key"])
            run = AttentionRunKey(**r["run_key"])
            problem = Problem(r["op"], static_json, run)
            if db.record(problem, env.id) is not None:
                continue
            op = get_op(r["op"])
            shape = shape_from_keys(static_json, run)
            # a winner swept on serving batches is re-timed on the same kind of batch
            lengths = r["method"].get("lengths", "full")
            shape = dataclasses.replace(shape, lengths=lengths)
            default = op.default(shape)
            configs = [default] if same_config(default, r["config"]) else [default, r["config"]]
            # the sweep's own trial and pipeline: each checked against the reference, re-timed side by side
            trial = (build_second_trial(op, shape, device, seed=args.seed) if args.second_trial
                     else build_trial(op, shape, device, seed=args.seed))
            dense_record = (r["method"].get("dense_pass") or {}).get("kept") is False and len(configs) == 2
            # the dense pass's rule (tuner.sweep.dense): its dense part's gain was
            # established on dense batches, which a mix dilutes; it must lose nowhere
            checked = confirm_again(trial, r["config"], default, timer, must_gain=False) if dense_record else None
            by_dense_rule = checked is not None and checked.default is not None  # else the winner rule says how it failed
            if by_dense_rule:
                outcomes = [Outcome(default, OK, checked.default), Outcome(r["config"], OK, checked.winner)]
                winner, default_timing = outcomes[1] if checked.held else outcomes[0], checked.default
            else:
                result = measure(trial, configs, default, timer, strategy="exhaustive")
                outcomes, winner, default_timing = result.outcomes, result.winner, result.default_timing
            del trial
            boundary_sync()
            row = {
                "op": r["op"], "shape": shape.label(), "run_key": r["run_key"],
                "sweep_winner": r["config"], "sweep_us": r["timing"]["median_us"],
                "sweep_default_us": r["default"]["median_us"],
                "default_matches_sweep": same_config(default, r["default"]["config"]),
                "outcomes": [{"config": o.config, "status": o.status, "error": o.error,
                              "median_us": o.timing and o.timing.median_us} for o in outcomes],
                **({"rule": f"{DENSE_RULE} (a dense-pass record)"} if by_dense_rule else {}),
                **({"dense_rule_error": checked.error} if checked is not None and checked.error else {}),
                # the equal-length guard's (winner, default) medians, where the dense rule timed one
                **({"guards_us": checked.guards_us} if checked is not None and checked.guards_us else {}),
            }
            rounds = draws_per_distribution(shape.batch)
            if winner is not None:
                db.save_winner(problem, env, winner.config, winner.timing, default, default_timing,
                               method=dict(timer.method, device=device, min_gain=settings.MIN_GAIN,
                                           kv_len=shape.kv_len, verified_from=r["method"], seed=args.seed,
                                           second_trial=args.second_trial,
                                           **({} if lengths == "full" else {"lengths": lengths}),
                                           # the trial's rounds of draws, as a sweep's method says them
                                           **({"rounds": rounds} if lengths != "full" and rounds > 1 else {}),
                                           # the dense pass over the winner kept: a sweep does not run it again
                                           **({"dense_pass": r["method"]["dense_pass"]}
                                              if "dense_pass" in r["method"] and same_config(winner.config, r["config"])
                                              else {})))
                row.update(winner=winner.config, winner_us=winner.timing.median_us,
                           default_us=default_timing and default_timing.median_us,
                           kept_sweep_winner=same_config(winner.config, r["config"]))
            rows.append(row)
            # after every record: a worker that dies keeps what it re-timed
            args.out.with_name(f"{args.out.name}.part{args.part}").write_text(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tunings", required=True, type=Path, help="the sweep's `tuner export` JSON")
    ap.add_argument("--db", required=True, help="the DB the re-checked records are written to (on a lent GPU "
                    "machine, under $OUT, or it is lost with the machine; tools/merge_reship.py reads it)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seconds", type=float, default=500.0)
    ap.add_argument("--seed", type=int, default=0,
                    help="the trials' seed: 0 re-times on the sweep's own draws of lengths; another (e.g. "
                         "1000003, the sweep's second trial) on lengths drawn independently of them")
    ap.add_argument("--second-trial", action="store_true",
                    help="re-time on the sweep's second trial of each shape (tuner.sweep.trials.build_second_trial: "
                         "lengths of the seed plus settings.SECOND_TRIAL_SEED, one batch at the bucket's top)")
    ap.add_argument("--max-batch", type=int, default=None, help="only records of batch sizes up to this")
    ap.add_argument("--batches", default=None, type=lambda text: {int(b) for b in text.split(",")},
                    help="only records of these batch sizes, comma-separated (a server benchmark's)")
    ap.add_argument("--heads", default=None, help="only these head configurations, Q/KV comma-separated")
    ap.add_argument("--ops", default=None, help="only these ops' records, comma-separated")
    ap.add_argument("--challengers-only", action="store_true",
                    help="only records whose winner is not the default (a default winner stays one)")
    ap.add_argument("--part", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--parts", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part is not None:
        return worker(args)
    from shipped_sweeps import gpus as visible_gpus  # the same GPU list as the sweeps (a sibling script)

    gpus = visible_gpus() or [""]  # no GPU: one worker on the CPU
    started = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--part", str(i), "--parts", str(len(gpus))],
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpu))
        for i, gpu in enumerate(gpus)
    ]
    codes = [p.wait() for p in procs]
    # a resumed run re-times only what is missing: keep the earlier runs' rows
    rows = json.loads(args.out.read_text()).get("rows", []) if args.out.exists() else []
    earlier = len(rows)
    for i in range(len(gpus)):
        part = args.out.with_name(f"{args.out.name}.part{i}")
        if part.exists():
            rows += json.loads(part.read_text())
            part.unlink()
    total = len(_records(args))
    doc = {
        "benchmark": "verify_shipped",
        "command": "python " + " ".join(sys.argv),
        "gpus": len(gpus),
        "seconds": round(time.monotonic() - started, 1),
        "worker_exit_codes": codes,
        "records_in": total,  # rows: every run's so far (resumed runs add theirs)
        "rows": rows,
    }
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"re-timed {len(rows) - earlier} records now ({len(rows)} of {total} in all) in {doc['seconds']} s "
          f"on {len(gpus)} GPUs; exit codes {codes}")


if __name__ == "__main__":
    main()
