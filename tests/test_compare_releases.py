"""scripts/compare_releases.py without a GPU: the alternating rounds and the figures per point.

The workers are stand-ins that answer from fixed tables (test fixtures, not measurements).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import compare_releases  # noqa: E402


class FakeWorker:
    """Answers 'pick' with its release's config and 'time' from a {config: [tflops per call]} map."""

    def __init__(self, pick, speeds, log, name):
        self.pick, self.speeds, self.log, self.name = pick, {k: list(v) for k, v in speeds.items()}, log, name

    def ask(self, op, **req):
        if op == "pick":
            return {"config": self.pick}
        if op == "runs":
            return {"ok": req["cfg"] in self.speeds}
        cfg = self.pick if req["cfg"] is None else req["cfg"]
        self.log.append((self.name, req["cfg"]))
        self.causal = req["causal"]
        return {"tflops": self.speeds[cfg].pop(0)}


def test_compare_point_alternates_and_takes_medians():
    log = []
    new = FakeWorker("N", {"N": [100, 90, 110], "O": [80, 80, 80], "sdpa": [50, 50, 50],
                           "sdpa_cudnn": [70, 60, 65]}, log, "new")
    old = FakeWorker("O", {"O": [100, 100, 100], "N": [120, 120, 120]}, log, "old")
    row = compare_releases.compare_point(new, old, "bf16", 128, 4096, rounds=3, iters=5, causal=True)
    assert (row["new_pick"], row["old_pick"]) == ("N", "O")
    assert (row["new"], row["old"], row["new@old"], row["old@new"], row["sdpa_flash"], row["sdpa_cudnn"]) == \
        (100, 100, 80, 120, 50, 65)
    assert row["samples"]["new"] == [100, 90, 110] and row["causal"] and new.causal and old.causal
    # every round runs all six measurements; the order reverses from one round to the next
    first, second = log[:6], log[6:12]
    assert first == list(reversed(second)) and len(log) == 18


def test_main_reports_kernel_only_ratio(monkeypatch, tmp_path, capsys):
    log = []
    workers = iter([FakeWorker("N", {"N": [110] * 2, "O": [99] * 2, "sdpa": [50] * 2, "sdpa_cudnn": [55] * 2}, log, "new"),
                    FakeWorker("O", {"O": [100] * 2, "N": [100] * 2}, log, "old")])
    monkeypatch.setattr(compare_releases, "Worker", lambda root, cache: next(workers))
    monkeypatch.setattr(FakeWorker, "close", lambda self: None, raising=False)
    old = tmp_path / "old"
    (old / "cupyflash").mkdir(parents=True)
    (old / "cupyflash" / "__init__.py").write_text("")
    out = tmp_path / "r.json"
    assert compare_releases.main(["--old", str(old), "--dtypes", "bf16", "--d-heads", "128", "--seqs", "4096",
                                  "--rounds", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1.100" in text  # new/old
    row = __import__("json").loads(out.read_text())["rows"][0]
    # kernel-only: new kernel vs old kernel on the same configs, geometric mean over both picks
    assert row["kernel_new_over_old"] == pytest.approx(((110 / 100) * (99 / 100)) ** 0.5)


def test_missing_old_checkout_exits_2(tmp_path, capsys):
    assert compare_releases.main(["--old", str(tmp_path)]) == 2
    assert "holds no cupyflash package" in capsys.readouterr().err


def test_old_release_without_the_new_knob_gives_no_old_at_new():
    """A new pick the old release cannot parse (a knob it lacks): old@new is left out, the kernel
    ratio comes from the old pick alone."""
    log = []

    new = FakeWorker("N", {"N": [110] * 3, "O": [99] * 3, "sdpa": [50] * 3, "sdpa_cudnn": [55] * 3}, log, "new")
    old = FakeWorker("O", {"O": [100] * 3}, log, "old")  # cannot run "N"
    row = compare_releases.compare_point(new, old, "bf16", 64, 512, rounds=3, iters=5)
    assert row["old@new"] is None and "old@new" not in row["samples"] and ("old", "N") not in log
    assert compare_releases.kernel_ratio(row) == pytest.approx(0.99)
    assert (row["new"], row["old"]) == (110, 100)
