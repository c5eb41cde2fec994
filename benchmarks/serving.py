"""decode_attention on decode traffic as servers make it: tuner against FA3's default and
against the oracle, per call and under CUDA graphs.

    python benchmarks/serving.py --out $OUT/serving.json [--seconds 540] [--resume]

(--resume: a run cut off by --seconds is finished by the same command with --resume, on
the JSON it wrote)

    python benchmarks/serving.py --combine WHOLE.json.xz RERUN.json.xz --out combined.json

(--combine: a run's rows with some cases re-timed by a later run, e.g. after a change that
touches one batch size, re-run with --batches: each later file's rows replace the earlier
ones' rows of the same case; the summaries are recomputed, each file's command kept)

Cases: head configurations (shipped ones and others) x batch sizes from a CUDA-graph capture
list (tuner.workload.traffic.CAPTURE_BATCHES) x length caps L from 1k to 128k (--caps) x length
distributions (tuner.workload.traffic.DISTRIBUTIONS). Modes, timed alike (CUDA graphs, cold
L2 by the bytes a call reads: tuner.workload.rotation):
- per_call: attention run with the true host-side max length, the page table as wide as
  the longest sequence (as a server slices it outside graphs, and under piecewise graphs);
- graph: one graph per batch size, captured with the server's max context (MAX_CONTEXT)
  as max_kv_len and page-table width, replayed over the case's lengths; the config is what
  the call resolves to inside a plain CUDA-graph capture after a warm-up call at that bound
  (as a server does it, without tuner.graph_capture), fixed for every replay;
- graph_unknown: the same graphs, captured inside tuner.graph_capture() with no lengths
  (unknown): a stored config is frozen only where it won at every kv bucket up to the bound
  for that batch size, else FA3's default;
- graph_declared: the same graphs, captured inside tuner.graph_capture(lengths) with the
  deployment's declared traffic (4096 lengths drawn from the case's distribution and cap,
  apart from the batch's own), so the frozen config is keyed on the lengths replays see:
  a declaration that matches each case's traffic, the best a declaration can do;
- graph_declared_pooled: the same graphs, with one declaration for the whole run (lengths
  pooled over every distribution and cap), as a server declaring all its traffic at once;
- graph_variants: several graphs per batch size at that bound, one per config set the records
  name over the lengths a replay may hold (tuner.integrations.graph_variants; the base graph
  is graph_unknown's), the one for the batch's host lengths replayed: what SGLang's decode
  graphs run with tuner's backend, no lengths declared;
- graph_variants_judged: the same, after tuner's replay judge (tuner.integrations.replay_judge)
  has timed the variant's graph against the base graph's over its first replays, pair by
  pair with its own events: the variant where it was no more than 1% slower, else the base
  graph. As a server's verdict comes from earlier steps of the class, the judge replays
  another draw of the case's distribution and cap in the same class of lengths (kv bucket,
  dense or not), or the case's own batch where JUDGE_DRAWS draws find none (the row's
  "graph_variants_judged_on"; "graph_variants_judge_ratio": the variant over the base).
For each mode: FA3's default, tuner (the config decode_attention resolves for the call: DB,
shipped tunings, borrowing rule, default; of a by_fill record, the config of the call's fill
or, in the declared modes, of the declared lengths'), and the oracle (every candidate config of the
whole space, unpruned (settings.FULL_SPACE), timed on exactly that batch, the fastest three re-timed side by side with the other
two). FlashInfer is left out of the space: its plan is host work per call, which a captured
decode graph cannot hold (tuner replaces a FlashInfer winner by the default under capture).
The JSON is written after every case, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from common import heads as head_configs
from common.case_runs import add_run_options, cases_of_this_run, done_rows, read_results, run_cases
from common.run_info import header
from common.stats import geomean

import tuner
from tuner import settings
from tuner.bench import CudaGraphTimer, WallClockTimer
from tuner.bench.trial import cold_l2_copies
from tuner.integrations.decode_attention import declared_branch, decode_attention, eager_config, graph_runs
from tuner.integrations.graph_variants import GraphVariants
from tuner.integrations.replay_judge import ReplayJudge
from tuner.keys import kv_len_bucket
from tuner.ops.decode_attention import BACKENDS, fill_branch
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.workload.rotation import bytes_read, fresh_page_copies
from tuner.workload.traffic import CAPTURE_BATCHES, DISTRIBUTIONS, draw_lengths, is_dense

SHIPPED = Path(__file__).resolve().parents[1] / "tuning_cache"
MAX_CONTEXT = 131072  # the graph mode's capture-time bound: max_kv_len and page-table width
# name: DecodeShape fields besides batch and kv_len. "shipped" ones have tunings in
# tuning_cache/; the others (the freshly swept keys) have none there
MODELS: dict[str, dict] = {
    "Llama-3.1-8B tp1 (shipped)": head_configs.LLAMA_8B_TP1,
    "Llama-3.1-70B tp8 (shipped)": head_configs.LLAMA_70B_TP8,
    "Qwen2.5-7B tp1 (shipped)": head_configs.QWEN_7B_TP1,
    "hd256 softcap50 window4095 (other)": head_configs.HD256_SOFTCAP_WINDOW,
    "hd64 sinks window127 (other)": head_configs.HD64_SINKS_WINDOW,
}
BATCHES = (1, 3, 8, 24, 64, 136, 256)  # drawn from CAPTURE_BATCHES
CAPS = (1024, 4096, 16384, 65536, 131072)
# --caps octaves: every kv bucket of a serving grid, for each of BATCHES (batch x cap within
# MAX_TOKENS). With CAPS a batch's longest sequence falls in the caps' own buckets from
# batch 24 up, so keys at kv 2k, 8k and 32k go unused there (where shipped grid winners lost
# most: docs/lab/issue12.md)
# --caps mid: three quarters of each octave, so a batch's longest sequence falls low or midway in
# its kv bucket, where the sweeps' trials (whose longest sits mostly near a bucket's top) put
# few batches; at batch 3 a record kept FA3's default 1.27x short of the oracle on such a batch
# (docs/decisions.md, "Dense pass")
CAP_SETS = {"issue": CAPS, "octaves": tuple(2**i for i in range(10, 18)),
            "mid": tuple(3 * 2**i for i in range(9, 16))}
MAX_TOKENS = 2 * 2**20  # batch x cap, beyond which a case is left out (time and memory)
MAX_TABLE_BYTES = 2**31  # the rotation's page tables in graph mode, at most
SCREEN_TOP = 3  # the oracle's finalists, re-timed side by side
JUDGE_DRAWS = 4  # graph_variants_judged: draws tried for a batch of the case's class to judge on
MODES = ("per_call", "graph", "graph_unknown", "graph_declared", "graph_declared_pooled", "graph_variants",
         "graph_variants_judged")
WIDE_MODES = MODES[1:]  # the modes whose calls carry the capture bound
# graph_declared_pooled's one declaration: 1024 lengths per distribution and cap
POOLED = [n for c in CAPS for d in DISTRIBUTIONS for n in draw_lengths(d, 1024, c, seed=7)]


def shipped_heads() -> dict[str, dict]:
    """Every head configuration the shipped tunings cover (tools/shapes/models.py), and the
    two unshipped ones of MODELS."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "shapes"))
    import models

    heads = {f"{deployments[0]} h{q}/{kv} (shipped)": dict(num_q_heads=q, num_kv_heads=kv, head_dim=d)
             for (q, kv, d), deployments in sorted(models.head_configs().items())}
    return heads | {name: spec for name, spec in MODELS.items() if "(other)" in name}


