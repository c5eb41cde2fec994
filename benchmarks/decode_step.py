"""A server's decode step, as SGLang's graph runner makes it, with tuner's decode_attention
against FA3's default: a real model's layer stack (RMSNorm, QKV projection, the new token's
K/V written into the paged cache, attention, output projection, RMSNorm, gated MLP; dummy
weights), one CUDA graph per batch size captured at the server's max context, and before each
replay the host step a server does (the step's lengths and page table written into the
captured buffers in place).

    python benchmarks/decode_step.py --model llama-3.1-8b --out $OUT/decode_step.json [--db tuner.db]

Modes, each its own graphs over the same steps: `fa3_default` (decode_attention with FA3's
default config: SGLang's FA3 backend's kernel, without the scheduler metadata SGLang
precomputes for it, so a slightly slower baseline), `tuner` (decode_attention as a plain capture
resolves it: the DB's graph record for the batch size and bound, else the frozen rule), and
`tuner_declared` (captured inside tuner.graph_capture(lengths) with the case's traffic), and
`tuner_variants` (tuner's base graph and a graph per variant beside it,
tuner.integrations.graph_variants, the step's own picked from its host lengths before each
replay: what SGLang's runner does with tuner's backend).
Cases: batch sizes x length caps x length distributions; a case's steps draw fresh lengths
from its distribution up to its cap. Time: CUDA events around the replays (the host step is
the same in every mode and left out), median over steps. Layers read one KV pool through
copies of the step's page table over different slots, enough copies that a step reads its
caches from memory, not the L2, where the pool has room (rotary embedding and the logits
head are left out: the same in every mode). The hidden state after the stack must
match fa3_default's within bf16 tolerance. Not SGLang itself: see the README's server section.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from common.case_runs import add_run_options, cases_of_this_run, done_rows, run_cases
from common.run_info import header
from common.stats import geomean

import tuner
from tuner.bench.trial import cold_l2_copies
from tuner.integrations.decode_attention import decode_attention
from tuner.integrations.graph_variants import GraphVariants
from tuner.ops.decode_attention import default_config
from tuner.workload import DecodeShape
from tuner.workload.traffic import DISTRIBUTIONS, draw_lengths

# public config.json values: hidden size, MLP width, layers, q heads, kv heads, head dim
MODELS = {
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 128),
    "qwen2.5-14b": (5120, 13824, 48, 40, 8, 128),
    "smoke": (64, 128, 2, 4, 2, 16),
}
MAX_CONTEXT = 131072  # the bound graphs are captured at (SGLang: the model's context length)
MAX_TOKENS = 2 * 2**20  # batch x cap at most: a step's tokens in the KV cache
FA3_DEFAULT = {"backend": "fa3", "num_splits": 0, "pack_gqa": None}
STEPS = 8
MODES = ("fa3_default", "tuner", "tuner_declared", "tuner_variants")


class Stack:
    """The model's layers with dummy weights, and one KV pool they all read, each layer through
    its own copy of the step's page table (tables())."""

    def __init__(self, model: str, device: str, dtype: torch.dtype, read_tokens: int, out_slots: int) -> None:
        hidden, inter, layers, heads, kv_heads, dim = MODELS[model]
        self.heads, self.kv_heads, self.dim, self.layers = heads, kv_heads, dim, layers
        gen = torch.Generator(device=device).manual_seed(0)

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=gen, device=device, dtype=dtype) / math.sqrt(cols)

        self.qkv = [weight((heads + 2 * kv_heads) * dim, hidden) for _ in range(layers)]
        self.o = [weight(hidden, heads * dim) for _ in range(layers)]
        self.gate_up = [weight(2 * inter, hidden) for _ in range(layers)]
        self.down = [weight(hidden, inter) for _ in range(layers)]
        # read_tokens slots the tables point at, then out_slots where the new tokens' K/V go
        self.out_slots = out_slots
        self.k = torch.randn(read_tokens + out_slots, 1, kv_heads, dim, generator=gen, device=device, dtype=dtype)
        self.v = torch.randn_like(self.k)

    def step(self, x: torch.Tensor, tables: list[torch.Tensor], lens: torch.Tensor, out_loc: torch.Tensor,
             bound: int, config: dict | None) -> torch.Tensor:
        """One decode step of every layer: the new tokens' K/V written to out_loc, attention over
        lens (which would include the new token in a server), layer i through tables[i % n]."""
        batch = x.shape[0]
        kwargs = {} if config is None else {"config": config}
        k_pool, v_pool = self.k, self.v
        for i in range(self.layers):
            table = tables[i % len(tables)]
            qkv = torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ self.qkv[i].T
            q, k, v = qkv.split([self.heads * self.dim, self.kv_heads * self.dim, self.kv_heads * self.dim], dim=-1)
            k_pool[out_loc, 0] = k.view(batch, self.kv_heads, self.dim)
            v_pool[out_loc, 0] = v.view(batch, self.kv_heads, self.dim)
            attn = decode_attention(q.view(batch, 1, self.heads, self.dim), k_pool, v_pool, table, lens, bound,
                                    **kwargs)
            x = x + attn.view(batch, -1) @ self.o[i].T
            gate, up = (torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ self.gate_up[i].T).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ self.down[i].T
        return x


