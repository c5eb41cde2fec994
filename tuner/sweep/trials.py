"""A shape's trials (its inputs on a device, the reference output, copies that read fresh
pages for a cold L2, the op's tolerance): the first, the second a winner must hold on, the dense pass's."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import torch

from tuner import settings
from tuner.bench import boundary_sync, one_line
from tuner.bench.trial import Guard, Trial, cold_l2_copies, l2_bytes
from tuner.ops import Config, Op
from tuner.search.pipeline import SecondTrial, confirm_again
from tuner.workload import DecodeInputs
from tuner.workload.rotation import bytes_read, fresh_page_copies
from tuner.workload.shapes import DecodeShape
from tuner.workload.traffic import (dense_draws, draws_per_distribution, equal_draw, graph_caps, graph_draws,
                                    serving_draws)


def too_big(shape: DecodeShape, device: str, draws: list[list[int]] | None = None) -> str | None:
    """Why the shape's trial cannot fit, or None. draws: the lengths of a serving or dense
    trial's batches, whose pools hold only their own pages (without them, every batch is
    counted as full)."""
    need = trial_bytes(shape, device, draws)
    if device == "cuda":
        # what PyTorch's cache holds unused is free to this process too
        free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    if need > free:
        return f"needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free on {device}"
    return None


def trial_bytes(shape: DecodeShape, device: str, draws: list[list[int]] | None = None) -> int:
    """About the memory a trial of the shape holds at its peak: its batches' KV pools, and
    headroom for outputs and the reference's work (twice the largest pool, or the
    reference's chunks where that is more); on a GPU, each mix batch's own cold-L2 copies."""
    if shape.lengths == "graph":  # its batches at their caps, one of each distribution, and the headroom
        caps = graph_caps(shape.batch, shape.kv_len)
        need = (3 * sum(caps) + 2 * caps[-1]) * shape.batch * shape.static_key().kv_bytes_per_token()
        batches = 3 * len(caps)
    elif shape.lengths == "full" or draws is None:
        batches = 1 if shape.lengths == "full" else 3 * draws_per_distribution(shape.batch)
        need = (batches + 2) * shape.kv_bytes()
    else:
        page, per_token = shape.page_size, shape.static_key().kv_bytes_per_token()
        pools = [sum(-(-n // page) for n in lens) * page * per_token for lens in draws]
        need = sum(pools) + max(2 * max(pools), 2 * settings.REFERENCE_CHUNK_BYTES)
        batches = len(draws)
    if device == "cuda" and shape.lengths != "full":
        # each batch's own copies for its part (part_copies): its pages and its page tables,
        # at most twice the L2 each
        need += batches * 4 * l2_bytes()
    return need


# a serving batch's page table is as wide as its longest sequence, rounded up to this many
# pages: so every batch's table stride is a multiple of 16, which Triton specialises its
# kernels on, and one batch's compiled kernels serve the others
TABLE_PAGES_ROUNDING = 16


def as_called(shape: DecodeShape, lens: list[int]) -> tuple[DecodeShape, int]:
    """A serving batch's shape and page-table width as a server's eager call passes them:
    its longest sequence as the max length, a table as wide as that (the lengths' own
    bucket, same run key), not the bucket's top. FA3's default sizes its splits by the
    table's width and the Triton kernel caps its splits by the max length, so at the
    bucket's top a batch may run other splits than its calls do (docs/decisions.md,
    "Second trials")."""
    longest = max(max(lens), shape.q_len, 1)
    unit = shape.page_size * TABLE_PAGES_ROUNDING
    return dataclasses.replace(shape, kv_len=longest), -(-longest // unit) * unit


def build_second_trial(op: Op, shape: DecodeShape, device: str, seed: int = 0) -> Trial:
    """The trial a serving winner must hold on again (tuner.search.pipeline.confirm_again):
    lengths drawn independently of the first trial's (seed + settings.SECOND_TRIAL_SEED),
    one batch reaching the bucket's top."""
    return build_trial(op, shape, device, seed + settings.SECOND_TRIAL_SEED, reach_top=True)


def build_dense_trial(op: Op, shape: DecodeShape, device: str, seed: int = 0) -> Trial:
    """The trial of a serving shape's dense pass (tuner.sweep.dense): its dense batches alone
    (tuner.workload.traffic.dense_draws, seed + settings.DENSE_TRIAL_SEED), each run as called."""
    return build_trial(op, shape, device, seed, draws=dense_draws(shape.batch, shape.kv_len,
                                                                  seed + settings.DENSE_TRIAL_SEED))


