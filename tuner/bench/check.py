"""Correctness: a candidate's output against the reference's, before any timing."""

from __future__ import annotations

from dataclasses import dataclass

import torch


# (atol, rtol) of a candidate's output against the reference's, by output dtype
TOLERANCE = {"float32": (1e-4, 1e-4), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}


def tolerance_for(dtype: object) -> tuple[float, float]:
    """TOLERANCE of a dtype (torch dtype or name); float32's for anything else."""
    return TOLERANCE.get(str(dtype).removeprefix("torch."), TOLERANCE["float32"])


@dataclass(frozen=True)
class Check:
    ok: bool
    max_error: float | None
    reason: str | None = None


def compare(out: object, ref: torch.Tensor, atol: float, rtol: float) -> Check:
    """ok when out has ref's shape and |out - ref| <= atol + rtol * |ref| everywhere."""
    if not isinstance(out, torch.Tensor):
        return Check(False, None, f"returned {type(out).__name__}, not a tensor")
    if out.shape != ref.shape:
        return Check(False, None, f"shape {tuple(out.shape)} differs from {tuple(ref.shape)}")
    if not out.numel():
        return Check(True, 0.0)
    out_f, ref_f = out.detach().float(), ref.detach().float().to(out.device)
    err = (out_f - ref_f).abs()
    # the three verdicts read back at once: one wait on the device per check, not three
    finite, max_error, within = torch.stack([torch.isfinite(out_f).all().float(), err.max(),
                                             (err <= atol + rtol * ref_f.abs()).all().float()]).tolist()
    if not finite:
        return Check(False, float("inf"), "non-finite values")
    ok = bool(within)
    return Check(ok, max_error, None if ok else f"max error {max_error:.3g} over tolerance")
