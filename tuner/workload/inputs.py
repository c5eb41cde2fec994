"""One decode problem's tensors: random inputs for a shape, with a valid page table and the
host-side lengths a server would hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tuner.keys import AttentionRunKey, AttentionStaticKey, attention_static_key
from tuner.workload.reference import paged_decode_reference
from tuner.workload.shapes import DecodeShape

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# how a page table lays a batch's pages out in the pool: "shuffled", a random permutation (a
# long-running server's fragmented pool), or "contiguous", each sequence's pages consecutive
# and the sequences one after another (a fresh batch from a sorted free list, as SGLang's token
# allocator gives one). Which one kernels are timed on can move their comparison
# (docs/decisions.md, "Graph variants", end to end).
PAGE_LAYOUTS = ("shuffled", "contiguous")


@dataclass
class DecodeInputs:
    """One decode problem, with its host-side lengths (never read back from the device).
    shape.kv_len bounds every sequence (the call's max_kv_len; a serving trial's batches put
    their longest above half its bucket); seq_lens_host, each sequence's length on the host,
    is None when every sequence has shape.kv_len."""

    shape: DecodeShape
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    sinks: torch.Tensor | None
    seq_lens_host: torch.Tensor | None = None  # int32, on the CPU

    def lengths(self) -> list[int]:
        """Each sequence's kv length."""
        if self.seq_lens_host is None:
            return [self.shape.kv_len] * self.shape.batch
        return self.seq_lens_host.tolist()

    def reference(self) -> torch.Tensor:
        s = self.shape
        return paged_decode_reference(
            self.q, self.k_cache, self.v_cache, self.page_table, self.cache_seqlens,
            causal=s.causal, window=s.window, softcap=s.softcap or None, sinks=self.sinks,
        )

    def static_key(self) -> AttentionStaticKey:
        s = self.shape
        return attention_static_key(
            self.q, self.k_cache, self.v_cache, causal=s.causal, window_size=s.window,
            softcap=s.softcap or None, sinks=self.sinks,
        )

    @property
    def kv_bytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    def run_key(self) -> AttentionRunKey:
        return self.shape.run_key()


def make_decode_inputs(shape: DecodeShape, device: str | torch.device = "cpu", seed: int = 0,
                       seq_lens: Sequence[int] | None = None, table_width: int | None = None,
                       layout: str = "shuffled") -> DecodeInputs:
    """Random inputs for a shape, with a valid page table laid out as `layout` says
    (PAGE_LAYOUTS).

    Every sequence holds shape.kv_len tokens, or seq_lens[i] (each at most shape.kv_len) when
    given. The page table is table_width tokens wide (default shape.kv_len), as a server's
    persistent table is as wide as its max context; only the pages a sequence holds exist
    in the cache (every other entry is page 0, never read), so each index is in range.
    """
    if layout not in PAGE_LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(PAGE_LAYOUTS)}")
    device = torch.device(device)
    # values are drawn on the device itself: a 4M-token cache is 16 GB, too much to make on
    # the host and copy over
    gen = torch.Generator(device=device).manual_seed(seed)
    host_gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = TORCH_DTYPES[shape.dtype]
    lens = [shape.kv_len] * shape.batch if seq_lens is None else [int(n) for n in seq_lens]
    if len(lens) != shape.batch or any(not 0 <= n <= shape.kv_len for n in lens):
        raise ValueError(f"seq_lens: {shape.batch} lengths in [0, {shape.kv_len}] expected, got {lens[:8]}")
    width = shape.kv_len if table_width is None else table_width
    if width < shape.kv_len:
        raise ValueError(f"table_width {width} cannot hold kv_len {shape.kv_len}")
    table_pages = -(-width // shape.page_size)
    seq_pages = [-(-n // shape.page_size) for n in lens]
    uniform = seq_lens is None and width == shape.kv_len
    num_pages = sum(seq_pages) if uniform else max(1, sum(seq_pages))  # page 0 fills the unused entries

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    q = randn(shape.batch, shape.q_len, shape.num_q_heads, shape.head_dim)
    k_cache = randn(num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
    v_cache = randn(num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
    order = torch.randperm(num_pages, generator=host_gen)  # drawn either way: the sinks' draw comes after it
    if layout == "contiguous":
        order = torch.arange(num_pages)
    if uniform:
        page_table = order.view(shape.batch, table_pages)
    else:
        page_table = torch.zeros(shape.batch, table_pages, dtype=torch.int64)
        taken = 0
        for i, n in enumerate(seq_pages):
            page_table[i, :n] = order[taken:taken + n]
            taken += n
    cache_seqlens = torch.tensor(lens, dtype=torch.int32)
    # in q's dtype, as FA3 requires
    sinks = torch.randn(shape.num_q_heads, generator=host_gen).to(device=device, dtype=dtype) if shape.sinks else None
    return DecodeInputs(
        shape=shape,
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=page_table.to(device=device, dtype=torch.int32),
        cache_seqlens=cache_seqlens.to(device),
        sinks=sinks,
        seq_lens_host=None if seq_lens is None else cache_seqlens,
    )
