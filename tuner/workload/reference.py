"""Paged-attention decode in plain torch: the correctness oracle for every other op."""

from __future__ import annotations

import math

import torch

from tuner import settings


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
    return _allowed(pos, key, causal=causal, window=window)


def _allowed(pos: torch.Tensor, key: torch.Tensor, *, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """Whether the query at each pos may attend to each key position (broadcast together)."""
    allowed = torch.ones(torch.broadcast_shapes(pos.shape, key.shape), dtype=torch.bool, device=pos.device)
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

    Sequences of similar length are attended together, padded to the chunk's longest, in
    chunks of about settings.REFERENCE_CHUNK_BYTES (one by one, a batch of 256 took 256
    rounds of a dozen small kernels).
    """
    batch, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k_cache.shape[2], v_cache.shape[-1]
    out = torch.empty(batch, q_len, num_q_heads, head_dim_v, dtype=q.dtype, device=q.device)
    lengths = [int(n) for n in cache_seqlens.tolist()]  # one read of the device, not one per sequence
    # keys from the first one any query's window holds (all, without a window): those
    # before it are masked for every query, and a long sequence's would cost the most
    left = window[0]
    firsts = [0 if left < 0 else max(0, n - q_len - left) for n in lengths]
    spans = [n - f for n, f in zip(lengths, firsts)]
    # float32 bytes per padded key of one sequence: its keys and values, and scores,
    # masked scores and probabilities for every query row (the einsums' own copies of the
    # keys and values add up to half again where a chunk holds several sequences)
    per_key = 4 * (num_kv_heads * (head_dim + head_dim_v) + 3 * num_q_heads * q_len)
    # a sequence without keys attends to nothing (output 0), and its page-table row is not
    # read: a server may leave anything there for a padded batch slot
    out[torch.tensor([b for b in range(batch) if lengths[b] == 0], dtype=torch.long, device=q.device)] = 0
    order = sorted((b for b in range(batch) if lengths[b] > 0), key=spans.__getitem__)
    start = 0
    while start < len(order):
        # ascending spans: the chunk's longest is its last; at most 5/4 of its shortest (or
        # 128 keys: short ones go together), so padding adds little to the work
        end, widest = start + 1, max(spans[order[start]] * 5 // 4, 128)
        while end < len(order) and spans[order[end]] <= widest and \
                (end + 1 - start) * spans[order[end]] * per_key <= settings.REFERENCE_CHUNK_BYTES:
            end += 1
        rows = order[start:end]
        out[torch.tensor(rows, device=q.device)] = _attend_chunk(
            q, k_cache, v_cache, page_table, rows, [lengths[b] for b in rows], [firsts[b] for b in rows],
            spans[rows[-1]], causal=causal, window=window, softcap=softcap, sinks=sinks,
            scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim),
        ).to(q.dtype)
        start = end
    return out


def _attend_chunk(q, k_cache, v_cache, page_table, rows, lengths, firsts, span, *, causal, window,
                  softcap, sinks, scale) -> torch.Tensor:
    """(len(rows), q_len, Hq, Dv) float32: the rows' sequences, each from its first key,
    padded to span keys."""
    device = q.device
    q_len, num_q_heads, head_dim = q.shape[1:]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    idx = torch.tensor(rows, device=device)
    length = torch.tensor(lengths, device=device).unsqueeze(1)  # (C, 1)
    key = torch.tensor(firsts, device=device).unsqueeze(1) + torch.arange(span, device=device)  # (C, L)
    held = key < length
    slot = torch.minimum(key, length - 1)  # padding reads a key the sequence holds
    pages = page_table[idx.unsqueeze(1), slot // page_size].long()
    k = k_cache[pages, slot % page_size].float()  # (C, L, Hkv, D)
    v = v_cache[pages, slot % page_size].float()
    qg = q[idx].float().view(len(rows), q_len, num_kv_heads, group, head_dim)
    scores = torch.einsum("cqhgd,clhd->chgql", qg, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = length - q_len + torch.arange(q_len, device=device)  # (C, q)
    allowed = _allowed(pos.unsqueeze(2), key.unsqueeze(1), causal=causal, window=window) & held.unsqueeze(1)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, num_kv_heads, group, 1, 1).expand(len(rows), -1, -1, q_len, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    # a query whose window holds no key (and no sink) attends to nothing: output 0
    probs = torch.nan_to_num(probs, nan=0.0)[..., :span]
    return torch.einsum("chgql,clhd->cqhgd", probs, v).reshape(len(rows), q_len, num_q_heads, -1)
