"""The replay judge's own rules, through ReplayJudge with plain labels (one verdict per graph)
on a fake clock: which replays pair, when whole steps count, and what forgetting a batch
size's graphs takes with it. Its use by a server: test_graph_variants and test_sglang."""

import pytest

from support.fake_events import EventClock
from tuner.integrations.replay_judge import PAIR_MAX_GAP, STEP_SPAN_MAX, ReplayJudge

PAIRS = 8


def _judge(events):
    drops = []
    judge = ReplayJudge(PAIRS, tolerance=0.01, on_drop=lambda batch, choice, ratio: drops.append((batch, choice, ratio)),
                        event=events)
    return judge, drops


def _step(judge, events, choice, cost, batch=4, after=0.0):
    """One server step: the replay (cost by the label replayed) and `after` ms more before the
    next step starts (by the label too), outside the replay's events."""
    with judge.replaying(batch, choice) as label:
        events.now += cost[label]
    events.now += after.get(label, 0.0) if isinstance(after, dict) else after
    return label


@pytest.mark.parametrize("gap, paired", [(PAIR_MAX_GAP, True), (PAIR_MAX_GAP + 1, False)])
def test_a_variant_replay_pairs_with_a_base_replay_at_most_pair_max_gap_steps_before_it(gap, paired):
    """Other steps (another batch size's, untimed) between a base replay and the variant's:
    up to PAIR_MAX_GAP steps apart they pair, one more and they do not (no verdict comes)."""
    events = EventClock()
    judge, drops = _judge(events)
    cost = {None: 1.0, "v": 1.5}
    for _ in range(PAIRS):
        assert _step(judge, events, "v", cost) is None
        for _ in range(gap - 1):
            _step(judge, events, None, cost, batch=8)
        assert _step(judge, events, "v", cost) == "v"
    _step(judge, events, None, cost, batch=8)  # (reads the last pair)
    assert ((4, "v") in judge.verdicts) is paired
    assert drops == ([(4, "v", pytest.approx(1.5))] if paired else [])


@pytest.mark.parametrize("counted, dropped", [(PAIRS // 2, True), (PAIRS // 2 - 1, False)])
def test_whole_steps_decide_only_where_at_least_half_the_pairs_counted_one(counted, dropped):
    """A variant whose replays gain (0.9x) and whose whole steps lose (1.4 ms against 1.2): the
    steps drop it where at least half the pairs gave a whole-step ratio. A pair whose base step
    held more than STEP_SPAN_MAX times its replays gives none: with fewer than half counted,
    the replays decide alone."""
    events = EventClock()
    judge, drops = _judge(events)
    cost = {None: 1.0, "v": 0.9}
    for pair in range(PAIRS):
        base_after = 0.2 if pair < counted else STEP_SPAN_MAX + 1.0
        assert _step(judge, events, "v", cost, after=base_after) is None
        assert _step(judge, events, "v", cost, after=0.5) == "v"
    _step(judge, events, None, cost, batch=8)
    assert judge.dropped(4, "v") is dropped
    if dropped:
        assert drops == [(4, "v", pytest.approx(1.4 / 1.2))]
    else:
        assert judge.verdicts[(4, "v")] == pytest.approx(0.9) and drops == []


def test_forgetting_a_batch_size_drops_its_replays_still_in_flight():
    """Replays timed on graphs captured again: their events, read after forget(), must not
    count for the new graphs (nor break the reading). The old variant was twice as slow; the
    new one, 10% faster, is judged on its own replays and kept."""
    events = EventClock()
    judge, drops = _judge(events)
    events.done = False  # a GPU that lags: nothing read yet
    for _ in range(PAIRS):
        _step(judge, events, "v", {None: 1.0, "v": 2.0})
    assert judge.in_flight
    judge.forget(4)
    assert not judge.in_flight
    events.done = True
    new_cost = {None: 1.0, "v": 0.9}
    assert [_step(judge, events, "v", new_cost) for _ in range(2 * PAIRS)] == [None, "v"] * PAIRS
    _step(judge, events, None, new_cost, batch=8)
    assert judge.verdicts == {(4, "v"): pytest.approx(0.9)} and drops == []


def test_forgetting_one_batch_size_keeps_another_ones_replays_in_flight():
    events = EventClock()
    judge, drops = _judge(events)
    events.done = False
    for _ in range(2 * PAIRS):
        _step(judge, events, "v", {None: 1.0, "v": 1.5}, batch=8)
    judge.forget(4)
    events.done = True
    _step(judge, events, None, {None: 1.0}, batch=2)
    assert drops == [(8, "v", pytest.approx(1.5))]
