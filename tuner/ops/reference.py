"""Paged-attention decode in plain torch: the correctness oracle for every other op."""

from __future__ import annotations

import math

import torch


def attention_mask(
    kv_len: int,
    q_len: int,
    *,
    causal: bool,
    window: tuple[int, int],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """(q_len, kv_len) bool mask of allowed keys.

    The q_len queries are the last q_len tokens of the sequence: query i sits at position
    kv_len - q_len + i. window=(left, right) allows keys in [pos - left, pos + right];
    -1 leaves that side unbounded; causal caps the right side at 0.
    """
    pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    key = torch.arange(kv_len, device=device).unsqueeze(0)
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        allowed &= key >= pos - left
    if right >= 0:
        allowed &= key <= pos + right
    return allowed


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention of q (batch, q_len, Hq, D) over a paged KV cache, computed in float32.

    k_cache/v_cache: (num_pages, page_size, Hkv, D[v]); page_table: (batch, max_pages)
    page indices; cache_seqlens: (batch,) tokens in the cache, the q_len new ones included.
    GQA: q head h reads kv head h // (Hq // Hkv). softcap s: scores -> s * tanh(scores / s).
    sinks: (Hq,) logits that join each softmax's denominator and attend to nothing.
    Returns (batch, q_len, Hq, Dv) in q's dtype.
    """
    batch, q_len, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.empty(batch, q_len, num_q_heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    lengths = cache_seqlens.tolist()  # one read of the device, not one per sequence
    left = window[0]
    for b in range(batch):
        kv_len = int(lengths[b])
        # keys from the first one any query's window holds (all, without a window): those
        # before it are masked for every query, and a long sequence's would cost the most
        first = 0 if left < 0 else max(0, kv_len - q_len - left)
        pages = page_table[b, first // page_size: (kv_len + page_size - 1) // page_size].long()
        keys = slice(first % page_size, first % page_size + kv_len - first)
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[keys].float()
        v = v_cache[pages].reshape(-1, num_kv_heads, v_cache.shape[-1])[keys].float()
        k = k.repeat_interleave(group, dim=1)  # (kv, Hq, D)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[b].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        mask = attention_mask(kv_len, q_len, causal=causal, window=window, device=q.device)[:, first:]
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(num_q_heads, 1, 1).expand(num_q_heads, q_len, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        # a query whose window holds no key (and no sink) attends to nothing: output 0
        probs = torch.nan_to_num(probs, nan=0.0)[..., :kv_len - first]
        out[b] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
