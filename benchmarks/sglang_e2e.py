"""SGLang's own offline benchmark (`sglang.bench_one_batch`: a static batch, prefill, then decode
steps in SGLang's CUDA graphs) with tuner's attention backend against SGLang's fa3, flashinfer
and triton backends, dummy weights from a public config.json, each backend in its own process.

    python benchmarks/sglang_e2e.py --out $OUT/sglang_e2e.json --model llama-3.1-8b \\
        [--backends tuner,fa3,flashinfer,triton] [--batches 1,8,32,128] \\
        [--input-lens 1024,4096,16384,32768] [--output-len 128] [--rounds 3] [--db graph.db] \\
        [--no-logits | --no-latency] [--layers N] [--lengths spread]
    python benchmarks/sglang_e2e.py ... --backends fa3,tuner,tuner-novariants \
        --step-latencies --step-timing --profile-steps 3     # where a step's time goes
    python benchmarks/sglang_e2e.py --merge A.json B.json ... --out all.json     # no GPU

Latency: per backend, input length and round, one bench_one_batch process (an out-of-memory
point costs that length only) over the batch sizes given, whose input and output fit the
model's context, a batch past MAX_PREFILL_TOKENS prefilled in parts of whole requests merged
into one decode batch (as SGLang's scheduler merges them), one past the KV cache skipped by
SGLang; its median decode latency and throughput per
(batch, input length), from its result file; decode graphs captured for those batch sizes only.
Lengths: bench_one_batch's own batches hold one prompt length (every request at the input
length), where FA3's scheduler is at its most even; --lengths spread gives each request its
own, drawn from the serving distribution "uniform" (in [input length / 2, input length],
seeded, the same for every backend), through bench_one_batch's --prompt-filename (a prompt of
N words is N tokens to the dummy tokenizer), as a server's batches hold mixed lengths.
Rounds, because one backend's median decode throughput moves by up to +-5% from one process to
the next (fa3 at 8 x 4096 on the H200: 1204, 1126 and 1105 tokens/s), more than the differences
sought: round r runs every backend's workers once, the backends' order rotated to start at the
r-th, so that neighbours in time alternate. The summary, per (batch, input length): BACKEND is
the median over its rounds of its median decode throughput, BACKEND_rounds its values in round
order, spread their max/min; tuner_over_best is tuner's median over the best built-in backend's
(by medians), and tuner_over_best_by_round their ratio within each round (neighbours in time, so
the pairs share the machine's drift); step_floor the step's bytes at the card's nominal bandwidth
and, with --profile-steps, each backend's attention kernels per step and attention_bound: the
most any attention kernel could raise the best built-in backend's throughput. A worker's time is
mostly startup, hence 128 decode steps each by default. Logits, after the rounds: per backend,
one worker, the first decode steps of one small batch (fixed token ids fed at every step, so
every backend decodes the same inputs), with the dummy weights drawn again, seeded, at scales
where attention shows in the logits (the dummy load format's uniform +-1e-3 makes every attention
uniform), each step copied out as it comes (SGLang's graphs return views of one shared buffer);
compared with the fa3 backend's relative to their largest magnitude, the built-in backends' own
differences being the noise floor. The logits go beside --out (ITS_NAME.BACKEND.logits.pt). The
tuner backend is SGLang's FA3 backend whose plain decode runs decode_attention
(tuner.integrations.sglang), registered in
the worker process before SGLang parses its arguments, with its graph-variant hooks (SGLang's
decode graphs, one per config set the per-call records name, picked per step); --db is its
TUNER_DB, over the shipped tunings (a new key's records: `tuner sweep decode_attention --grid
serving --model M`; graph records for the base graphs: `... decode_attention_graph ...`). The
JSON is written after every worker, its result files kept beside it (ITS_NAME.work/,
BACKEND.LEN.jsonl for round 0, BACKEND.LEN.rR.jsonl after), its exit codes by LEN for round 0
(as files written before rounds read) and LEN#R after, each row with its round, and each
worker's seconds; no worker starts where what is left before --deadline is less than the longest
worker so far took, and one still running at --deadline is stopped (a device call must end);
--resume keeps each (length, round) that ran and runs the rest, and --merge
joins the JSON of several runs per (length, round) (one backend, or its latency alone, a device
call, say). Needs SGLang, its dependencies and a GPU: `bash tools/prepare_sglang.sh` here, then
on the GPU machine `bash .gpu/sglang/install` after the staging of ../shared/gpu/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from common.run_info import header
from common.sglang_logs import (capture_cost, graph_plans, judge_verdicts, profile_summaries, skipped_batches,
                                step_latencies)
from common.sglang_models import (CONFIGS, MAX_PREFILL_TOKENS, PREFILL_MARGIN, gpu_memory_gb, mem_fraction,
                                  write_model_dir)
from common.sglang_step_timing import ENV as STEP_TIMING_ENV
from common.sglang_step_timing import install as install_step_timing
from common.sglang_step_timing import install_own as install_own_step_timing
from common.sglang_step_timing import medians_text, step_timings
from common.step_floor import step_floor

BUILT_IN = ("fa3", "flashinfer", "triton")
TIMED_OUT = 124  # a worker's exit code past --timeout (as timeout(1) gives)
NOT_STARTED = "not run: --deadline"
STOPPED_AT_DEADLINE = "stopped at --deadline"  # (--resume runs it again, as one not started)
MIN_WORKER_S = 30  # no worker starts with less time left than this (SGLang's start-up alone takes longer)
# tuner's workers under other settings, beside the plain one in the same run (a diagnosis of
# what a step costs: its graph variants, its replay judge), or with its FlashInfer graph variant
# (off by default until measured): backend label -> the worker's environment
TUNER_SETTINGS = {"tuner": {}, "tuner-novariants": {"TUNER_GRAPH_VARIANTS": "0"},
                  "tuner-nojudge": {"TUNER_REPLAY_JUDGE": "0"}, "tuner-flashinfer": {"TUNER_SGLANG_FLASHINFER": "1"}}
LOGITS_BATCH, LOGITS_INPUT, LOGITS_STEPS = 4, 2048, 4
# a latency worker's backend, for the TP ranks bench_one_batch spawns (prepare_rank)
RANK_SETUP = "TUNER_E2E_RANK_SETUP"
# SGLang 0.5.17 captures 58 prefill graphs in every worker (9 s; 65 s on a fresh machine, compiling),
# which bench_one_batch's decode steps never replay: left out unless --prefill-graphs
NO_PREFILL_GRAPHS = "--disable-prefill-cuda-graph"
OPTIONAL_FLAGS = (NO_PREFILL_GRAPHS,)  # dropped where the installed SGLang does not know them


class UsageError(ValueError):
    """Arguments that do not fit what --out or --merge's files hold (one line, exit 2)."""


