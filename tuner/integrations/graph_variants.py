"""Graph variants: several CUDA graphs per batch size, and the choice among them before each
replay from the step's host lengths, so that a server decoding in CUDA graphs runs, at every
step, the configs decode_attention's per-call records name for that step's lengths.

A graph captured at the server's max context replays every later step's lengths, and one
config cannot suit them all: a per-replay choice inside one graph costs more than it gains
(docs/decisions.md, "Per-replay dispatch"). Before each replay a server already runs a host
step that writes the step's lengths into the graph's buffers. So tuner names, per batch size,
the few config sets the records hold over the lengths a replay may have (each kv bucket up to
the bound, dense batches or not), the server captures one graph for each (the base graph as
it captures today, and each variant inside `tuner.graph_capture(variant.lengths)`), and
before a replay asks which to run. Each graph holds one config set: no device step, no
empty node, and the choice costs the host a max and a sum over the batch's lengths.

    variants = GraphVariants()
    for bs in capture_batch_sizes:
        graphs[bs, None] = capture(bs)                   # as today
        for variant in variants.plan(bs, calls[bs]):     # one decode_attention call per static key
            with tuner.graph_capture(variant.lengths):
                graphs[bs, variant.label] = capture(bs)
    ...
    graphs[bs, variants.label(bs, seq_lens_cpu)].replay()  # None: the base graph

A class of replays runs its variant's graph only where its configs differ from the base
graph's; the variants kept (settings.graph_variants_max()) are those of the longest lengths,
where a step's time goes; every other class runs the base graph, as before.

Where a class's record is FA3's wave_fit config (tuner.ops.fa3_waves), which caps FA3's splits
from each call's own lengths, the cap a step needs is known only from its lengths: up to
WAVE_CAPS_PER_BATCH more graphs hold FA3 at the caps such steps mostly need, and label()
picks one where the step's lengths need exactly that cap. So do classes that run FA3's plain
default, where every call of the graph may be capped alike (default_cap_call): a record that
keeps the default was not beaten over its trials' batches, but FA3 spills past one wave on
some batches of any bucket, and a record swept before wave_fit existed (the shipped ones)
never asked. Each such graph is judged against the base graph per class of steps, as every
variant is (tuner.integrations.replay_judge).

A server that can capture another attention backend (SGLang's FlashInfer) gets one variant
more that runs it, plan(alternative=...): for the classes the base graph would replay, for
those whose own variant lost, and, judged against it, for those whose variant was kept: a
class keeps the alternative only where it beat the graph the class would replay without it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from tuner import settings
from tuner.db.fingerprint import library_version
from tuner.integrations.decode_attention import declared_branch, decode_attention, graph_runs
from tuner.keys import kv_len_bucket
from tuner.ops.base import sm_count
from tuner.ops.fa3_waves import (KEPT_BATCH, MODELLED_SGL_KERNEL, WAVE_FIT, static_splits, tiles_per_split, wave_args,
                                 wave_cap)
from tuner.runtime.capture import DeclaredLengths, graph_capture
from tuner.workload.traffic import is_dense

Config = dict[str, Any]
LABEL_PREFIX = "tuner-"
# FA3 caps given a graph of their own per batch size where a record is wave_fit: the one that
# fits a batch of like sequences in one wave (SMs // (batch x tiles)) and the next, which were
# 66% and 13% of the H200's held-out capped batches (docs/decisions.md, "FA3's wave overflow")
WAVE_CAPS_PER_BATCH = 2
FEW_LENGTHS = 32  # pick() reads a batch of up to this many lengths as Python ints, a larger one with NumPy


class StepLengths(DeclaredLengths):
    """The declaration of one class of replays: every batch's longest sequence at kv_len (its
    kv bucket's top), its batches dense or not (settings.DENSE_FILL)."""

    records_misses = False  # a class of lengths tuner made up, not a deployment's traffic

    def __init__(self, kv_len: int, dense: bool, fa3_cap: int = 0, default_capped: bool = False) -> None:
        super().__init__(None)
        self.known = self.per_sequence = True
        self.top, self.dense, self.fa3_cap, self.default_capped = kv_len, dense, fa3_cap, default_capped

    def kv_len(self, batch: int) -> int:
        return self.top

    def fill_share(self, batch: int, fill: float) -> float | None:
        return 1.0 if self.dense else 0.0

    def __repr__(self) -> str:  # (also what tensor-parallel ranks compare of their plans)
        cap = f", FA3 cap {self.fa3_cap}" if self.fa3_cap else ""
        default = ", FA3's default capped" if self.default_capped else ""
        return f"StepLengths({self.top}, {'dense' if self.dense else 'not dense'}{cap}{default})"


