"""The environment fingerprint: what a measurement is only valid for.

Read once per process. On a machine with CUDA it describes the current GPU, else the CPU.
Library versions come from package metadata, so no kernel library is imported.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from importlib import metadata
from typing import Any

from tuner.keys import canonical_json

# distribution names to try for each library, first found wins
_LIBRARIES = {
    "torch": ("torch",),
    "triton": ("triton",),
    "sgl_kernel": ("sglang-kernel", "sgl-kernel"),
    "flashinfer": ("flashinfer-python", "flashinfer"),
}


def _version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _nvidia_driver() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            first = f.readline()
    except OSError:
        return None
    for word in first.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return None


def _device_fields() -> dict[str, Any]:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {
            "device": props.name,
            "device_kind": "cuda",
            "sm_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
            "driver": _nvidia_driver(),
            "cuda": torch.version.cuda,
        }
    return {
        "device": _cpu_name(),
        "device_kind": "cpu",
        "cpu_count": os.cpu_count(),
    }


def fingerprint_id(data: dict[str, Any]) -> str:
    """Content hash of a fingerprint: equal environments share one id."""
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()[:16]


@functools.cache
def current_fingerprint() -> dict[str, Any]:
    from tuner import __version__

    data = _device_fields()
    for field, names in _LIBRARIES.items():
        data[field] = _version(names)
    data["tuner"] = __version__
    return data


def current_fingerprint_id() -> str:
    return fingerprint_id(current_fingerprint())
