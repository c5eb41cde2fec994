"""SGLang's own offline benchmark (`sglang.bench_one_batch`: a static batch, prefill, then decode
steps in SGLang's CUDA graphs) with tuner's attention backend against SGLang's fa3, flashinfer
and triton backends, dummy weights from a public config.json, each backend in its own process.

    python benchmarks/sglang_e2e.py --out $OUT/sglang_e2e.json --model llama-3.1-8b \\
        [--backends tuner,fa3,flashinfer,triton] [--batches 1,8,32,128] \\
        [--input-lens 1024,4096,16384,32768] [--output-len 32] [--db graph.db]

For each backend: bench_one_batch's median decode latency and throughput per (batch,
input length), from its result file; then the logits of the first decode steps of one small
batch (fixed token ids fed at every step, so every backend decodes the same inputs), compared
with the fa3 backend's relative to their largest magnitude. The tuner backend is SGLang's FA3
backend whose plain decode runs decode_attention (tuner.integrations.sglang), registered in
the worker process before SGLang parses its arguments; --db is its TUNER_DB (graph records
for the model's key: `tuner sweep decode_attention_graph --grid serving --model M`). The JSON
is written after every backend; --resume keeps the backends it holds. Needs SGLang, its
dependencies and a GPU: `bash tools/prepare_sglang.sh` here, then on the GPU machine
`bash .gpu/sglang/install` after the staging of ../shared/gpu/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.run_info import header

# public config.json values (Hugging Face), enough for SGLang to build the model with dummy weights
CONFIGS = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "rope_scaling": {
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
        "max_window_layers": 28, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "use_sliding_window": False, "vocab_size": 152064, "bos_token_id": 151643, "eos_token_id": 151645,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}
BUILT_IN = ("fa3", "flashinfer", "triton")
LOGITS_BATCH, LOGITS_INPUT, LOGITS_STEPS = 4, 2048, 4


def _special(token_id: int, content: str) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def write_model_dir(model: str, path: Path) -> Path:
    """config.json, and a tokenizer of a few words: bench_one_batch loads one whatever its
    flags, from tokenizer.json and tokenizer_config.json both, and feeds token ids it draws
    itself (below 10000), so the tokenizer never encodes a prompt."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIGS[model], indent=1))
    specials = ["<unk>", "<s>", "</s>"]
    (path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_special(i, t) for i, t in enumerate(specials)], "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(specials + ["a", "the"])},
                  "unk_token": "<unk>"}}))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": CONFIGS[model]["max_position_embeddings"], "clean_up_tokenization_spaces": False}))
    return path


def bench_argv(model_dir: Path, backend: str, args: argparse.Namespace, result: Path) -> list[str]:
    """SGLang's arguments for bench_one_batch's latency test."""
    return ["--model-path", str(model_dir), "--load-format", "dummy", "--attention-backend", backend,
            "--batch-size", *args.batches.split(","), "--input-len", *args.input_lens.split(","),
            "--output-len", str(args.output_len), "--result-filename", str(result), "--run-name", backend,
            "--mem-fraction-static", str(args.mem_fraction)]


def summarize(rows: dict[str, list[dict]]) -> list[dict]:
    """Per (batch, input length): each backend's median decode throughput, and tuner's over
    the best built-in backend's (where both ran)."""
    table: dict[tuple[int, int], dict] = {}
    for backend, results in rows.items():
        for r in results:
            entry = table.setdefault((r["batch_size"], r["input_len"]), {"batch": r["batch_size"],
                                                                         "input_len": r["input_len"]})
            entry[backend] = r.get("median_decode_throughput")
    out = []
    for key in sorted(table):
        entry = table[key]
        built_in = {b: entry[b] for b in BUILT_IN if entry.get(b)}
        if entry.get("tuner") and built_in:
            best = max(built_in, key=built_in.get)
            entry.update(best_built_in=best, tuner_over_best=entry["tuner"] / built_in[best])
        out.append(entry)
    return out


def logits_agreement(reference, other) -> float:
    """max |a - b| over max |a|, over every step's logits."""
    return float((other.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-30))


def run_worker(mode: str, backend: str, argv: list[str], logits_out: Path | None, db: str | None,
               log: Path, timeout_s: float) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # nothing on this path needs a network
    if db:
        env["TUNER_DB"] = db
    command = [sys.executable, __file__, "--worker", mode, "--worker-backend", backend,
               *(["--worker-logits", str(logits_out)] if logits_out else []), "--", *argv]
    with log.open("a") as out:
        try:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return 124