def bench_argv(model_dir: Path, backend: str, batches: list[int], input_len: int, args: argparse.Namespace,
               result: Path) -> list[str]:
    """SGLang's arguments for bench_one_batch's latency test of one input length, its decode
    graphs captured for these batch sizes only; with --lengths spread, its prompts file."""
    sizes = [str(b) for b in batches]
    graphs = [] if args.capture_bs == "default" else ["--cuda-graph-bs-decode", *sizes]
    prompts = []
    if getattr(args, "lengths", "equal") == "spread":
        path = result.parent / f"prompts.{input_len}.txt"
        path.write_text("".join(" ".join(["a"] * n) + "\n" for n in spread_lengths(max(batches), input_len)))
        prompts = ["--prompt-filename", str(path)]
    prefill_graphs = [] if getattr(args, "prefill_graphs", False) else [NO_PREFILL_GRAPHS]
    return ["--model-path", str(model_dir), "--load-format", "dummy", "--attention-backend", attention_backend(backend),
            "--batch-size", *sizes, "--input-len", str(input_len), "--output-len", str(args.output_len),
            "--result-filename", str(result), "--run-name", backend, "--mem-fraction-static", str(args.mem_fraction),
            *(["--tp-size", str(args.tp)] if getattr(args, "tp", 1) > 1 else []), *graphs, *prompts,
            *prefill_graphs]


def bench_parser() -> argparse.ArgumentParser:
    """bench_one_batch's own command line: SGLang's server arguments and its benchmark's."""
    from sglang.benchmark import one_batch
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    one_batch.BenchArgs.add_cli_args(parser)
    return parser


def known_to_sglang(argv: list[str]) -> list[str]:
    """argv without the optional flags (NO_PREFILL_GRAPHS) that the installed SGLang's parser
    does not know (before 0.5.17's per-phase graphs, say): such a SGLang has no prefill graphs
    to leave out, and would refuse the flag."""
    known = {flag for action in bench_parser()._actions for flag in action.option_strings}
    return [a for a in argv if a not in OPTIONAL_FLAGS or a in known]


def attention_backend(label: str) -> str:
    """SGLang's --attention-backend for a backend label (tuner's TUNER_SETTINGS labels: "tuner")."""
    return "tuner" if label in TUNER_SETTINGS else label


def diagnosis_argv(args: argparse.Namespace) -> list[str]:
    """bench_one_batch's own flags for --step-latencies (every decode step's latency in its
    log) and --profile-steps (a torch profiler trace of that many steps halfway through)."""
    every_step = getattr(args, "step_latencies", False) or getattr(args, "step_timing", False)
    argv = ["--log-decode-step", "1"] if every_step else []
    if getattr(args, "profile_steps", 0):
        argv += ["--profile", "--profile-stage", "decode", "--profile-steps", str(args.profile_steps),
                 "--profile-activities", "CPU", "GPU"]
    return argv


# --lengths spread draws this many prompt lengths per input length, whatever the run's batch
# sizes, and a batch of B takes the first B: so a (batch, length) point gets the same prompts
# in every run, and runs with other --batches merge
SPREAD_DRAWS = 256


def spread_lengths(batch: int, input_len: int) -> list[int]:
    """The first `batch` prompt lengths under --lengths spread: the serving distribution
    "uniform" (in [input_len / 2, input_len]), SPREAD_DRAWS of them seeded by the length alone;
    bench_one_batch takes the first B of the file's for a batch of B."""
    from tuner.workload.traffic import draw_lengths

    if batch > SPREAD_DRAWS:
        raise UsageError(f"--lengths spread draws {SPREAD_DRAWS} prompts: batch {batch} is larger")
    return draw_lengths("uniform", SPREAD_DRAWS, input_len, seed=0)[:batch]


def latency_points(model: str, batches: list[int], input_lens: list[int], output_len: int) -> list[tuple[int, list]]:
    """(input length, its batch sizes) to run: requests of at most MAX_PREFILL_TOKENS, input and
    output within the model's context (SGLang sizes its tables by it and checks no length). A
    batch past the KV cache SGLang skips itself ("due to max batch size limit")."""
    context = CONFIGS[model]["max_position_embeddings"]
    return [(n, list(batches)) for n in input_lens if n <= MAX_PREFILL_TOKENS and n + output_len <= context]


