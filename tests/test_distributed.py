"""torch.distributed on the CPU (gloo, 2 ranks): `torchrun ... -m tuner sweep` shares the
work and every rank ends with the same winners; runtime tuning under a process group
agrees on one winner and does not deadlock when only some ranks have a DB hit."""

import json
import multiprocessing
import os
import re
import subprocess
import sys

import torch

from tuner.db import TuningDB, current_fingerprint_id
from tuner.ops import get_op
from tuner.workload import DecodeShape
from tuner.sweep import candidate_configs

SMALL = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32")
SHAPES = [dict(batch=1, kv_len=512, **SMALL), dict(batch=2, kv_len=1024, **SMALL),
          dict(batch=3, kv_len=300, q_len=2, **SMALL)]


def _torchrun_sweep(tmp_path, shapes: list[dict], db_path, search: str, program: tuple[str, ...] = ("-m", "tuner"),
                    extra: tuple[str, ...] = (), **env_vars: str) -> tuple[list[tuple[str, str, str, str]], str]:
    """`tuner sweep` (or program's) under torchrun on 2 CPU ranks: each rank's (rank,
    winners, measured here, winners digest) line, and what the ranks printed."""
    shapes_file = tmp_path / "shapes.json"
    shapes_file.write_text(json.dumps(shapes))
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_vars)
    env.pop("TUNER_DB", None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         *program, "sweep", "torch_split_decode", "--shapes", str(shapes_file), "--db", str(db_path),
         "--repeats", "3", "--search", search, *extra],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = re.findall(r"rank (\d)/2: (\d+) winners, measured (\d+) here, winners digest (\w+)", result.stdout)
    assert sorted(int(r) for r, *_ in lines) == [0, 1], result.stdout
    return lines, result.stdout


def test_a_guided_torchrun_sweep_ends_with_one_set_of_winners_on_every_rank(tmp_path):
    """Guided search under ranks: each rank shortlists from the gathered first rung, which
    every rank reads before rank 0's later rungs overwrite it, so the ranks' shortlists (and
    round robins) agree."""
    shapes = [dict(batch=b, kv_len=512, **SMALL) for b in (1, 2, 3, 4)]
    lines, _ = _torchrun_sweep(tmp_path, shapes, tmp_path / "g.db", "guided")
    assert len({digest for *_, digest in lines}) == 1 and all(int(n) == 4 for _, n, _, _ in lines)


def test_torchrun_sweep_shares_the_work_and_every_rank_has_the_same_winners(tmp_path):
    db_path = tmp_path / "dist.db"
    lines, _ = _torchrun_sweep(tmp_path, SHAPES, db_path, "exhaustive")
    assert len({digest for *_, digest in lines}) == 1 and all(int(n) == 3 for _, n, _, _ in lines)
    op = get_op("torch_split_decode")
    shapes = [DecodeShape(**s) for s in SHAPES]
    total = sum(len(candidate_configs(op, s)) for s in shapes)
    measured = [int(m) for _, _, m, _ in lines]
    assert sum(measured) == total and min(measured) > 0  # shared, each config once
    db = TuningDB(db_path)
    assert len(db.records()) == 3 and db.counts()[current_fingerprint_id()]["measurements"] == total
    assert db.integrity() == []


RANK_FAULTS = (os.path.join(os.path.dirname(__file__), "support", "rank_faults.py"),)


def test_a_shape_one_rank_cannot_hold_is_failed_on_every_rank_and_the_sweep_goes_on(tmp_path):
    """A trial too big for one rank's free memory failed that rank's shape alone: it went on
    to the next shape while the others measured, and the ranks' collectives no longer
    matched (a hang, or one shape's measurements taken for another's). Now every rank fails
    the shape together and the rest is swept as before."""
    lines, output = _torchrun_sweep(tmp_path, SHAPES, tmp_path / "short.db", "exhaustive", program=RANK_FAULTS,
                                    SHORT_RANK="1", SHORT_BATCH="2")
    assert len({digest for *_, digest in lines}) == 1 and all(int(n) == 2 for _, n, _, _ in lines)
    assert "another rank could not build its trial" in output
    db = TuningDB(tmp_path / "short.db")
    assert sorted(r.problem.run_key.batch for r in db.records()) == [1, 3]


