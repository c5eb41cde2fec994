"""Which of FlashInfer's companion packages its decode and prefill wrappers really import.

Imports flashinfer, plans and runs the paged decode wrapper (CUDA cores and tensor cores)
and the paged prefill wrapper (FA2 and FA3) on a small problem, then lists which companion
packages ended up in sys.modules (and which are installed at all). Run on a GPU:

    python benchmarks/flashinfer_imports.py --out results.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from importlib import metadata

import torch

# FlashInfer 0.7.2.post1's Requires-Dist beyond torch: the module each one provides
COMPANIONS = {
    "apache-tvm-ffi": "tvm_ffi", "cuda-python": "cuda.bindings", "cuda-tile": "cuda.tile",
    "nvidia-cudnn-frontend": "cudnn", "nccl4py": "nccl", "nccl-extensions": "nccl_ep",
    "nvidia-cutlass-dsl": "cutlass", "nvidia-ml-py": "pynvml", "einops": "einops", "click": "click",
    "ninja": "ninja", "tabulate": "tabulate", "requests": "requests", "tqdm": "tqdm", "packaging": "packaging",
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    installed = {dist: _installed(mod) for dist, mod in COMPANIONS.items()}  # before any import
    import flashinfer

    ran = []
    batch, pages, page_size, heads, kv_heads, dim = 3, 64, 16, 32, 8, 128
    k = torch.randn(batch * pages, page_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.arange(batch * pages, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), page_size, dtype=torch.int32)
    workspace = torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda")
    for use_tc in (False, True):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tc)
        w.plan(indptr, indices, last, heads, kv_heads, dim, page_size, q_data_type=torch.bfloat16)
        w.run(torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16), (k, v))
        ran.append(f"decode use_tensor_cores={use_tc}")
    for backend in ("fa2", "fa3"):
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
        qo = torch.arange(batch + 1, dtype=torch.int32) * 2
        w.plan(qo, indptr, indices, last, heads, kv_heads, dim, page_size, causal=True, q_data_type=torch.bfloat16)
        w.run(torch.randn(batch * 2, heads, dim, device="cuda", dtype=torch.bfloat16), (k, v))
        ran.append(f"prefill backend={backend}")
    torch.cuda.synchronize()
    imported = {dist: any(m == mod or m.startswith(mod + ".") for m in sys.modules) for dist, mod in COMPANIONS.items()}
    versions = {}
    for dist in COMPANIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    result = {"flashinfer": flashinfer.__version__, "torch": torch.__version__, "ran": ran,
              "companions": {d: {"installed": installed[d], "imported": imported[d], "version": versions[d]}
                             for d in COMPANIONS},
              "command": "python benchmarks/flashinfer_imports.py " + " ".join(sys.argv[1:])}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
