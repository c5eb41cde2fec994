"""Attention shapes of common models at tensor-parallel sizes 1, 2, 4 and 8: the grids the
shipped H200 tunings (tuning_cache/) were swept over.

    python tools/shapes/models.py            # writes tools/shapes/models_*.json

models_serving.json is issue 12's serving grid (every capture batch size x kv 32-128k on
mixed-length batches, and MTP verify), for `tools/shipped_sweeps.py --set serving`.

Per GPU, a model's attention is (q heads / tp, max(1, kv heads / tp)) heads of dim 128
(kv heads are replicated once tp exceeds them, as vLLM and SGLang do); a tp that does not
divide the q heads is not a valid deployment and is left out. Models sharing a per-GPU head
configuration share its tunings, so each is swept once (tools/shipped_sweeps.py
splits them over the GPUs it is given).
"""

from __future__ import annotations

import json
from pathlib import Path

from tuner.workload.models import known_model
from tuner.workload.traffic import CAPTURE_BATCHES, SERVING_KV

HERE = Path(__file__).resolve().parent

# the models whose head configurations were shipped, by their names in tuner's model table
# (tuner.workload.models): name -> (q heads, kv heads, head dim) of their one attention kind
SHIPPED_MODELS = ("Llama-3.1-8B", "Llama-3.1-70B", "Qwen2.5-7B", "Qwen2.5-72B", "Qwen3-8B", "Qwen3-32B",
                  "Qwen3-30B-A3B", "Mistral-7B-v0.3", "Mistral-Nemo-12B", "Mistral-Small-24B")
MODELS = {name: (a.num_q_heads, a.num_kv_heads, a.head_dim)
          for name in SHIPPED_MODELS for (a,) in [known_model(name)]}
TP_SIZES = (1, 2, 4, 8)
PAGE_SIZES = {"decode_attention": 1, "fa3": 1, "flashinfer": 16}  # SGLang/LightLLM page 1; vLLM 16

DECODE_BATCHES, DECODE_KV = (1, 4, 16, 64, 256), (512, 2048, 8192, 32768, 131072)
DECODE_MAX_TOKENS = 4 * 2**20  # batch x kv beyond this is past a serving budget at these sizes
PREFILL = [(b, q, kv) for q in (128, 1024) for b in (1, 8) for kv in (4096, 32768)]


def head_configs() -> dict[tuple[int, int, int], list[str]]:
    """(q heads, kv heads, head dim) per GPU -> the "model tpN" deployments that run it."""
    out: dict[tuple[int, int, int], list[str]] = {}
    for name, (q, kv, d) in MODELS.items():
        for tp in TP_SIZES:
            if q % tp:
                continue
            out.setdefault((q // tp, max(1, kv // tp), d), []).append(f"{name} tp{tp}")
    return out


def decode_shapes(q: int, kv: int, d: int, page_size: int) -> list[dict]:
    return [
        {"batch": b, "kv_len": n, "num_q_heads": q, "num_kv_heads": kv, "head_dim": d, "page_size": page_size}
        for b in DECODE_BATCHES for n in DECODE_KV if b * n <= DECODE_MAX_TOKENS
    ]


def prefill_shapes(q: int, kv: int, d: int, page_size: int) -> list[dict]:
    return [
        {"batch": b, "q_len": ql, "kv_len": n, "num_q_heads": q, "num_kv_heads": kv, "head_dim": d,
         "page_size": page_size}
        for b, ql, n in PREFILL
    ]


def serving_shapes(q: int, kv: int, d: int, page_size: int) -> list[dict]:
    """Issue 12's serving grid: every capture batch size x kv bucket, each shape a mix of
    serving batches (tuner.workload.traffic); and MTP verify (2 and 4 query tokens) on mixed
    lengths at a few batch sizes."""
    heads = {"num_q_heads": q, "num_kv_heads": kv, "head_dim": d, "page_size": page_size, "lengths": "serving"}
    decode = [dict(batch=b, kv_len=n, **heads) for b in CAPTURE_BATCHES for n in SERVING_KV if b * n <= DECODE_MAX_TOKENS]
    mtp = [dict(batch=b, kv_len=n, q_len=ql, **heads) for ql in (2, 4) for b in (1, 4, 16, 64)
           for n in (2048, 8192, 32768, 131072) if b * n <= DECODE_MAX_TOKENS]
    return decode + mtp


# (file, shapes, op), in the order the shipped sweeps run them
SWEEPS = (
    ("models_decode.json", decode_shapes, "decode_attention"),
    ("models_decode16.json", decode_shapes, "flashinfer"),
    ("models_prefill.json", prefill_shapes, "fa3"),
    ("models_decode.json", decode_shapes, "fa3"),  # the FA3 drop-in's own winners
)
# the serving-true sweeps (issue 12): `tools/shipped_sweeps.py --set serving`
SERVING_SWEEPS = (
    ("models_serving.json", serving_shapes, "decode_attention"),
    ("models_serving.json", serving_shapes, "fa3"),
)


def main() -> None:
    configs = head_configs()
    order = sorted(configs, key=lambda c: (-c[0] * c[2], -c[1]))  # biggest first
    files = {}
    for name, make, op in SWEEPS + SERVING_SWEEPS:
        shapes = [s for c in order for s in make(*c, PAGE_SIZES[op])]
        if name in files:  # another op sweeps the same file
            files[name]["ops"].append(op)
            continue
        (HERE / name).write_text(json.dumps(shapes, indent=0) + "\n")
        files[name] = {"ops": [op], "shapes": len(shapes)}
    index = {
        "models": {name: {"num_q_heads": q, "num_kv_heads": kv, "head_dim": d} for name, (q, kv, d) in MODELS.items()},
        "tp_sizes": list(TP_SIZES),
        "head_configs": [
            {"num_q_heads": q, "num_kv_heads": kv, "head_dim": d, "deployments": deps}
            for (q, kv, d), deps in sorted(configs.items())
        ],
        "files": files,
    }
    (HERE / "models.json").write_text(json.dumps(index, indent=1) + "\n")
    for name, f in files.items():
        print(f"{name}: {f['shapes']} shapes for {', '.join(f['ops'])}")


if __name__ == "__main__":
    main()