def _tables(lens: list[int], width: int, span: int, copies: int, seed: int) -> list[torch.Tensor]:
    """copies page tables (page size 1, width columns) of the step's lengths, copy c giving
    each sequence its own shuffled slots of [c x span, (c + 1) x span): layers reading
    different copies read different memory, as a model's layers do."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(span, generator=gen).to(torch.int32)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(lens):
        table[i, :n] = order[taken:taken + n]
        taken += n
    return [table + c * span for c in range(copies)]


def table_copies(stack: Stack, span: int, device: str) -> int:
    """How many table copies a case's layers take in turn: enough that a step reads its caches
    from memory, not the L2 (tuner.bench.trial.cold_l2_copies of a copy's bytes), within the
    pool's read slots and the layer count."""
    per_token = 2 * stack.kv_heads * stack.dim * stack.k.element_size()
    room = (stack.k.shape[0] - stack.out_slots) // span
    return max(1, min(stack.layers, room, cold_l2_copies(span * per_token, device)))


def run_case(stack: Stack, case: dict, device: str, seed: int, baseline: dict) -> dict:
    batch, cap, dist = case["batch"], case["cap"], case["distribution"]
    width = MAX_CONTEXT if device == "cuda" else cap
    span = batch * cap  # the slots one copy of a step's tables may use
    copies = table_copies(stack, span, device)
    steps = [draw_lengths(dist, batch, cap, seed * 1000 + s) for s in range(STEPS + 1)]
    hosts = [_tables(lens, width, span, copies, seed * 1000 + s) for s, lens in enumerate(steps)]
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, stack.o[0].shape[0], generator=gen, device=device, dtype=stack.k.dtype)
    tables = [t.to(device) for t in hosts[0]]
    lens = torch.tensor(steps[0], dtype=torch.int32, device=device)
    # the new tokens' K/V go past every slot a table reads: no step reads what another wrote,
    # so every mode's steps read the same values
    out_loc = torch.arange(stack.k.shape[0] - batch, stack.k.shape[0], device=device)
    declared = draw_lengths(dist, 4096, cap, seed + 10**6)
    row = dict(case, steps=STEPS, table_copies=copies)
    outputs = {}
    variants = GraphVariants()
    q = torch.zeros(batch, 1, stack.heads, stack.dim, device=device, dtype=stack.k.dtype)
    for mode in MODES:
        config = baseline if mode == "fa3_default" else None
        run = (lambda: stack.step(x, tables, lens, out_loc, width, config))
        graphs = {None: _graph(run, declared if mode == "tuner_declared" else None, device)}
        picked = [None] * (STEPS + 1)
        if mode == "tuner_variants":  # a graph per variant beside the base graph, as SGLang's runner keeps them
            for variant in variants.plan(batch, [(q, stack.k, stack.v, tables[0], lens, width)]):
                graphs[variant.label] = _graph(run, variant.lengths, device)
            picked = [variants.label(batch, lengths) for lengths in steps]
        times, finals = [], []
        for s in range(1, STEPS + 1):
            for table, new in zip(tables, hosts[s]):  # the host step before a replay: pages and
                table.copy_(new)                      # lengths written in place
            lens.copy_(torch.tensor(steps[s], dtype=torch.int32))
            replay, out = graphs[picked[s]]
            if replay is None:  # on the CPU: the step run as it would be captured
                started = time.perf_counter()
                with tuner.graph_capture(out):
                    out = run()
                times.append((time.perf_counter() - started) * 1e3)
            else:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                replay()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            finals.append(out.float().clone())
        outputs[mode] = finals
        row[mode] = dict(step_ms=statistics.median(times), config=baseline if config else _config_of(
            stack, mode, batch, width, declared, tables[0], lens, device))
        if mode == "tuner_variants":
            row[mode]["variants_replayed"] = picked[1:]
    base = row["fa3_default"]["step_ms"]
    for mode in MODES[1:]:
        row[mode]["speedup"] = base / row[mode]["step_ms"]
        row[mode]["max_error_vs_default"] = max(float((a - b).abs().max())
                                                for a, b in zip(outputs[mode], outputs["fa3_default"]))
        # the same over the default's largest magnitude: the stack's hidden state is not unit-scaled
        row[mode]["relative_error_vs_default"] = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                                                     for a, b in zip(outputs[mode], outputs["fa3_default"]))
    return row


