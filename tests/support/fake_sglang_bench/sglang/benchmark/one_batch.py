"""bench_one_batch's latency test and model loading, faked: throughput from the backend's name
and the harness's round (from its result file's name: BACKEND.LEN.rR.jsonl, round 0 without
.rR), and load_model's runner (sglang.srt.model_executor.model_runner). FAKE_SGLANG_CRASH=
"backend:input_len" (every round), "backend:input_len:rR" (round R alone) or "backend:logits"
(load_model) makes that run die; FAKE_SGLANG_ROUND_SPEED='{"backend": [factor of round 0, of
round 1, ...]}' scales a backend's throughput by round (one process's luck); FAKE_SGLANG_STARTS
names a file each latency run appends "backend round" to as it starts (the order they ran in).
FAKE_SGLANG_EXTENDS names a file each call of the module's extend() appends its requests' input
lengths to: the latency test then prefills each batch through it (as the real one's runner
does) and its rows say how many requests the decode batch held. --prompt-filename: as the real
one, one prompt a line, a batch of B takes the first B (the rows' prompt_lens: their words,
each a token to the harness's dummy tokenizer). --tp-size N above 1: as the real one, each rank
runs the latency test in a process it spawns (multiprocessing's spawn, which imports the
harness's script again as __mp_main__), and the rows come from rank 0; each row says what its
rank's process had set up (rank_setup: the "tuner" backend registered, extend in parts). Each
decode step, the warm-up's too, goes through the (fake) DecodeCudaGraphRunner.execute, as a
worker's --step-timing may have wrapped it."""

import argparse
import json
import os
import re
import sys

import numpy as np

from sglang.srt.server_args import ServerArgs


class _Req:
    def __init__(self, input_len):
        self.origin_input_ids = [7] * input_len


class _Batch:
    def __init__(self, reqs):
        self.reqs = list(reqs)

    def merge_batch(self, other):
        self.reqs = self.reqs + other.reqs


def extend(reqs, model_runner):
    """One forward over these requests' input tokens (recorded): (next ids, logits, batch)."""
    import torch

    with open(os.environ["FAKE_SGLANG_EXTENDS"], "a") as calls:
        calls.write(json.dumps([len(r.origin_input_ids) for r in reqs]) + "\n")
    return torch.zeros(len(reqs), dtype=torch.int64), torch.zeros(len(reqs), 4), _Batch(reqs)


def _decode_batch(batch_size, input_len):
    """How many requests the decode batch holds after the prefill (through extend() where asked)."""
    if not os.environ.get("FAKE_SGLANG_EXTENDS"):
        return batch_size
    _, _, batch = extend([_Req(input_len) for _ in range(batch_size)], None)
    return len(batch.reqs)

SPEED = {"fa3": 1.0, "flashinfer": 0.97, "triton": 0.9, "tuner": 1.1, "broken": 1.0}


class BenchArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--batch-size", type=int, nargs="+")
        parser.add_argument("--input-len", type=int, nargs="+")
        parser.add_argument("--output-len", type=int, nargs="+")
        parser.add_argument("--result-filename")
        parser.add_argument("--run-name")
        parser.add_argument("--prompt-filename", default="")
        parser.add_argument("--log-decode-step", type=int, default=0)
        parser.add_argument("--profile", action="store_true")
        parser.add_argument("--profile-stage", default="all")
        parser.add_argument("--profile-steps", type=int)
        parser.add_argument("--profile-activities", nargs="+", default=["CPU", "GPU"])


def _parse(argv):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    BenchArgs.add_cli_args(parser)
    return parser.parse_args(argv)