def unfit_input_lens(model: str, input_lens: list[int], output_len: int) -> str | None:
    """Why latency_points leaves out an input length the command asked for (one line), or None."""
    kept = {n for n, _ in latency_points(model, [1], input_lens, output_len)}
    for n in input_lens:
        if n in kept:
            continue
        if n > MAX_PREFILL_TOKENS:
            return f"--input-lens {n}: one request past one prefill ({MAX_PREFILL_TOKENS} tokens)"
        context = CONFIGS[model]["max_position_embeddings"]
        longer = [name for name, c in CONFIGS.items() if c["max_position_embeddings"] >= n + output_len
                  and name.startswith(model)]
        return (f"--input-lens {n}: with --output-len {output_len} past {model}'s context of {context} tokens"
                + (f" (--model {longer[0]} has the same heads and a longer one)" if longer else ""))
    return None


def prefill_parts(input_lens: list[int], max_tokens: int) -> list[range]:
    """Consecutive runs of requests, each of at most max_tokens input tokens (a longer request
    alone), in order."""
    parts, start, tokens = [], 0, 0
    for i, n in enumerate(input_lens):
        if i > start and tokens + n > max_tokens:
            parts.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    return parts + [range(start, len(input_lens))] if input_lens else parts


def prefill_in_parts(extend, max_tokens: int = MAX_PREFILL_TOKENS):
    """bench_one_batch's extend(reqs, model_runner), prefilling the requests in parts of at most
    max_tokens and merging the parts' batches into one (ScheduleBatch.merge_batch, as SGLang's
    scheduler joins a prefilled batch to the running one), so that the decode steps measured
    run one batch of them all, at contexts a one-forward prefill cannot reach."""

    def run(reqs, model_runner):
        parts = prefill_parts([len(r.origin_input_ids) for r in reqs], max_tokens)
        if len(parts) == 1:
            return extend(reqs, model_runner)
        import torch

        ids, logits, batch = extend([reqs[i] for i in parts[0]], model_runner)
        for part in parts[1:]:
            more_ids, more_logits, more = extend([reqs[i] for i in part], model_runner)
            batch.merge_batch(more)
            ids, logits = torch.cat([ids, more_ids]), torch.cat([logits, more_logits])
        return ids, logits, batch

    run.in_parts = True
    return run


def latency_key(input_len: int, rnd: int) -> str:
    """exit_codes' key of one worker: the input length for round 0 (so files written before
    rounds existed read as round 0), LEN#R for round R."""
    return str(input_len) if rnd == 0 else f"{input_len}#{rnd}"


def row_key(row: dict) -> str:
    """The worker a result row came from (rows of files written before rounds: round 0)."""
    return latency_key(row["input_len"], row.get("round", 0))


def rotated(backends: list[str], rnd: int) -> list[str]:
    """Round rnd's order: the backends as given, starting at the rnd-th, so that no backend
    always runs right after the same one (a machine's drift would favour one of a pair)."""
    start = rnd % len(backends)
    return backends[start:] + backends[:start]


def summarize(rows: dict[str, list[dict]]) -> list[dict]:
    """Per (batch, input length), from each backend's median decode throughput per round:
    summary_entry's figures."""
    rounds: dict[tuple[int, int], dict[str, dict[int, float]]] = {}
    for backend, results in rows.items():
        for r in results:
            by_backend = rounds.setdefault((r["batch_size"], r["input_len"]), {})
            values = by_backend.setdefault(backend, {})
            if r.get("median_decode_throughput"):
                values[r.get("round", 0)] = r["median_decode_throughput"]
    return [summary_entry(batch, input_len, rounds[batch, input_len]) for batch, input_len in sorted(rounds)]


def summary_entry(batch: int, input_len: int, rounds: dict[str, dict[int, float]]) -> dict:
    """Each backend's median over its rounds (under its name, as before rounds existed) and its
    values in round order; tuner's median (and each TUNER_SETTINGS label's) over the best
    built-in backend's (by medians) and, within each round both ran, tuner's over that
    backend's (neighbours in time); each backend's max/min over its rounds, where it has two
    or more."""
    entry: dict = {"batch": batch, "input_len": input_len}
    for backend, values in rounds.items():
        entry[backend] = statistics.median(values.values()) if values else None
        entry[f"{backend}_rounds"] = [values[r] for r in sorted(values)]
    built_in = {b: entry[b] for b in BUILT_IN if entry.get(b)}
    if built_in and any(entry.get(label) for label in TUNER_SETTINGS):
        best = entry["best_built_in"] = max(built_in, key=built_in.get)
        for label in TUNER_SETTINGS:  # tuner, and tuner under another setting, against the same backend
            if entry.get(label):
                entry[f"{label}_over_best"] = entry[label] / built_in[best]
        if entry.get("tuner"):
            tuner, other = rounds["tuner"], rounds[best]
            entry["tuner_over_best_by_round"] = {str(r): tuner[r] / other[r] for r in sorted(tuner) if r in other}
    spread = {b: max(v.values()) / min(v.values()) for b, v in rounds.items() if len(v) >= 2}
    if spread:
        entry["spread"] = spread
    return entry


def logits_agreement(reference, other) -> float:
    """max |a - b| over max |a|, over every step's logits."""
    return float((other.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-30))


def run_worker(mode: str, backend: str, argv: list[str], logits_out: Path | None, db: str | None,
               log: Path, timeout_s: float, extra_env: dict[str, str] | None = None) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # nothing on this path needs a network
    env.update(TUNER_SETTINGS.get(backend, {}), **(extra_env or {}))
    if db:
        env["TUNER_DB"] = db
    command = [sys.executable, __file__, "--worker", mode, "--worker-backend", backend,
               *(["--worker-logits", str(logits_out)] if logits_out else []), "--", *argv]
    with log.open("a") as out:
        try:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return TIMED_OUT


