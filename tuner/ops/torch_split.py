"""Split-KV paged decode in torch: the kv chunk size is a real, CPU-measurable knob."""

from __future__ import annotations

import math

import torch

from tuner.ops.rules import config_error, is_int
from tuner.workload.inputs import DecodeInputs
from tuner.ops.base import Config, Op
from tuner.workload.reference import attention_mask
from tuner.workload.shapes import DecodeShape, grid

CHUNKS = (0, 64, 128, 256, 512, 1024, 2048)  # 0: one pass over the whole sequence


def split_kv_decode(inputs: DecodeInputs, chunk: int) -> torch.Tensor:
    """Attention over kv chunks of `chunk` tokens, merged by log-sum-exp (0: no split)."""
    s = inputs.shape
    q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
    batch, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads, group = s.num_kv_heads, s.num_q_heads // s.num_kv_heads
    kv_len = s.kv_len  # host-side: the longest sequence (each its own, on the host, when mixed)
    chunk = kv_len if chunk <= 0 else min(chunk, kv_len)
    num_chunks = -(-kv_len // chunk)
    padded = num_chunks * chunk
    scale = 1.0 / math.sqrt(head_dim)

    # gather each sequence's tokens through the page table: (batch, kv, Hkv, D)
    token = torch.arange(kv_len, device=q.device)
    pages = inputs.page_table[:, token // s.page_size].long()
    slots = token % s.page_size
    k = k_cache[pages, slots].float()
    v = v_cache[pages, slots].float()
    if padded != kv_len:
        k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, padded - kv_len))
        v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, padded - kv_len))
    # (batch, Hkv, chunks, chunk, D) and q as (batch, Hkv, group * q_len, D)
    k = k.view(batch, num_chunks, chunk, num_kv_heads, head_dim).permute(0, 3, 1, 2, 4)
    v = v.view(batch, num_chunks, chunk, num_kv_heads, -1).permute(0, 3, 1, 2, 4)
    qg = q.float().view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, num_kv_heads, 1, group * q_len, head_dim)

    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # (b, Hkv, chunks, g*q, chunk)
    if s.softcap:
        scores = s.softcap * torch.tanh(scores / s.softcap)
    if inputs.seq_lens_host is None:
        mask = attention_mask(kv_len, q_len, causal=s.causal, window=s.window, device=q.device)
        mask = torch.nn.functional.pad(mask, (0, padded - kv_len))  # padding is masked out
        mask = mask.view(q_len, num_chunks, chunk).transpose(0, 1).repeat(1, group, 1)
    else:  # each sequence's own mask: its queries at its own last positions, nothing past its length
        mask = torch.stack([torch.nn.functional.pad(
            attention_mask(n, q_len, causal=s.causal, window=s.window, device=q.device), (0, padded - n))
            for n in inputs.lengths()])
        mask = mask.view(batch, q_len, num_chunks, chunk).transpose(1, 2).repeat(1, 1, group, 1).unsqueeze(1)
    scores = scores.masked_fill(~mask, float("-inf"))

    chunk_max = scores.amax(dim=-1, keepdim=True)  # (b, Hkv, chunks, g*q, 1)
    safe_max = torch.where(torch.isfinite(chunk_max), chunk_max, torch.zeros_like(chunk_max))
    weights = torch.exp(scores - safe_max)
    chunk_sum = weights.sum(dim=-1, keepdim=True)
    chunk_out = torch.matmul(weights, v)  # (b, Hkv, chunks, g*q, Dv)

    # merge the chunks: rescale each by exp(its max - the global max)
    global_max = safe_max.amax(dim=2, keepdim=True)
    if inputs.sinks is not None:
        sink = inputs.sinks.float().view(1, num_kv_heads, 1, group, 1, 1)
        sink = sink.expand(batch, -1, -1, -1, q_len, -1).reshape(batch, num_kv_heads, 1, group * q_len, 1)
        global_max = torch.maximum(global_max, sink)
    factor = torch.exp(safe_max - global_max) * torch.isfinite(chunk_max)
    total = (chunk_sum * factor).sum(dim=2)
    out = (chunk_out * factor).sum(dim=2)
    if inputs.sinks is not None:
        total = total + torch.exp(sink - global_max).squeeze(2)
    out = torch.where(total > 0, out / total.clamp_min(1e-30), torch.zeros_like(out))
    # (b, Hkv, g*q, Dv) -> (b, q, Hq, Dv)
    out = out.view(batch, num_kv_heads, group, q_len, -1).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, num_q_heads, -1).to(q.dtype)


def _configs(shape: DecodeShape) -> list[Config]:
    # chunks at least as long as the sequence all mean "no split": keep one of them
    return [{"chunk": c} for c in CHUNKS if c == 0 or c < shape.kv_len]


def _run(inputs: DecodeInputs, config: Config) -> torch.Tensor:
    return split_kv_decode(inputs, int(config["chunk"]))


_CPU = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")

TORCH_SPLIT_DECODE = Op(
    name="torch_split_decode",
    description="split-KV paged decode in torch; tunes the kv chunk size (runs on CPU and GPU)",
    configs=_configs,
    default=lambda shape: {"chunk": 0},
    run=_run,
    check=lambda config, shape: config_error(config, {"chunk": is_int(0, 2**40)}),
    device=lambda: "cuda" if torch.cuda.is_available() else "cpu",
    grids={
        "cpu-tiny": grid([1, 4], [256, 1024], **_CPU),
        "cpu-small": grid([1, 4, 16], [512, 2048, 8192], **_CPU),
        "decode": grid([1, 4, 16, 64, 256], [512, 2048, 8192, 32768, 131072], max_tokens=4 * 2**20)
        + grid([1, 4, 16, 64, 256], [512, 2048, 8192, 32768, 131072], max_tokens=4 * 2**20,
               num_q_heads=8, num_kv_heads=1),
    },
)