@dataclass(frozen=True)
class Variant:
    """A graph to capture beside a batch size's base graph: its label (the server's key for
    it), the declaration to capture it under, and the config each call of the graph runs."""

    label: str
    lengths: StepLengths
    configs: tuple[str, ...]
    alternative: str | None = None  # a server backend its calls run instead (plan's `alternative`)


class Pick(NamedTuple):
    """The graph a step replays and why: its variant's label and the step's class of lengths
    (kv bucket, dense, and the FA3 cap where a cap graph was picked). One graph may serve
    several classes, and it can win on one and lose on another: drop_pick() takes one class
    off it. against: the graph the replay judge times it against, None for the base graph, or
    the label of the variant it challenges (the alternative backend's against a variant the
    judge kept for that class)."""

    label: str
    step_class: tuple
    against: str | None = None


def _canonical(config: Config) -> str:
    return repr(sorted(config.items()))


_FA3_DEFAULT_TEXT = _canonical({"backend": "fa3", "num_splits": 0, "pack_gqa": None})


def captured_configs(calls: Sequence[tuple], batch: int) -> tuple[str, ...]:
    """What each decode_attention call (its positional arguments, as a graph captures it: no
    host lengths) runs under the active declaration, as canonical text: of a by_fill record
    the declared part, of a backend a graph cannot hold the default backend's config."""
    out = []
    for call in calls:
        config = declared_branch(decode_attention.tuner.config_for(*call), batch)
        out.append(_canonical(graph_runs(config, call)))
    return tuple(out)


def _wave_fit_call(calls: Sequence[tuple], batch: int) -> tuple | None:
    """The first call whose config under the active declaration is FA3's wave_fit, or None."""
    for call in calls:
        if WAVE_FIT in declared_branch(decode_attention.tuner.config_for(*call), batch):
            return call
    return None


@dataclass(frozen=True)
class _WaveSteps:
    """What label() needs to find a step's FA3 cap: the wave_fit call's shape, the classes
    of replays whose record is wave_fit, and the label of each cap given a graph."""

    shape: dict[str, int]
    classes: frozenset[tuple[int, bool]]
    labels: dict[int, str]


@functools.cache
def _modelled_fa3_installed() -> bool:
    """Whether the installed sgl-kernel's FA3 scheduler is one the wave model was read from."""
    return library_version(("sglang-kernel", "sgl-kernel"), "sgl_kernel") in MODELLED_SGL_KERNEL


def default_cap_call(calls: Sequence[tuple], batch: int, base: tuple[str, ...]) -> tuple | None:
    """The call whose shape cap graphs of FA3's default are planned on, where they may be
    (settings.graph_wave_caps, and an sgl-kernel whose FA3 the model follows): every call
    of the graph runs FA3's plain default in the base graph, with 16-bit q and cache, no
    window and one shape (a cap graph caps every such call alike), and FA3's tiles at this
    batch size can spill past one wave but fit two; else None. Not past KEPT_BATCH
    sequences: there the model would run in every step's host step (tens of us; a smaller
    batch's cap is kept per batch of kv blocks), for gains no run has measured."""
    if not calls or batch > KEPT_BATCH or not settings.graph_wave_caps() or not _modelled_fa3_installed():
        return None
    if set(base) != {_FA3_DEFAULT_TEXT}:
        return None
    q, k_cache, page_table = calls[0][0], calls[0][1], calls[0][3]
    shape = wave_args(q, k_cache, page_table, sm_count(q.device.index))
    for call in calls:
        window = tuple(call[7]) if len(call) > 7 else (-1, -1)  # (decode_attention's default)
        if (call[0].dtype not in (torch.bfloat16, torch.float16) or call[1].dtype != call[0].dtype
                or window != (-1, -1) or wave_args(call[0], call[1], call[3], shape["sms"]) != shape):
            return None
    tiles = tiles_per_split(**shape)
    most_splits = static_splits(tiles, shape["table_keys"], shape["head_dim"], shape["sms"])
    # (FA3 does not split a table of at most 4 kv blocks: no step of it would need a cap)
    can_spill = most_splits > 1 and batch * tiles * most_splits > shape["sms"] and batch * tiles <= 2 * shape["sms"]
    return calls[0] if can_spill else None