def reinit_weights(model) -> None:
    """The dummy weights drawn again, in place (captured graphs keep reading them), seeded by
    parameter name so every backend's process draws the same: norms 1, biases 0, embeddings
    N(0, 1), other matrices N(0, 1/fan_in), so attention scores are of order 1 and a wrong
    attention output shows in the logits."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
                continue
            generator = torch.Generator(device=param.device).manual_seed(zlib.crc32(name.encode()))
            std = 1.0 if "embed" in name else param.shape[-1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=generator, device=param.device) * std)


def worker(mode: str, backend: str, logits_out: str | None, argv: list[str]) -> None:
    """In its own process: SGLang's benchmark (mode "latency") or the first decode steps'
    logits of one small batch (mode "logits"), with the tuner backend registered (bench_one_batch
    loads no plugins, and tuner is not installed where it runs from a checkout)."""
    if mode == "latency":  # (its TP ranks, spawned, set themselves up alike: prepare_rank)
        os.environ[RANK_SETUP] = backend
    prepare_rank(backend)
    from sglang.benchmark import one_batch

    argv = known_to_sglang(argv)
    sys.argv = ["bench_one_batch", *argv]
    if mode == "latency":
        one_batch.cli_main()
        return
    import numpy as np
    import torch
    from sglang.srt.server_args import PortArgs, ServerArgs

    server_args = ServerArgs.from_cli_args(bench_parser().parse_args(argv))
    if hasattr(one_batch, "_set_envs_and_config"):  # as the benchmark's own main() does first
        one_batch._set_envs_and_config(server_args)
    runner, _ = one_batch.load_model(server_args, PortArgs.init_new(server_args), 0, 0)
    reinit_weights(runner.torch_runner.model)
    np.random.seed(0)
    reqs = one_batch.prepare_synthetic_inputs_for_latency_test(LOGITS_BATCH, LOGITS_INPUT)
    _, logits, batch = runner.extend(reqs)
    graph_runner = getattr(runner.torch_runner, "decode_cuda_graph_runner", None)
    steps = [logits.to("cpu", torch.float32, copy=True)]  # copied now: the next step overwrites the buffer it views
    replayed = []
    for step in range(LOGITS_STEPS):  # the same token ids for every backend, not its own samples
        ids = torch.full((LOGITS_BATCH,), 100 + step, dtype=torch.int64, device=logits.device)
        _, logits = runner.decode(ids, batch)
        steps.append(logits.to("cpu", torch.float32, copy=True))
        replayed.append(_graph_label(getattr(graph_runner, "_replay_graph_key", None)))
    torch.save(torch.stack(steps), logits_out)
    graphs = getattr(getattr(graph_runner, "backend", None), "_graphs", {})  # SGLang's graphs by ShapeKey
    # tuner's FlashInfer variants by batch size (this worker configures no logging: its plan lines are lost)
    flashinfer = getattr(getattr(runner.torch_runner, "attn_backend", None), "tuner_flashinfer_labels", {})
    Path(f"{logits_out}.graphs.json").write_text(json.dumps(dict(
        captured=sorted({(key.size, _graph_label(key)) for key in graphs}, key=lambda k: (k[0], str(k[1]))),
        replayed=replayed, flashinfer_labels=sorted(set(flashinfer.values())))))


def prepare_rank(backend: str) -> None:
    """What a latency worker's process needs before SGLang runs in it: the tuner backend
    registered (backend "tuner"), and bench_one_batch's prefill in parts."""
    # (SGLang's own load_batch timed inside tuner's hooks, the whole step outside them)
    timer = install_own_step_timing() if os.environ.get(STEP_TIMING_ENV) else None
    if attention_backend(backend) == "tuner":
        from tuner.integrations.sglang import register

        register()
    from sglang.benchmark import one_batch

    if not getattr(one_batch.extend, "in_parts", False):
        one_batch.extend = prefill_in_parts(one_batch.extend)  # its runner calls the module's extend
    if timer is not None:
        install_step_timing(timer)


def _graph_label(key) -> str | None:
    """A decode graph's variant label (SGLang's ShapeKey), None for a batch size's own graph."""
    return getattr(key, "variant_label", None)


def logits_path(out: Path, backend: str) -> Path:
    return out.with_name(f"{out.stem}.{backend}.logits.pt")


