"""Per-replay dispatch inside a captured decode graph, measured before it is built (issue 37):
what a graph captured at the server's bound would cost and gain if it held, as CUDA-graph
conditional (IF) nodes, each config the per-call records name for its batch size, a one-program
device step choosing, at every replay, the one whose kv bucket holds the replay's longest
sequence (nothing on the host sees the lengths).

    python benchmarks/graph_dispatch.py --out $OUT/graph_dispatch.json [--heads 32/8] [--seconds 200]
    python benchmarks/graph_dispatch.py --out /tmp/graph_dispatch.json --smoke   # CPU, interpreted

Cases are serving.py's (capture batch sizes x length caps x distributions). Each is timed as
serving.py's graph modes time it (max length and page table at the bound, cold L2 by bytes
read), four ways side by side:
- default: FA3's default, captured alone (what a server's graph runs today);
- ideal: the config the per-call lookup gives this batch (true max length and host lengths),
  captured alone at the bound: what a dispatch with no cost could reach;
- dispatch: the device step and one IF node per distinct config of the batch size's kv buckets
  up to the bound, each branch writing one output;
- bare: the same device step and as many IF nodes, every branch FA3's default: the dispatch's
  own cost;
- ideal_in_node: the device step and one IF node, always taken, around the ideal config: the
  least a dispatch can cost (against ideal).
After the timing, the dispatch graph is replayed once more and the branch that ran, and its
output, are checked against the host's expectation. Needs torch's conditional-node capture
(CUDAGraph.begin_capture_to_if_node, CUDA >= 12.4), which torch 2.11 lacks: there the run stops at once.
The JSON is written after every case.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from common import heads as head_configs
from common.case_runs import add_run_options, cases_of_this_run, done_rows, run_cases
from common.run_info import header
from common.stats import geomean
from serving import MAX_CONTEXT, MAX_TABLE_BYTES, SHIPPED
from serving import _calls as graph_calls
from serving import cases as serving_cases

import tuner
from tuner import settings
from tuner.bench import CudaGraphTimer, WallClockTimer
from tuner.bench.trial import cold_l2_copies
from tuner.integrations.decode_attention import decode_attention
from tuner.keys.run import kv_len_bucket
from tuner.ops.decode_attention import BACKENDS, fill_branch
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.workload.rotation import bytes_read, fresh_page_copies
from tuner.workload.traffic import draw_lengths, is_dense

VARIANTS = ("default", "ideal", "dispatch", "bare", "ideal_in_node")
NO_BUCKET = 2**31 - 1  # a padding bucket top no length reaches


@triton.jit
def _branch_flags_kernel(seqlens, batch, tops, branch_of, flags, n_branches, dense_fill,
                         N_TOPS: tl.constexpr, BLOCK: tl.constexpr, K: tl.constexpr):
    """flags[k] = (k is the branch of the kv bucket that holds the longest of seqlens[:batch],
    in its dense column (branch_of[N_TOPS + bucket]) where the lengths sum to dense_fill x
    batch x the longest or more, else in its other one (branch_of[bucket]))."""
    longest = tl.max(tl.zeros([BLOCK], dtype=tl.int32), 0)
    total = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0)
    for start in range(0, batch, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lens = tl.load(seqlens + offs, mask=offs < batch, other=0)
        longest = tl.maximum(longest, tl.max(lens, 0))
        total += tl.sum(lens.to(tl.float32), 0)
    bucket = tl.sum((tl.load(tops + tl.arange(0, N_TOPS)) < longest).to(tl.int32), 0)
    dense = (total >= dense_fill * batch * longest.to(tl.float32)) & (longest > 0)
    branch = tl.load(branch_of + bucket + dense.to(tl.int32) * N_TOPS)
    k = tl.arange(0, K)
    tl.store(flags + k, k == branch, mask=k < n_branches)


class GraphDispatch:
    """One decode call as a captured graph would hold it: the device step, then an IF node per
    config. Called outside a capture (a warm-up), every branch runs and the flagged one's
    output is returned."""

    def __init__(self, tops: list[int], branch_of: dict[bool, list[int]], configs: list[dict], device: str) -> None:
        self.configs = configs
        n_tops = triton.next_power_of_2(len(tops))
        self.tops = torch.full((n_tops,), NO_BUCKET, dtype=torch.int32, device=device)
        self.tops[:len(tops)] = torch.tensor(tops, dtype=torch.int32)
        self.branch_of = torch.zeros(2 * n_tops, dtype=torch.int32, device=device)  # other, then dense
        for column, dense in enumerate((False, True)):
            self.branch_of[column * n_tops:column * n_tops + len(tops)] = torch.tensor(branch_of[dense])
        self.k = triton.next_power_of_2(len(configs))
        self.flags = torch.zeros(self.k, dtype=torch.bool, device=device)

    def choose(self, seqlens: torch.Tensor) -> None:
        _branch_flags_kernel[(1,)](seqlens, seqlens.shape[0], self.tops, self.branch_of, self.flags,
                                   len(self.configs), settings.DENSE_FILL, N_TOPS=self.tops.shape[0], BLOCK=128,
                                   K=self.k)

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        self.choose(args[4])
        if not (args[0].is_cuda and torch.cuda.is_current_stream_capturing()):
            outs = [decode_attention(*args, **kwargs, config=c) for c in self.configs]
            return outs[int(self.flags.nonzero()[0])]
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        out = torch.empty_like(args[0])
        for i, config in enumerate(self.configs):
            graph.begin_capture_to_if_node(self.flags[i])
            out.copy_(decode_attention(*args, **kwargs, config=config))
            graph.end_capture_to_conditional_node()
        return out


def branch_table(dispatch, args: tuple, kwargs: dict, batch: int, bound: int
                 ) -> tuple[list[int], dict[bool, list[int]], list[dict]]:
    """Every kv bucket top up to the bound; for dense batches and for others, each bucket's
    index of the config the per-call lookup gives a call of this batch size whose longest
    sequence fills that bucket (a by_fill record's dense or other config); those configs, once each."""
    tops, configs = [], []
    branch_of: dict[bool, list[int]] = {False: [], True: []}
    for exponent in range(bound.bit_length()):
        top = 1 << exponent
        call = list(args)
        call[5] = top  # max_kv_len: the bucket the lookup keys on
        record = dispatch.config_for(*call, **kwargs)
        tops.append(top)
        for dense, lens in ((False, None), (True, [top] * batch)):
            config = fill_branch(record, lens, top, batch)
            if config not in configs:
                configs.append(config)
            branch_of[dense].append(configs.index(config))
    return tops, branch_of, configs


def expected_branch(tops: list[int], branch_of: dict[bool, list[int]], lens: list[int]) -> int:
    longest = max(lens)
    return branch_of[longest > 0 and is_dense(sum(lens), len(lens), longest)][tops.index(kv_len_bucket(longest))]


def run_case(case: dict, spec: dict, device: str, timer, bound: int, seed: int) -> dict:
    lens = draw_lengths(case["distribution"], case["batch"], case["cap"], seed)
    shape = DecodeShape(batch=case["batch"], kv_len=max(lens), **spec)
    inputs = make_decode_inputs(shape, device=device, seed=seed, seq_lens=lens)
    host_lens, read = inputs.seq_lens_host, bytes_read(inputs)
    n = cold_l2_copies(read, device)
    if device == "cuda":
        n = max(1, min(n, MAX_TABLE_BYTES // (case["batch"] * -(-bound // shape.page_size) * 4)))
    copies = fresh_page_copies(inputs, n)
    del inputs
    per_call = graph_calls(copies[0], copies, max(lens), None, host_lens)
    graph = graph_calls(copies[0], copies, bound, bound, None)
    lookup = decode_attention.tuner
    (a, k), (ga, gk) = per_call[0], graph[0]
    default = lookup.default(ga, gk)
    ideal = fill_branch(lookup.config_for(*a, **k), host_lens, max(lens), case["batch"])
    tops, branch_of, configs = branch_table(lookup, ga, gk, case["batch"], bound)
    dispatch = GraphDispatch(tops, branch_of, configs, device)
    bare = GraphDispatch(tops, branch_of, [default] * len(configs), device)
    in_node = GraphDispatch(tops, {False: [0] * len(tops), True: [0] * len(tops)}, [ideal], device)
    row = dict(case, kv_max=max(lens), copies=n, default=default, ideal=ideal, branches=configs,
               branch_of_bucket={name: dict(zip(tops, branch_of[dense])) for name, dense in (("other", False),
                                                                                             ("dense", True))},
               expected_branch=expected_branch(tops, branch_of, lens))
    rotations = [[lambda a=a, k=k: decode_attention(*a, **k, config=default) for a, k in graph],
                 [lambda a=a, k=k: decode_attention(*a, **k, config=ideal) for a, k in graph],
                 [lambda a=a, k=k: dispatch(a, k) for a, k in graph],
                 [lambda a=a, k=k: bare(a, k) for a, k in graph],
                 [lambda a=a, k=k: in_node(a, k) for a, k in graph]]
    timings = timer.interleaved(rotations) if hasattr(timer, "interleaved") else [timer(r) for r in rotations]
    row["capture_failed"] = bool(getattr(timer, "last_capture_failed", False))
    row["us"] = {v: t.median_us for v, t in zip(VARIANTS, timings)}
    row["over_default"] = {v: row["us"]["default"] / row["us"][v] for v in VARIANTS}
    row.update(check_replay(dispatch, ga, gk, configs[row["expected_branch"]], device))
    return row


def check_replay(dispatch: GraphDispatch, args: tuple, kwargs: dict, expected: dict, device: str) -> dict:
    """The branch one replay of a captured dispatch ran (its flag), and its output's largest
    difference from the expected branch's config run alone."""
    reference = decode_attention(*args, **kwargs, config=expected)
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin()
            try:
                out = dispatch(args, kwargs)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        dispatch.flags.zero_()
        graph.replay()
        torch.cuda.synchronize()
    else:
        out = dispatch(args, kwargs)
    ran = dispatch.flags[:len(dispatch.configs)].nonzero().flatten().tolist()
    return {"branch_ran": ran, "max_error_vs_expected": float((out.float() - reference.float()).abs().max())}


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def summarize(rows: list[dict]) -> dict:
    done = [r for r in rows if "us" in r]
    return {
        "cases": len(done),
        "capture_failed": sum(r["capture_failed"] for r in done),
        "wrong_branch": sum(r["branch_ran"] != [r["expected_branch"]] for r in done),
        **{f"{v}_over_default_geomean": geomean([r["over_default"][v] for r in done]) for v in VARIANTS[1:]},
        "dispatch_slower_than_default_by_2pct": sum(r["over_default"]["dispatch"] < 1 / 1.02 for r in done),
        "dispatch_worst_over_default": min((r["over_default"]["dispatch"] for r in done), default=None),
        # the dispatch's own cost: bare's time over the default's, in us
        "bare_cost_us_median": _median([r["us"]["bare"] - r["us"]["default"] for r in done]),
        "one_node_cost_us_median": _median([r["us"]["ideal_in_node"] - r["us"]["ideal"] for r in done]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(ap)
    ap.add_argument("--heads", default="32/8",
                    help="one head configuration as Q/KV [hdD] ... (default: Llama 3.1 8B's, which the shipped "
                         "tunings cover)")
    ap.add_argument("--db", type=Path, help="a user DB over the shipped tunings (default: shipped only)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cuda" and not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        ap.error(f"torch {torch.__version__} cannot capture conditional nodes "
                 "(CUDAGraph.begin_capture_to_if_node; torch 2.11 lacks it)")
    BACKENDS.pop("flashinfer", None)  # a host plan per call: never inside a captured graph
    tuner.configure(db=args.db or Path(tempfile.mkdtemp()) / "none.db", shipped=SHIPPED, mode="lookup")
    if args.smoke:
        heads, bound = {"smoke": dict(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")}, 128
        timer = WallClockTimer(warmup=1, repeats=2, min_repeats=2)
    else:
        try:
            heads = {f"h{args.heads}": head_configs.parse_spec(args.heads)}
        except ValueError as e:
            ap.error(str(e))
        bound, timer = MAX_CONTEXT, CudaGraphTimer(warmup=2, repeats=15)
    todo = cases_of_this_run(ap, args, serving_cases(args.smoke, heads))
    started = time.perf_counter()

    def write(rows: list[dict]) -> dict:
        doc = {**header("graph_dispatch", started), "bound": bound, "heads": heads, "summary": summarize(rows),
               "rows": rows}
        args.out.write_text(json.dumps(doc, indent=1, default=str))
        return doc

    rows = run_cases(todo, args.seconds, device,
                     run=lambda i, case: run_case(case, heads[case["model"]], device, timer, bound, seed=i),
                     fields=lambda case: case,
                     describe=lambda r: " ".join(f"{v} {r['over_default'][v]:.3f}" for v in VARIANTS[1:])
                     + f" branch {r['branch_ran']}/{r['expected_branch']}",
                     write=write, done=done_rows(args))
    print(json.dumps(write(rows)["summary"], default=str))
    sys.exit(0 if rows and all("us" in r for r in rows) else 1)


if __name__ == "__main__":
    main()
