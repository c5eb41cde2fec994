"""Compile tuner's Triton decode kernels for an H100/H200 (sm_90) on a machine with no GPU, as
the GPU would build them: the CUDA config space, the compiled (not interpreted) kernels, down
to a cubin. The interpreter runs the kernels' arithmetic on the CPU but builds nothing, so
this is what catches what only compilation sees (types, layouts, constexpr branches).

    python tests/support/compile_for_hopper.py OUT.json

Writes {"triton", "variants": [{shape, config, kernels}], "errors": [...], "max_shared_bytes"};
exits 1 on any error, or a kernel that needs more shared memory than an sm_90 block has.
Run it in its own process: it needs Triton imported without TRITON_INTERPRET and replaces
Triton's active driver with a stand-in that names the target.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

SM90_SMS = 132  # an H200's
SM90_SHARED_BYTES = 232448  # the most shared memory one block may take on sm_90 (227 KiB)


class Sm90Target:
    """What JITFunction.run asks of the active driver when it only builds a kernel."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


# every static-key feature the kernels branch on, each in a shape of its own
SHAPES = {
    "plain": dict(num_q_heads=32, num_kv_heads=8, head_dim=128),
    "window_softcap_d256": dict(num_q_heads=16, num_kv_heads=8, head_dim=256, window=(4095, 0), softcap=50.0),
    "sinks_window_d64": dict(num_q_heads=64, num_kv_heads=8, head_dim=64, window=(127, 0), sinks=True),
    "mtp_q4": dict(num_q_heads=32, num_kv_heads=8, head_dim=128, q_len=4),
    "page16_fp16": dict(num_q_heads=32, num_kv_heads=4, head_dim=128, page_size=16, dtype="float16"),
    "chunked_merge": dict(num_q_heads=32, num_kv_heads=8, head_dim=128),
}
# the merge reads the splits a chunk at a time only past MERGE_TILE floats (head dims above
# 256 with many splits): a smaller tile takes that branch here
MERGE_TILES = {"chunked_merge": 16 * 128}


def variants(td, shape, everything: bool) -> list[dict]:
    """The CUDA space of this shape (graph lengths: the by-load configs too): all of it, or the
    first config of each kind."""
    with mock.patch("torch.cuda.is_available", return_value=True):
        configs = td._configs(shape)
    if not everything:
        kinds: dict[str, dict] = {}
        for c in configs:
            kinds.setdefault("items_per_sm" if c.get("items_per_sm") else
                             "tokens_per_split" if c.get("tokens_per_split") else "even", c)
        configs = list(kinds.values())
    return configs


def built(kernels) -> list:
    """The kernels the stand-in device's caches hold, built down to a cubin."""
    return [k for fn in kernels for k in fn.device_caches[0][0].values() if k.asm.get("cubin")]


def compiled_kernels(kernels) -> int:
    return len(built(kernels))


def main(out: Path) -> int:
    driver.set_active(Sm90Target())
    from tuner.ops import triton_decode as td
    from tuner.workload import DecodeShape, make_decode_inputs

    kernels = td._define_kernels()
    td._kernels = lambda interpret: kernels  # CPU tensors would otherwise ask for the interpreter
    td.sm_count = lambda index=None: SM90_SMS
    doc: dict = {"triton": triton.__version__, "target": "cuda sm_90", "variants": [], "errors": []}
    default_tile = td.MERGE_TILE
    for name, spec in SHAPES.items():
        td.MERGE_TILE = MERGE_TILES.get(name, default_tile)
        shape = DecodeShape(batch=4, kv_len=4096, lengths="graph", **spec)
        inputs = make_decode_inputs(shape, device="cpu")
        for config in variants(td, shape, everything=name == "plain"):
            before = compiled_kernels(kernels)
            try:
                td._run(inputs, config, compile_only=True)
                doc["variants"].append(dict(shape=name, config=config, kernels=compiled_kernels(kernels) - before))
            except Exception as e:  # noqa: BLE001 - every variant is tried; each failure is listed
                doc["errors"].append(dict(shape=name, config=config, error=f"{type(e).__name__}: {e}"[:2000]))
    doc["compiled"] = compiled_kernels(kernels)
    # a kernel needing more would fail at every launch on the GPU
    doc["max_shared_bytes"] = max((k.metadata.shared for k in built(kernels)), default=0)
    out.write_text(json.dumps(doc, indent=1))
    return 1 if doc["errors"] or doc["max_shared_bytes"] > SM90_SHARED_BYTES else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
