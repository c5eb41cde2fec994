"""tuner.bench on its own: the winner rule, the decision against the default, the timer's
statistics, and the search strategies' steps (tuner.search)."""

import pytest

from tuner.bench import ERROR, OK, WRONG, Outcome, Timing, WallClockTimer, beats, decide, summarize, timer_for
from tuner.search import get_strategy


def t(median, spread=0.0):
    return Timing(median, spread, 5)


def test_beats_needs_more_than_noise_and_min_gain():
    assert beats(t(80, 2), t(100, 2))
    assert not beats(t(95, 20), t(100, 20))  # within the noise
    assert not beats(t(99.5), t(100.0))  # under the 1% minimum gain
    assert beats(t(99.5), t(100.0), min_gain=0.0)


def test_decide_when_the_default_failed_or_everything_failed():
    fast, slow = Outcome({"c": 1}, OK, t(10)), Outcome({"c": 2}, OK, t(20))
    no_timer = None  # nothing may be re-timed without a correct default
    assert decide(None, [Outcome({"c": 0}, ERROR), slow, fast], {"c": 0}, timer=no_timer) == (fast, None)
    assert decide(None, [Outcome({"c": 0}, ERROR), Outcome({"c": 1}, WRONG)], {"c": 0}, timer=no_timer) == (None, None)


def test_decide_keeps_a_default_no_challenger_looked_faster_than_without_retiming():
    default = Outcome({"c": 0}, OK, t(10))
    assert decide(None, [default, Outcome({"c": 1}, OK, t(11))], {"c": 0}, timer=None) == (default, default.timing)


class MixTimer:
    """Times a rotation as the mean cost of its calls; each call returns (config, batch)."""

    def __init__(self, cost):
        self.cost = cost  # config -> per batch cost

    def _time(self, rotation):
        costs = [self.cost[c][j] for c, j in (fn() for fn in rotation)]
        return t(sum(costs) / len(costs))

    def paired(self, a, b):
        return self._time(a), self._time(b)


# a serving trial's runs: two copies each of two batches (run c * 2 + j is copy c of batch j);
# its parts: each batch's runs over copies of its own
MIX_RUNS = [lambda config, j=j: (config["c"], j) for _ in range(2) for j in range(2)]
MIX_PARTS = [[MIX_RUNS[0], MIX_RUNS[2]], [MIX_RUNS[1], MIX_RUNS[3]]]


class InterleavingMixTimer(MixTimer):
    """A MixTimer that times several rotations in one run, as the CUDA-graph timer does."""

    def interleaved(self, rotations):
        return [self._time(r) for r in rotations]


@pytest.mark.parametrize("timer_class", [MixTimer, InterleavingMixTimer])
def test_a_winner_of_a_mix_must_not_lose_on_any_of_its_batches(timer_class):
    """Measured on the H200: a config chosen on the mean of a serving trial's batches ran at
    0.78x of FA3's default on one distribution's batches."""
    default = Outcome({"c": 0}, OK, t(100))
    lopsided = Outcome({"c": 1}, OK, t(60))  # 20 on one batch, 100 * 1.3 on the other
    even = Outcome({"c": 2}, OK, t(80))
    timer = timer_class({0: [100, 100], 1: [20, 130], 2: [80, 80]})
    winner, default_timing = decide(MIX_RUNS, [default, lopsided, even], {"c": 0}, timer=timer, parts=MIX_PARTS)
    assert winner.config == {"c": 2} and winner.timing.median_us == 80 and default_timing.median_us == 100
    # without the parts (a trial of one batch), the mean decides
    assert decide(MIX_RUNS, [default, lopsided, even], {"c": 0}, timer=timer)[0].config == {"c": 1}
    # no challenger holds on every batch: the default stays
    assert decide(MIX_RUNS, [default, lopsided], {"c": 0}, timer=timer, parts=MIX_PARTS)[0].config == {"c": 0}
    # a loss within settings.MAX_PART_LOSS (2%) on one batch is no loss
    timer.cost[1] = [20, 101.5]
    assert decide(MIX_RUNS, [default, lopsided], {"c": 0}, timer=timer, parts=MIX_PARTS)[0].config == {"c": 1}


@pytest.mark.parametrize("timer_class", [MixTimer, InterleavingMixTimer])
def test_a_winner_must_not_lose_on_a_guard_batch_outside_the_mix_nor_be_wrong_there(timer_class):
    """A batch of equal lengths (FA3's most even schedule) is timed apart from the mix, whose
    mean it does not enter: a config ahead on every batch of the mix but behind on it by more
    than settings.MAX_PART_LOSS, or not right there, gives way to the next."""
    from tuner.bench.trial import Guard

    # the guard is batch 2: its runs return (config, 2); config 9 does not run right there
    guard = Guard(runs=[lambda config: (config["c"], 2)] * 2, reference=(0, 2))
    asked = []

    def problem(config):
        asked.append(config["c"])
        return "wrong on a guard batch" if config["c"] == 9 else None

    default = Outcome({"c": 0}, OK, t(100))
    behind_there = Outcome({"c": 1}, OK, t(70))  # 70 on the mix, 103 on the guard
    ahead = Outcome({"c": 2}, OK, t(80))
    wrong = Outcome({"c": 9}, OK, t(60))
    timer = timer_class({0: [100, 100, 100], 1: [70, 70, 103], 2: [80, 80, 95], 9: [60, 60, 60]})
    winner, default_timing = decide(MIX_RUNS, [default, behind_there, ahead], {"c": 0}, timer=timer,
                                    parts=MIX_PARTS, guards=[guard], guard_problem=problem)
    # the mix's timings are the parts' means: the guard is not in them
    assert winner.config == {"c": 2} and winner.timing.median_us == 80 and default_timing.median_us == 100
    assert asked == [1, 2]  # each challenger checked on the guard before it is timed there
    assert decide(MIX_RUNS, [default, behind_there, ahead], {"c": 0}, timer=timer,
                  parts=MIX_PARTS)[0].config == {"c": 1}  # without the guard it wins
    assert decide(MIX_RUNS, [default, wrong, ahead], {"c": 0}, timer=timer, parts=MIX_PARTS, guards=[guard],
                  guard_problem=problem)[0].config == {"c": 2}