def cases(smoke: bool, heads: dict[str, dict] = MODELS, caps: tuple[int, ...] = CAPS) -> list[dict]:
    """Every case, ordered so that a run cut short still spans the models, sizes and lengths."""
    if smoke:
        return [dict(model="smoke", batch=b, cap=c, distribution=d) for b in (1, 3) for c in (64,)
                for d in DISTRIBUTIONS]
    assert all(b in CAPTURE_BATCHES for b in BATCHES)
    grid = [dict(model=m, batch=b, cap=c, distribution=d) for c in caps for b in BATCHES for d in DISTRIBUTIONS
            for m in heads if b * c <= MAX_TOKENS]
    # a stride through the grid that is coprime with its length visits every case once
    stride = next(s for s in range(len(grid) // 3, len(grid)) if math.gcd(s, len(grid)) == 1)
    return [grid[(i * stride) % len(grid)] for i in range(len(grid))]


def _resolved_in_capture(dispatch, args: tuple, kwargs: dict, device: str) -> dict:
    """The config a call at the capture bound resolves to inside a plain CUDA-graph capture,
    after a warm-up call at that bound outside it (on the CPU, with no capture, the warm-up's)."""
    dispatch.config_for(*args, **kwargs)  # the warm-up: memoised as an eager call's
    if device != "cuda":
        return dispatch.config_for(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph captures no kernel: "the CUDA Graph is empty"
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            config = dispatch.config_for(*args, **kwargs)
    return config


def _variant_replayed(dispatch, args: tuple, kwargs: dict, batch: int, host_lens, base: dict) -> tuple[dict, dict]:
    """(record, plain config) of the graph variant a server replays for a batch with these host
    lengths (GraphVariants.label), among those planned for its batch size at the bound of
    `args`; the base graph's config where the batch's lengths have no variant."""
    variants = GraphVariants()
    planned = {v.label: v for v in variants.plan(batch, [args])}
    label = variants.label(batch, host_lens)
    if label is None:
        return base, base
    with tuner.graph_capture(planned[label].lengths):
        record = dispatch.config_for(*args, **kwargs)
        # as the variant's capture runs it (a wave_fit record: FA3 at the variant's cap)
        return record, graph_runs(declared_branch(record, batch), args)


class _HostEvent:
    """A CUDA event's interface on the host's clock, for the judge where no GPU runs (smoke)."""

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.at - self.at) * 1e3


def _judged(calls, base: dict, variant: dict, batch: int, device: str) -> tuple[dict, float | None]:
    """(config, ratio): what the replay judge leaves a step of these calls, each graph a replay
    of the whole rotation (as the timer's): the variant, or the base graph's config where the
    variant ran slower by over the judge's tolerance; the verdict's ratio (None: no variant)."""
    if variant == base:
        return base, None
    runs = {label: _rotation(calls, config) for label, config in ((None, base), ("variant", variant))}
    replay = {}
    for label, rotation in runs.items():
        for run in rotation:  # warm-up: compiles, and plans nothing inside the capture
            run()
        if device == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for run in rotation:
                    run()
            replay[label] = graph.replay
        else:
            replay[label] = lambda rotation=rotation: [run() for run in rotation]
    # (replays alone: this loop's steps are not a server's, and hold nothing but the replays)
    judge = ReplayJudge(settings.REPLAY_JUDGE_PAIRS, settings.REPLAY_JUDGE_TOLERANCE, on_drop=lambda *a: None,
                        whole_steps=False, **({} if device == "cuda" else {"event": _HostEvent}))
    for _ in range(2 * settings.REPLAY_JUDGE_PAIRS):  # base and variant in turn, a pair per two steps
        with judge.replaying(batch, "variant") as label:
            replay[label]()
    if device == "cuda":
        torch.cuda.synchronize()
    judge.tick()  # reads the last pair
    ratio = judge.verdicts.get((batch, "variant"))
    return (base if judge.dropped(batch, "variant") else variant), ratio


def _calls(inputs, copies, max_kv_len: int, table_width: int | None, host_lens):
    """The rotation's call arguments: one per copy, the page table widened to table_width."""
    s = inputs.shape
    out = []
    for c in copies:
        table = c.page_table
        if table_width is not None:
            wide = torch.zeros(s.batch, -(-table_width // s.page_size), dtype=table.dtype, device=table.device)
            wide[:, :table.shape[1]] = table
            table = wide
        out.append(((c.q, c.k_cache, c.v_cache, table, c.cache_seqlens, max_kv_len, s.causal, s.window,
                     s.softcap, c.sinks), {} if host_lens is None else {"seq_lens_host": host_lens}))
    return out


def _rotation(calls, config):
    # each call's config resolved as its eager call would be (a wave_fit cap from its host
    # lengths): the timer captures the calls, and a capture alone would run FA3's default
    return [lambda a=a, k=k, c=eager_config(config, *a, **k): decode_attention(*a, **k, config=c) for a, k in calls]


def _time(timer, calls, configs: list[dict]) -> list[float | None]:
    """Side-by-side medians (us) of configs on the rotation; None where a config failed."""
    try:
        if hasattr(timer, "interleaved"):
            return [t.median_us for t in timer.interleaved([_rotation(calls, c) for c in configs])]
    except Exception:  # noqa: BLE001 - one config's failure: time them one by one
        pass
    out: list[float | None] = []
    for c in configs:
        try:
            out.append(timer(_rotation(calls, c)).median_us)
        except Exception:  # noqa: BLE001
            out.append(None)
    return out


def _step_class(lens: list[int]) -> tuple[int, bool]:
    """A batch's class of lengths, as GraphVariants.pick gives it (no padding)."""
    return kv_len_bucket(max(lens)), is_dense(sum(lens), len(lens), max(lens))


def _judge_batch(case: dict, spec: dict, lens: list[int], copies: int, device: str, seed: int):
    """The judge's graph-mode calls (the rotation at the capture bound): another draw of the
    case's traffic in its class of lengths, or None where JUDGE_DRAWS draws find none (the
    case's own batch is judged)."""
    for attempt in range(JUDGE_DRAWS):
        other = draw_lengths(case["distribution"], case["batch"], case["cap"], seed + (attempt + 2) * 10**6)
        if _step_class(other) == _step_class(lens):
            shape = DecodeShape(batch=case["batch"], kv_len=max(other), **spec)
            drawn = fresh_page_copies(make_decode_inputs(shape, device=device, seed=seed + 1, seq_lens=other), copies)
            return _calls(drawn[0], drawn, MAX_CONTEXT, MAX_CONTEXT, None)
    return None


def run_case(case: dict, spec: dict, device: str, final, screen, seed: int) -> dict:
    """One case's row: its batch, what each mode runs (tuned_per_mode), the oracle's finalists
    and every mode's default, tuner's pick and oracle timed side by side (timed_modes)."""
    lens = draw_lengths(case["distribution"], case["batch"], case["cap"], seed)
    kv_max = max(lens)
    shape = DecodeShape(batch=case["batch"], kv_len=kv_max, **spec)
    inputs = make_decode_inputs(shape, device=device, seed=seed, seq_lens=lens)
    host_lens = inputs.seq_lens_host
    read = bytes_read(inputs)
    n = cold_l2_copies(read, device)
    if device == "cuda":  # the graph mode's wide tables, all copies together, within bounds
        per_table = case["batch"] * -(-MAX_CONTEXT // shape.page_size) * 4
        n = max(1, min(n, MAX_TABLE_BYTES // per_table))
    copies = fresh_page_copies(inputs, n)
    del inputs
    row = dict(case, kv_max=kv_max, kv_mean=sum(lens) / len(lens), bytes_read=read, copies=n)
    calls = {"per_call": _calls(copies[0], copies, kv_max, None, host_lens),
             **dict.fromkeys(WIDE_MODES, _calls(copies[0], copies, MAX_CONTEXT, MAX_CONTEXT, None))}
    defaults, tuned, stored = tuned_per_mode(case, calls, host_lens, kv_max, device, seed)
    judge_calls = None
    if tuned["graph_variants"] != tuned["graph_unknown"]:
        judge_calls = _judge_batch(case, spec, lens, n, device, seed)
    row["graph_variants_judged_on"] = "this batch" if judge_calls is None else "another draw"
    tuned["graph_variants_judged"], row["graph_variants_judge_ratio"] = _judged(
        judge_calls or calls["graph"], tuned["graph_unknown"], tuned["graph_variants"], case["batch"], device)
    del judge_calls
    stored["graph_variants_judged"] = tuned["graph_variants_judged"]
    row.update(default=defaults, tuner=tuned, **({"tuner_record": stored} if stored != tuned else {}))
    finalists = oracle_finalists(calls["per_call"], screen, row)
    row.update(timed_modes(final, calls, defaults, tuned, finalists))
    return row


def tuned_per_mode(case: dict, calls: dict[str, list], host_lens, kv_max: int, device: str,
                   seed: int) -> tuple[dict, dict, dict]:
    """Per mode (but graph_variants_judged): FA3's default, the plain config tuner runs there,
    and the record its lookup served (a by_fill record where it holds one)."""
    dispatch = decode_attention.tuner
    (a, k), (ga, gk) = calls["per_call"][0], calls["graph"][0]
    # what a deployment declares at capture: its traffic's lengths (a sample of this case's
    # distribution, not this batch's own lengths)
    declared = draw_lengths(case["distribution"], 4096, case["cap"], seed + 10**6)
    # (the record each lookup served, and the plain config a call captured there runs)
    with tuner.graph_capture(declared):
        declared_record = dispatch.config_for(*ga, **gk)
        declared_config = declared_branch(declared_record, case["batch"])
    with tuner.graph_capture(POOLED):
        pooled_record = dispatch.config_for(*ga, **gk)
        pooled_config = declared_branch(pooled_record, case["batch"])
    with tuner.graph_capture():  # lengths unknown
        unknown_config = dispatch.config_for(*ga, **gk)
    variant_record, variant_config = _variant_replayed(dispatch, ga, gk, case["batch"], host_lens, unknown_config)
    graph_config = _resolved_in_capture(dispatch, ga, gk, device)
    defaults = {"per_call": dispatch.default(a, k), **{m: dispatch.default(ga, gk) for m in WIDE_MODES}}
    tuned = {"per_call": dispatch.config_for(*a, **k), "graph": graph_config,
             "graph_unknown": unknown_config, "graph_declared": declared_config,
             "graph_declared_pooled": pooled_config, "graph_variants": variant_config}
    # a by_fill record runs the config of its call's fill (per call: these host lengths; a
    # graph captured in graph_capture(lengths): the declared lengths'; any other captured
    # graph: its config for any batch); that plain config is timed, as it runs
    stored = dict(tuned, graph_declared=declared_record, graph_declared_pooled=pooled_record,
                  graph_variants=variant_record)
    tuned = {m: fill_branch(c, host_lens if m == "per_call" else None, kv_max, case["batch"])
             for m, c in tuned.items()}
    return defaults, tuned, stored


def oracle_finalists(per_call: list, screen, row: dict) -> list[dict]:
    """The oracle's SCREEN_TOP finalists: every candidate screened on exactly this batch (per
    call), fastest first; the row gets the candidates' count and every screened time."""
    a, k = per_call[0]
    candidates = decode_attention.tuner.configs(a, k)
    screened = []
    for config in candidates:
        try:
            screened.append((screen(_rotation(per_call, config)).median_us, config))
        except Exception:  # noqa: BLE001 - a config that cannot run this batch is no oracle
            continue
    screened.sort(key=lambda t: t[0])
    row["candidates"] = len(candidates)
    row["screen_us"] = [[round(t, 3), c] for t, c in screened]  # every config that ran, fastest first
    return [c for _, c in screened[:SCREEN_TOP]]


def timed_modes(final, calls: dict[str, list], defaults: dict, tuned: dict, finalists: list[dict]) -> dict:
    """Per mode, its default, tuner's config and the oracle (the fastest of those and the
    finalists) timed side by side on the mode's calls (per call: narrow tables; the graph
    modes: one table at the capture bound), and tuner's output against the default's."""
    a, k = calls["per_call"][0]
    reference = decode_attention(*a, **k, config=defaults["per_call"])
    out_row = {}
    for modes in (("per_call",), WIDE_MODES):
        distinct: list[dict] = []
        for c in [defaults[m] for m in modes] + [tuned[m] for m in modes] + finalists:
            if c not in distinct:
                distinct.append(c)
        us = _time(final, calls[modes[0]], distinct)
        by = {json.dumps(c, sort_keys=True): t for c, t in zip(distinct, us)}
        o_us, oracle = min(((t, json.loads(c)) for c, t in by.items() if t is not None), key=lambda x: x[0])
        for mode in modes:
            d_us, t_us = by[json.dumps(defaults[mode], sort_keys=True)], by[json.dumps(tuned[mode], sort_keys=True)]
            out = decode_attention(*calls[mode][0][0], **calls[mode][0][1], config=tuned[mode])
            error = float((out.float() - reference.float()).abs().max())
            out_row[mode] = dict(default_us=d_us, tuner_us=t_us, oracle_us=o_us, oracle=oracle,
                                 tuner_speedup=d_us / t_us if d_us and t_us else None,
                                 oracle_speedup=d_us / o_us if d_us else None, tuner_max_error_vs_default=error)
    return out_row


def summary(rows: list[dict], mode: str) -> dict:
    done = [r[mode] for r in rows if mode in r and r[mode]["tuner_speedup"] and r[mode]["oracle_speedup"]]
    # tuner's pick failed to run or time where the default ran: counted, never dropped unseen
    failed = sum(1 for r in rows if mode in r and r[mode]["default_us"] and not r[mode]["tuner_speedup"])
    gt = geomean([d["tuner_speedup"] for d in done])
    go = geomean([d["oracle_speedup"] for d in done])
    return {
        "cases": len(done),
        "tuner_failed": failed,
        "tuner_over_default_geomean": gt,
        "oracle_over_default_geomean": go,
        # share of the oracle's gain tuner captures, in log terms: ln(tuner) / ln(oracle)
        "share_of_oracle_gain": (math.log(gt) / math.log(go)) if gt and go and go > 1 else None,
        "tuner_worst_over_default": min((d["tuner_speedup"] for d in done), default=None),
        "slower_than_default_by_2pct": sum(d["tuner_speedup"] < 1 / 1.02 for d in done),
        "tuner_kept_default": sum(r["tuner"][mode] == r["default"][mode] for r in rows if mode in r),
    }


def write(out: Path, rows: list[dict], planned: int, started: float, heads: dict[str, dict],
          head: dict | None = None) -> dict:
    """The run's JSON: its header (by default this run's: header()), the summaries, the rows."""
    modes = MODES
    doc = {
        **(head or header("serving", started)),
        "cases_planned": planned,
        "capture_batches": list(CAPTURE_BATCHES),
        "max_context": MAX_CONTEXT,
        "models": heads,
        "summary": {m: dict(summary(rows, m),
                            by_distribution={d: summary([r for r in rows if r.get("distribution") == d], m)
                                             for d in DISTRIBUTIONS},
                            by_model={name: summary([r for r in rows if r.get("model") == name], m)
                                      for name in heads})
                    for m in modes},
        "rows": rows,
    }
    out.write_text(json.dumps(doc, indent=1, default=str))
    return doc


CASE_FIELDS = ("model", "batch", "cap", "distribution")
# the options that change what a case measures: runs that differ in one cannot be combined
# (--models, --batches, --limit, --part, --seconds and --resume only choose which cases run)
SAME_OPTIONS = {"--db": None, "--heads": "issue", "--caps": "issue"}


def _options(command: str | None) -> dict[str, str | None]:
    """SAME_OPTIONS' values in a run's command line."""
    words = shlex.split(command or "")
    found = dict(SAME_OPTIONS)
    for i, word in enumerate(words):
        name, _, value = word.partition("=")
        if name in found:
            found[name] = value or (words[i + 1] if i + 1 < len(words) else None)
    return found


def combine(paths: list[Path], out: Path) -> dict:
    """One JSON of several runs' rows, a later file's row replacing an earlier one's of the
    same case (CASE_FIELDS), unless it holds an error where the earlier did not; the runs
    must share their environment, capture bound, SAME_OPTIONS and the specs of the head
    configurations they share, else ValueError. Its header says which files and commands
    its rows came from."""
    docs = [read_results(p) for p in paths]
    first = docs[0]
    heads: dict[str, dict] = {}
    for path, doc in zip(paths, docs):
        for field in ("benchmark", "environment", "max_context"):
            if doc.get(field) != first.get(field):
                raise ValueError(f"{path.name}: its {field} is not {paths[0].name}'s, so its rows cannot stand "
                                 "beside them")
        if _options(doc.get("command")) != _options(first.get("command")):
            raise ValueError(f"{path.name}: its {', '.join(SAME_OPTIONS)} are not {paths[0].name}'s")
        for name, spec in doc.get("models", {}).items():
            if heads.setdefault(name, spec) != spec:
                raise ValueError(f"{path.name}: its head configuration {name!r} is not the earlier files'")
    by_case: dict[tuple, dict] = {}
    for doc in docs:
        for row in doc["rows"]:
            case = tuple(row.get(f) for f in CASE_FIELDS)
            if "error" not in row or "error" in by_case.get(case, {"error": True}):
                by_case[case] = row
    head = {"benchmark": first["benchmark"], "command": "python " + " ".join(sys.argv),
            "combined_from": [{"file": p.name, "command": d.get("command"), "when": d.get("when"),
                               "rows": len(d["rows"])} for p, d in zip(paths, docs)],
            "environment": first["environment"], "seconds": sum(d.get("seconds", 0) for d in docs)}
    return write(out, list(by_case.values()), max(d.get("cases_planned", 0) for d in docs), 0.0, heads, head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(ap)
    ap.add_argument("--combine", nargs="+", type=Path, metavar="JSON",
                    help="run nothing: write --out from these runs' JSON files (plain or .xz), each later "
                         "file's rows replacing the earlier ones' rows of the same case, summaries recomputed")
    ap.add_argument("--db", type=Path, help="the user DB over the shipped tunings (default: none, shipped only)")
    ap.add_argument("--heads", default="issue",
                    help="issue: MODELS (3 shipped head configurations, 2 others); shipped: all 11 shipped ones "
                         "and the 2 others; or one head configuration as Q/KV [hdD] [windowW] [softcapC] [sinks] "
                         "(e.g. \"48/8\")")
    ap.add_argument("--models", help="only the head configurations whose name holds this text (e.g. \"(other)\")")
    ap.add_argument("--caps", choices=tuple(CAP_SETS), default="issue",
                    help="issue: length caps 1k, 4k, 16k, 64k, 128k; octaves: every power of two from 1k to 128k, "
                         "so each batch size reaches every kv bucket; mid: 1.5k, 3k, ... 96k, three quarters of "
                         "each octave, so a batch's longest falls low or midway in its kv bucket")
    ap.add_argument("--batches", help="only the cases of these batch sizes, comma-separated (e.g. 1: re-time the "
                                      "cases a change at batch 1 touches); each keeps its seed from the whole run")
    args = ap.parse_args()
    if args.combine:
        try:
            doc = combine(args.combine, args.out)
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--combine: {e}")
        print_summary(doc)
        return
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    BACKENDS.pop("flashinfer", None)  # see the docstring: not graph-capturable
    settings.FULL_SPACE = True  # the oracle searches the whole space, so what pruning costs shows
    db = args.db or Path(tempfile.mkdtemp()) / "none.db"
    tuner.configure(db=db, shipped=SHIPPED, mode="lookup")
    if device == "cuda":
        final, screen = CudaGraphTimer(warmup=2, repeats=15), CudaGraphTimer(warmup=1, repeats=3)
    else:
        final, screen = WallClockTimer(warmup=1, repeats=3, min_repeats=3), WallClockTimer(
            warmup=1, repeats=2, min_repeats=2)
    if args.smoke:
        heads = {"smoke": dict(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")}
    else:
        heads = {"issue": MODELS}.get(args.heads) or (shipped_heads() if args.heads == "shipped" else None)
        if heads is None:
            try:
                heads = {f"h{args.heads} (new)": head_configs.parse_spec(args.heads)}
            except ValueError as e:
                ap.error(str(e))
    if args.models:
        heads = {name: spec for name, spec in heads.items() if args.models in name}
        if not heads:
            ap.error(f"--models {args.models!r} names no head configuration")
    todo = cases_of_this_run(ap, args, cases(args.smoke, heads, CAP_SETS[args.caps]))
    if args.batches:
        try:
            batches = {int(b) for b in args.batches.split(",")}
        except ValueError:
            ap.error(f"--batches takes batch sizes, comma-separated, got {args.batches!r}")
        todo = [(i, case) for i, case in todo if case["batch"] in batches]
        if not todo:
            ap.error(f"--batches {args.batches} leaves no case")
    started = time.perf_counter()

    def describe(row: dict) -> str:
        return "".join(f" {m} {row[m]['tuner_speedup']:.3f}/{row[m]['oracle_speedup']:.3f}" for m in MODES if m in row)

    rows = run_cases(todo, args.seconds, device,
                     run=lambda i, case: run_case(case, heads[case["model"]], device, final, screen, seed=i),
                     fields=lambda case: case, describe=describe,
                     write=lambda done: write(args.out, done, len(todo), started, heads), done=done_rows(args))
    print_summary(write(args.out, rows, len(todo), started, heads))


def print_summary(doc: dict) -> None:
    for m, sm in doc["summary"].items():
        print(m, json.dumps({k: v for k, v in sm.items() if not k.startswith("by_")}, default=str))


if __name__ == "__main__":
    main()