def _planned_caps(batch: int, shape: dict[str, int]) -> list[int]:
    """The caps given graphs at this batch size (WAVE_CAPS_PER_BATCH, from the one that fits a
    batch of like sequences in one wave)."""
    fits = max(shape["sms"] // (batch * tiles_per_split(**shape)), 1)
    return list(range(fits, fits + WAVE_CAPS_PER_BATCH))


def _sparse_can_occur(batch: int, top: int) -> bool:
    """Whether a batch of this size whose longest sequence is at most top can be not dense:
    its lengths (padding included) are at least 1, so its sum at least longest + batch - 1,
    which at batch 1 and 2 always reaches settings.DENSE_FILL of batch x longest."""
    return not is_dense(top + batch - 1, batch, top)


class GraphVariants:
    """Per batch size, which replays run which captured graph (see the module's docstring).
    plan() at capture, label() (or pick()) before each replay; one per model runner (or process)."""

    def __init__(self, max_variants: int | None = None) -> None:
        self.max_variants = settings.graph_variants_max() if max_variants is None else max_variants
        self._labels: dict[int, dict[tuple[int, bool], str]] = {}  # batch -> (kv bucket, dense) -> label
        self._waves: dict[int, _WaveSteps] = {}  # batch -> its FA3 cap graphs, where a record is wave_fit
        self._dropped: dict[int, set[tuple]] = {}  # batch -> the (label, step class) picks drop_pick took off
        self._alternatives: dict[int, str] = {}  # batch -> the label of its alternative backend's variant
        self._kept: dict[int, set[Pick]] = {}  # batch -> the picks keep_pick was told of, where it has an alternative

    def plan(self, batch: int, calls: Iterable[tuple], alternative: str | None = None) -> list[Variant]:
        """The variants worth capturing beside the base graph of `batch`, whose decode_attention
        calls are `calls` (their positional arguments; one per static key suffices, each with
        the graph's bound as max_kv_len). alternative: the name of another attention backend
        the server can capture (SGLang's FlashInfer): one more variant, whose calls run it,
        for every class of lengths the base graph would replay (a cap graph still comes first
        where a step's lengths need its cap) and every class whose own variant the replay
        judge drops, for the judge to keep where it wins, and it challenges, class by class,
        the variants the judge keeps (keep_pick, pick()). Call it outside any graph_capture."""
        calls = [tuple(c) for c in calls]
        self.forget(batch)
        if not calls or self.max_variants <= 0:
            return []
        bound = max(int(c[5]) for c in calls)
        with graph_capture():  # what the base graph runs: lengths unknown
            base = captured_configs(calls, batch)
        default_call = default_cap_call(calls, batch, base)
        groups: dict[tuple[str, ...], list[tuple[int, bool]]] = {}
        wave_classes: dict[tuple[str, ...], list[tuple[int, bool]]] = {}  # by what they run, uncapped
        recorded: set[tuple[str, ...]] = set()  # the groups of wave_classes a wave_fit record is in
        base_classes: list[tuple[int, bool]] = []  # the classes the base graph would replay
        every_class: list[tuple[int, bool]] = []
        wave_call = None
        for exponent in range(kv_len_bucket(bound).bit_length() - 1, -1, -1):  # longest first
            for dense in (True, False):
                if not dense and not _sparse_can_occur(batch, 1 << exponent):
                    continue  # a graph no replay would pick
                with graph_capture(StepLengths(1 << exponent, dense)):
                    configs = captured_configs(calls, batch)
                    found = _wave_fit_call(calls, batch)
                if found is not None:
                    recorded.add(configs)
                    wave_call = wave_call or found
                elif default_call is not None and configs == base:
                    found = default_call  # (a class that runs FA3's default)
                if found is not None:
                    wave_classes.setdefault(configs, []).append((1 << exponent, dense))
                every_class.append((1 << exponent, dense))
                if configs != base:
                    groups.setdefault(configs, []).append((1 << exponent, dense))
                else:
                    base_classes.append((1 << exponent, dense))
        variants = []
        for configs, classes in list(groups.items())[:self.max_variants]:
            label = f"{LABEL_PREFIX}{len(variants) + 1}"
            variants.append(Variant(label, StepLengths(*classes[0]), configs))
            self._labels.setdefault(batch, {}).update(dict.fromkeys(classes, label))
        if alternative is not None:  # (every class it may serve: pick() sends them to it)
            label = self._alternatives[batch] = f"{LABEL_PREFIX}{len(variants) + 1}"
            declared = StepLengths(*(base_classes or every_class)[0])  # (for the calls it leaves to tuner)
            variants.append(Variant(label, declared, (alternative,), alternative=alternative))
        if wave_classes:  # a cap graph runs one set's configs for every call: a record's first, then the longest
            capped = next((c for c in wave_classes if c in recorded), next(iter(wave_classes)))
            variants += self._plan_caps(batch, calls, wave_call or default_call, wave_classes[capped], len(variants),
                                        default_capped=default_call is not None)
        return variants

    def forget(self, batch: int) -> None:
        """No variant for this batch size (until its next plan): every step replays its base graph."""
        for held in (self._labels, self._waves, self._dropped, self._alternatives, self._kept):
            held.pop(batch, None)

    def _plan_caps(self, batch: int, calls: list[tuple], wave_call: tuple, classes: list[tuple[int, bool]],
                   taken: int, default_capped: bool = False) -> list[Variant]:
        """The graphs of FA3 at the caps _planned_caps names, for classes whose record is wave_fit
        (or, default_capped, FA3's plain default) and whose other calls run alike (so a step of
        any of them may replay the graph)."""
        q, k_cache, page_table = wave_call[0], wave_call[1], wave_call[3]
        shape, variants, labels = wave_args(q, k_cache, page_table, sm_count(q.device.index)), [], {}
        for cap in _planned_caps(batch, shape):
            lengths = StepLengths(*classes[0], fa3_cap=cap, default_capped=default_capped)
            with graph_capture(lengths):
                configs = captured_configs(calls, batch)
            label = f"{LABEL_PREFIX}{taken + len(variants) + 1}"
            variants.append(Variant(label, lengths, configs))
            labels[cap] = label
        self._waves[batch] = _WaveSteps(shape, frozenset(classes), labels)
        return variants

    def drop(self, batch: int, label: str) -> None:
        """A variant that could not be captured: its replays run the base graph."""
        labels = self._labels.get(batch, {})
        for step_class in [c for c, kept in labels.items() if kept == label]:
            del labels[step_class]
        if self._alternatives.get(batch) == label:
            del self._alternatives[batch]
            self._kept.pop(batch, None)
        waves = self._waves.get(batch)
        if waves is not None:
            for cap in [c for c, kept in waves.labels.items() if kept == label]:
                del waves.labels[cap]
            if not waves.labels:  # (no cap graph left: pick() need not read the step's lengths for one)
                del self._waves[batch]

    def described(self, batch: int) -> str:
        """The batch size's plan as text, every class of steps and the graph it replays (what
        tensor-parallel ranks compare: their variants may look alike while their classes differ)."""
        waves = self._waves.get(batch)
        return repr((sorted(self._labels.get(batch, {}).items()), self._alternatives.get(batch),
                     None if waves is None else (sorted(waves.shape.items()), sorted(waves.classes),
                                                 sorted(waves.labels.items()))))

    def drop_pick(self, batch: int, pick: Pick) -> None:
        """A verdict against one class of steps on its graph (tuner.integrations.replay_judge):
        those steps replay, from now on, the graph their class names without a cap where a cap
        graph was dropped, else the alternative backend's variant where there is one and it
        was not the graph dropped, else the base graph; the graph keeps its other classes."""
        self._dropped.setdefault(batch, set()).add(pick)

    def keep_pick(self, batch: int, pick: Any) -> None:
        """A verdict for one class of steps on its graph: where the batch size has an alternative
        backend's variant and the graph kept is another, the alternative challenges it for that
        class next (its steps replay the alternative, judged against the graph kept, and go back
        to that graph if the alternative loses: pick()). Anything but a Pick is ignored."""
        alternative = self._alternatives.get(batch)
        if alternative is not None and isinstance(pick, Pick) and pick.label != alternative:
            self._kept.setdefault(batch, set()).add(pick)

    def label(self, batch: int, seq_lens_host: Any, raw_batch: int | None = None) -> str | None:
        """The graph to replay for a step: a variant's label, or None for the base graph (see
        pick())."""
        picked = self.pick(batch, seq_lens_host, raw_batch)
        return None if picked is None else picked.label

    def pick(self, batch: int, seq_lens_host: Any, raw_batch: int | None = None) -> Pick | None:
        """The variant a step replays and its class of lengths, or None for the base graph.
        seq_lens_host: the step's lengths on the host (a CPU tensor, an array or a list), of
        its first raw_batch sequences (all of them if None, at most `batch`); the rest of
        `batch` are padding of length 1, as a server pads a batch up to a captured size."""
        labels = self._labels.get(batch)
        if (not labels and batch not in self._waves and batch not in self._alternatives) or seq_lens_host is None:
            return None
        if isinstance(seq_lens_host, torch.Tensor) and not seq_lens_host.is_cpu:
            return None
        lengths, longest, total = _real_lengths(seq_lens_host, batch if raw_batch is None else min(raw_batch, batch))
        if not len(lengths):
            return None
        total += batch - len(lengths)
        step_class = (kv_len_bucket(max(longest, 1)), is_dense(total, batch, longest))
        dropped = self._dropped.get(batch, ())
        waves = self._waves.get(batch)
        if waves is not None and waves.labels and step_class in waves.classes:
            # the padding too: FA3 gives each padded sequence a tile of its own
            cap = wave_cap(_padded(lengths, batch), **waves.shape)
            capped = Pick(waves.labels.get(cap), (*step_class, cap))
            if capped.label is not None and capped not in dropped:
                return self._challenged(batch, capped, dropped) if self._kept else capped
        label = labels.get(step_class) if labels else None
        if label is not None and not (dropped and Pick(label, step_class) in dropped):
            picked = Pick(label, step_class)
            return self._challenged(batch, picked, dropped) if self._kept else picked
        alternative = self._alternatives.get(batch)
        if alternative is None or (dropped and Pick(alternative, step_class) in dropped):
            return None
        return Pick(alternative, step_class)

    def _challenged(self, batch: int, pick: Pick, dropped: Any) -> Pick:
        """The pick, or where the judge kept it and the alternative backend's variant has not
        lost against it, that variant's challenge (keep_pick)."""
        kept = self._kept.get(batch)
        if not kept or pick not in kept:
            return pick
        challenger = Pick(self._alternatives[batch], pick.step_class, pick.label)
        return pick if dropped and challenger in dropped else challenger


def _real_lengths(seq_lens_host: Any, real: int) -> tuple[list[int] | np.ndarray, int, int]:
    """The step's real sequences' lengths (the first `real` given), their longest and their
    sum: Python ints for a batch of up to FEW_LENGTHS, where NumPy's reductions cost more than
    Python's (every step pays), else a NumPy array."""
    array = isinstance(seq_lens_host, (torch.Tensor, np.ndarray))
    given = seq_lens_host.shape[0] if array else len(seq_lens_host)  # (a tensor's len() costs 2 us)
    size = min(real, given)
    if size <= FEW_LENGTHS:
        if array:
            lengths = (seq_lens_host if given <= FEW_LENGTHS else seq_lens_host[:size]).tolist()
            del lengths[size:]
        else:
            lengths = [int(n) for n in seq_lens_host[:size]]
        return lengths, int(max(lengths, default=0)), int(sum(lengths))
    as_array = seq_lens_host.numpy() if isinstance(seq_lens_host, torch.Tensor) else np.asarray(seq_lens_host)
    lengths = as_array[:size]
    return lengths, int(lengths.max()), int(lengths.sum())


def _padded(lengths: list[int] | np.ndarray, batch: int) -> list[int] | np.ndarray:
    """The lengths with the batch's padding (length 1) after them."""
    pads = batch - len(lengths)
    if not pads:
        return lengths
    if isinstance(lengths, list):
        return lengths + [1] * pads
    return np.concatenate((lengths, np.ones(pads, dtype=lengths.dtype)))


__all__ = ["GraphVariants", "Pick", "StepLengths", "Variant", "captured_configs"]
