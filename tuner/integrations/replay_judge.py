"""A server's own replays judge each graph variant against its batch size's base graph.

A variant's configs won their trials (tuner.sweep) on batches tuner built, and a server's
batches can differ in ways no trial held: one prompt length for a whole batch, the page
table's layout, the kernels of the step around attention. Inside SGLang at batch 8 x 32k a
variant that had won its trials ran the whole decode step ~4% slower than FA3's default
(docs/decisions.md, "Graph variants"). So the server's first replays of each variant decide,
for each class of lengths it serves (GraphVariants.pick: one graph may serve several kv
buckets, and win on one while it loses on another): they alternate with the base graph (what
the server runs without variants: the batch size's graph record, or FA3's default) over the
same class, a pair of CUDA events timing each replay; once `pairs` variant replays each have
a base replay just before them (at most PAIR_MAX_GAP steps before, with as many real
sequences), a class whose median time ratio exceeds 1 + tolerance is taken off the variant
(GraphVariants.drop_pick), and its steps replay the base graph from then on. A class kept is
judged again after settings.REPLAY_JUDGE_RECHECK more of its replays, then after twice as
many, and so on: its traffic may change, and a variant must not go on losing. A choice may
name another graph to be judged against (a Pick's `against`: an alternative backend's variant
challenging the variant kept for a class, GraphVariants.keep_pick): its other replays, and its
steps once it has lost, run that graph instead of the base graph, and it loses where its
replays' median ratio exceeds 1 (no tolerance: the graph it challenges has won already).

Consecutive steps of a server differ by a token per sequence, so a pair compares like with
like. The events also take in the host's work between them and the replay's launch, alike for
both graphs: it pulls a ratio towards 1, never past it. Each judged replay's whole step is
timed too, from its start event to the next step's (an event the next step records on the same
stream): that span holds what the replay's events do not (the step's sampling and copies, the
GPU's wait for the host). A variant is dropped where its replays' median ratio exceeds
1 + tolerance or its whole steps' exceeds 1 + step_tolerance (wider: a whole step carries the
host's jitter), so one whose replay gains while its steps lose is dropped. A pair whose base
step spans more than STEP_SPAN_MAX times the pair's longer replay held something else (a
prefill, the server idle) and gives no whole-step ratio; a variant step that long counts, as
the variant's own cost may be what made it long. No step of a process that decides alone
waits for the GPU: an event's time is read only once query() says the event is done, at a
later step. While a verdict is pending a step costs three event records on the host; after,
nothing.

Ranks that replay one graph together (tensor parallelism) must replay the same graphs, so
their verdicts must agree: given `agree` (the slowest rank's ratios, replays' and whole
steps', by one collective of the ranks' medians), a judge reads each replay a fixed
AGREED_READ_LAG steps after it ran, so that every rank counts the same pairs at the same
step and calls `agree` at the same step, and the agreed ratios decide on every rank (a
replay not yet done by then is waited for: a server's host runs a step or two ahead of its
GPU, so the wait is nil or short).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tuner import settings

if TYPE_CHECKING:
    from tuner.integrations.graph_variants import GraphVariants

# what a step replays: a GraphVariants.pick (a variant's label and the step's class of lengths,
# judged per class) or a plain label (a server's own graphs: judged per graph)
Choice = Any
VariantKey = tuple[int, Choice]  # (batch size, choice)
# a variant replay pairs with its class's last base replay only if that ran at most this many
# server steps before it (two classes' steps may interleave) with as many real sequences: a
# batch padded up to its size may hold fewer, and then far less work
PAIR_MAX_GAP = 2
# ranks that must agree read a replay this many server steps after it ran (by then done: a
# server's host runs at most a step or two ahead of its GPU), waiting for it if it is not
AGREED_READ_LAG = 4
# a pair gives a whole-step ratio only if its base step (its start to the next step's) spans at
# most this many times the pair's longer replay: a longer one held another forward (a prefill)
# or idle time
STEP_SPAN_MAX = 2.0
# a server's log, not a warning: a warning made an error (python -W error) would stop its step
log = logging.getLogger("tuner")


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


@dataclass
class Timed:
    """One replay being timed: its variant (or the base graph of that class), the server's
    step it ran at, its real sequences (None: not known), its events, and the server's own
    label of the graphs (SGLang's LoRA graphs, say: a pair compares graphs of one label)."""

    key: VariantKey
    variant: bool
    step: int
    raw_batch: int | None
    start: Any
    end: Any = None
    server_label: Any = None
    next_start: Any = None  # the next server step's start (recorded at its tick): the whole step's end


@dataclass
class _Tally:
    steps: int = 0  # replays of this class so far: even ones run the base graph, odd ones the variant
    # the last base replay read: it, its replay's time and its whole step's (ms; None: none read)
    last_base: tuple[Timed, float, float | None] | None = None
    ratios: list[float] = field(default_factory=list)
    step_ratios: list[float] = field(default_factory=list)


def label_of(choice: Choice) -> str | None:
    """The graph label a choice names (a Pick's label, or the choice itself)."""
    return getattr(choice, "label", choice)


def against_of(choice: Choice) -> str | None:
    """The graph a choice is judged against: a Pick's `against` (a variant it challenges), else
    None, the base graph."""
    return getattr(choice, "against", None)


class ReplayJudge:
    """Alternates each choice (a variant, or a variant for one class of lengths) with the base
    graph (or the graph it challenges: against_of) over its first replays and gives the verdict (on_drop(batch, choice, median ratio)
    for one that lost). pairs 0: judges nothing, every variant replays as planned. agree:
    where ranks replay together, the (replays', whole steps') ratios they all act on, given
    this rank's (see the module docstring; a whole-step ratio of 0.0: none); it may be set
    later, before the first replay is judged. whole_steps False: replays alone decide (a
    caller whose replays are not a server's steps)."""

    def __init__(self, pairs: int, tolerance: float, on_drop: Callable[[int, Choice, float], None],
                 event: Callable[[], Any] = _cuda_event, recheck: int = settings.REPLAY_JUDGE_RECHECK,
                 agree: Callable[[tuple[float, float]], tuple[float, float]] | None = None,
                 step_tolerance: float = settings.REPLAY_JUDGE_STEP_TOLERANCE, whole_steps: bool = True,
                 on_keep: Callable[[int, Choice], None] | None = None) -> None:
        self.pairs, self.tolerance, self._on_drop, self._event = pairs, tolerance, on_drop, event
        self._on_keep = on_keep
        self.recheck, self.agree = recheck, agree
        self.step_tolerance, self.whole_steps = step_tolerance, whole_steps
        self._tallies: dict[VariantKey, _Tally] = {}
        self._rechecks: dict[VariantKey, list[int]] = {}  # a kept choice: [replays since its verdict, the next recheck]
        self.verdicts: dict[VariantKey, float] = {}  # each judged variant's median ratio to the base graph
        self.details: dict[VariantKey, str] = {}  # a drop's replay and whole-step ratios, in words
        self._lost: set[VariantKey] = set()  # the choices dropped
        self._in_flight: deque[Timed] = deque()
        self._last: Timed | None = None  # the last replay timed: the next step's tick ends its whole step
        self._step = 0  # the server's replays so far (tick)

    @classmethod
    def for_variants(cls, variants: GraphVariants, event: Callable[[], Any] = _cuda_event) -> ReplayJudge:
        """The judge of a server's graph variants: $TUNER_REPLAY_JUDGE pairs (settings), a
        pick that loses taken off its variant in `variants`, and logged (drop_variant); one
        kept told to `variants` (an alternative backend's variant may challenge it next)."""
        judge = cls(settings.replay_judge_pairs(), settings.REPLAY_JUDGE_TOLERANCE, on_drop=lambda *a: None,
                    event=event, on_keep=variants.keep_pick)
        judge._on_drop = lambda batch, choice, ratio: drop_variant(variants, batch, choice, ratio,
                                                                   judge.details.get((batch, choice), ""))
        return judge

    @contextmanager
    def replaying(self, batch: int, choice: Choice, raw_batch: int | None = None) -> Iterator[str | None]:
        """Around each replay a server runs itself: gives the label to replay (the choice's, or
        the graph it is judged against, None for the base graph: on every other step while the
        choice is judged, and once it has lost) and times the replay where it is judged.
        choice: variants.pick(...) (or a label: one verdict for every step that replays it);
        raw_batch: the step's real sequences, where the batch is padded up to its size.

            with judge.replaying(bs, variants.pick(bs, seq_lens_cpu)) as label:
                graphs[bs, label].replay()
        """
        self.tick()
        if choice is None or not self.judging(batch, choice):
            if choice is None:
                yield None
            else:
                yield against_of(choice) if self.dropped(batch, choice) else label_of(choice)
            return
        variant = self.replays_variant(batch, choice)
        timed = self.start(batch, choice, variant, raw_batch)
        yield label_of(choice) if variant else against_of(choice)
        self.finish(timed)

    def tick(self) -> None:
        """A server step begins (every replay, judged or not): ends the last step's whole time,
        if it was timed, and reads the replays done so far."""
        self._step += 1
        last = self._last
        if self.whole_steps and last is not None and last.next_start is None and last.step == self._step - 1:
            last.next_start = self._event()
            last.next_start.record()
        if self._in_flight:
            self.collect()

    def forget(self, batch: int) -> None:
        """A batch size's graphs captured again (GraphVariants.plan): its verdicts, and what
        was being judged of it, belong to the old graphs."""
        self._in_flight = deque(t for t in self._in_flight if t.key[0] != batch)
        for verdicts in (self._tallies, self.verdicts, self._rechecks, self.details):
            for key in [k for k in verdicts if k[0] == batch]:
                del verdicts[key]
        self._lost = {k for k in self._lost if k[0] != batch}

    def dropped(self, batch: int, choice: Choice) -> bool:
        """Whether the choice was judged slower than the graph it was judged against."""
        return (batch, choice) in self._lost

    def replays_variant(self, batch: int, choice: Choice) -> bool:
        """Whether this step of the choice replays its variant (else the graph it is judged
        against): always once judged; while judged, every other step, the other graph first."""
        key = (batch, choice)
        if self.pairs <= 0 or key in self.verdicts:
            return True
        tally = self._tallies.setdefault(key, _Tally())
        tally.steps += 1
        return tally.steps % 2 == 0

    def judging(self, batch: int, choice: Choice) -> bool:
        """Whether this step of the choice is judged (asked once a step): until its verdict,
        and again once a kept choice is due its recheck."""
        key = (batch, choice)
        if self.pairs <= 0:
            return False
        if key not in self.verdicts:
            return True
        recheck = self._rechecks.get(key)
        if recheck is None:  # dropped: its steps replay the base graph
            return False
        recheck[0] += 1
        if recheck[0] <= recheck[1]:
            return False
        del self.verdicts[key]  # judged again; if kept, its next recheck comes twice as late
        recheck[0], recheck[1] = 0, 2 * recheck[1]
        return True

    def start(self, batch: int, choice: Choice, variant: bool, raw_batch: int | None = None,
              server_label: Any = None) -> Timed:
        """Before the replay: its start event, recorded on the current stream."""
        start = self._event()
        start.record()
        self._last = Timed((batch, choice), variant, self._step, raw_batch, start, server_label=server_label)
        return self._last

    def finish(self, timed: Timed) -> None:
        """After the replay: its end event; read at a later step (collect)."""
        timed.end = self._event()
        timed.end.record()
        self._in_flight.append(timed)

    def collect(self) -> None:
        """Read the replays whose events are done (ranks that agree: those AGREED_READ_LAG
        steps old), in the order they ran, and give verdicts."""
        while self._in_flight and self._readable(self._in_flight[0]):
            timed = self._in_flight.popleft()
            if timed.key in self.verdicts:
                continue
            tally = self._tallies[timed.key]
            ms = timed.start.elapsed_time(timed.end)
            span = None if timed.next_start is None else timed.start.elapsed_time(timed.next_start)
            if not timed.variant:
                tally.last_base = (timed, ms, span)
                continue
            base, tally.last_base = tally.last_base, None
            if base is None or not _neighbours(base[0], timed):
                continue
            # (a base replay timed at 0 ms: neutral, and counted, so ranks count alike)
            tally.ratios.append(ms / base[1] if base[1] > 0 else 1.0)
            step_ratio = _whole_step_ratio(base[2], span, max(base[1], ms))
            if step_ratio is not None:
                tally.step_ratios.append(step_ratio)
            if len(tally.ratios) >= self.pairs:
                self._decide(timed.key, statistics.median(tally.ratios), _median_or_none(tally.step_ratios,
                                                                                         self.pairs))

    def _readable(self, timed: Timed) -> bool:
        """Whether a replay's times may be read now: its end and its whole step's end done
        (alone), or AGREED_READ_LAG steps past (ranks that agree: the same step on every rank;
        its events waited for)."""
        if self.agree is None:
            return timed.end.query() and (not self.whole_steps or (
                timed.next_start is not None and timed.next_start.query()))
        if self._step - timed.step < AGREED_READ_LAG:
            return False
        for event in (timed.end, timed.next_start):  # (the next step's tick recorded next_start)
            if event is not None and not event.query():
                event.synchronize()
        return True

    @property
    def in_flight(self) -> bool:
        return bool(self._in_flight)

    def _decide(self, key: VariantKey, replay_ratio: float, step_ratio: float | None) -> None:
        """The verdict on the replays' median ratio and the whole steps' (where at least half
        the pairs gave one), each against its tolerance; ranks that agree, on the slowest
        rank's of each. The verdict's ratio: the whole steps' where they alone lost, else the
        replays'."""
        if self.agree is not None:
            replay_ratio, agreed_step = self.agree((replay_ratio, step_ratio or 0.0))
            step_ratio = agreed_step or None
        # a challenger must not be slower at all: the graph it challenges already beat the base graph
        replays_lost = replay_ratio > 1 + (0.0 if against_of(key[1]) is not None else self.tolerance)
        steps_lost = step_ratio is not None and step_ratio > 1 + self.step_tolerance
        ratio = step_ratio if steps_lost and not replays_lost else replay_ratio
        self.verdicts[key] = ratio
        del self._tallies[key]
        # (the log names both: a drop on the whole steps alone shows where a variant lost)
        both = f"{replay_ratio:.3f}x by its replays, {_ratio_text(step_ratio)} by its whole steps"
        if replays_lost or steps_lost:
            self._lost.add(key)
            self._rechecks.pop(key, None)
            self.details[key] = both
            self._on_drop(*key, ratio)
        else:
            self._rechecks.setdefault(key, [0, self.recheck])[0] = 0  # (a recheck's: its next comes twice as late)
            batch, choice = key  # (info: what a server's log shows of tuner's choices, beside the drops)
            log.info("tuner: graph variant %s of batch size %d ran %.3fx the time of %s over its first replays here "
                     "(%s); %s keep it", label_of(choice), batch, ratio, _against_text(choice), both, _steps_of(choice))
            if self._on_keep is not None:
                self._on_keep(*key)


def _whole_step_ratio(base_span: float | None, variant_span: float | None, longer_replay: float) -> float | None:
    """A pair's whole-step ratio (variant over base), or None where either span is missing or
    the base's held more than its step (STEP_SPAN_MAX times the pair's longer replay). A long
    variant step counts: its own cost may be what made it long."""
    if base_span is None or variant_span is None or variant_span <= 0:
        return None
    if not 0 < base_span <= STEP_SPAN_MAX * longer_replay:
        return None
    return variant_span / base_span


def _median_or_none(ratios: list[float], pairs: int) -> float | None:
    """The whole steps' median ratio where at least half the pairs counted one."""
    return statistics.median(ratios) if ratios and 2 * len(ratios) >= pairs else None


def _ratio_text(ratio: float | None) -> str:
    return "not counted" if ratio is None else f"{ratio:.3f}x"


def _neighbours(base: Timed, variant: Timed) -> bool:
    """Whether a base replay and a variant replay compare like with like (PAIR_MAX_GAP; as
    many real sequences; graphs of one server label)."""
    return (variant.step - base.step <= PAIR_MAX_GAP and base.raw_batch == variant.raw_batch
            and base.server_label == variant.server_label)


def drop_variant(variants: GraphVariants, batch: int, choice: Choice, ratio: float, both: str = "") -> None:
    """A verdict against a choice: its steps replay the graph it was judged against from now on
    (a pick: the steps of its class of lengths; a label: every step of the variant). both: the
    replays' and the whole steps' ratios, in words."""
    if getattr(choice, "step_class", None) is None:
        variants.drop(batch, choice)
    else:
        variants.drop_pick(batch, choice)
    log.warning("tuner: graph variant %s of batch size %d ran %.3fx the time of %s over its first replays here%s; "
                "%s replay that graph", label_of(choice), batch, ratio, _against_text(choice),
                f" ({both})" if both else "", _steps_of(choice))


def _against_text(choice: Choice) -> str:
    against = against_of(choice)
    return "the batch size's graph" if against is None else f"variant {against}"


def _steps_of(choice: Choice) -> str:
    """The steps a verdict holds for, in words (a pick's class of lengths, or every step)."""
    step_class = getattr(choice, "step_class", None)
    if step_class is None:
        return "its steps"
    return f"its steps at kv bucket {step_class[0]}, {'dense' if step_class[1] else 'not dense'}" + (
        f", FA3 cap {step_class[2]}" if len(step_class) > 2 else "")


__all__ = ["ReplayJudge", "Timed", "against_of", "drop_variant", "label_of"]
