import os
import warnings

import pytest
import torch

import tuner
from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id, fingerprint_id
from tuner.keys import attention_run_key, canonical_json

FP = (current_fingerprint_id(), current_fingerprint())
STATIC = ("float32", 8, 2)


class FakeClock:
    """The wall-clock timer's clock, advanced by what each call costs: tune mode's timings are
    exact, whatever the machine's load, and nothing sleeps."""

    BASE_S = 0.001  # every call's cost: no timing is zero

    def __init__(self, monkeypatch):
        import tuner.bench.timer as timer_module

        self.now = 0
        monkeypatch.setattr(timer_module.time, "perf_counter_ns", lambda: self.now)

    def spend(self, seconds: float) -> None:
        self.now += int((self.BASE_S + seconds) * 1e9)


@pytest.fixture
def clock(monkeypatch):
    return FakeClock(monkeypatch)


def make_fn(calls=None, slow=None, clock=None):
    """A decorated function that records the config each call ran with; slow: seconds more a
    config's call costs on the fake clock."""
    assert not slow or clock is not None, "slow calls are timed on the fake clock"
    slow = slow or {}

    @tuner.autotune(
        "toy",
        configs=[{"block": 16}, {"block": 32}, {"block": 64}],
        static_key=lambda x, batch, kv: STATIC,
        run_key=lambda x, batch, kv: (batch, 1, kv),
        default={"block": 32},
    )
    def fn(x, batch, kv, *, config):
        if calls is not None:
            calls.append(config["block"])
        if clock is not None:
            clock.spend(slow.get(config["block"], 0.0))
        return x * 2

    return fn


def store(db_path, batch, kv, config, fp=FP, op="toy", gain=2.0):
    """A winner that ran `gain` times as fast as the default at its own key."""
    db = TuningDB(db_path)
    db.save_record(Problem(op, canonical_json(STATIC), attention_run_key(batch, 1, kv)), fp, config,
                   median_us=1.0, spread_us=0.1, samples=5, default_config={"block": 32},
                   default_median_us=gain, default_spread_us=0.1, method={"timer": "test"})
    db.close()


def run(fn, batch, kv, calls):
    calls.clear()
    fn(torch.ones(2), batch, kv)
    return calls[-1]


def test_lookup_exact_nearest_and_default(db_path):
    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    fn = make_fn(calls)
    assert run(fn, 16, 2048, calls) == 64
    assert run(fn, 16, 1500, calls) == 64  # same kv bucket (<= 2048)
    assert run(fn, 8, 4096, calls) == 64  # nearest neighbour, 2 octaves away
    assert run(fn, 1, 2**20, calls) == 32  # too far: the default


def test_a_neighbour_is_borrowed_only_when_every_nearest_one_gained_10_percent(db_path):
    """Split-KV configs tuned for one batch can lose to the default an octave away (H200,
    benchmarks/results/h200/mixed_lengths_before.json): small gains are not carried over."""
    store(db_path, 4, 2048, {"block": 64}, gain=1.5)
    store(db_path, 16, 2048, {"block": 16}, gain=1.05)  # beat its default by only 5%
    store(db_path, 64, 2048, {"block": 16}, gain=1.2)
    store(db_path, 256, 2048, {"block": 64}, gain=1.3)
    store(db_path, 1, 512, {"block": 16}, gain=1.0)  # the default was best there: exact hits still use it
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    fn = make_fn(calls)
    assert run(fn, 16, 2048, calls) == 16  # exact: always the stored winner, whatever its gain
    assert run(fn, 1, 512, calls) == 16
    assert run(fn, 2, 2048, calls) == 64  # one neighbour (b4), 1.5x: borrowed
    assert run(fn, 8, 2048, calls) == 32  # b4 (1.5x) and b16 (1.05x) equally near: the default
    assert run(fn, 32, 2048, calls) == 32  # b16 (1.05x) and b64 (1.2x): the default
    assert run(fn, 128, 2048, calls) == 64  # b64 (1.2x) and b256 (1.3x): the tie rule's pick, b256
    assert run(fn, 2, 512, calls) == 32  # b1 at 1.0x: never lent
    tuner.configure(db=db_path, mode="lookup")
    fn(torch.ones(2), 8, 2048)
    assert tuner.flush_misses() == 1  # served the default: a miss, for `sweep --from-misses`


def test_explicit_config_always_wins(db_path):
    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path, mode="force")
    calls = []
    fn = make_fn(calls)
    fn(torch.ones(2), 16, 2048, config={"block": 16})
    assert calls == [16]  # no tuning ran, the caller's config was used


def test_off_mode_uses_the_default(db_path):
    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path, mode="off")
    calls = []
    assert run(make_fn(calls), 16, 2048, calls) == 32


def test_records_of_another_environment_are_ignored(db_path):
    other = dict(current_fingerprint(), device="Another GPU")
    store(db_path, 16, 2048, {"block": 64}, fp=(fingerprint_id(other), other))
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    assert run(make_fn(calls), 16, 2048, calls) == 32


def test_mode_comes_from_the_environment(db_path, monkeypatch):
    store(db_path, 16, 2048, {"block": 64})
    monkeypatch.setenv("TUNER_MODE", "off")
    tuner.configure(db=db_path, mode=None)  # None: $TUNER_MODE (a setting not given is kept)
    calls = []
    assert run(make_fn(calls), 16, 2048, calls) == 32
    with pytest.raises(tuner.TunerError, match="mode"):
        tuner.configure(mode="sometimes")


def test_db_comes_from_the_environment(db_path, monkeypatch):
    store(db_path, 16, 2048, {"block": 64})
    monkeypatch.setenv("TUNER_DB", str(db_path))
    tuner.configure()
    calls = []
    assert run(make_fn(calls), 16, 2048, calls) == 64


def test_the_snapshot_is_read_once_and_lookups_are_memoised(db_path):
    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    fn = make_fn(calls)
    assert run(fn, 16, 2048, calls) == 64
    store(db_path, 16, 2048, {"block": 16})  # a later write is not seen until configure()
    assert run(fn, 16, 2048, calls) == 64
    assert len(fn.tuner.memo) == 1
    tuner.configure(db=db_path, mode="lookup")
    assert run(fn, 16, 2048, calls) == 16


def test_tune_mode_tunes_a_missing_key_once_and_stores_it(db_path, clock):
    tuner.configure(db=db_path, mode="tune")
    calls = []
    fn = make_fn(calls, slow={32: 0.004, 64: 0.004}, clock=clock)  # block 16 is clearly fastest
    out = fn(torch.ones(2), 4, 100)
    assert torch.equal(out, torch.full((2,), 2.0))
    assert set(calls) == {16, 32, 64}  # every candidate ran
    assert run(fn, 4, 100, calls) == 16 and calls == [16]  # then the memo, no tuning
    records = TuningDB(db_path).records()
    assert len(records) == 1 and records[0].config == {"block": 16}
    assert records[0].method["source"] == "runtime" and records[0].problem.run_key == attention_run_key(4, 1, 100)
    # a new process in lookup mode finds it
    tuner.configure(db=db_path, mode="lookup")
    assert run(make_fn(calls), 4, 100, calls) == 16


