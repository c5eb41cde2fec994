"""The environment fingerprint: what a measurement is only valid for.

Read once per process. On a machine with CUDA it describes the current GPU, else the CPU.
Library versions come from package metadata or, where a package was unpacked without it
(staged installs), from the module's __version__: the loaded module's, else the
`__version__ = "..."` line of its version file, so no kernel library is imported for it.

Which records apply in an environment (the user's DB and the shipped tunings alike):
those measured on the same GPU (name, SM count, capability) with the same CUDA, torch,
Triton, sgl-kernel and FlashInfer versions (local build tags such as torch's "+cu130"
aside). The GPU driver and tuner's own version may differ: neither changes which kernel
code runs, and an upgrade of tuner must not retire every winner.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

from tuner.version import __version__
from tuner.keys import canonical_json

# (distribution names to try, first found wins; the module, for its __version__)
_LIBRARIES = {
    "torch": (("torch",), "torch"),
    "triton": (("triton",), "triton"),
    "sgl_kernel": (("sglang-kernel", "sgl-kernel"), "sgl_kernel"),
    "flashinfer": (("flashinfer-python", "flashinfer"), "flashinfer"),
}
# where packages keep `__version__ = "..."` (sgl_kernel/version.py, flashinfer/_build_meta.py)
_VERSION_FILES = ("version.py", "_version.py", "_build_meta.py", "__init__.py")
_VERSION_LINE = re.compile(r"""^__version__\s*(?::\s*str\s*)?=\s*["']([^"']+)["']""", re.M)


def _module_version(module: str) -> str | None:
    """The module's __version__ without importing it (a kernel library's import loads its
    CUDA binaries): the loaded module's, else the line in its package's version file."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        version = getattr(loaded, "__version__", None)
        return str(version) if version else None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for name in _VERSION_FILES:
            try:
                match = _VERSION_LINE.search((Path(folder) / name).read_text(encoding="utf-8", errors="replace"))
            except OSError:
                continue
            if match:
                return match.group(1)
    return None


def library_version(names: tuple[str, ...], module: str) -> str | None:
    """A library's version: package metadata, else the module's __version__, else None."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return _module_version(module)


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
    data = _device_fields()
    for field, (names, module) in _LIBRARIES.items():
        data[field] = library_version(names, module)
    data["tuner"] = __version__
    return data


def current_fingerprint_id() -> str:
    return fingerprint_id(current_fingerprint())


class Environment(NamedTuple):
    """An environment a measurement is valid for: its fingerprint's data and id (the hash
    of the data). A pair, so it unpacks as (id, data)."""

    id: str
    data: dict[str, Any]

    @classmethod
    def of(cls, data: dict[str, Any]) -> "Environment":
        return cls(fingerprint_id(data), data)


@functools.cache
def current_environment() -> Environment:
    """This process's environment (read once)."""
    return Environment.of(current_fingerprint())


# -- which environments' records apply here ------------------------------------------------

# fingerprint fields that may differ between a record's environment and this one
MAY_DIFFER = frozenset({"driver", "tuner"})
# versions compared without a local build tag: torch "2.11.0+cu130" from PyTorch's index is
# the "2.11.0" of PyPI's wheel for the same CUDA, which the fingerprint's cuda field names
_VERSIONS = ("torch", "triton", "sgl_kernel", "flashinfer")
_DEVICE_FIELDS = ("device", "device_kind", "sm_count", "capability")


def _comparable(field_name: str, value: Any) -> Any:
    if field_name in _VERSIONS and isinstance(value, str):
        return value.split("+", 1)[0]
    return value


def differing_fields(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The fingerprint fields that keep records of `recorded` from applying in `current`."""
    return sorted(k for k in set(recorded) | set(current)
                  if k not in MAY_DIFFER and _comparable(k, recorded.get(k)) != _comparable(k, current.get(k)))


def applies(recorded: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether records measured in environment `recorded` may be used in `current`."""
    return not differing_fields(recorded, current)


def why_not(recorded: dict[str, Any], current: dict[str, Any]) -> str:
    """Why records of the `recorded` environment do not apply in `current` ("" if they do)."""
    fields = differing_fields(recorded, current)
    if not fields:
        return ""
    if any(f in fields for f in _DEVICE_FIELDS):
        return f"made on {recorded.get('device')}, this is {current.get('device')}"
    return "; ".join(f"{f} {recorded.get(f)} there, {current.get(f)} here" for f in fields)
