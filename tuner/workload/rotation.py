"""Copies of a decode problem for timing with a cold L2, sized by the bytes a call reads.

A call reads only part of what is allocated: a sliding window reads its last keys, short
sequences in a wide page table read their own pages. A rotation of whole-cache copies sized
by allocation then times a hot L2, which flatters a windowed config (docs/decisions.md,
"Timing method"). Here the copies share one KV pool, and each copy's page table points the
pages its call reads at pages no other copy reads, holding the same values: every copy gives
the same output, and a rotation of n copies reads n times the bytes of one call from memory.
"""

from __future__ import annotations

import dataclasses

import torch

from tuner.workload.inputs import DecodeInputs

# keys before a window's first visible one that kernels still load (FA3 starts at a whole
# block of up to 176 keys; our Triton kernel at the first visible key): counted as read, so
# they are fresh in every copy too. A kernel that loads further left (FlashInfer's, not
# checked) reads pages all copies share there: its timing, never its output, is affected
WINDOW_MARGIN = 256


def read_spans(inputs: DecodeInputs) -> list[tuple[int, int]]:
    """Per sequence, the keys [lo, hi) a call reads (a window's, with WINDOW_MARGIN)."""
    left = inputs.shape.window[0]
    q_len = inputs.shape.q_len
    spans = []
    for n in inputs.lengths():
        lo = 0 if left < 0 else max(0, n - q_len - left - WINDOW_MARGIN)
        spans.append((lo, n))
    return spans


def bytes_read(inputs: DecodeInputs) -> int:
    """KV bytes one call reads, in whole pages."""
    page = inputs.shape.page_size
    per_page = (inputs.k_cache[0].nbytes + inputs.v_cache[0].nbytes) if inputs.k_cache.shape[0] else 0
    return sum(-(-hi // page) - lo // page for lo, hi in read_spans(inputs) if hi > lo) * per_page


def _read_pages(inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of the page-table entries a call reads, row by row. A mask over the
    table, not a Python list of every page (a million at page size 1 for batch 256 x 4k,
    seconds a sweep)."""
    page = inputs.shape.page_size
    device = inputs.page_table.device
    lo, hi = torch.tensor(read_spans(inputs), dtype=torch.long, device=device).view(-1, 2).unbind(1)
    first, last = lo // page, torch.where(hi > lo, -(-hi // page), lo // page)
    col = torch.arange(inputs.page_table.shape[1], device=device)
    return ((col >= first[:, None]) & (col < last[:, None])).nonzero(as_tuple=True)


def fresh_page_copies(inputs: DecodeInputs, count: int, shuffled: bool = False) -> list[DecodeInputs]:
    """count copies of inputs (the first one's page table unchanged), over one KV pool in
    which the pages each copy reads are its own: in each copy after the first, consecutive
    pages for each sequence, one sequence after another, or (shuffled) a random permutation of
    that copy's pages, as a shuffled first table has them (PAGE_LAYOUTS). The pool is made
    beside inputs' caches (for a moment both are held: callers leave room,
    tuner.sweep.trials.too_big), which are then not needed: drop inputs and use the copies."""
    if count <= 1:
        return [inputs]
    rows_t, cols_t = _read_pages(inputs)
    source = inputs.page_table[rows_t, cols_t].long()
    held, fresh = inputs.k_cache.shape[0], len(rows_t)
    k_pool = torch.cat([inputs.k_cache] + [inputs.k_cache[source]] * (count - 1))
    v_pool = torch.cat([inputs.v_cache] + [inputs.v_cache[source]] * (count - 1))
    copies = [dataclasses.replace(inputs, k_cache=k_pool, v_cache=v_pool)]
    order = torch.Generator().manual_seed(count)
    for c in range(1, count):
        table = inputs.page_table.clone()
        pages = torch.arange(held + (c - 1) * fresh, held + c * fresh)
        if shuffled:  # each entry's page moves with its values: a copy keeps the same output
            mix = torch.randperm(fresh, generator=order)
            k_pool[pages[mix]], v_pool[pages[mix]] = k_pool[pages].clone(), v_pool[pages].clone()
            pages = pages[mix]
        table[rows_t, cols_t] = pages.to(device=table.device, dtype=table.dtype)
        copies.append(dataclasses.replace(inputs, k_cache=k_pool, v_cache=v_pool, page_table=table))
    return copies