class Run:
    """One invocation's results, written to --out after every worker (a device call may end
    mid-backend); with --resume, what --out holds: each (input length, round) that ran (exit 0)
    and each logits file a worker finished are kept."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out, self.started = args, out, time.perf_counter()
        doc = json.loads(out.read_text()) if args.resume and out.exists() else {}
        if doc and doc.get("capture_bs", "run") != args.capture_bs:
            raise UsageError(f"--resume: {out} captured --capture-bs {doc.get('capture_bs', 'run')}, not "
                             f"{args.capture_bs}: its capture costs would not compare")
        self.results: dict[str, dict] = doc.get("results", {})
        self.logits_files = {b: out.parent / name for b, name in doc.get("logits_files", {}).items()}

    def left_s(self) -> float:
        return self.args.deadline - (time.perf_counter() - self.started)

    def may_start(self) -> bool:
        """Whether a worker may start: before --deadline, with time left for as long as the
        longest worker so far took (at least MIN_WORKER_S), since one running at the deadline
        is stopped and what it did is lost."""
        took = [s for r in self.results.values() for part in (r, r.get("latency", {}))
                for s in part.get("worker_seconds", {}).values()]
        return self.left_s() >= max([MIN_WORKER_S, *took])

    def timed_worker(self, entry: dict, key: str, start: Callable[[float], int | str]) -> int | str:
        """start(timeout_s), its seconds kept in entry["worker_seconds"][key]; a worker stopped
        because --deadline came before its --timeout is recorded as such, not as a timeout."""
        timeout_s = min(self.args.timeout, self.left_s())
        began = time.perf_counter()
        code = start(timeout_s)
        entry.setdefault("worker_seconds", {})[key] = round(time.perf_counter() - began, 1)
        if code == TIMED_OUT and timeout_s < self.args.timeout:
            return STOPPED_AT_DEADLINE
        return code

    def log(self, backend: str) -> Path:
        return self.out.with_suffix(f".{backend}.log")

    def save(self) -> dict:
        doc = document(self.args, self.started, self.results, self.logits_files, self.out)
        self.out.write_text(json.dumps(doc, indent=1))
        return doc


def run_latency(run: Run, backend: str, rnd: int, input_len: int, batches: list[int], model_dir: Path,
                work: Path) -> None:
    """One bench_one_batch worker, unless this (input length, round) already ran: its exit code,
    and the rows of its result file, each with its round."""
    latency = run.results.setdefault(backend, {}).setdefault("latency", dict(exit_codes={}, rows=[]))
    key = latency_key(input_len, rnd)
    if latency["exit_codes"].get(key) == 0:
        return
    if not run.may_start():
        latency["exit_codes"][key] = NOT_STARTED
        return
    result = work / (f"{backend}.{input_len}.jsonl" if rnd == 0 else f"{backend}.{input_len}.r{rnd}.jsonl")
    result.unlink(missing_ok=True)
    argv = bench_argv(model_dir, backend, batches, input_len, run.args, result) + diagnosis_argv(run.args)
    log = run.log(backend)
    logged = log.stat().st_size if log.exists() else 0
    traces = work / f"profile.{backend}.{key.replace('#', '.r')}"  # (--profile-steps)
    extra_env = dict(SGLANG_TORCH_PROFILER_DIR=str(traces))
    if getattr(run.args, "step_timing", False):
        extra_env[STEP_TIMING_ENV] = "1"
    code = run.timed_worker(latency, key, lambda timeout_s: run_worker(
        "latency", backend, argv, None, run.args.db, log, timeout_s, extra_env=extra_env))
    latency["exit_codes"][key] = code
    with log.open("rb") as text:  # this worker's part of the backend's log
        text.seek(logged)
        worker_log = text.read().decode(errors="replace")
    capture = capture_cost(worker_log)
    latency.setdefault("capture", {}).pop(key, None)  # an earlier attempt's, if any
    if capture is not None:
        latency["capture"][key] = capture
    latency.setdefault("judge_verdicts", {})[key] = judge_verdicts(worker_log)
    latency.setdefault("skipped", {})[key] = skipped_batches(worker_log)
    latency.setdefault("graph_plans", {})[key] = graph_plans(worker_log)
    if getattr(run.args, "step_latencies", False):
        latency.setdefault("steps", {})[key] = step_latencies(worker_log)
    if getattr(run.args, "step_timing", False):
        latency.setdefault("step_timing", {})[key] = timed = step_timings(worker_log)
        for batch, t in timed.items():
            print(f"step timing {backend} b{batch} L{input_len}: {medians_text(t)}", flush=True)
    if getattr(run.args, "profile_steps", 0):
        latency.setdefault("profile", {})[key] = profiled = profile_summaries(traces, run.args.profile_steps)
        for batch, p in profiled.items():
            if "error" in p:
                print(f"profile {backend} b{batch} L{input_len}: unreadable ({p['error']})", flush=True)
                continue
            print(f"profile {backend} b{batch} L{input_len}: per step GPU busy {p['gpu_busy_us']:.0f} us (attention "
                  f"{p['attention_us']:.0f} us), idle "
                  f"{p['gpu_idle_us']:.0f} us, {p['gpu_ops']:.0f} GPU ops, {p['graph_launches']:.1f} graph launches "
                  f"({p['graph_launch_host_us']:.0f} us on the host)", flush=True)
    rows = [json.loads(line) for line in result.read_text().splitlines()] if result.exists() else []
    latency["rows"] = [r for r in latency["rows"] if row_key(r) != key] + [dict(r, round=rnd) for r in rows]
    run.save()
    print(f"round {rnd}, {backend}, input length {input_len}: exit {code}", flush=True)


def run_rounds(run: Run, backends: list[str], model_dir: Path, work: Path) -> None:
    """Every round's latency workers, each input length's backends one after another in the
    round's order, so that the workers compared in a round are neighbours in time."""
    args = run.args
    batches = [int(b) for b in args.batches.split(",")]
    points = latency_points(args.model, batches, [int(n) for n in args.input_lens.split(",")], args.output_len)
    for rnd in range(args.rounds):
        for input_len, fits in points:
            for backend in rotated(backends, rnd):
                run_latency(run, backend, rnd, input_len, fits, model_dir, work)


def run_logits(run: Run, backend: str, model_dir: Path, work: Path) -> None:
    """The logits worker, unless its file is already here from a worker that finished."""
    entry = run.results.setdefault(backend, {})
    path = logits_path(run.out, backend)
    if entry.get("logits_exit_code") == 0 and path.exists():
        return
    if not run.may_start():  # as a latency worker (--resume runs it later)
        entry["logits_exit_code"] = NOT_STARTED
        run.save()
        return
    path.unlink(missing_ok=True)  # a worker that fails must not be scored on an older file
    Path(f"{path}.graphs.json").unlink(missing_ok=True)
    argv = bench_argv(model_dir, backend, [LOGITS_BATCH], LOGITS_INPUT, run.args, work / "logits.jsonl")
    code = run.timed_worker(entry, "logits", lambda timeout_s: run_worker(
        "logits", backend, argv, path, run.args.db, run.log(backend), timeout_s))
    entry["logits_exit_code"] = code
    if code == 0 and path.exists():
        run.logits_files[backend] = path
        graphs = Path(f"{path}.graphs.json")  # the decode graphs SGLang captured, and those it replayed
        if graphs.exists():
            entry["decode_graphs"] = json.loads(graphs.read_text())
    run.save()


