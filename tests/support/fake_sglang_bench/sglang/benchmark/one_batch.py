"""bench_one_batch's latency test and model loading, faked: throughput from the backend's name
(FAKE_SGLANG_CRASH="backend:input_len", or "backend:logits" for load_model, makes that run die), and a model whose weights each
process draws at random (as the dummy load format does) and whose logits come back as views
of one buffer that every step overwrites (as SGLang's graphs return them)."""

import argparse
import json
import os
import sys

import numpy as np
import torch

from sglang.srt.server_args import ServerArgs

SPEED = {"fa3": 1.0, "flashinfer": 0.97, "triton": 0.9, "tuner": 1.1, "broken": 1.0}


class BenchArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--batch-size", type=int, nargs="+")
        parser.add_argument("--input-len", type=int, nargs="+")
        parser.add_argument("--output-len", type=int, nargs="+")
        parser.add_argument("--result-filename")
        parser.add_argument("--run-name")


def _parse(argv):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    BenchArgs.add_cli_args(parser)
    return parser.parse_args(argv)


def cli_main():
    args = _parse(sys.argv[1:])
    for n in args.input_len:
        if os.environ.get("FAKE_SGLANG_CRASH") == f"{args.attention_backend}:{n}":
            raise MemoryError("CUDA out of memory (fake)")
    with open(args.result_filename, "a") as out:
        for n in args.input_len:
            for b in args.batch_size:
                throughput = SPEED[args.attention_backend] * b * 1000.0 / (1 + n / 8192)
                out.write(json.dumps(dict(run_name=args.run_name, batch_size=b, input_len=n,
                                          output_len=args.output_len[0], median_decode_throughput=throughput,
                                          median_decode_latency=b / throughput,
                                          graph_bs=args.cuda_graph_bs_decode)) + "\n")


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(64, 16)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.empty(16))
        self.lm_head = torch.nn.Linear(16, 64, bias=False)
        with torch.no_grad():  # the dummy load format: small random values, drawn in each process
            for p in self.parameters():
                p.uniform_(-1e-3, 1e-3)


class _Runner:
    def __init__(self, backend):
        self.backend = backend
        self.torch_runner = type("ModelRunner", (), {})()
        self.torch_runner.model = _Model()
        self.buffer = torch.empty(4, 64)

    def _logits(self, ids, step):
        model = self.torch_runner.model
        hidden = model.embed_tokens(ids % 64) * model.norm.weight + step
        if self.backend == "broken":
            hidden = hidden + torch.randn(hidden.shape)  # a wrong attention output
        with torch.no_grad():
            self.buffer[: len(ids)] = model.lm_head(hidden)
        return self.buffer[: len(ids)]

    def extend(self, reqs):
        ids = torch.tensor([r[-1] for r in reqs])
        return ids, self._logits(ids, 0), len(reqs)

    def decode(self, ids, batch):
        return ids, self._logits(ids, 1 + int(ids[0]) % 7)


def load_model(server_args, port_args, gpu_id, tp_rank):
    if os.environ.get("FAKE_SGLANG_CRASH") == f"{server_args.attention_backend}:logits":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (fake)")
    return _Runner(server_args.attention_backend), None


def prepare_synthetic_inputs_for_latency_test(batch_size, input_len):
    return [list(np.random.randint(0, 10000, input_len)) for _ in range(batch_size)]
