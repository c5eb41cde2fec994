"""Run the sweeps behind the shipped tunings: tools/shapes/models_*.json, one process
per GPU, each GPU taking every n-th head configuration, all writing one DB.

    python tools/shipped_sweeps.py --db $OUT/shipped.db --logs $OUT --seconds 540 [--set serving]
        [--search guided] [--ops decode_attention] [--heads 32/8,8/1] [--batches 3,8,24] [--profile]

GPUs come from CUDA_VISIBLE_DEVICES (else every GPU torch sees). The sweeps are the CLI's
(`python -m tuner sweep OP --shapes ... --halving`), run in the order of SWEEPS in
models.py; they resume, so a run cut off by --seconds is finished by running it again.
Writes a JSON line per finished sweep (op, part, GPU, seconds, exit code, and the winners
the whole DB held before and after it: on one GPU, how far a run cut off got; on several,
all parts write the one DB at once) to LOGS/sweeps.jsonl. A sweep stopped at the deadline
gets SIGINT first, so it prints the shapes it finished into its log (and, under --profile,
which runs each sweep under cProfile into LOGS/part<N>.<op>.prof, writes the profile).
--set serving sweeps issue 12's serving grid: give it a DB of its own, since its keys are
the grid's and a DB holding the grid's winners keeps them (the sweeps run without --force,
so that they resume); its decode_attention sweeps leave FlashInfer out (--backends), as a
captured decode graph cannot hold its per-call plan.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "shapes"))
import models  # noqa: E402


def gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g.strip() for g in visible.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def head_config(shape: dict) -> tuple:
    return shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"]


def only_heads(shapes: list[dict], heads: str | None) -> list[dict]:
    """The shapes of the head configurations heads names ("Q/KV,...", e.g. "32/8,8/1"; None:
    all of them)."""
    if not heads:
        return shapes
    wanted = {tuple(int(n) for n in h.split("/")) for h in heads.split(",")}
    return [s for s in shapes if (s["num_q_heads"], s["num_kv_heads"]) in wanted]


def split(shapes: list[dict], parts: int) -> list[list[dict]]:
    """Every parts-th head configuration to each part, in file order (biggest first)."""
    order: list[tuple] = []
    for s in shapes:
        if head_config(s) not in order:
            order.append(head_config(s))
    return [[s for s in shapes if order.index(head_config(s)) % parts == i] for i in range(parts)]


# `python -m cProfile` exits 0 whatever its program's exit code: run the module under a
# profiler here, written however it ends, its SystemExit passed on (argv: profile, module, args)
PROFILED = ("import cProfile, runpy, sys\n"
            "out, module = sys.argv[1:3]\n"
            "sys.argv = [module] + sys.argv[3:]\n"
            "profile = cProfile.Profile()\n"
            "try:\n"
            "    profile.runcall(runpy.run_module, module, run_name='__main__', alter_sys=True)\n"
            "finally:\n"
            "    profile.dump_stats(out)\n")


def sweep_command(op: str, path: Path, args: argparse.Namespace, profile: Path | None = None) -> list[str]:
    python = [sys.executable] + (["-c", PROFILED, str(profile)] if profile else ["-m"])
    cmd = python + ["tuner", "sweep", op, "--shapes", str(path), "--search", args.search, "--db", args.db]
    if op == "decode_attention" and args.set == "serving":  # graphs cannot hold FlashInfer's plan
        cmd += ["--backends", "fa3,triton_decode"]
    return cmd


def stored_winners(db: str) -> int | None:
    """How many winners the DB holds (None before it exists)."""
    from tuner.db import TuningDB
    from tuner.errors import TunerError

    try:
        with TuningDB(db, create=False) as database:
            return sum(c["records"] for c in database.counts().values())
    except TunerError:
        return None


# a sweep stopped at the deadline: SIGINT first, so it prints what it finished (and a
# profile is written), then harder
STOP_SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # it ended on its own meanwhile
        pass


def stop(proc: subprocess.Popen, signals: list[int], grace: float = 20.0) -> None:
    """Each signal in turn to proc's process group, until it ends (the last: waited for)."""
    for sig in signals:
        _signal(proc, sig)
        try:
            proc.wait(timeout=grace if sig != signals[-1] else None)
            return
        except subprocess.TimeoutExpired:
            continue