def cli_main():
    args = _parse(sys.argv[1:])
    if args.tp_size > 1:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        ranks = [context.Process(target=_latency_test, args=(sys.argv[1:], rank)) for rank in range(args.tp_size)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        if any(process.exitcode for process in ranks):
            raise SystemExit(1)
        return
    _latency_test(sys.argv[1:], 0)


def _latency_test(argv, rank):
    args = _parse(argv)
    if rank:
        return
    backend = args.attention_backend
    match = re.search(r"\.r(\d+)\.jsonl$", args.result_filename)
    rnd = int(match.group(1)) if match else 0
    if os.environ.get("FAKE_SGLANG_STARTS"):
        with open(os.environ["FAKE_SGLANG_STARTS"], "a") as starts:
            starts.write(f"{backend} {rnd}\n")
    for n in args.input_len:
        if os.environ.get("FAKE_SGLANG_CRASH") in (f"{backend}:{n}", f"{backend}:{n}:r{rnd}"):
            raise MemoryError("CUDA out of memory (fake)")
    # the model runner's capture lines, as SGLang 0.5.17 logs them (its default list: 36 sizes)
    sizes = args.cuda_graph_bs_decode or [1, 2, 4, 8, 12, *range(16, 257, 8)]
    print(f"[fake TP0] Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, bs={sizes}, "
          "avail mem=17.72 GB", flush=True)
    print(f"[fake TP0] Capture target decode CUDA graph end. elapsed={0.05 * len(sizes) / SPEED[backend]:.2f} s, "
          f"mem usage={0.01 * len(sizes):.2f} GB, avail mem=17.66 GB.", flush=True)
    factors = json.loads(os.environ.get("FAKE_SGLANG_ROUND_SPEED", "{}")).get(backend)
    speed = SPEED[backend] * (factors[rnd] if factors else 1.0)
    prompts = []
    if args.prompt_filename:
        with open(args.prompt_filename) as lines:
            prompts = [len(line.split()) for line in lines]
    _replay(1)  # the warm-up's step
    print("Warmup ...\nDecode 0. Batch size: 1, latency: 0.09000 s, throughput: 11.11 token/s\nBenchmark ...")
    with open(args.result_filename, "a") as out:
        for n in args.input_len:
            for b in args.batch_size:
                throughput = speed * b * 1000.0 / (1 + n / 8192)
                _log_steps(args, b, 1000.0 / throughput)
                if args.profile:
                    _write_trace(backend, b, n, args.output_len[0], args.profile_steps or 1)
                decoded = _decode_batch(b, n)
                out.write(json.dumps(dict(run_name=args.run_name, batch_size=b, input_len=n, decode_batch=decoded,
                                          output_len=args.output_len[0], median_decode_throughput=throughput,
                                          median_decode_latency=b / throughput,
                                          graph_bs=args.cuda_graph_bs_decode, prompt_lens=prompts[:b] or None,
                                          prefill_graphs=not getattr(args, "disable_prefill_cuda_graph", False),
                                          rank_setup=_rank_setup(), tuner_env={
                                              k: v for k, v in os.environ.items() if k.startswith("TUNER_")
                                              and k != "TUNER_DB"})) + "\n")


def _replay(batch):
    """One decode step through the graph runner (its class as a worker's set-up may have wrapped it)."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    DecodeCudaGraphRunner().execute(type("ForwardBatch", (), {"batch_size": batch})())


def _log_steps(args, batch, scale):
    for i in range(args.output_len[0] - 1):
        _replay(batch)
        if i < 5 or (args.log_decode_step > 0 and i % args.log_decode_step == 0):
            print(f"Decode {i}. Batch size: {batch}, latency: {scale * (1 + i / 10) / 1000:6.5f} s, "
                  f"throughput: {batch / (scale * (1 + i / 10) / 1000):9.2f} token/s")


def _write_trace(backend, batch, input_len, output_len, steps):
    import gzip

    events = []
    for step in range(steps):
        t = 1000.0 * step
        events += [dict(ph="X", cat="cuda_runtime", name="cudaGraphLaunch", ts=t, dur=4.0),
                   dict(ph="X", cat="kernel", name=f"attention_{backend}", ts=t + 5, dur=10.0),
                   dict(ph="X", cat="kernel", name="mlp", ts=t + 20, dur=20.0)]
    folder = os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
    os.makedirs(folder, exist_ok=True)
    name = f"profile_batch{batch}_input{input_len}_output{output_len}_decode.trace.json.gz"
    with gzip.open(os.path.join(folder, name), "wt") as f:
        json.dump(dict(traceEvents=events), f)


def _rank_setup():
    """What this process has of the harness's set-up: the tuner backend registered, and this
    module's extend wrapped to prefill in parts."""
    from sglang.srt.layers.attention.attention_registry import REGISTERED

    return dict(tuner_registered="tuner" in REGISTERED, extend_in_parts=getattr(extend, "in_parts", False))


def load_model(server_args, port_args, gpu_id, tp_rank):
    if os.environ.get("FAKE_SGLANG_CRASH") == f"{server_args.attention_backend}:logits":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (fake)")
    from sglang.srt.model_executor.model_runner import Runner

    return Runner(server_args.attention_backend), None


def prepare_synthetic_inputs_for_latency_test(batch_size, input_len):
    return [list(np.random.randint(0, 10000, input_len)) for _ in range(batch_size)]