def build_trial(op: Op, shape: DecodeShape, device: str, seed: int = 0, reach_top: bool = False,
                draws: list[list[int]] | None = None) -> Trial:
    """The trial of one shape of an op. MemoryError when it cannot fit; a RuntimeError of
    the reference passes through (the caller records the shape as failed).

    A "serving" shape's trial holds batches of each length distribution (serving_draws); its
    rotation runs them in turn, so a timing is their mean: the expected time over the mix,
    each batch weighted alike: copies of each for a cold L2 over the whole set, and more of each
    for its part, timed alone (part_copies). reach_top: a
    serving trial's first batch reaches the bucket's top (serving_draws). Each serving batch
    runs as a call of it does (as_called). A "graph" shape's trial holds the batches its
    graph replays (graph_draws), each as wide as the bound and with no host lengths. draws:
    the batches' lengths instead of the shape's own (a dense pass's). A serving trial of more
    than one sequence also holds a guard, a batch of equal lengths (equal_draw) outside the
    mix, where it fits beside it (a dense pass's trial too, the same batch as its shape's first
    trial's: its candidates must lose nowhere to the winner they would run beside)."""
    if shape.lengths == "serving" and draws is None:
        draws = serving_draws(shape.batch, shape.kv_len, seed, reach_top)
    why = too_big(shape, device, draws)  # (trial_bytes reads draws only for a serving shape's)
    if why:
        raise MemoryError(why)
    guard_lens = None
    if shape.lengths == "serving" and shape.batch > 1:
        guard_lens = equal_draw(shape.batch, shape.kv_len, seed)
        if too_big(shape, device, draws + [guard_lens]):  # the mix is measured without it
            guard_lens = None
    if shape.lengths == "full" and draws is None:
        batches = [op.make_inputs(shape, device=device, seed=seed)]
    elif shape.lengths == "graph":  # each batch as the graph captured at the bound runs it
        batches = [op.make_inputs(shape, device=device, seed=seed, seq_lens=lens)
                   for lens in (draws if draws is not None else graph_draws(shape.batch, shape.kv_len, seed))]
    else:
        batches = []
        for lens in draws:
            called, width = as_called(shape, lens)
            batches.append(op.make_inputs(called, device=device, seed=seed, seq_lens=lens, table_width=width))
    references = [inputs.reference() for inputs in batches]
    count = cold_l2_copies(sum(bytes_read(inputs) for inputs in batches), device)
    own = [count if len(batches) == 1 else part_copies(inputs, count, device) for inputs in batches]
    copies = []  # the rotation takes `count` of each batch's
    for j, n in enumerate(own):
        # a batch's own pool goes as soon as its copies hold theirs: held until all were made,
        # the originals had doubled the trial's pools at its peak (trial_bytes counts one more)
        inputs, batches[j] = batches[j], None
        copies.append(fresh_page_copies(inputs, n))
        del inputs
    if shape.lengths == "graph":  # a replay has no host lengths (a copy's pages were laid out by them)
        copies = [[dataclasses.replace(c, seq_lens_host=None) for c in per_batch] for per_batch in copies]
    del batches
    runs = [functools.partial(op.run, per_batch[c]) for c in range(count) for per_batch in copies]
    # the batches differ only in lengths, which kernels read from the device: one batch's
    # kernels are every batch's
    precompile = functools.partial(op.precompile, copies[0][0]) if op.precompile is not None else None
    # runs[c * len(copies) + j] is copy c of batch j; a part runs every copy of its batch
    parts = [[functools.partial(op.run, c) for c in per_batch] for per_batch in copies] if len(copies) > 1 else []
    guards = [] if guard_lens is None else [build_guard(op, shape, device, seed, guard_lens)]
    return Trial(runs=runs, reference=references[0], tolerance=op.tolerance[shape.dtype], kv_len=shape.kv_len,
                 checks=[(i, ref) for i, ref in enumerate(references) if i > 0], precompile=precompile,
                 parts=parts, guards=guards)


def build_guard(op: Op, shape: DecodeShape, device: str, seed: int, lengths: list[int]) -> Guard:
    """A batch of these lengths as a call of it runs (as_called), over copies of its own for a
    cold L2 (as a part's), with its reference output."""
    called, width = as_called(shape, lengths)
    inputs = op.make_inputs(called, device=device, seed=seed, seq_lens=lengths, table_width=width)
    reference = inputs.reference()
    copies = fresh_page_copies(inputs, part_copies(inputs, 1, device))
    del inputs
    return Guard(runs=[functools.partial(op.run, c) for c in copies], reference=reference, lengths=tuple(lengths))


def part_copies(inputs: DecodeInputs, count: int, device: str) -> int:
    """Copies of a mix's batch, which is also timed alone (its part): as many as it alone
    needs to read twice the L2 (at most settings.PART_MAX_COPIES), at least the mix's
    `count`. Each copy holds a page table of its own: those past `count` take at most twice
    the L2 of memory (a wide graph bound's tables outweigh the pages a short batch reads)."""
    alone = cold_l2_copies(bytes_read(inputs), device, settings.PART_MAX_COPIES)
    if device != "cuda" or alone <= count:
        return count
    room = 2 * l2_bytes() // max(inputs.page_table.nbytes, 1)
    return count + min(alone - count, room)


def kv_copies(inputs: DecodeInputs, device: str, max_copies: int = 64) -> int:
    """How many copies a cold-L2 rotation needs (tuner.bench.trial), by the bytes a call
    reads (tuner.workload.rotation), not the bytes allocated."""
    return cold_l2_copies(bytes_read(inputs), device, max_copies)


def on_second_trial(op: Op, shape: DecodeShape, device: str, seed: int, config: Config, default: Config,
                    timer: Any, min_gain: float, must_gain: bool = True,
                    starting: Callable[[Config], None] | None = None) -> SecondTrial:
    """config against the default on the shape's second trial (pipeline.confirm_again's
    rule, starting its), built once the first is freed; one that cannot be built does not
    hold (its error says why: a lost CUDA context, say, which no config is to blame for)."""
    try:
        trial = build_second_trial(op, shape, device, seed)
    except (RuntimeError, MemoryError) as e:
        return SecondTrial(False, error=one_line(e))
    boundary_sync(release=False)
    return confirm_again(trial, config, default, timer, min_gain=min_gain, must_gain=must_gain, starting=starting)