def pass_sigint_on() -> None:
    """A run started in the background (`nohup ... &`) has SIGINT ignored, and its sweeps
    inherit that, so STOP_SIGNALS' first would not reach them. With Python's own handler here,
    each sweep gets SIGINT's default again (an exec resets a handled signal), and one stopped
    at the deadline still prints the shapes it finished."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--logs", required=True, type=Path)
    ap.add_argument("--seconds", type=float, default=540.0, help="stop every sweep after this long (resumable)")
    ap.add_argument("--set", choices=("grid", "serving"), default="grid",
                    help="grid: the shipped tunings' grids (models.SWEEPS); serving: issue 12's serving grid")
    ap.add_argument("--search", default="halving", help="the sweeps' search (tuner.search), e.g. guided for serving")
    ap.add_argument("--ops", help="only these ops' sweeps, comma-separated (e.g. decode_attention)")
    ap.add_argument("--heads", help="only these head configurations, Q/KV comma-separated (e.g. 32/8,8/1,28/4: "
                    "serving.py's shipped ones first; a later run without --heads resumes the rest)")
    ap.add_argument("--batches", help="only these batch sizes, comma-separated (e.g. serving.py's 3,8,24,64,136,256)")
    ap.add_argument("--dry-run", action="store_true", help="print each GPU's sweep commands, run nothing")
    ap.add_argument("--profile", action="store_true", help="each sweep under cProfile, into LOGS/part<N>.<op>.prof")
    args = ap.parse_args()
    pass_sigint_on()
    sweeps = models.SWEEPS if args.set == "grid" else models.SERVING_SWEEPS
    devices = gpus()
    if not devices:
        sys.exit("no GPU: the shipped sweeps run on CUDA GPUs")
    args.logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shipped-"))
    deadline = time.monotonic() + args.seconds
    scripts = []
    for part, gpu in enumerate(devices):
        steps = []
        for name, _, op in sweeps:
            if args.ops and op not in args.ops.split(","):
                continue
            shapes = only_heads(json.loads((HERE / "shapes" / name).read_text()), args.heads)
            if args.batches:
                shapes = [s for s in shapes if s["batch"] in {int(b) for b in args.batches.split(",")}]
            shapes = split(shapes, len(devices))[part]
            if not shapes:
                continue
            path = work / f"{part}.{op}.{name}"
            path.write_text(json.dumps(shapes))
            steps.append((op, path, name))
        scripts.append((part, gpu, steps))
    if args.dry_run:
        for part, gpu, steps in scripts:
            for op, path, name in steps:
                print(f"GPU {gpu}: {' '.join(sweep_command(op, path, args))}  # {len(json.loads(path.read_text()))} "
                      f"shapes of {name}")
        return

    results: list[dict] = []

    def run_part(part: int, gpu: str, steps: list) -> None:
        """This GPU's sweeps, one after another, each stopped at the deadline."""
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, PYTHONUNBUFFERED="1", COLUMNS="120")
        with open(args.logs / f"part{part}.log", "w") as log:
            for op, path, name in steps:
                left = deadline - time.monotonic()
                if left <= 1:
                    break
                profile = args.logs / f"part{part}.{op}.prof" if args.profile else None
                cmd = sweep_command(op, path, args, profile)
                before = stored_winners(args.db)
                t0 = time.monotonic()
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    rc = proc.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    stop(proc, STOP_SIGNALS)
                    rc = "stopped"
                results.append({"op": op, "shapes_file": name, "part": part, "gpu": gpu, "shapes": len(json.loads(path.read_text())),
                                "seconds": round(time.monotonic() - t0, 1), "rc": rc,
                                "db_winners_before": before, "db_winners_after": stored_winners(args.db)})

    threads = [threading.Thread(target=run_part, args=s) for s in scripts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(args.logs / "sweeps.jsonl", "a") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
            print(json.dumps(r))


if __name__ == "__main__":
    main()
