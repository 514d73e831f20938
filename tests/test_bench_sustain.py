"""Sustained timing without a GPU, in scripts/bench_backward.py and bench_impls.py (the forward
bench's): the load phase runs the call back to back for the given time, then the timed calls run
back to back between event pairs (stand-ins for torch's events record a fake clock, so the medians
are exact; test fixtures, not measurements). Also the knob probe's --twins and the forward
bench's --rounds."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_backward  # noqa: E402
import bench_impls  # noqa: E402


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


def test_forward_time_events_sustained_loads_then_times_without_a_spin():
    log, sets = [], []
    torch, clock = _fake_torch(log)

    def run(i):
        sets.append(i)
        log.append("call")
        clock[0] += 1.0 if "record" in log else 0.25

    timing = bench_impls.time_events(torch, run, n_sets=3, warmup=2, iters=4, sustain=0.02)
    assert timing.median_ms == 1.0
    assert "spin" not in log
    first = log.index("record")
    # the load phase: at least one batch of 8 calls, each followed by a sync; then 2 warm-up calls
    assert log[:first].count("call") >= 1 + 8 + 2 and log[:first].count("sync") >= 2
    assert log[first:] == ["record", "call", "record"] * 4 + ["sync"]
    assert set(sets) == {0, 1, 2}  # the load rotates the input sets like the timed calls


def test_forward_time_events_burst_spins_once_before_the_warmup():
    log = []
    torch, clock = _fake_torch(log)

    def run(i):
        log.append("call")
        clock[0] += 1.0

    bench_impls.time_events(torch, run, n_sets=1, warmup=2, iters=3)
    assert log.count("spin") == 1 and log.index("spin") < log.index("record")


def test_forward_time_host_sustained_blocks_the_load_and_times_batches():
    blocks, calls = [], []
    t0 = time.perf_counter()
    timing = bench_impls.time_host(lambda i: calls.append(i) or i, blocks.append, n_sets=2, warmup=1,
                                   samples=3, batch=4, sustain=0.02)
    assert time.perf_counter() - t0 >= 0.02
    # run(0) + 1 warm-up + >= 8 load calls + 3 samples of 4
    assert len(calls) >= 1 + 1 + 8 + 12 and timing.median_ms >= 0
    assert len(blocks) >= 2 + 1 + 3


def test_probe_twins_add_features_to_the_table_pick():
    import probe_sm90_d64_256 as probe
    from cupyflash.families.forward_sm90.config import HopperForwardKernelConfig as H

    pick = H.parse("forward_sm90(BF16, 64, 192, 128, 3): tma+ws+pingpong+overlap+persistent+qbuf2+lazy")
    twin = probe.with_features(pick, "emu1+lazy+ring")  # lazy is there already: kept, not repeated
    assert twin == pick.replace(exp_emulation=1, turn_ring=True)
    assert str(twin).endswith("+qbuf2+emu1+lazy+ring")
    with pytest.raises(ValueError, match="turn_ring needs persistent"):
        probe.with_features(pick.replace(persistent=False, double_q=False), "ring")


def test_forward_rounds_report_the_median_round_of_each_checked_column():
    import contextlib

    import bench
    from cupyflash.benchmarking import Timing

    order = []

    class FakeImpl:
        def __init__(self, name, medians):
            self.name, self.medians = name, list(medians)

        def prepare(self, problem):
            pass

        def context(self):
            return contextlib.nullcontext()

        def time(self, torch, warmup, iters, sustain):
            order.append(self.name)
            m = self.medians.pop(0)
            return Timing(m, m - 0.1, m + 0.1, iters)

    torch = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None))
    problem = SimpleNamespace(flops=2e12)
    args = SimpleNamespace(warmup=1, iters=5, sustain=0.0, rounds=4)
    a, b = FakeImpl("a", [3.0, 1.0, 2.0]), FakeImpl("b", [9.0, 9.5, 10.0])
    rec_a = {"dtype": "bf16", "d_head": 128, "seq": 1024, "ms_median": 4.0, "ms_min": 3.9, "ms_max": 4.1, "samples": 5}
    rec_b = dict(rec_a, ms_median=8.0, ms_min=7.9, ms_max=8.1)
    bench._more_rounds(torch, problem, [(a, rec_a), (b, rec_b)], args)
    assert order == ["b", "a", "a", "b", "b", "a"]  # rounds 2 and 4 reversed, round 3 in order
    assert rec_a["ms_rounds"] == [4.0, 3.0, 1.0, 2.0] and rec_a["ms_median"] == 2.0  # lower median: a real round
    assert rec_a["tflops"] == pytest.approx(2e12 / 2e-3 / 1e12)
    assert (rec_a["ms_min"], rec_a["ms_max"], rec_a["samples"]) == (0.9, 4.1, 20)
    assert rec_b["ms_rounds"] == [8.0, 9.0, 9.5, 10.0] and rec_b["ms_median"] == 9.0
    assert "round_errors" not in rec_a

    class Flaky(FakeImpl):  # a later round that raises leaves the others standing
        def time(self, torch, warmup, iters, sustain):
            if not self.medians:
                raise RuntimeError("peer went away")
            return super().time(torch, warmup, iters, sustain)

    c = Flaky("c", [5.0])
    rec_c = dict(rec_a, ms_median=6.0, ms_min=5.9, ms_max=6.1)
    bench._more_rounds(torch, problem, [(c, rec_c)], SimpleNamespace(warmup=1, iters=5, sustain=0.0, rounds=3))
    assert rec_c["ms_rounds"] == [6.0, 5.0] and rec_c["ms_median"] == 5.0
    assert rec_c["round_errors"] == ["RuntimeError: peer went away"]