def agreements(logits_files: dict[str, Path]) -> dict[str, float]:
    """Each backend's logits against fa3's (relative max error), where both files are here."""
    present = {b: f for b, f in logits_files.items() if f.exists()}
    if "fa3" not in present:
        return {}
    import torch

    reference = torch.load(present["fa3"])
    return {b: logits_agreement(reference, torch.load(f)) for b, f in present.items() if b != "fa3"}


def document(args: argparse.Namespace, started: float, results: dict, logits_files: dict[str, Path],
             out: Path) -> dict:
    config = dict(CONFIGS[args.model], **({"num_hidden_layers": args.layers} if args.layers else {}))
    doc = dict(header("sglang_e2e", started), model=args.model, config=config,
                batches=args.batches, input_lens=args.input_lens, output_len=args.output_len, rounds=args.rounds,
                capture_bs=getattr(args, "capture_bs", "run"), lengths=getattr(args, "lengths", "equal"),
                max_prefill_tokens=MAX_PREFILL_TOKENS, mem_fraction=getattr(args, "mem_fraction", None),
                tp=getattr(args, "tp", 1), prefill_graphs=getattr(args, "prefill_graphs", False), results=results,
                logits_files={b: os.path.relpath(f, out.parent) for b, f in logits_files.items()},
                logits_vs_fa3_relative_max_error=agreements(logits_files),
                summary=with_flashinfer_verdicts(with_tuner_graphs(summarize(
                    {b: r.get("latency", {}).get("rows", []) for b, r in results.items()}), results), results),
                skipped=skipped_points(results),
                capture_seconds_median={b: statistics.median(c["seconds"] for c in r["latency"]["capture"].values())
                                        for b, r in results.items() if r.get("latency", {}).get("capture")})
    return with_attention_times(with_step_floors(doc, args))


