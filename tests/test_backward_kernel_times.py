"""scripts/backward_kernel_times.py without a GPU: the kernel-role names, the period and mean
durations from made-up profiler events (exact by construction), and a clean exit without CUDA."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import backward_kernel_times as bkt  # noqa: E402


def test_roles():
    assert bkt.role_of("void backward_sm90_dkdv_kernel<...>") == "dkdv"
    assert bkt.role_of("backward_sm90_preprocess_kernel") == "preprocess"
    assert bkt.role_of("backward_sm90_convert_kernel") == "convert"
    assert bkt.role_of("Memset") == "other"


def test_summarize_period_and_means():
    events = []
    for i in range(5):  # calls every 100 us: preprocess 10 us, dK/dV 80, convert 12 overlapping its end
        t = 100.0 * i
        events += [("pre preprocess", t, t + 10), ("x_dkdv_kernel", t + 10, t + 90), ("convert", t + 85, t + 97)]
    events.append(("zero-length convert", 1000.0, 1000.0))  # ignored
    period, means, tflops, dkdv_tflops = bkt.summarize(events, flops=2e9)
    assert period == 100.0
    assert means == {"preprocess": 10.0, "dkdv": 80.0, "convert": 12.0}
    assert tflops == pytest.approx(2e9 / 100 / 1e6) and dkdv_tflops == pytest.approx(2e9 / 80 / 1e6)


def test_summarize_needs_two_calls():
    with pytest.raises(ValueError, match="two dK/dV"):
        bkt.summarize([("dkdv", 0.0, 5.0)], flops=1.0)


def test_calls_check(capsys):
    with pytest.raises(SystemExit):
        bkt.main(["--calls", "2"])
    assert "--calls" in capsys.readouterr().err


def test_main_without_torch_or_gpu_measures_nothing(capsys):
    assert bkt.main(["--seqs", "1k"]) == 0
    assert "nothing measured" in capsys.readouterr().out
