"""bench_frameworks.per_round_ratio: each row against its SDPA peer within a round (no GPU)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_frameworks  # noqa: E402


def test_ratio_is_taken_within_each_round_so_a_host_speed_change_cancels():
    # the thirtieth session's host: ours and SDPA both slowed in rounds 1, 4 and 5
    samples = {"cupyflash.torch.attention": {"wall": [19.8, 13.5, 12.9, 18.9, 18.3]},
               "SDPA flash": {"wall": [16.8, 18.6, 17.0, 26.4, 29.4]}}
    medians_ratio = 18.3 / 18.6  # what the two medians say
    r = bench_frameworks.per_round_ratio(samples, "cupyflash.torch.attention")
    assert r == pytest.approx(13.5 / 18.6)  # the per-round ratios' median (0.62, 0.72, 0.73, 0.76, 1.18)
    assert r < medians_ratio
    assert bench_frameworks.per_round_ratio(samples, "SDPA flash") == 1.0


def test_training_rows_compare_with_their_own_sdpa_step():
    samples = {"cupyflash fwd+bwd (autograd)": {"wall": [200.0, 240.0, 260.0]},
               "SDPA flash fwd+bwd (autograd)": {"wall": [100.0, 200.0, 200.0]},
               "SDPA flash": {"wall": [10.0, 10.0, 10.0]}}
    assert bench_frameworks.per_round_ratio(samples, "cupyflash fwd+bwd (autograd)") == pytest.approx(1.3)
    assert bench_frameworks.per_round_ratio(samples, "SDPA flash fwd+bwd (autograd)") is None  # a peer


def test_no_peer_no_ratio():
    samples = {"attention_varlen fwd+bwd (autograd)": {"wall": [1.0]}, "SDPA flash": {"wall": [1.0]}}
    assert bench_frameworks.per_round_ratio(samples, "attention_varlen fwd+bwd (autograd)") is None
    assert bench_frameworks.per_round_ratio({"x": {"wall": []}, "SDPA flash": {"wall": []}}, "x") is None