def _graph(run, lengths, device: str) -> tuple:
    """(replay, output) of the step captured at the bound after a warm-up call there, inside
    tuner.graph_capture(lengths) where lengths are given; on the CPU, (None, lengths): the
    step is run at each replay, under the same declaration."""
    if device != "cuda":
        return None, lengths
    with tuner.graph_capture(lengths) if lengths is not None else contextlib.nullcontext():
        run()  # the warm-up call at the bound, as a server makes one before capturing
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
    return graph.replay, out


def _config_of(stack: Stack, mode: str, batch: int, width: int, declared: list[int], table, lens, device) -> dict:
    """The attention config a tuner mode's capture ran (for the JSON)."""
    k = stack.k
    q = torch.zeros(batch, 1, stack.heads, stack.dim, device=device, dtype=k.dtype)
    with tuner.graph_capture(declared if mode == "tuner_declared" else None):
        return decode_attention.tuner.config_for(q, k, stack.v, table, lens, width)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(ap)
    ap.add_argument("--model", default="llama-3.1-8b", choices=[m for m in MODELS if m != "smoke"])
    ap.add_argument("--db", type=Path, help="the tuning DB (graph records) over the shipped tunings")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--caps", default="1024,4096,16384,32768")
    args = ap.parse_args()
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    model = "smoke" if args.smoke else args.model
    batches = (1, 3) if args.smoke else tuple(int(b) for b in args.batches.split(","))
    caps = (32,) if args.smoke else tuple(int(c) for c in args.caps.split(","))
    cases = [dict(model=model, batch=b, cap=c, distribution=d) for c in caps for b in batches
             for d in DISTRIBUTIONS if b * c <= MAX_TOKENS]
    if args.db is not None:
        tuner.configure(db=args.db, mode="lookup")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kv_heads, dim = MODELS[model][4:]
    most = max(b * c for b, c in ((case["batch"], case["cap"]) for case in cases))
    stack = Stack(model, device, dtype, read_tokens=most, out_slots=max(batches))
    todo = cases_of_this_run(ap, args, cases)

    def write(rows: list[dict]) -> dict:
        done = [r for r in rows if "error" not in r]
        doc = {**header("decode_step", started), "model": model, "max_context": MAX_CONTEXT, "cases": len(todo),
               "summary": {m: dict(geomean_speedup=geomean([r[m]["speedup"] for r in done]),
                                   slowest=min((r[m]["speedup"] for r in done), default=None),
                                   max_error_vs_default=max((r[m]["max_error_vs_default"] for r in done),
                                                            default=None),
                                   relative_error_vs_default=max((r[m]["relative_error_vs_default"] for r in done),
                                                                 default=None))
                           for m in MODES[1:]},
               "rows": rows}
        args.out.write_text(json.dumps(doc, indent=1, default=str))
        return doc

    # FA3's default; on the CPU (--smoke) the default backend's default, FA3 being unavailable there
    baseline = FA3_DEFAULT if device == "cuda" else default_config(DecodeShape(
        batch=1, kv_len=32, num_q_heads=stack.heads, num_kv_heads=kv_heads, head_dim=dim, dtype="float32"))
    rows = run_cases(todo, args.seconds, device, run=lambda i, case: run_case(stack, case, device, i, baseline),
                     fields=lambda case: case, write=write, done=done_rows(args),
                     describe=lambda r: "".join(f" {m} {r[m]['speedup']:.3f}x" for m in MODES[1:] if m in r))
    doc = write(rows)
    print(json.dumps(doc["summary"]), file=sys.stderr)


if __name__ == "__main__":
    main()
