"""Which sgl-kernel releases can load against a given torch: the libtorch symbols each
release's FA3 library (sgl_kernel/flash_ops.abi3.so) needs that torch's libraries lack.

An undefined symbol makes the import fail (`undefined symbol: ...`), so a release with any
missing symbol cannot run on that torch. Reads wheels already downloaded (pip download
--no-deps --python-version 3.12 --platform manylinux2014_x86_64 sglang-kernel==V torch==T);
needs binutils' nm:

    python benchmarks/sgl_kernel_torch_abi.py --torch torch-2.11.0-*.whl sglang_kernel-0.4.*.whl --out abi.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import zipfile
from pathlib import Path

TORCH_LIBS = ("libc10.so", "libc10_cuda.so", "libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so", "libtorch_python.so")
# provided by the system, CUDA or Python, not by torch
NOT_TORCH = re.compile(r"^(_?Py|__|_ITM|cuda|cu[A-Z]|pthread|std::)")


def _symbols(path: Path, undefined: bool) -> set[str]:
    flag = "--undefined-only" if undefined else "--defined-only"
    out = subprocess.run(["nm", "-D", flag, str(path)], capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    return {n for n in names if "@" not in n}


def _demangle(names: list[str]) -> list[str]:
    if not names:
        return []
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def _requires(wheel: zipfile.ZipFile) -> list[str]:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    return [line.split(":", 1)[1].strip() for line in wheel.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", required=True, help="the torch wheel to load against")
    parser.add_argument("wheels", nargs="+", help="sglang-kernel wheels")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        with zipfile.ZipFile(args.torch) as tw:
            torch_version = next(n for n in tw.namelist() if n.endswith(".dist-info/METADATA")).split("-")[1].split(".dist")[0]
            exported: set[str] = set()
            for lib in TORCH_LIBS:
                tw.extract(f"torch/lib/{lib}", tmp_path / "torch")
                exported |= _symbols(tmp_path / "torch" / "torch" / "lib" / lib, undefined=False)
        releases = {}
        for wheel_path in sorted(args.wheels):
            with zipfile.ZipFile(wheel_path) as w:
                version = Path(wheel_path).name.split("-")[1]
                w.extract("sgl_kernel/flash_ops.abi3.so", tmp_path / version)
                needed = _symbols(tmp_path / version / "sgl_kernel" / "flash_ops.abi3.so", undefined=True)
                missing = sorted(n for n in needed - exported if not NOT_TORCH.match(n))
                releases[version] = {"requires": _requires(w), "missing_torch_symbols": _demangle(missing),
                                     "loads": not missing}
    result = {"torch": torch_version, "library": "sgl_kernel/flash_ops.abi3.so", "releases": releases,
              "command": "python benchmarks/sgl_kernel_torch_abi.py --torch " + Path(args.torch).name + " "
              + " ".join(Path(w).name for w in sorted(args.wheels)) + " --out " + Path(args.out).name}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for version, r in releases.items():
        print(f"sglang-kernel {version}: {'loads' if r['loads'] else 'cannot load'} on torch {torch_version} "
              f"({len(r['missing_torch_symbols'])} symbols missing; requires {', '.join(r['requires']) or 'nothing'})")


if __name__ == "__main__":
    main()
