"""Per-replay dispatch by switching captured nodes on and off from the host (issue 37), measured
before it is built: a decode graph captured at the server's bound holds, at each call site,
every config the per-call records name for its batch size, one after another; before a replay,
the host (which in SGLang writes the step's lengths into the graph's buffers anyway) enables
the nodes of the config for the step's lengths and disables the others
(cudaGraphNodeSetEnabled: a disabled kernel node runs as an empty node).

    python benchmarks/graph_toggle.py --out $OUT/graph_toggle.json [--heads 32/8] [--seconds 200]

Cases are serving.py's, timed as its graph modes time them (max length and page table at the
bound, cold L2 by bytes read), side by side:
- default: FA3's default, captured alone (what a server's graph runs today);
- chosen: the branch the host would choose for this batch (the per-call records' config for
  the kv bucket of its longest sequence, dense or not), captured alone at the bound;
- toggled: every branch captured at each call site (one after another, or with --parallel
  each on a stream of its own), all but the chosen one switched off.
The device cost of the dispatch is toggled over chosen; its host cost, the microseconds of one
cudaGraphNodeSetEnabled, is timed once per case, with the nodes a switch of branch flips.
Before timing, each call site's nodes are matched to their branches by capturing each branch
alone: a graph whose nodes do not come in that order, kernel by kernel, is not timed.
Needs a CUDA build of torch that keeps the captured graph (CUDAGraph(keep_graph=True)).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from common import heads as head_configs
from common.case_runs import add_run_options, cases_of_this_run, done_rows, run_cases
from common.run_info import header
from common.stats import geomean
from graph_dispatch import branch_table, expected_branch
from serving import MAX_CONTEXT, MAX_TABLE_BYTES, SHIPPED
from serving import _calls as graph_calls
from serving import cases as serving_cases

import tuner
from tuner.bench import CudaGraphTimer
from tuner.bench.trial import cold_l2_copies
from tuner.integrations.decode_attention import decode_attention
from tuner.ops.decode_attention import BACKENDS, fill_branch
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.workload.rotation import bytes_read, fresh_page_copies
from tuner.workload.traffic import draw_lengths

VARIANTS = ("default", "chosen", "toggled")
KERNEL, MEMCPY, MEMSET = 0, 1, 2  # cudaGraphNodeType: the kinds cudaGraphNodeSetEnabled takes
SWITCHABLE = (KERNEL, MEMCPY, MEMSET)


class GraphNodes:
    """The few CUDA runtime and driver calls that list a kept graph's nodes, describe them and
    switch them on and off in its instantiated graph (ctypes over the libraries torch loaded)."""

    def __init__(self) -> None:
        self.rt = _library("libcudart.so.13", "libcudart.so.12", "libcudart.so")
        self.driver = _library("libcuda.so.1", "libcuda.so")
        self.kernel_params = getattr(self.driver, "cuGraphKernelNodeGetParams_v2", None) \
            or self.driver.cuGraphKernelNodeGetParams

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} returned CUDA error {code}")

    def nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self._check(self.rt.cudaGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)), "cudaGraphGetNodes")
        handles = (ctypes.c_void_p * count.value)()
        self._check(self.rt.cudaGraphGetNodes(ctypes.c_void_p(graph), handles, ctypes.byref(count)),
                    "cudaGraphGetNodes")
        return [handles[i] for i in range(count.value)]

    def signature(self, node: int) -> tuple:
        """(type,) and, for a kernel, its function and launch dimensions: what identifies a node
        of one branch's capture in another capture of the same call."""
        kind = ctypes.c_int(-1)
        self._check(self.rt.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cudaGraphNodeGetType")
        if kind.value != KERNEL:
            return (kind.value,)
        # the driver's CUDA_KERNEL_NODE_PARAMS(_v2) and the runtime's cudaKernelNodeParams begin
        # alike (function, grid, block, shared bytes) and fit in this buffer
        params = (ctypes.c_ubyte * 256)()
        if self.kernel_params(ctypes.c_void_p(node), params) != 0:
            self._check(self.rt.cudaGraphKernelNodeGetParams(ctypes.c_void_p(node), params),
                        "cudaGraphKernelNodeGetParams")
        func = ctypes.c_void_p.from_buffer(params).value
        dims = tuple((ctypes.c_uint * 7).from_buffer(params, 8))  # grid x, y, z, block x, y, z, shared bytes
        return (KERNEL, func, *dims)

    def set_enabled(self, graph_exec: int, node: int, enabled: bool) -> None:
        self._check(self.rt.cudaGraphNodeSetEnabled(ctypes.c_void_p(graph_exec), ctypes.c_void_p(node),
                                                    ctypes.c_uint(int(enabled))), "cudaGraphNodeSetEnabled")


def _library(*names: str) -> ctypes.CDLL:
    for name in names:
        try:
            return ctypes.CDLL(name)  # the copy torch already loaded, found by its soname
        except OSError:
            continue
    raise OSError(f"none of {names} could be loaded")


def branch_segments(branches: Sequence[Sequence[tuple]], graph: Sequence[tuple], calls: int) -> list[list[range]]:
    """For a graph captured as `calls` call sites, each running every branch in turn: per call
    site, the node index range of each branch, given each branch's node signatures captured
    alone. Raises ValueError where the graph's nodes do not come in that order."""
    per_call = sum(len(b) for b in branches)
    if len(graph) != per_call * calls:
        raise ValueError(f"{len(graph)} nodes, expected {calls} call sites x {per_call}")
    segments, at = [], 0
    for call in range(calls):
        site = []
        for b, expected in enumerate(branches):
            if list(graph[at:at + len(expected)]) != list(expected):
                raise ValueError(f"call site {call}, branch {b}: nodes differ from the branch captured alone")
            site.append(range(at, at + len(expected)))
            at += len(expected)
        segments.append(site)
    return segments


def unswitchable(branches: Sequence[Sequence[tuple]]) -> list[int]:
    """Node types in any branch that cudaGraphNodeSetEnabled cannot switch off."""
    return sorted({sig[0] for b in branches for sig in b if sig[0] not in SWITCHABLE})


class ToggleTimer(CudaGraphTimer):
    """CudaGraphTimer whose rotations may carry `prepare(graph)` on their first call: those are
    captured with the graph kept, and prepared after instantiation, before any replay."""

    def _capture(self, rotation: Sequence[Callable]) -> Callable[[], None]:
        prepare = getattr(rotation[0], "prepare", None)
        if prepare is None:
            return super()._capture(rotation)
        graph = capture_kept(rotation, self._stream())
        prepare(graph)
        self.last_capture_failed = False
        return graph.replay


def capture_kept(rotation: Sequence[Callable], stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """One warm-up call outside the capture, then the rotation captured, kept and instantiated."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rotation[0]()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            for fn in rotation:
                fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    graph.instantiate()
    return graph


class ToggledSite:
    """One call site of the toggled graph: every branch's call, each copied into one output,
    one after another, or (parallel) each on its own stream between a fork and a join, so
    that the switched-off branches' empty nodes need not wait for one another. The first
    site's `prepare` matches the kept graph's nodes to branches and switches off all but the
    chosen one's."""

    def __init__(self, args: tuple, kwargs: dict, configs: list[dict],
                 streams: list[torch.cuda.Stream] | None = None) -> None:
        self.args, self.kwargs, self.configs = args, kwargs, configs
        self.out = torch.empty_like(args[0])
        self.streams = streams if streams and len(configs) > 1 else None

    def __call__(self) -> torch.Tensor:
        if self.streams is None:
            for config in self.configs:
                self.out.copy_(decode_attention(*self.args, **self.kwargs, config=config))
            return self.out
        main = torch.cuda.current_stream()
        for config, stream in zip(self.configs, self.streams):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                self.out.copy_(decode_attention(*self.args, **self.kwargs, config=config))
        for stream in self.streams:
            main.wait_stream(stream)
        return self.out


def branch_signatures(nodes: GraphNodes, site: ToggledSite, stream: torch.cuda.Stream) -> list[list[tuple]]:
    """Each branch of a site captured alone (with its copy into the output): its nodes' signatures."""
    out = []
    for config in site.configs:
        alone = ToggledSite(site.args, site.kwargs, [config])
        graph = capture_kept([alone], stream)
        out.append([nodes.signature(n) for n in nodes.nodes(graph.raw_cuda_graph())])
        del graph
    return out


def set_cost_us(nodes: GraphNodes, graph_exec: int, node: int, repeats: int = 2000) -> float:
    """Host microseconds of one cudaGraphNodeSetEnabled (alternately off and on, ending on)."""
    started = time.perf_counter()
    for i in range(repeats):
        nodes.set_enabled(graph_exec, node, i % 2 == 1)
    return (time.perf_counter() - started) / repeats * 1e6


def run_case(case: dict, spec: dict, nodes: GraphNodes, timer: ToggleTimer, bound: int, seed: int,
             parallel: bool) -> dict:
    lens = draw_lengths(case["distribution"], case["batch"], case["cap"], seed)
    shape = DecodeShape(batch=case["batch"], kv_len=max(lens), **spec)
    inputs = make_decode_inputs(shape, device="cuda", seed=seed, seq_lens=lens)
    host_lens = inputs.seq_lens_host
    n = cold_l2_copies(bytes_read(inputs), "cuda")
    n = max(1, min(n, MAX_TABLE_BYTES // (case["batch"] * -(-bound // shape.page_size) * 4)))
    copies = fresh_page_copies(inputs, n)
    del inputs
    graph = graph_calls(copies[0], copies, bound, bound, None)
    lookup = decode_attention.tuner
    (ga, gk) = graph[0]
    default = lookup.default(ga, gk)
    per_call = graph_calls(copies[0], copies[:1], max(lens), None, host_lens)[0]
    ideal = fill_branch(lookup.config_for(*per_call[0], **per_call[1]), host_lens, max(lens), case["batch"])
    tops, branch_of, configs = branch_table(lookup, ga, gk, case["batch"], bound)
    chosen = expected_branch(tops, branch_of, lens)
    row = dict(case, layout="parallel" if parallel else "sequence", kv_max=max(lens), copies=n, default=default,
               ideal=ideal, branches=configs,
               chosen_branch=chosen, chosen_is_ideal=configs[chosen] == ideal)
    streams = [torch.cuda.Stream() for _ in configs] if parallel else None
    sites = [ToggledSite(a, k, configs, streams) for a, k in graph]
    signatures = branch_signatures(nodes, sites[0], timer._stream())
    row["nodes_per_branch"] = [len(s) for s in signatures]
    if bad := unswitchable(signatures):
        return dict(row, error=f"a branch holds nodes of types {bad}, which cannot be switched off")
    state: dict = {}

    def prepare(kept: torch.cuda.CUDAGraph) -> None:
        all_nodes = nodes.nodes(kept.raw_cuda_graph())
        segments = branch_segments(signatures, [nodes.signature(x) for x in all_nodes], len(sites))
        graph_exec = kept.raw_cuda_graph_exec()
        for site in segments:
            for b, segment in enumerate(site):
                for i in segment:
                    nodes.set_enabled(graph_exec, all_nodes[i], b == chosen)
        state["set_cost_us"] = set_cost_us(nodes, graph_exec, all_nodes[segments[0][chosen][0]])

    sites[0].prepare = prepare
    rotations = [[lambda a=a, k=k: decode_attention(*a, **k, config=default) for a, k in graph],
                 [lambda a=a, k=k: decode_attention(*a, **k, config=configs[chosen]) for a, k in graph],
                 sites]
    timings = timer.interleaved(rotations)
    row["us"] = {v: t.median_us for v, t in zip(VARIANTS, timings)}
    row["over_default"] = {v: row["us"]["default"] / row["us"][v] for v in VARIANTS}
    row["toggled_over_chosen"] = row["us"]["chosen"] / row["us"]["toggled"]
    row["set_cost_us"] = state.get("set_cost_us")
    # a switch of branch at a call site flips the old branch's nodes and the new one's
    row["nodes_flipped_per_switch_max"] = 2 * max(row["nodes_per_branch"])
    reference = decode_attention(*ga, **gk, config=configs[chosen])
    row["max_error_vs_chosen"] = float((sites[0].out.float() - reference.float()).abs().max())
    return row


def summarize(rows: list[dict]) -> dict:
    done = [r for r in rows if "us" in r]
    cost = sorted(r["us"]["toggled"] - r["us"]["chosen"] for r in done)
    return {
        "cases": len(done),
        "failed": sum("error" in r for r in rows),
        "chosen_over_default_geomean": geomean([r["over_default"]["chosen"] for r in done]) if done else None,
        "toggled_over_default_geomean": geomean([r["over_default"]["toggled"] for r in done]) if done else None,
        "toggled_slower_than_default_by_2pct": sum(r["over_default"]["toggled"] < 0.98 for r in done),
        "device_cost_us_median": cost[len(cost) // 2] if cost else None,
        "set_cost_us_median": sorted(r["set_cost_us"] for r in done)[len(done) // 2] if done else None,
        "max_error_vs_chosen": max((r["max_error_vs_chosen"] for r in done), default=None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(ap)
    ap.add_argument("--heads", default="32/8",
                    help="one head configuration as Q/KV [hdD] ... (default: Llama 3.1 8B's, which the shipped "
                         "tunings cover)")
    ap.add_argument("--db", type=Path, help="a user DB over the shipped tunings (default: shipped only)")
    ap.add_argument("--parallel", action="store_true",
                    help="capture each call site's branches on streams of their own, not one after another")
    args = ap.parse_args()
    if args.smoke or not torch.cuda.is_available():
        ap.error("needs a GPU: switching captured nodes is a CUDA-graph feature (no --smoke)")
    BACKENDS.pop("flashinfer", None)  # a host plan per call: never inside a captured graph
    tuner.configure(db=args.db or Path(tempfile.mkdtemp()) / "none.db", shipped=SHIPPED, mode="lookup")
    try:
        heads = {f"h{args.heads}": head_configs.parse_spec(args.heads)}
    except ValueError as e:
        ap.error(str(e))
    nodes, timer = GraphNodes(), ToggleTimer(warmup=2, repeats=15)
    todo = cases_of_this_run(ap, args, serving_cases(False, heads))
    started = time.perf_counter()

    def write(rows: list[dict]) -> dict:
        doc = {**header("graph_toggle", started), "bound": MAX_CONTEXT, "heads": heads,
               "summary": summarize(rows), "rows": rows}
        args.out.write_text(json.dumps(doc, indent=1, default=str))
        return doc

    rows = run_cases(todo, args.seconds, "cuda",
                     run=lambda i, case: run_case(case, heads[case["model"]], nodes, timer, MAX_CONTEXT, seed=i,
                                                     parallel=args.parallel),
                     fields=lambda case: case,
                     describe=lambda r: " ".join(f"{v} {r['over_default'][v]:.3f}" for v in VARIANTS[1:])
                     + f" set {r['set_cost_us']:.2f}us nodes {r['nodes_per_branch']}",
                     write=write, done=done_rows(args))
    print(json.dumps(write(rows)["summary"], default=str))
    sys.exit(0 if rows and all("us" in r for r in rows) else 1)


if __name__ == "__main__":
    main()