def worker(mode: str, backend: str, logits_out: str | None, argv: list[str]) -> None:
    """In its own process: SGLang's benchmark (mode "latency") or the first decode steps'
    logits of one small batch (mode "logits"), with the tuner backend registered (bench_one_batch
    loads no plugins, and tuner is not installed where it runs from a checkout)."""
    if backend == "tuner":
        from tuner.integrations.sglang import register

        register()
    from sglang.benchmark import one_batch

    sys.argv = ["bench_one_batch", *argv]
    if mode == "latency":
        one_batch.cli_main()
        return
    import numpy as np
    import torch
    from sglang.srt.server_args import PortArgs, ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    one_batch.BenchArgs.add_cli_args(parser)
    server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
    runner, _ = one_batch.load_model(server_args, PortArgs.init_new(server_args), 0, 0)
    np.random.seed(0)
    reqs = one_batch.prepare_synthetic_inputs_for_latency_test(LOGITS_BATCH, LOGITS_INPUT)
    _, logits, batch = runner.extend(reqs)
    steps = [logits]
    for step in range(LOGITS_STEPS):  # the same token ids for every backend, not its own samples
        ids = torch.full((LOGITS_BATCH,), 100 + step, dtype=torch.int64, device=logits.device)
        _, logits = runner.decode(ids, batch)
        steps.append(logits)
    torch.save(torch.stack([s.float().cpu() for s in steps]), logits_out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the JSON to write")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(CONFIGS))
    ap.add_argument("--backends", default="tuner,fa3,flashinfer,triton")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--input-lens", default="1024,4096,16384,32768")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--db", help="TUNER_DB for the tuner backend (its graph records)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds a backend's worker may take")
    ap.add_argument("--resume", action="store_true", help="keep the backends --out already holds")
    ap.add_argument("--worker", choices=("latency", "logits"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-backend", help=argparse.SUPPRESS)
    ap.add_argument("--worker-logits", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.worker:
        worker(args.worker, args.worker_backend, args.worker_logits, rest[1:] if rest[:1] == ["--"] else rest)
        return
    if not args.out:
        ap.error("--out is required")
    started = time.perf_counter()
    out = Path(args.out)
    doc = json.loads(out.read_text()) if args.resume and out.exists() else {}
    results, logits_files = doc.get("results", {}), doc.get("logits_files", {})
    work = Path(tempfile.mkdtemp(prefix="sglang-e2e-"))
    model_dir = write_model_dir(args.model, work / args.model)
    for backend in args.backends.split(","):
        if backend in results:
            continue
        result, log, logits = work / f"{backend}.jsonl", out.with_suffix(f".{backend}.log"), work / f"{backend}.pt"
        rc = run_worker("latency", backend, bench_argv(model_dir, backend, args, result), None, args.db, log,
                        args.timeout)
        rows = [json.loads(line) for line in result.read_text().splitlines()] if result.exists() else []
        small = bench_argv(model_dir, backend, argparse.Namespace(**{**vars(args), "batches": str(LOGITS_BATCH),
                                                                     "input_lens": str(LOGITS_INPUT)}), result)
        logits_rc = run_worker("logits", backend, small, logits, args.db, log, args.timeout)
        results[backend] = dict(exit_code=rc, logits_exit_code=logits_rc, rows=rows)
        if logits.exists():
            logits_files[backend] = str(logits)
        agreement = {}
        if "fa3" in logits_files:
            import torch

            reference = torch.load(logits_files["fa3"])
            agreement = {b: logits_agreement(reference, torch.load(f)) for b, f in logits_files.items() if b != "fa3"}
        doc = dict(header("sglang_e2e", started), model=args.model, config=CONFIGS[args.model],
                   batches=args.batches, input_lens=args.input_lens, output_len=args.output_len,
                   results=results, logits_files=logits_files,
                   logits_vs_fa3_relative_max_error=agreement,
                   summary=summarize({b: r["rows"] for b, r in results.items()}))
        out.write_text(json.dumps(doc, indent=1))
        print(f"{backend}: exit {rc}, {len(rows)} rows; logits exit {logits_rc}", flush=True)
    for entry in doc.get("summary", []):
        print(json.dumps(entry), flush=True)


if __name__ == "__main__":
    main()
