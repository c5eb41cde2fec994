"""ServerArgs and PortArgs as bench_one_batch's callers use them; --attention-backend takes its
choices from a list that add_attention_backend_choices extends, as 0.5.17's does. Its
--disable-prefill-cuda-graph only with FAKE_SGLANG_PREFILL_GRAPHS set (0.5.17 has it; an older
SGLang would refuse it)."""

import argparse
import os

# "broken": a backend whose attention is wrong, the logits comparison's positive control
ATTENTION_BACKEND_CHOICES = ["fa3", "flashinfer", "triton", "broken"]


def add_attention_backend_choices(names):
    ATTENTION_BACKEND_CHOICES.extend(names)


class ServerArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model-path", required=True)
        parser.add_argument("--load-format", default="auto")
        parser.add_argument("--attention-backend", choices=ATTENTION_BACKEND_CHOICES)
        parser.add_argument("--mem-fraction-static", type=float)
        parser.add_argument("--cuda-graph-bs-decode", type=int, nargs="+")
        parser.add_argument("--tp-size", type=int, default=1)
        if os.environ.get("FAKE_SGLANG_PREFILL_GRAPHS"):
            parser.add_argument("--disable-prefill-cuda-graph", action="store_true")

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "ServerArgs":
        args = cls()
        args.__dict__.update(vars(namespace))
        return args


class PortArgs:
    @staticmethod
    def init_new(server_args):
        return None