def test_guards_problem_says_why_a_config_is_not_right_on_a_guard_and_lets_a_lost_context_through():
    import torch

    from tuner.bench.runner import guards_problem
    from tuner.bench.trial import Guard

    def run(config):
        if config["c"] == "fails":
            raise ValueError("no kernel for this shape")
        if config["c"] == "faults":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return torch.ones(3) * (2.0 if config["c"] == "wrong" else 1.0)

    guard = Guard(runs=[run], reference=torch.ones(3))
    assert guards_problem({"c": "right"}, [guard], (1e-3, 1e-3)) is None
    assert guards_problem({"c": "wrong"}, [guard], (1e-3, 1e-3)).startswith("wrong on a guard batch")
    assert "no kernel for this shape" in guards_problem({"c": "fails"}, [guard], (1e-3, 1e-3))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        guards_problem({"c": "faults"}, [guard], (1e-3, 1e-3))


def test_summarize_median_and_iqr():
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s.median_us == 3.0 and s.samples == 5 and s.spread_us == pytest.approx(2.0)




class RecordingTimer:
    method = {"timer": "recording"}

    def quick(self):
        return QUICK


QUICK = RecordingTimer()


def test_strategies_list_their_steps_by_name():
    timer = RecordingTimer()
    configs = [{"c": 0}, {"c": 1}, {"c": 2}]
    exhaustive = get_strategy("exhaustive")
    assert [(s.config, s.timer, s.rung) for s in exhaustive.first(configs, timer)] == [(c, timer, 1) for c in configs]
    assert exhaustive.then([], configs[0], timer, 1) == []
    halving = get_strategy("halving")
    first = halving.first(configs, timer)
    assert [(s.timer, s.rung) for s in first] == [(QUICK, 0)] * 3
    outcomes = [Outcome({"c": 0}, OK, t(10)), Outcome({"c": 1}, OK, t(5)), Outcome({"c": 2}, OK, t(5.2)),
                Outcome({"c": 3}, WRONG)]
    then = halving.then(outcomes, {"c": 0}, timer, 0)
    assert sorted(s.config["c"] for s in then) == [0, 1, 2] and {(s.timer, s.rung) for s in then} == {(timer, 1)}
    assert halving.then(outcomes, {"c": 0}, timer, 1) == []
    with pytest.raises(Exception, match="unknown search strategy"):
        get_strategy("nope")


def test_a_strategy_is_one_module_in_tuner_search(tmp_path, monkeypatch):
    """A module with a STRATEGY anywhere on tuner.search's path is found by name; no list
    to register it in."""
    import sys

    import tuner.search as search

    (tmp_path / "only_default.py").write_text(
        "from tuner.search.base import Step\n"
        "class OnlyDefault:\n"
        "    name = 'only-default'\n"
        "    def first(self, configs, timer):\n"
        "        return [Step(configs[0], timer, 1)]\n"
        "    def then(self, outcomes, default, timer, rung):\n"
        "        return []\n"
        "STRATEGY = OnlyDefault()\n")
    monkeypatch.setattr(search, "__path__", [*search.__path__, str(tmp_path)])
    search.strategies.cache_clear()
    try:
        assert set(search.strategies()) == {"exhaustive", "guided", "halving", "only-default"}
        timer = RecordingTimer()
        assert [s.config for s in get_strategy("only-default").first([{"c": 0}, {"c": 1}], timer)] == [{"c": 0}]
    finally:
        monkeypatch.undo()
        monkeypatch.delitem(sys.modules, "tuner.search.only_default", raising=False)
        search.strategies.cache_clear()
    assert set(search.strategies()) == {"exhaustive", "guided", "halving"}


def test_timer_presets_make_the_timer_of_the_device():
    wall = timer_for("sweep-cpu", "cpu")
    assert isinstance(wall, WallClockTimer) and wall.method["repeats"] == 15
    assert timer_for("runtime", "cpu").method["max_seconds"] == 0.5


def test_a_library_sweep_on_a_gpu_times_with_the_cuda_graph_timers_own_defaults():
    """sweep() without timer= took a cheaper preset (2 warm-up calls, 15 samples) than the
    CudaGraphTimer() it used to build (3 and 20); only the CLI asks for 2 and 15."""
    from tuner.bench.cuda_timer import CudaGraphTimer

    assert timer_for("sweep-gpu", "cuda").method == CudaGraphTimer().method


def test_the_wall_clock_times_a_rotation_of_different_inputs_as_their_mean(monkeypatch):
    """A serving trial rotates batches of different cost; a per-call median kept the middle
    one's time and dropped the long batch's (review of issue 12). A fake clock: each call
    advances it by its cost."""
    import tuner.bench.timer as timer_module

    now = [0]
    monkeypatch.setattr(timer_module.time, "perf_counter_ns", lambda: now[0])

    def call(cost_ms):
        def run():
            now[0] += cost_ms * 1_000_000
        return run

    rotation = [call(1), call(2), call(30)]
    timer = WallClockTimer(warmup=1, repeats=4, min_repeats=4)
    assert timer(rotation).median_us == pytest.approx(11_000.0)
    fast, slow = timer.paired(rotation, [call(3)])
    assert fast.median_us == pytest.approx(11_000.0) and slow.median_us == pytest.approx(3_000.0)