def with_step_floors(doc: dict, args: argparse.Namespace) -> dict:
    """Each summary entry with its decode step's floor (common.step_floor, at the card's nominal
    bandwidth, the median measured step's lengths: the prompts plus half the output, each rank's
    share under tensor parallelism) and each backend's floor over its median step (of_floor):
    how far from the card a step runs, and how much of it attention is."""
    equal = getattr(args, "lengths", "equal") == "equal"
    ranks = getattr(args, "tp", 1) or 1
    for entry in doc["summary"]:
        batch, input_len = entry["batch"], entry["input_len"]
        prompts = [input_len] * batch if equal else spread_lengths(batch, input_len)
        floor = step_floor(doc["config"], [n + doc["output_len"] // 2 for n in prompts],
                           doc["environment"].get("device", ""), ranks)
        if floor is not None:
            entry["step_floor"] = dict(floor, of_floor={
                b: floor["floor_ms"] / (1e3 * batch / entry[b]) for b in (*BUILT_IN, *TUNER_SETTINGS) if entry.get(b)})
    return doc


def with_attention_times(doc: dict) -> dict:
    """Where --profile-steps traced a point's steps: each backend's attention kernels per step
    (the median over its workers' traces; ms, the KV bytes read per second, the share of its
    median step) beside the step floor, and attention_bound: the most any attention kernel
    could raise the best built-in backend's throughput, were its attention to read the KV
    cache at the card's nominal bandwidth and the rest of its step to stay as it is."""
    for entry in doc["summary"]:
        floor = entry.get("step_floor")
        if floor is None:
            continue
        times = {b: _attention_ms(doc["results"].get(b, {}), entry["batch"], entry["input_len"])
                 for b in (*BUILT_IN, *TUNER_SETTINGS) if entry.get(b)}
        step_ms = {b: 1e3 * entry["batch"] / entry[b] for b in times}
        attention = {b: dict(ms=ms, kv_tb_per_s=floor["kv_gb"] / ms, of_step=ms / step_ms[b])
                     for b, ms in times.items() if ms}
        if not attention:
            continue
        floor["attention"] = attention
        best = entry.get("best_built_in")
        if best in attention:
            kv_floor_ms = floor["kv_gb"] / floor["hbm_tb_per_s"]
            floor["attention_bound"] = step_ms[best] / (step_ms[best] - attention[best]["ms"] + kv_floor_ms)
    return doc


def _attention_ms(result: dict, batch: int, input_len: int) -> float | None:
    """A backend's decode attention ms per step at a point: the median over its workers'
    profile summaries (None where none traced it)."""
    profiles = result.get("latency", {}).get("profile", {})
    found = [p[str(batch)]["attention_us"] for key, p in profiles.items()
             if int(key.split("#")[0]) == input_len and "attention_us" in p.get(str(batch), {})]
    return statistics.median(found) / 1e3 if found else None


def with_tuner_graphs(summary: list[dict], results: dict) -> list[dict]:
    """Each entry with what tuner's workers captured at its batch size and input length, where
    their logs said (graph_plans): tuner_graphs_default (every graph ran the default: tuner
    and its rival then ran the same kernels, and their ratio is the noise) and
    tuner_graph_variants (the most variants a worker planned)."""
    plans = results.get("tuner", {}).get("latency", {}).get("graph_plans", {})
    for entry in summary:
        seen = [by_batch[str(entry["batch"])] for key, by_batch in plans.items()
                if int(key.split("#")[0]) == entry["input_len"] and str(entry["batch"]) in by_batch]
        if seen:
            entry["tuner_graphs_default"] = all(p["base_default"] and not p["variants"] for p in seen)
            entry["tuner_graph_variants"] = max(p["variants"] for p in seen)
    return summary


def with_flashinfer_verdicts(summary: list[dict], results: dict) -> list[dict]:
    """Each entry with the replay judge's verdicts on SGLang's FlashInfer graph in the
    tuner-flashinfer workers at that point (flashinfer_graph_verdicts: the steps, the graph it
    was timed against, its time over that graph's, dropped or not): FlashInfer's graph and
    tuner's timed pair by pair in one process, which the throughputs of separate processes,
    2-5% apart from run to run, cannot resolve."""
    latency = results.get("tuner-flashinfer", {}).get("latency", {})
    plans, verdicts = latency.get("graph_plans", {}), latency.get("judge_verdicts", {})
    for entry in summary:
        found = []
        for key, logged in verdicts.items():
            label = plans.get(key, {}).get(str(entry["batch"]), {}).get("flashinfer")
            if label is None or int(key.split("#")[0]) != entry["input_len"]:
                continue
            found += [dict(steps=v["steps"], over=v.get("against", "base graph"), ratio=v["ratio"], dropped=v["dropped"])
                      for v in logged if v["batch"] == entry["batch"] and v["label"] == label]
        if found:
            entry["flashinfer_graph_verdicts"] = found
    return summary


def skipped_points(results: dict) -> list[dict]:
    """(batch, input length) points some backend's worker skipped (past its KV cache), with
    the backends that did: the summary has no entry for them, or one without those backends."""
    by_point: dict[tuple[int, int], set[str]] = {}
    for backend, result in results.items():
        for key, batches in result.get("latency", {}).get("skipped", {}).items():
            for batch in batches:
                by_point.setdefault((batch, int(key.split("#")[0])), set()).add(backend)
    return [dict(batch=b, input_len=n, backends=sorted(by_point[b, n])) for b, n in sorted(by_point)]


def merge_result(into: dict, result: dict) -> None:
    """A backend's results from another run joined in: its (input length, round) workers that
    ran where these did not, its logits where these have none."""
    if "latency" in result:
        mine = into.setdefault("latency", dict(exit_codes={}, rows=[]))
        for key, code in result["latency"]["exit_codes"].items():
            if mine["exit_codes"].get(key) != 0:
                mine["exit_codes"][key] = code
                mine["rows"] = [r for r in mine["rows"] if row_key(r) != key]
                mine["rows"] += [r for r in result["latency"]["rows"] if row_key(r) == key]
                for part in ("capture", "judge_verdicts", "skipped", "graph_plans", "steps", "profile",
                             "step_timing", "worker_seconds"):  # each worker's
                    mine.setdefault(part, {}).pop(key, None)
                    if key in result["latency"].get(part, {}):
                        mine[part][key] = result["latency"][part][key]
    if "logits_exit_code" in result and into.get("logits_exit_code") != 0:
        into["logits_exit_code"] = result["logits_exit_code"]
        if "logits" in result.get("worker_seconds", {}):
            into.setdefault("worker_seconds", {})["logits"] = result["worker_seconds"]["logits"]


def merge(files: list[str], out: Path, args: argparse.Namespace) -> dict:
    """Join several runs' JSON, backend by backend and part by part (a run may hold one
    backend's latency and another run its logits); the logits compared again where their
    files lie where their JSON says."""
    results: dict[str, dict] = {}
    logits_files: dict[str, Path] = {}
    docs = []
    for f in files:
        doc = json.loads(Path(f).read_text())
        docs.append(doc)
        for backend, result in doc["results"].items():
            merge_result(results.setdefault(backend, {}), result)
        for backend, name in doc.get("logits_files", {}).items():
            if doc["results"].get(backend, {}).get("logits_exit_code") == 0:
                logits_files.setdefault(backend, (Path(f).parent / name).resolve())
    modes = {doc.get("capture_bs", "run") for doc in docs}
    if len(modes) > 1:
        raise UsageError("--merge: these runs captured different batch sizes "
                         f"(--capture-bs {', '.join(sorted(modes))})")
    lengths = {doc.get("lengths", "equal") for doc in docs}
    if len(lengths) > 1:
        raise UsageError(f"--merge: these runs' batches hold different lengths (--lengths {', '.join(sorted(lengths))})")
    args.lengths = lengths.pop()
    tps = {doc.get("tp", 1) for doc in docs}
    if len(tps) > 1:
        raise UsageError(f"--merge: these runs split the model over different GPUs (--tp {', '.join(map(str, sorted(tps)))})")
    args.tp = tps.pop()
    first = docs[0]
    args.capture_bs = modes.pop()
    args.model, args.batches, args.input_lens, args.output_len = (first["model"], first["batches"],
                                                                  first["input_lens"], first["output_len"])
    args.layers = first["config"]["num_hidden_layers"]
    args.rounds = max(doc.get("rounds", 1) for doc in docs)  # files written before rounds: one
    merged = dict(document(args, time.perf_counter(), results, logits_files, out), merged_from=files)
    out.write_text(json.dumps(merged, indent=1))
    return merged


def run_all(args: argparse.Namespace, out: Path) -> dict:
    """The latency rounds, then each backend's logits worker; the document written."""
    run = Run(args, out)
    work = out.with_name(f"{out.stem}.work")  # beside --out: what a cut-short call ran comes back
    name = f"{args.model}-{args.layers}-layers" if args.layers else args.model
    model_dir = write_model_dir(args.model, work / name, args.layers)
    backends = args.backends.split(",")
    if args.latency:
        run_rounds(run, backends, model_dir, work)
    for backend in backends:
        if args.logits:
            run_logits(run, backend, model_dir, work)
        result = run.results.get(backend, {})
        print(f"{backend}: latency {json.dumps(result.get('latency', {}).get('exit_codes', {}))}, "
              f"logits exit {result.get('logits_exit_code')}", flush=True)
    return run.save()


def harness_parser() -> argparse.ArgumentParser:
    """This script's command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the JSON to write")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(CONFIGS))
    ap.add_argument("--backends", default="tuner,fa3,flashinfer,triton",
                    help="comma-separated: SGLang's fa3, flashinfer, triton, and tuner; tuner-novariants and "
                         "tuner-nojudge run tuner without its graph variants or without its replay judge, "
                         "tuner-flashinfer with its FlashInfer graph variant (TUNER_SGLANG_FLASHINFER=1)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--input-lens", default="1024,4096,16384,32768")
    ap.add_argument("--output-len", type=int, default=128, help="decode steps per worker (its startup takes "
                    "far longer)")
    ap.add_argument("--rounds", type=int, default=3, help="latency workers per backend and input length, "
                    "the backends' order rotated each round")
    ap.add_argument("--mem-fraction", type=float, help="SGLang's --mem-fraction-static (default: all but "
                    f"{PREFILL_MARGIN}x the model's prefill activations, at most 0.85)")
    ap.add_argument("--capture-bs", choices=("run", "default"), default="run",
                    help="decode graphs for the run's batch sizes only (run), or for SGLang's default list "
                         "(default: what a server captures at startup; each worker's capture seconds and GB are "
                         "in its results either way)")
    ap.add_argument("--lengths", choices=("equal", "spread"), default="equal",
                    help="equal: every request at the input length (bench_one_batch's own batches); spread: each "
                         "its own, uniform in [input length / 2, input length], as a server's batches hold")
    ap.add_argument("--layers", type=int, help="fewer decoder layers than the model has: a quick check of the "
                    "integration (its figures are not the model's)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs) per worker: the model's "
                    "per-GPU heads are its heads over this; tuner's replay judge then agrees across them")
    ap.add_argument("--prefill-graphs", action="store_true", help="let SGLang capture its prefill graphs (0.5.17: "
                    "58 of them, 9 s a worker, 65 s on a fresh machine); by default left out, as only decode is compared")
    ap.add_argument("--db", help="TUNER_DB for the tuner backend (its graph records)")
    ap.add_argument("--step-latencies", action="store_true", help="every measured decode step's latency in the "
                    "results (steps), not only the median: where in a run a backend's steps differ")
    ap.add_argument("--step-timing", action="store_true", help="each measured decode graph step's host time "
                    "(SGLang's load_batch with tuner's hooks, and execute: load_batch and the replay's launch) and GPU "
                    "time (CUDA events around execute) in the results (step_timing), medians printed per batch size (each "
                    "step's line is printed while the next step's graph runs; compare such runs with each other)")
    ap.add_argument("--profile-steps", type=int, default=0, metavar="N", help="a torch profiler trace of N decode "
                    "steps halfway through each worker, summarized per batch size in the results (profile: GPU busy "
                    "and idle time per step, its top kernels, graph launches); those steps run slower")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds one worker (one input length and round) may take")
    ap.add_argument("--deadline", type=float, default=560.0,
                    help="seconds: no worker starts unless as long as the longest worker so far took (at least "
                         f"{MIN_WORKER_S}) is left before it; one still running then is stopped (\"{STOPPED_AT_DEADLINE}\"). "
                         "--resume runs either later")
    ap.add_argument("--latency", action=argparse.BooleanOptionalAction, default=True, help="bench_one_batch runs")
    ap.add_argument("--logits", action=argparse.BooleanOptionalAction, default=True, help="the logits comparison")
    ap.add_argument("--resume", action="store_true", help="keep what --out already holds, run the rest")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join these runs' JSON into --out (no GPU)")
    ap.add_argument("--worker", choices=("latency", "logits"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-backend", help=argparse.SUPPRESS)
    ap.add_argument("--worker-logits", help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = harness_parser()
    args, rest = ap.parse_known_args()
    if args.worker:
        worker(args.worker, args.worker_backend, args.worker_logits, rest[1:] if rest[:1] == ["--"] else rest)
        return
    if not args.out:
        ap.error("--out is required")
    if args.lengths == "spread" and not args.merge and max(int(b) for b in args.batches.split(",")) > SPREAD_DRAWS:
        ap.error(f"--lengths spread draws {SPREAD_DRAWS} prompts: --batches {args.batches} goes past that")
    if not args.merge:
        unfit = unfit_input_lens(args.model, [int(n) for n in args.input_lens.split(",")], args.output_len)
        if unfit and args.input_lens != ap.get_default("input_lens"):
            ap.error(unfit)
        if unfit:  # the default lengths: the model's own are run
            print(f"left out: {unfit}", flush=True)
    if args.mem_fraction is None and not args.merge:
        args.mem_fraction = mem_fraction(gpu_memory_gb(), CONFIGS[args.model])
    out = Path(args.out)
    try:
        doc = merge(args.merge, out, args) if args.merge else run_all(args, out)
    except UsageError as e:
        ap.error(str(e))
    for entry in doc.get("summary", []):
        print(json.dumps(entry), flush=True)
    print(f"logits vs fa3 (relative max error): {json.dumps(doc['logits_vs_fa3_relative_max_error'])}", flush=True)


if __name__ == "__mp_main__" and os.environ.get(RANK_SETUP):
    # bench_one_batch runs each TP rank (--tp above 1) in a process it spawns, which imports
    # this script under this name and knows nothing of the worker's set-up: it does it again
    prepare_rank(os.environ[RANK_SETUP])

if __name__ == "__main__":
    main()