def test_a_key_one_thread_is_tuning_is_served_the_lookups_config_in_another(db_path):
    """Threads whose first calls shared a key each tuned it, at once, timing against each
    other's load (a helper's review: 4 threads, 4 tunings, 3 records replaced)."""
    import threading

    tuner.configure(db=db_path, mode="tune")
    tuning_began, other_done = threading.Event(), threading.Event()
    runs: dict[str, list[int]] = {"tuner": [], "other": []}

    @tuner.autotune("toy", configs=[{"block": 16}, {"block": 32}, {"block": 64}], default={"block": 32},
                    static_key=lambda x, who: STATIC, run_key=lambda x, who: (4, 1, 100))
    def fn(x, who, *, config):
        runs[who].append(config["block"])
        if who == "tuner" and not tuning_began.is_set():
            tuning_began.set()
            other_done.wait(30)  # the other thread's call comes while this one tunes
        return x

    tuning = threading.Thread(target=fn, args=(torch.ones(1), "tuner"))
    tuning.start()
    assert tuning_began.wait(30)
    fn(torch.ones(1), "other")
    other_done.set()
    tuning.join(60)
    assert runs["other"] == [32]  # the default, once: no second tuning
    assert len(runs["tuner"]) > 3 and len(TuningDB(db_path).records()) == 1