def test_a_forced_sweep_that_finds_no_winner_reports_none_on_every_rank(tmp_path):
    """Where no config ran right, rank 0 stores nothing: the other ranks read the DB's record
    from an earlier sweep and reported it as this sweep's winner (rank 0 too)."""
    db_path = tmp_path / "force.db"
    _torchrun_sweep(tmp_path, SHAPES, db_path, "exhaustive")
    lines, output = _torchrun_sweep(tmp_path, SHAPES, db_path, "exhaustive", program=RANK_FAULTS, extra=("--force",),
                                    BROKEN_BATCH="2")
    assert len({digest for *_, digest in lines}) == 1 and all(int(n) == 2 for _, n, _, _ in lines)
    assert "no config ran right" in output


# -- runtime tuning under a process group ----------------------------------------------------------

SERVER = multiprocessing.get_context("forkserver")


def _rank_main(rank, init_file, db_path, out_path):
    import torch.distributed as dist

    import tuner

    import tuner.bench.timer as timer_module

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    tuner.configure(db=db_path, mode="tune")
    now = [0]  # the timer's clock, faked: each call advances it by its cost (exact, and no sleeping)
    timer_module.time.perf_counter_ns = lambda: now[0]

    @tuner.autotune("dist_op", configs=[{"c": 0}, {"c": 1}, {"c": 2}], default={"c": 0},
                    static_key=lambda x: "k", run_key=lambda x: (x.shape[0], 1, 64))
    def op(x, *, config):
        now[0] += int({0: 0.004, 1: 0.003, 2: 0.0005}[config["c"]] * (1 + rank) * 1e9)  # c=2 is fastest everywhere
        return x * 2.0

    x = torch.ones(4)
    first = op(x)
    chosen = list(op.tuner.memo.values())
    op(x)  # a memo hit: no collective, no re-tuning
    with open(out_path, "w") as f:
        json.dump({"chosen": chosen, "ok": bool(torch.equal(first, x * 2.0))}, f)
    dist.barrier()
    dist.destroy_process_group()


def test_runtime_tuning_under_a_process_group_agrees_even_when_one_rank_has_a_db_hit(tmp_path):
    from tuner.bench import Timing
    from tuner.db import Problem, current_fingerprint
    from tuner.keys import attention_run_key, canonical_json

    # rank 0's DB already holds a winner for the call's key (c=1); rank 1's is empty
    hit = TuningDB(tmp_path / "rank0.db")
    hit.save_winner(Problem("dist_op", canonical_json("k"), attention_run_key(4, 1, 64)),
                    (current_fingerprint_id(), current_fingerprint()), {"c": 1}, Timing(3.0, 0.1, 5), {"c": 0},
                    Timing(4.0, 0.1, 5), method={})
    hit.close()
    procs = [SERVER.Process(target=_rank_main, args=(r, tmp_path / "pg_init", tmp_path / f"rank{r}.db",
                                                      tmp_path / f"out{r}.json")) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung: the ranks did not make the same collective calls"
    assert [p.exitcode for p in procs] == [0, 0]
    outs = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]
    assert outs[0]["chosen"] == outs[1]["chosen"] == [{"c": 2}] and all(o["ok"] for o in outs)
    # rank 0 stored the agreed winner over its stale hit; rank 1 stored nothing of its own
    assert [r.config for r in TuningDB(tmp_path / "rank0.db").records()] == [{"c": 2}]
    assert not (tmp_path / "rank1.db").exists() or TuningDB(tmp_path / "rank1.db").records() == []
