"""scripts/bench_backward.py's sustained timing without a GPU: the load phase runs the call back to
back for the given time, then the timed calls run back to back between event pairs (stand-ins for
torch's events record a fake clock, so the medians are exact; test fixtures, not measurements)."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_backward  # noqa: E402


def test_sustain_load_runs_for_the_time_and_syncs():
    calls, syncs = [], []
    t0 = time.perf_counter()
    bench_backward.sustain_load(lambda: calls.append(1), 0.05, lambda: syncs.append(len(calls)))
    assert time.perf_counter() - t0 >= 0.05
    assert syncs and all(n % 8 == 0 for n in syncs) and len(calls) == syncs[-1]


def _fake_torch(log):
    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            log.append("record")
            self.t = clock[0]

        def elapsed_time(self, other):
            return other.t - self.t

        def synchronize(self):
            pass

    def sleep(cycles):
        log.append("spin")

    cuda = SimpleNamespace(Event=Event, synchronize=lambda: log.append("sync"), _sleep=sleep)
    return SimpleNamespace(cuda=cuda), clock


def test_time_events_sustained_times_back_to_back_without_spins():
    log = []
    torch, clock = _fake_torch(log)
    durations = iter([2.0, 1.0, 3.0] + [5.0] * 1000)  # the three timed calls, then the load phase's

    def fn():
        log.append("call")
        clock[0] += next(durations) if "record" in log else 0.5

    # warm-up and load calls advance the clock by 0.5 before the first record; the three timed
    # calls by 2, 1 and 3 ms
    ms = bench_backward.time_events(torch, fn, warmup=1, reps=3, sustain=0.02)
    assert ms == 2.0
    assert "spin" not in log
    timed = log[log.index("record"):]
    assert timed == ["record", "call", "record"] * 3 + ["sync"]


def test_time_events_burst_spins_before_each_call():
    log = []
    torch, clock = _fake_torch(log)

    def fn():
        log.append("call")
        clock[0] += 1.0

    assert bench_backward.time_events(torch, fn, warmup=1, reps=2) == 1.0
    assert log.count("spin") == 2