def test_tune_mode_tunes_a_key_that_a_neighbours_record_serves(db_path, clock):
    """A borrowed record is a stand-in: tune mode tunes the key itself and stores it."""
    store(db_path, 8, 4096, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    assert run(make_fn(calls), 16, 2048, calls) == 64  # (served by its neighbour)
    tuner.configure(db=db_path, mode="tune")
    fn = make_fn(calls, slow={32: 0.004, 64: 0.004}, clock=clock)
    calls.clear()
    fn(torch.ones(2), 16, 2048)
    assert set(calls) == {16, 32, 64}  # every candidate ran
    tuner.configure(mode="off")
    exact = [r for r in TuningDB(db_path).records() if r.problem.run_key == attention_run_key(16, 1, 2048)]
    assert [r.config for r in exact] == [{"block": 16}]


def test_tune_mode_does_not_retune_stored_keys_but_force_does(db_path):
    store(db_path, 4, 128, {"block": 64})
    tuner.configure(db=db_path, mode="tune")
    calls = []
    fn = make_fn(calls)
    assert run(fn, 4, 128, calls) == 64 and calls == [64]
    tuner.configure(db=db_path, mode="force")
    calls.clear()
    fn(torch.ones(2), 4, 128)
    assert set(calls) == {16, 32, 64}
    calls.clear()
    fn(torch.ones(2), 4, 128)
    assert len(calls) == 1  # once per key per process


def test_tune_mode_stores_nothing_when_the_confirming_run_fails(db_path, monkeypatch, clock):
    """A failed side-by-side re-timing stored the default as the key's tuned winner, and an
    exact record is never tuned again: the key kept the default for good."""
    from tuner.bench import WallClockTimer

    def out_of_memory(self, a, b):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(WallClockTimer, "paired", out_of_memory)
    tuner.configure(db=db_path, mode="tune")
    fn = make_fn(slow={32: 0.004, 64: 0.004}, clock=clock)
    with pytest.raises(torch.OutOfMemoryError):
        fn(torch.ones(2), 4, 100)
    tuner.configure(mode="off")  # writes what the process holds
    assert TuningDB(db_path).records() == []


def _paired_results(monkeypatch, *wins):
    """WallClockTimer.paired faked: each call in turn says whether the first rotation won
    (10 us against 20 us), lost (20 against 10), or, "level", came out 0.5% ahead (19.9
    against 20: less than the winner rule's gain)."""
    from tuner.bench import Timing, WallClockTimer

    results = iter(wins)

    def paired(self, a, b):
        fast, slow = Timing(10.0, 0.1, 5), Timing(20.0, 0.1, 5)
        won = next(results)
        if won == "level":
            return Timing(19.9, 0.1, 5), slow
        return (fast, slow) if won else (slow, fast)
    monkeypatch.setattr(WallClockTimer, "paired", paired)


def test_tune_mode_stores_the_default_when_its_winner_loses_the_confirming_re_timing(db_path, monkeypatch, clock):
    """Tune mode stored a config that re-timed 2.9x slower than the default as a 1.84x winner:
    one side-by-side timing on a loaded host decided it. A second one must agree."""
    _paired_results(monkeypatch, True, False)  # wins the first side-by-side, loses the second
    tuner.configure(db=db_path, mode="tune")
    calls = []
    fn = make_fn(calls, slow={32: 0.004, 64: 0.004}, clock=clock)
    fn(torch.ones(2), 4, 100)
    assert run(fn, 4, 100, calls) == 32 and calls == [32]  # the default serves, and the key is not tuned again
    tuner.configure(mode="off")
    [record] = TuningDB(db_path).records()
    assert record.config == record.default_config == {"block": 32}
    assert record.method["confirmed"]["held"] is False and record.method["confirmed"]["config"] == {"block": 16}


def test_tune_mode_stores_the_default_where_its_winner_is_only_level_in_the_confirming_re_timing(
        db_path, monkeypatch, clock):
    """The confirming re-timing asks for the winner rule's gain, as a sweep's second trial
    does: level with the default is not a win."""
    _paired_results(monkeypatch, True, "level")
    tuner.configure(db=db_path, mode="tune")
    fn = make_fn(slow={32: 0.004, 64: 0.004}, clock=clock)
    fn(torch.ones(2), 4, 100)
    tuner.configure(mode="off")
    [record] = TuningDB(db_path).records()
    assert record.config == record.default_config == {"block": 32}
    assert record.method["confirmed"]["held"] is False and record.method["confirmed"]["winner_us"] == 19.9


def test_tune_mode_stores_a_winner_that_holds_its_confirming_re_timing_and_says_so(db_path, monkeypatch, clock):
    _paired_results(monkeypatch, True, True)
    tuner.configure(db=db_path, mode="tune")
    fn = make_fn(slow={32: 0.004, 64: 0.004}, clock=clock)
    fn(torch.ones(2), 4, 100)
    tuner.configure(mode="off")
    [record] = TuningDB(db_path).records()
    assert record.config == {"block": 16} and record.method["confirmed"]["held"] is True


def test_tune_mode_stores_nothing_when_its_confirming_re_timing_fails(db_path, monkeypatch, clock):
    from tuner.bench import Timing, WallClockTimer

    fast, slow = Timing(10.0, 0.1, 5), Timing(20.0, 0.1, 5)
    results = iter([(fast, slow)])

    def paired(self, a, b):
        try:
            return next(results)
        except StopIteration:
            raise torch.OutOfMemoryError("CUDA out of memory") from None
    monkeypatch.setattr(WallClockTimer, "paired", paired)
    tuner.configure(db=db_path, mode="tune")
    fn = make_fn(slow={32: 0.004, 64: 0.004}, clock=clock)
    fn(torch.ones(2), 4, 100)
    tuner.configure(mode="off")
    assert TuningDB(db_path).records() == []


def test_never_tunes_during_cuda_graph_capture(db_path, monkeypatch):
    tuner.configure(db=db_path, mode="tune")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []
    fn = make_fn(calls)
    assert run(fn, 4, 100, calls) == 32 and calls == [32]  # default, nothing tuned
    assert fn.tuner.memo == {}  # and not remembered: it tunes once capture is over
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    calls.clear()
    fn(torch.ones(2), 4, 100)
    assert set(calls) == {16, 32, 64}


def test_a_garbage_db_warns_once_and_runs_on_defaults(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"\x00garbage" * 512)
    tuner.configure(db=bad, mode="lookup")
    calls = []
    fn = make_fn(calls)
    with pytest.warns(UserWarning, match="bad.db"):
        assert run(fn, 4, 100, calls) == 32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run(fn, 8, 100, calls) == 32
    assert bad.read_bytes() == b"\x00garbage" * 512


@pytest.mark.parametrize("part", ["shipped", "db"])
def test_a_loader_that_runs_out_of_memory_warns_once_and_every_call_runs_the_default(db_path, monkeypatch, part):
    """A MemoryError reading the shipped tunings or the DB left the table unloaded, so every
    tuned call read them again and raised again (15-30 s each under a memory cap)."""
    from tuner.db import shipped

    store(db_path, 4, 100, {"block": 64})
    loads = []

    def out_of_memory(*args, **kwargs):
        loads.append(part)
        raise MemoryError

    if part == "shipped":
        monkeypatch.setattr(shipped, "load_shipped", out_of_memory)
    else:
        monkeypatch.setattr(TuningDB, "snapshot", out_of_memory)
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    fn = make_fn(calls)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        results = [run(fn, 4, kv, calls) for kv in (100, 1000, 5000, 100)]
    assert [str(w.message) for w in seen] == [
        "tuner: MemoryError; " + ("shipped tunings not used" if part == "shipped" else "running with library defaults")]
    assert loads == [part]  # read once, not per call
    # the part that failed adds nothing; the other still serves
    assert results == ([64, 32, 32, 64] if part == "shipped" else [32, 32, 32, 32])


def test_a_missing_db_is_created_by_the_first_flush_of_misses_not_by_a_call(tmp_path):
    """A serving run into a DB that did not exist yet recorded no misses, silently: the miss
    writer needed a readable DB. The first flush now creates it; a call never does."""
    target = tmp_path / "absent.db"
    tuner.configure(db=target, mode="lookup")
    calls = []
    assert run(make_fn(calls), 4, 100, calls) == 32
    assert not target.exists()
    assert tuner.flush_misses() == 1
    [miss] = TuningDB(target, create=False).misses(current_fingerprint_id())
    assert miss.problem.run_key.batch == 4 and miss.served == "default"


def test_misses_that_cannot_create_their_db_give_one_warning(tmp_path):
    """One warning, not one per flush (each exit, configure() and timed write warned again)."""
    tuner.configure(db=tmp_path / "no-such-dir" / "tuning.db", mode="lookup")
    calls = []
    fn = make_fn(calls)
    run(fn, 4, 100, calls)
    with pytest.warns(UserWarning, match="could not record 1 missed keys.*does not exist.*until configure"):
        assert tuner.flush_misses() == 0
    run(fn, 8, 100, calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuner.flush_misses() == 0


def _misses_in(target):
    return [(m.problem.run_key.batch, m.count) for m in TuningDB(target, create=False).misses(current_fingerprint_id())]


def test_misses_are_written_a_while_after_the_first_without_waiting_for_an_exit(tmp_path, monkeypatch):
    """Misses were written only at exit (or configure()): SGLang ends its workers with SIGKILL,
    so a server's misses were never written (a helper's review)."""
    import time

    from tuner import settings
    from tuner.runtime import state

    monkeypatch.setattr(settings, "MISS_FLUSH_AFTER_S", 0.05)
    target = tmp_path / "absent.db"
    tuner.configure(db=target, mode="lookup")
    calls = []
    run(make_fn(calls), 4, 100, calls)
    deadline = time.monotonic() + 20
    while not target.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    state.runtime.flush_soon.cancel(wait_s=10)  # (a write under way is done)
    assert _misses_in(target) == [(4, 1)] and tuner.flush_misses() == 0  # written once


_KILLED = """
import multiprocessing, os, signal, sys, time
import torch, tuner
from tuner import settings
settings.MISS_FLUSH_AFTER_S = float(sys.argv[2])
tuner.configure(db=sys.argv[1], mode="lookup", shipped="off")

@tuner.autotune("toy", configs=[{"block": 16}, {"block": 32}], default={"block": 32},
                static_key=lambda x, batch: ("float32", 8, 2), run_key=lambda x, batch: (batch, 1, 100))
def fn(x, batch, *, config):
    return x

if sys.argv[3] == "killed":  # once the timed writer has written (however slow the machine), SIGKILL
    import sqlite3
    fn(torch.ones(1), 4)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            if sqlite3.connect(sys.argv[1]).execute("SELECT count(*) FROM misses").fetchone()[0]:
                break
        except sqlite3.Error:
            pass
    os.kill(os.getpid(), signal.SIGKILL)
elif sys.argv[3] == "fork":  # the parent's DB open, a miss pending; a child that exits as Python does
    fn(torch.ones(1), 2)
    tuner.flush_misses()
    fn(torch.ones(1), 4)
    pid = os.fork()
    if pid == 0:
        fn(torch.ones(1), 8)
        sys.exit(0)
    os.waitpid(pid, 0)
    tuner.flush_misses()
else:  # a multiprocessing worker of the fork method: it ends in os._exit
    child = multiprocessing.get_context("fork").Process(target=fn, args=(torch.ones(1), 8))
    child.start()
    child.join()
    sys.exit(child.exitcode)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX: SIGKILL and fork")
@pytest.mark.parametrize("how, stored", [("killed", [(4, 1)]), ("fork", [(2, 1), (4, 1), (8, 1)]),
                                         ("mp-fork", [(8, 1)])])
def test_killed_forked_and_multiprocessing_processes_write_their_own_misses_once(tmp_path, how, stored):
    """SIGKILL, as SGLang ends its schedulers: the misses were lost. A forked child wrote its
    parent's pending misses again at its exit (counted twice), and its first write failed on
    the parent's file lock, inherited (a traceback at exit, its misses lost). A
    multiprocessing worker ends in os._exit: its misses were lost (helpers' reviews)."""
    import subprocess
    import sys

    target = tmp_path / "served.db"
    env = {k: v for k, v in os.environ.items() if k not in ("TUNER_DB", "TUNER_MODE")}
    done = subprocess.run([sys.executable, "-c", _KILLED, str(target), "0.1", how], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == (-9 if how == "killed" else 0), done.stderr
    assert "Traceback" not in done.stderr and "warning" not in done.stderr.lower(), done.stderr
    assert sorted(_misses_in(target)) == stored


_FORKED_MID_WORK = """
import os, sys, threading, time
import torch, tuner
from tuner.runtime import state
tuner.configure(db=sys.argv[1], mode="tune", shipped="off")
began, release = threading.Event(), threading.Event()

@tuner.autotune("toy", configs=[{"block": 16}, {"block": 32}], default={"block": 32},
                static_key=lambda x, who: ("float32", 8, 2), run_key=lambda x, who: (4, 1, 100))
def fn(x, who, *, config):
    if who == "thread" and not began.is_set():
        began.set()
        release.wait(30)
    return x

if sys.argv[2] == "tuning":  # a thread is tuning the key the child calls
    worker = threading.Thread(target=fn, args=(torch.ones(1), "thread"))
else:  # a thread is inside a write to the DB
    def write():
        with state.runtime.writing():
            began.set()
            time.sleep(3.0)
    worker = threading.Thread(target=write)
worker.start()
began.wait(30)
start = time.monotonic()
pid = os.fork()
if pid == 0:
    fn(torch.ones(1), "child")
    print("child tuned", len(fn.tuner.tuned), flush=True)
    os._exit(0)
print("fork waited %.2f" % (time.monotonic() - start), flush=True)
os.waitpid(pid, 0)
release.set()
worker.join()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_fork_waits_for_a_write_under_way_and_the_child_tunes_what_a_parents_thread_was_tuning(tmp_path):
    """A child forked while a thread wrote to SQLite hung at its own first write (3 of 9 in a
    helper's stress run); one forked while a thread tuned a key never tuned that key (the
    claim was inherited, with no thread to release it)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TUNER_DB", "TUNER_MODE")}
    for how in ("writing", "tuning"):
        done = subprocess.run([sys.executable, "-c", _FORKED_MID_WORK, str(tmp_path / f"{how}.db"), how], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        waited = float(done.stdout.split("fork waited ")[1].split()[0])
        if how == "writing":
            assert waited >= 0.5, done.stdout  # the write (3 s) ended first
        else:
            assert "child tuned 1" in done.stdout, done.stdout


def test_a_flush_that_meets_another_writers_lock_keeps_its_misses_for_the_next(tmp_path, monkeypatch):
    """One lock held past the wait stopped miss recording for the life of the process, and
    dropped the misses it had taken (a helper's review)."""
    from filelock import FileLock

    import tuner.db.store as store

    monkeypatch.setattr(store, "WRITE_LOCK_TIMEOUT_S", 0.2)
    target = tmp_path / "t.db"
    TuningDB(target).close()
    tuner.configure(db=target, mode="lookup")
    calls = []
    fn = make_fn(calls)
    run(fn, 2, 100, calls)
    other = FileLock(str(target) + ".lock")
    with other:
        with pytest.warns(UserWarning, match="could not record 1 missed keys yet.*stayed locked.*kept"):
            assert tuner.flush_misses() == 0
    run(fn, 4, 100, calls)
    assert tuner.flush_misses() == 2 and sorted(_misses_in(target)) == [(2, 1), (4, 1)]


def test_a_flush_does_not_wait_out_the_busy_timeout_behind_a_reader(tmp_path):
    """The log's merge after a write waited 30 s (SQLite's busy timeout) behind any open read,
    stalling configure(), an exit, and in tune mode the call that stored its winner."""
    import sqlite3
    import time

    target = tmp_path / "t.db"
    tuner.configure(db=target, mode="lookup")
    calls = []
    fn = make_fn(calls)
    run(fn, 2, 100, calls)
    assert tuner.flush_misses() == 1
    reader = sqlite3.connect(target, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM misses").fetchone()
    run(fn, 4, 100, calls)
    start = time.monotonic()
    assert tuner.flush_misses() == 1
    assert time.monotonic() - start < 15  # not the 30 s busy timeout
    reader.close()


def test_configure_while_the_timed_writer_opens_the_old_db_sends_later_misses_to_the_new(tmp_path, monkeypatch):
    """configure(db=B) while the timed writer was opening A (a slow check of a big file): the
    writer kept A as the runtime's DB, and every later miss went into A (a helper's review)."""
    import threading
    import time

    from tuner import settings

    monkeypatch.setattr(settings, "MISS_FLUSH_AFTER_S", 0.05)
    monkeypatch.setattr(settings, "MISS_EXIT_WAIT_S", 0.2)
    a, b = tmp_path / "A.db", tmp_path / "B.db"
    check = TuningDB.require_sound

    def slow(self, action):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(1.0)
        return check(self, action)
    monkeypatch.setattr(TuningDB, "require_sound", slow)
    tuner.configure(db=a, mode="lookup")
    calls = []
    fn = make_fn(calls)
    run(fn, 2, 100, calls)
    time.sleep(0.3)  # the timed writer is opening A
    tuner.configure(db=b, mode="lookup")
    time.sleep(1.5)
    run(fn, 4, 100, calls)
    tuner.flush_misses()
    assert _misses_in(a) == [(2, 1)] and _misses_in(b) == [(4, 1)]


def test_a_db_file_replaced_or_deleted_under_the_runtime_gets_the_next_writes(tmp_path):
    """The runtime kept its engine on the old file: after `mv` (or sweep --force's rename
    aside) or rm, misses and tuned winners went into a file no one reads (a helper's review)."""
    target, other = tmp_path / "t.db", tmp_path / "other.db"
    tuner.configure(db=target, mode="lookup")
    calls = []
    fn = make_fn(calls)
    run(fn, 2, 100, calls)
    assert tuner.flush_misses() == 1 and _misses_in(target) == [(2, 1)]
    TuningDB(other).close()
    os.replace(other, target)  # another DB put in its place
    run(fn, 4, 100, calls)
    assert tuner.flush_misses() == 1 and _misses_in(target) == [(4, 1)]
    target.unlink()
    run(fn, 8, 100, calls)
    assert tuner.flush_misses() == 1 and _misses_in(target) == [(8, 1)]


def test_a_relative_db_path_names_one_file_whatever_the_directory_later(tmp_path, monkeypatch):
    """TUNER_DB=tuner.db was resolved at each open: a server that changed directory wrote its
    misses into a new file there (a helper's review)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    monkeypatch.setenv("TUNER_DB", "rel.db")
    tuner.configure(db=None, mode="lookup")
    calls = []
    run(make_fn(calls), 4, 100, calls)
    monkeypatch.chdir(tmp_path / "b")
    assert tuner.flush_misses() == 1
    assert _misses_in(tmp_path / "a" / "rel.db") == [(4, 1)] and not (tmp_path / "b" / "rel.db").exists()


def test_wrapper_keeps_the_function_name_and_args():
    fn = make_fn()
    assert fn.__name__ == "fn"
    assert torch.equal(fn(torch.ones(3), batch=2, kv=10), torch.full((3,), 2.0))


def test_combined_key_and_signatures_with_defaults_and_keyword_only_params(db_path):
    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    seen = []

    @tuner.autotune("toy", configs=[{"block": 16}, {"block": 64}], default={"block": 32},
                    key=lambda x, batch, kv=2048, *, scale=1.0: (STATIC, batch, 1, kv))
    def fn(x, batch, kv=2048, *, config, scale=1.0):
        seen.append((config["block"], kv, scale))
        return x * scale

    assert torch.equal(fn(torch.ones(2), 16), torch.ones(2))
    assert torch.equal(fn(torch.ones(2), batch=16, kv=2000, scale=3.0), torch.full((2,), 3.0))
    fn(torch.ones(2), 16, 2**20, config={"block": 16})
    assert seen == [(64, 2048, 1.0), (64, 2000, 3.0), (16, 2**20, 1.0)]


def test_config_for_names_what_a_call_would_run_without_running_it(db_path):
    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    fn = make_fn(calls)
    x = torch.ones(2)
    assert fn.tuner.config_for(x, 16, 2000) == {"block": 64}  # exact key's bucket
    assert fn.tuner.config_for(x, 1, 2**20) == {"block": 32}  # too far: the default
    assert calls == []  # nothing ran
    assert run(fn, 16, 2000, calls) == 64 and run(fn, 1, 2**20, calls) == 32  # what the calls then run

    @tuner.autotune("toy", configs=[{"block": 16}], default={"block": 32},
                    key=lambda x, batch, kv=2048: (STATIC, batch, 1, kv))
    def combined(x, batch, kv=2048, *, config):
        raise AssertionError("not called")

    assert combined.tuner.config_for(x, 16) == {"block": 64} and combined.tuner.config_for(x, 16, 2**20) == {
        "block": 32}
    config = combined.tuner.config_for(x, 16)
    config["block"] = 0  # a copy: the memo is not changed through it
    assert combined.tuner.config_for(x, 16) == {"block": 64}


def test_a_declarations_fill_share_weighs_each_batch_by_its_longest():
    """One long (16k) in eight, the rest short (256-1024): at batch 3 two batches in three
    hold no long sequence and are dense, but they take little time; weighted by the longest,
    the dense share is under a half (unweighted it was two thirds, and a dense config was
    captured for batches that mostly hold a long one). Batch 2 is always dense (the longer
    is at least half the sum); an int declares no sequence lengths."""
    import random
    rng = random.Random(1)
    few_long = [rng.randint(12288, 16384) for _ in range(512)] + [rng.randint(256, 1024) for _ in range(3584)]
    with tuner.graph_capture(few_long) as declared:
        assert declared.fill_share(3, 0.5) < 0.4
        assert declared.fill_share(2, 0.5) == 1.0
        assert declared.fill_share(64, 0.5) == 0.0
    with tuner.graph_capture([1000] * 10) as declared:
        assert declared.fill_share(256, 0.5) == 1.0
    with tuner.graph_capture(16384) as declared:
        assert declared.fill_share(3, 0.5) is None


def test_graph_capture_keys_calls_on_the_declared_lengths_not_the_capture_bound(db_path):
    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    fn = make_fn(calls)
    bound = 2**17  # the server's max context: what a graph is captured with
    assert run(fn, 16, bound, calls) == 32  # keyed on the bound: the default
    with tuner.graph_capture(2048) as declared:
        assert run(fn, 16, bound, calls) == 64  # keyed on the declared typical length
        assert run(fn, 16, 1000, calls) == 64  # never keyed past the call's own bound
        assert declared.kv_len(16) == 2048
    assert run(fn, 16, bound, calls) == 32  # outside, as before (the memo was put back)
    assert fn.tuner.config_for(torch.ones(2), 16, bound) == {"block": 32}


def test_graph_capture_keys_a_batch_on_its_longest_sequence_weighted_by_length(db_path):
    from tuner.runtime.capture import DeclaredLengths

    samples = DeclaredLengths(range(1, 1001))
    # the longest of b uniform draws has density ~ x^(b-1); weighted by x, its median is
    # 1000 * 2^(-1/(b+1))
    assert samples.kv_len(1) == 707
    assert samples.kv_len(8) == 926
    assert samples.kv_len(256) == 998
    # one sequence in eight is long: a lone sequence is usually short, but the long ones
    # take most of the time, and get their config
    assert DeclaredLengths([100] * 7 + [3000]).kv_len(1) == 3000
    assert DeclaredLengths(5000).kv_len(3) == 5000
    store(db_path, 16, 1024, {"block": 16})
    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    fn = make_fn(calls)
    lengths = [100] * 90 + [2000] * 10  # mostly short; in a batch of 16 the longest is long
    with tuner.graph_capture(lengths):
        assert run(fn, 16, 2**17, calls) == 64
    with tuner.graph_capture([1000] * 999 + [2000]):
        assert run(fn, 16, 2**17, calls) == 16  # the longest of 16 is almost surely 1000: kv 1024's winner


def test_graph_capture_of_unknown_lengths_freezes_only_what_wins_at_every_length(db_path):
    """Issue 12: the 128k bucket's winner, frozen into a graph replayed over any length, ran
    at 0.46x of the default on short batches (H200). With lengths unknown, a graph keeps a
    stored config only where it won at every kv bucket up to the bound for its batch."""
    for kv in (2**k for k in range(10, 18)):
        store(db_path, 16, kv, {"block": 64})  # batch 16: one winner at every bucket, 1k-128k
    store(db_path, 8, 1024, {"block": 16})  # batch 8: the short lengths' winner differs
    store(db_path, 8, 2**17, {"block": 64})
    for kv in (2**k for k in range(11, 18)):
        store(db_path, 2, kv, {"block": 64})  # batch 2: one winner, but none measured at 1k
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    fn = make_fn(calls)
    bound = 2**17
    assert run(fn, 8, bound, calls) == 64  # eagerly at the bound: that key's own winner
    with tuner.graph_capture() as declared:
        assert not declared.known
        assert run(fn, 16, bound, calls) == 64  # the one winner of every bucket
        assert run(fn, 8, bound, calls) == 32  # winners differ by length: the default
        assert run(fn, 8, 1024, calls) == 16  # a bound of 1024: only that bucket's winner counts
        assert run(fn, 4, bound, calls) == 32  # no winner of its own batch: the default, nothing borrowed
        assert run(fn, 2, bound, calls) == 32  # a bucket unmeasured (1k): the default
        assert run(fn, 2, 4096, calls) == 32
    assert run(fn, 8, bound, calls) == 64  # outside, as before


def test_a_cuda_graph_capture_without_declaration_freezes_only_what_wins_at_every_length(db_path, monkeypatch):
    """The same rule inside a plain CUDA-graph capture, for a call not resolved before it; what
    it resolved is not kept, so eager calls after it get their own key's winner."""
    import tuner.runtime.decorator as decorator

    store(db_path, 8, 1024, {"block": 16})
    store(db_path, 8, 2**17, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    fn = make_fn(calls)
    monkeypatch.setattr(decorator, "capturing", lambda: True)
    assert run(fn, 8, 2**17, calls) == 32
    for _ in range(3):
        assert run(fn, 4, 2**17, calls) == 32  # no winner of its own: the default, nothing borrowed
    assert tuner.flush_misses() == 0  # a capture at the bound says nothing of the traffic's keys
    monkeypatch.setattr(decorator, "capturing", lambda: False)
    assert run(fn, 8, 2**17, calls) == 64


def test_a_config_memoised_before_a_capture_is_resolved_again_inside_it(db_path, monkeypatch):
    """A server's warm-up call at the capture bound memoises that bucket's winner; a plain
    CUDA-graph capture after it must not freeze it for every replayed length (H200: the
    window-4095 key's 128k winner ran at 0.46x of FA3's default on short batches), and the
    memo serves the eager calls after the capture as before. A winner of every bucket is
    frozen as it is, and the capture status is not asked for it on a memo hit."""
    for kv in (2**k for k in range(10, 18)):
        store(db_path, 16, kv, {"block": 64})  # batch 16: one winner at every bucket
    store(db_path, 8, 1024, {"block": 16})  # batch 8: the winners differ by length
    store(db_path, 8, 2**17, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    fn = make_fn(calls)
    bound = 2**17
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert run(fn, 8, bound, calls) == 64  # warm-up, eagerly: the bound's winner, memoised
    assert run(fn, 16, bound, calls) == 64
    asked = []

    def is_capturing():
        asked.append(1)
        return True

    from tuner.runtime.capture_watch import CAPTURES

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", is_capturing)
    assert run(fn, 8, bound, calls) == 64 and not asked  # no capture begun through torch: not asked
    CAPTURES[0] += 1  # one begun (tuner.runtime.capture_watch counts them)
    try:
        assert run(fn, 8, bound, calls) == 32  # under capture: the frozen rule's choice, the default
        assert fn.tuner.config_for(torch.ones(2), 8, bound) == {"block": 32}
        assert asked
        asked.clear()
        assert run(fn, 16, bound, calls) == 64 and not asked  # frozen as it is, no query
    finally:
        CAPTURES[0] -= 1
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert run(fn, 8, bound, calls) == 64  # after the capture: the memo's winner again
    assert fn.tuner.config_for(torch.ones(2), 8, bound) == {"block": 64}


def test_captures_are_counted_from_begin_to_end_also_when_one_fails():
    from tuner.runtime.capture_watch import CAPTURES, watch_captures

    class Graph:
        def capture_begin(self, fail=False):
            if fail:
                raise RuntimeError("capture refused")

        def capture_end(self):
            raise RuntimeError("capture invalidated")

    before = CAPTURES[0]
    watch_captures(Graph)
    watch_captures(Graph)  # once per class
    graph = Graph()
    graph.capture_begin()
    assert CAPTURES[0] == before + 1
    with pytest.raises(RuntimeError, match="invalidated"):
        graph.capture_end()
    assert CAPTURES[0] == before
    with pytest.raises(RuntimeError, match="refused"):
        graph.capture_begin(fail=True)
    assert CAPTURES[0] == before


def test_torch_compile_does_not_recompile_when_the_capture_count_changes(db_path, monkeypatch):
    """A capture-sensitive memo hit reads the capture count; traced by dynamo, that read
    would become a guard, and every capture would recompile the caller (review of 1c54335)."""
    from torch._dynamo.testing import CompileCounter

    from tuner.runtime.capture_watch import CAPTURES
    from tuner.runtime.decorator import CaptureSensitive

    store(db_path, 8, 2**17, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    fn = make_fn()
    real_is_available = torch.cuda.is_available
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fn(torch.ones(2), 8, 2**17)
    assert [type(c) for c in fn.tuner.memo.values()] == [CaptureSensitive]
    monkeypatch.setattr(torch.cuda, "is_available", real_is_available)  # dynamo asks it too
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(lambda x: fn(x, 8, 2**17), backend=counter)
    compiled(torch.ones(2))
    CAPTURES[0] += 1
    try:
        compiled(torch.ones(2))
    finally:
        CAPTURES[0] -= 1
    assert counter.frame_count == 1


def test_a_capture_end_that_fails_while_the_stream_still_captures_keeps_the_count(monkeypatch):
    from tuner.runtime.capture_watch import CAPTURES, watch_captures

    class Graph:
        def capture_begin(self):
            pass

        def capture_end(self):
            raise RuntimeError("capture must end on the stream it began on")

    watch_captures(Graph)
    before = CAPTURES[0]
    Graph().capture_begin()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="stream it began on"):
        Graph().capture_end()
    assert CAPTURES[0] == before + 1  # still capturing: still counted
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(RuntimeError):
        Graph().capture_end()
    assert CAPTURES[0] == before


def test_in_tune_mode_a_non_default_memo_entry_is_capture_sensitive(db_path, monkeypatch):
    """Tuning another bucket changes what the frozen rule keeps: an entry it kept when
    memoised may not be kept later, so in tune and force modes every non-default one is
    checked under capture (review of 1c54335)."""
    from tuner.runtime.decorator import CaptureSensitive

    for kv in (2**k for k in range(10, 18)):
        store(db_path, 16, kv, {"block": 64})  # the frozen rule keeps it, as things stand
    tuner.configure(db=db_path, mode="tune")
    fn = make_fn()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fn(torch.ones(2), 16, 2**17)
    assert [type(c) for c in fn.tuner.memo.values()] == [CaptureSensitive]
    tuner.configure(mode="lookup")
    fn(torch.ones(2), 16, 2**17)
    assert [type(c) for c in fn.tuner.memo.values()] == [dict]  # in lookup mode the table is fixed


@pytest.mark.parametrize("lengths", [0, [], [5, 0], "abc", True, [1.5, "x"],
                                     # keyed or unordered: a dict gave its keys, a set each length once
                                     {4096: 3, 128: 97}, {128, 4096}, frozenset({128}), {4096: 1}.keys()])
def test_graph_capture_refuses_what_is_not_lengths(lengths):
    with pytest.raises(tuner.TunerError, match="graph_capture") as e:
        with tuner.graph_capture(lengths):
            pass
    assert "\n" not in str(e.value)


# kv_len at batches 1, 2, 3, 4, 8, 12, 16, 24, 64, 256 and fill_share(b, 0.5) at 1, 2, 3, 8, 16,
# as the declaration computed them over every sample before it summarised them
_SMALL_DECLARATIONS = {
    "uniform": ([707, 794, 841, 871, 926, 949, 961, 973, 990, 998],
                [1.0, 1.0, 0.8912934675982462, 0.7712742716325568, 0.5787186224447639]),
    "few long": ([3000] * 10, [1.0, 1.0, 0.27350427350427353, 0.016018306636155607, 0.004076878276062901]),
    "repeated": ([9000] + [32768] * 9, [1.0, 1.0, 0.33840977707467607, 0.03619409581050027, 0.010158691140808251]),
    "heavy tail": ([19495, 28088, 46650, 46650, 46650, 46650, 137182, 137182, 137182, 137182],
                   [1.0, 1.0, 0.1014135184782587, 0.014469391972156092, 0.0010609828777978676]),
}


def _declared_samples(name):
    import random

    if name == "uniform":
        return list(range(1, 1001))
    if name == "few long":
        return [100] * 7 + [3000]
    if name == "repeated":
        rng = random.Random(7)
        return [rng.choice([512, 1024, 1500, 4096, 4096, 9000, 32768]) for _ in range(40)]
    rng = random.Random(11)
    return [int(rng.paretovariate(1.2) * 300) for _ in range(200)]


@pytest.mark.parametrize("name", sorted(_SMALL_DECLARATIONS))
def test_a_declaration_kept_as_distinct_lengths_keys_and_fills_as_over_every_sample(name):
    kv, fill = _SMALL_DECLARATIONS[name]
    with tuner.graph_capture(_declared_samples(name)) as declared:
        assert [declared.kv_len(b) for b in (1, 2, 3, 4, 8, 12, 16, 24, 64, 256)] == kv
        assert [declared.fill_share(b, 0.5) for b in (1, 2, 3, 8, 16)] == fill


def test_a_declaration_of_many_distinct_lengths_is_summarised_within_each_kv_bucket():
    """A trace of 10**6 lengths cost ~0.5 s of Python per new batch size (every sample, every
    time); held as at most a few thousand lengths, its keys stay in the same kv buckets."""
    import random

    from tuner.keys import kv_len_bucket
    from tuner.runtime.capture import MAX_DISTINCT

    rng = random.Random(3)
    samples = [min(131072, int(rng.lognormvariate(9, 1.5)) + 1) for _ in range(30000)]
    ordered, n = sorted(samples), len(samples)

    def over_every_sample(b):  # the rule of DeclaredLengths.kv_len, written out per sample
        weights = [s * (((i + 1) / n) ** b - (i / n) ** b) for i, s in enumerate(ordered)]
        total, half = 0.0, sum(weights) / 2
        return next(s for s, w in zip(ordered, weights) if (total := total + w) >= half)

    with tuner.graph_capture(samples) as declared:
        assert len(set(samples)) > 2 * MAX_DISTINCT and len(declared.lengths) <= MAX_DISTINCT
        assert sum(declared.counts) == n
        for b in (1, 2, 3, 8, 16, 24, 64, 160, 256):
            assert kv_len_bucket(declared.kv_len(b)) == kv_len_bucket(over_every_sample(b)), b


def test_configure_inside_graph_capture_holds_after_it(db_path):
    store(db_path, 16, 2**17, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    fn = make_fn(calls)
    assert run(fn, 16, 2**17, calls) == 64
    with tuner.graph_capture(2048):
        tuner.configure(mode="off")
    assert run(fn, 16, 2**17, calls) == 32  # off: the default, not the memo from before


def test_nothing_is_tuned_inside_graph_capture(db_path):
    """Its calls carry the capture bound, not the declared key: timing them for that key
    would store a wrong winner (review of issue 12)."""
    TuningDB(db_path).close()
    tuner.configure(db=db_path, mode="tune")
    calls = []
    fn = make_fn(calls)
    with tuner.graph_capture(2048):
        assert run(fn, 16, 2**17, calls) == 32 and calls == [32]  # the default, run once: no tuning
    assert TuningDB(db_path).records() == [] and not fn.tuner.tuned
    assert tuner.flush_misses() == 1  # the declared key is recorded as missed


def test_a_call_resolving_while_graph_capture_ends_leaves_nothing_behind(db_path):
    import threading

    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    inside, ended = threading.Event(), threading.Event()

    def accepts(config, x, batch, kv):
        if threading.current_thread() is not threading.main_thread():
            inside.set()
            ended.wait(10)  # the capture ends while this call resolves
        return True

    @tuner.autotune("toy", configs=[{"block": 64}], default={"block": 32}, accepts=accepts,
                    static_key=lambda x, batch, kv: STATIC, run_key=lambda x, batch, kv: (batch, 1, kv))
    def fn(x, batch, kv, *, config):
        return config["block"]

    seen = []
    with tuner.graph_capture(2048):
        other = threading.Thread(target=lambda: seen.append(fn(torch.ones(2), 16, 2**17)))
        other.start()
        assert inside.wait(10)
    ended.set()
    other.join(10)
    assert seen == [64]  # resolved for the declared lengths, as it began
    assert fn(torch.ones(2), 16, 2**17) == 32  # but not kept: outside, the bound's key serves


def test_config_for_never_tunes(db_path):
    TuningDB(db_path).close()
    tuner.configure(db=db_path, mode="tune")
    calls = []
    fn = make_fn(calls)
    assert fn.tuner.config_for(torch.ones(2), 16, 2048) == {"block": 32} and calls == []
    assert TuningDB(db_path).records() == []
    run(fn, 16, 2048, calls)  # the call itself tunes
    assert len(TuningDB(db_path).records()) == 1


def test_graph_capture_takes_integer_likes_and_refuses_text():
    import numpy as np

    from tuner.runtime.capture import DeclaredLengths

    assert DeclaredLengths(np.int64(4096)).kv_len(8) == 4096
    assert DeclaredLengths(np.array([100, 200])).lengths == [100, 200]
    assert DeclaredLengths(torch.tensor([300, 100, 300])).lengths == [100, 300]
    assert DeclaredLengths(torch.tensor([300, 100, 300])).counts == [1, 2]
    for bad in ("123", b"12", [True, 2], [1.5]):
        with pytest.raises(tuner.TunerError, match="graph_capture"):
            DeclaredLengths(bad)


def test_graph_capture_does_not_nest():
    with tuner.graph_capture(100):
        with pytest.raises(tuner.TunerError, match="does not nest"):
            with tuner.graph_capture(200):
                pass


def test_star_args_functions_get_the_generic_wrapper(db_path):
    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    seen = []

    @tuner.autotune("toy", configs=[{"block": 16}], default={"block": 32},
                    static_key=lambda *a, **k: STATIC, run_key=lambda *a, **k: (a[0], 1, k["kv"]))
    def fn(*args, config, **kwargs):
        seen.append(config["block"])

    fn(16, kv=2048)
    fn(16, kv=2**20)
    assert seen == [64, 32]


def test_key_functions_must_be_given_one_way():
    with pytest.raises(tuner.TunerError, match="static_key"):
        tuner.autotune("x", configs=[], default={}, static_key=lambda: 1)
    with pytest.raises(tuner.TunerError, match="not both"):
        tuner.autotune("x", configs=[], default={}, key=lambda: 1, run_key=lambda: 1, static_key=lambda: 1)


def test_parameters_named_like_the_wrappers_locals_reach_the_kernel(db_path):
    tuner.configure(db=db_path, mode="lookup")

    @tuner.autotune("toy", configs=[{"block": 16}], default={"block": 32},
                    static_key=lambda static, batch, kv_len, q_len: STATIC,
                    run_key=lambda static, batch, kv_len, q_len: (len(batch), 1, max(kv_len)))
    def fn(static, batch, kv_len, q_len, *, config):
        return static, batch, kv_len, q_len

    assert fn("S", "BATCH", [5, 7], "Q") == ("S", "BATCH", [5, 7], "Q")


def test_numpy_kv_lengths_are_bucketed_like_ints(db_path):
    import numpy as np

    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path, mode="lookup")
    calls = []
    fn = make_fn(calls)
    fn(torch.ones(2), 16, np.int64(1500))
    fn(torch.ones(2), 16, 2000)
    assert calls == [64, 64] and len(fn.tuner.memo) == 1


def test_memo_buckets_agree_with_kv_len_bucket(db_path):
    from tuner.keys import kv_len_bucket

    tuner.configure(db=db_path, mode="off")
    fn = make_fn([])
    for kv in (0, 1, 2, 3, 2048, 2049, 2**40, 2**40 + 1):
        fn.tuner.memo.clear()
        fn(torch.ones(1), 1, kv)
        [key] = fn.tuner.memo
        assert 1 << key[3] == kv_len_bucket(kv)


def test_configure_lets_force_mode_tune_again(tmp_path):
    calls = []
    fn = make_fn(calls)
    for name in ("a.db", "b.db"):
        tuner.configure(db=tmp_path / name, mode="force")
        calls.clear()
        fn(torch.ones(2), 4, 128)
        assert set(calls) == {16, 32, 64}
        assert len(TuningDB(tmp_path / name).records()) == 1


def test_tune_mode_with_an_unwritable_db_warns_and_still_serves_the_winner(tmp_path, clock):
    (tmp_path / "t.db.lock").mkdir()  # the DB cannot be created here
    tuner.configure(db=tmp_path / "t.db", mode="tune")
    calls = []
    fn = make_fn(calls, slow={32: 0.004, 64: 0.004}, clock=clock)
    with pytest.warns(UserWarning, match="could not store"):
        fn(torch.ones(2), 4, 100)
    assert run(fn, 4, 100, calls) == 16


# -- issue 10: what a real server does to the runtime -------------------------------------------


def test_configure_mode_keeps_the_db_it_was_pointed_at(db_path):
    """configure(mode=...) used to re-point the runtime at the default DB."""
    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path)
    tuner.configure(mode="lookup")
    calls = []
    assert run(make_fn(calls), 16, 2048, calls) == 64
    tuner.configure(db=None)  # None: $TUNER_DB, else the default file
    assert run(make_fn(calls), 16, 2048, calls) == 32


def test_threads_resolving_their_first_keys_at_once_load_one_snapshot_and_borrow_alike(db_path, monkeypatch):
    """The first snapshot load raced between threads: one thread's half-loaded gains made
    another refuse to borrow, and memoise the default for good."""
    import threading

    import tuner.db.shipped as shipped

    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path)
    loads = []
    entered = threading.Event()
    real = shipped.load_shipped

    def slow_load(*args, **kwargs):  # the first load waits a little for a second to start
        loads.append(1)
        if len(loads) == 1:
            entered.wait(0.3)
        else:
            entered.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(shipped, "load_shipped", slow_load)
    results: list[int] = []

    def call():
        calls = []
        make_fn(calls)(torch.ones(1), 8, 4096)  # a neighbour's winner: borrowed only with its gain loaded
        results.append(calls[-1])

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loads == [1] and results == [64, 64, 64, 64]


def test_empty_batches_and_keys_no_host_value_gives_run_the_default(db_path):
    store(db_path, 16, 2048, {"block": 64})
    tuner.configure(db=db_path)
    calls = []

    @tuner.autotune("toy", configs=[{"block": 64}], default={"block": 32},
                    key=lambda x, batch, kv, static=STATIC: (static, batch, 1, kv))
    def fn(x, batch, kv, static=STATIC, *, config):
        calls.append(config["block"])
        return x

    fn(torch.ones(0), 0, 2048)  # an empty batch: no run key, the default (FA3 returns an empty output)
    fn(torch.ones(1), 16, 2048, static=None)  # a key function's "not tunable"
    fn(torch.ones(1), 16, 2048)
    assert calls == [32, 32, 64]


@pytest.mark.parametrize("kv", [3.5, "2048", None, [2048]])
def test_a_kv_length_that_is_no_integer_is_one_clear_value_error(kv):
    """A key function's kv length of the wrong type raised whatever the wrapper's arithmetic
    raised (a str: "'>' not supported between instances of 'str' and 'int'")."""
    @tuner.autotune("toy_kv", configs=[{"block": 64}], default={"block": 32},
                    key=lambda x, kv: (STATIC, 1, 1, kv))
    def fn(x, kv, *, config):
        return config["block"]

    with pytest.raises(ValueError, match="kv_len must be an integer"):
        fn(torch.ones(1), kv)
    assert fn(torch.ones(1), 2048) == 32


def test_tune_mode_checks_each_config_against_a_copy_when_the_kernel_writes_into_out(db_path, clock):
    """A kernel writing into the caller's out= returns that one tensor for every config: each
    was checked against itself, and a wrong (but fast) config was crowned."""
    tuner.configure(db=db_path, mode="tune")

    @tuner.autotune("writes_out", configs=[{"right": True}, {"right": False}], default={"right": True},
                    static_key=lambda x, out: ("f32",), run_key=lambda x, out: (1, 1, 16))
    def fn(x, out, *, config):
        if config["right"]:
            clock.spend(0.002)  # the right config is the slow one
            out.copy_(x * 2)
        else:
            out.fill_(7.0)
        return out

    x, out = torch.ones(4), torch.empty(4)
    fn(x, out)
    [record] = TuningDB(db_path).records()
    assert record.config == {"right": True} and out.tolist() == [2.0] * 4


def test_tune_mode_tunes_calls_that_return_the_softmax_lse_too(db_path, clock):
    """FA3 with return_softmax_lse returns (out, lse): tune mode compared the tuple and
    called every config wrong, so such calls were never tuned."""
    tuner.configure(db=db_path, mode="tune")

    @tuner.autotune("with_lse", configs=[{"fast": False}, {"fast": True}], default={"fast": False},
                    static_key=lambda x: ("f32",), run_key=lambda x: (1, 1, 16))
    def fn(x, *, config):
        clock.spend(0.0 if config["fast"] else 0.003)
        return x * 2, x.sum(-1)

    fn(torch.ones(4, 4))
    [record] = TuningDB(db_path).records()
    assert record.config == {"fast": True}


def test_records_of_an_older_tuner_or_another_driver_still_apply(db_path):
    """The user's DB took an exact fingerprint: an upgrade of tuner retired every winner."""
    older = dict(current_fingerprint(), tuner="0.0.1", driver="1.2.3")
    store(db_path, 16, 2048, {"block": 64}, fp=(fingerprint_id(older), older))
    other_torch = dict(current_fingerprint(), torch="0.0-other")
    store(db_path, 4, 2048, {"block": 16}, fp=(fingerprint_id(other_torch), other_torch))
    tuner.configure(db=db_path)
    calls = []
    fn = make_fn(calls)
    assert run(fn, 16, 2048, calls) == 64
    assert run(fn, 4, 512, calls) == 32  # another torch: never applies


def _corrupt(db_path, sql):
    import sqlite3

    with sqlite3.connect(db_path) as conn:
        conn.execute("PRAGMA foreign_keys=OFF")
        conn.execute(sql)


@pytest.mark.parametrize("sql", [
    "UPDATE records SET config = 'not json' WHERE batch = 4",
    "UPDATE records SET config = '[64]' WHERE batch = 4",
    "UPDATE records SET batch = 0 WHERE batch = 4",
    "UPDATE records SET kv_len_bucket = 'abc' WHERE batch = 4",
    "UPDATE records SET created_at = 'yesterday' WHERE batch = 4",
    "UPDATE records SET median_us = -1 WHERE batch = 4",
    "UPDATE records SET fingerprint_id = 'gone' WHERE batch = 4",
], ids=["non-json config", "list config", "batch 0", "text kv bucket", "bad created_at", "negative time",
        "orphaned fingerprint"])
def test_one_malformed_row_is_left_out_with_one_warning_and_the_rest_serve(db_path, sql):
    store(db_path, 16, 2048, {"block": 64})
    store(db_path, 4, 2048, {"block": 16})
    _corrupt(db_path, sql)
    tuner.configure(db=db_path)
    calls = []
    fn = make_fn(calls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(fn, 16, 2048, calls) == 64
        assert run(fn, 4, 2048, calls) == 64  # its own row is left out: the neighbour's is borrowed
    said = [str(w.message) for w in caught if "tuner" in str(w.message)]
    assert len(said) == 1 and "1 malformed rows" in said[0] and "records id" in said[0]


def test_malformed_fingerprint_data_leaves_its_records_out(db_path):
    store(db_path, 16, 2048, {"block": 64})
    _corrupt(db_path, "UPDATE fingerprints SET data = 'not json'")
    tuner.configure(db=db_path)
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(make_fn(calls), 16, 2048, calls) == 32
    assert any("malformed" in str(w.message) for w in caught)


def test_misses_are_never_written_into_a_damaged_db(db_path):
    store(db_path, 16, 2048, {"block": 64})
    _corrupt(db_path, "UPDATE records SET config = 'not json'")
    tuner.configure(db=db_path)
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(make_fn(calls), 4, 64, calls)  # a miss
        assert tuner.flush_misses() == 0
    assert any("could not record" in str(w.message) and "damaged" in str(w.message) for w in caught)
    import sqlite3

    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT count(*) FROM misses").fetchone() == (0,)


def test_a_misss_lengths_never_break_the_call_and_are_not_a_captures(db_path):
    TuningDB(db_path).close()

    class OnGpu:  # a CUDA tensor's stand-in that counts its reads
        device, reads = torch.device("cuda", 0), 0

        def tolist(self):
            self.reads += 1
            return [1, 2]

    on_gpu = OnGpu()
    tuner.configure(db=db_path, mode="lookup")

    def lengths(x, batch, kv):
        if batch == 3:
            raise RuntimeError("a broken hook")
        if batch == 11:  # lengths left on the GPU: readable, at the price of a sync
            return on_gpu
        return [1e300, 1e300, 0] if batch == 5 else [kv // 2, kv]

    @tuner.autotune("toy", configs=[{"block": 64}], default={"block": 32}, lengths=lengths,
                    static_key=lambda x, batch, kv: STATIC, run_key=lambda x, batch, kv: (batch, 1, kv))
    def fn(x, batch, kv, *, config):
        return config["block"]

    assert fn(torch.ones(2), 3, 2048) == 32 and fn(torch.ones(2), 5, 2048) == 32  # the calls run
    fn(torch.ones(2), 7, 2048)
    with tuner.graph_capture(1024):
        fn(torch.ones(2), 9, 2**17)  # a capture's lengths are not its traffic's
    fn(torch.ones(2), 11, 2048)
    assert tuner.flush_misses() == 5
    lengths_of = {m.problem.run_key.batch: m.lengths for m in TuningDB(db_path).misses(current_fingerprint_id())}
    assert lengths_of == {3: None, 5: None, 7: (1, 1536.0, 2048.0, 512.0), 9: None, 11: None}
    assert on_gpu.reads == 0
