"""scripts/bench.py without a GPU: --help, the no-GPU exit, and its report formatting.

The records fed to the formatter below are synthetic fixtures that exercise the layout; they are
not measurements.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cupyflash.device import has_gpu

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench.py"
sys.path.insert(0, str(REPO / "scripts"))

import bench_report  # noqa: E402


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=dict(os.environ))


def test_help_works_without_gpu_or_torch():
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    for flag in ("--seqs", "--dtypes", "--d-heads", "--causal", "--configs", "--all-tune", "--progression",
                 "--iters", "--json", "--plot", "Exit codes"):
        assert flag in done.stdout


@pytest.mark.skipif(has_gpu(), reason="with a GPU this would run the benchmark")
def test_without_gpu_exits_2_with_a_clear_message(tmp_path):
    done = _run("--json", str(tmp_path / "r.json"))
    assert done.returncode == 2
    assert "no CUDA GPU found" in done.stderr and "nothing was run" in done.stderr
    assert not (tmp_path / "r.json").exists()


def test_bad_arguments_exit_2():
    assert _run("--dtypes", "int8").returncode == 2
    assert _run("--d-heads", "80").returncode == 2
    assert _run("--seqs", "3000").returncode == 2
    assert _run("--configs", "(BF16, 128): nonsense").returncode == 2
    assert _run("--peers", "triton").returncode == 2


def test_forward_takes_causal_so_bench_can_pass_it():
    import inspect

    import cupyflash

    params = inspect.signature(cupyflash.forward).parameters
    assert "causal" in params and params["causal"].default is False


@pytest.mark.skipif(has_gpu(), reason="with a GPU this would run the benchmark")
def test_causal_gets_past_argument_checks_without_gpu(tmp_path):
    done = _run("--causal", "--seqs", "2k,4k", "--json", str(tmp_path / "r.json"))
    assert done.returncode == 2 and "no CUDA GPU found" in done.stderr and "not supported" not in done.stderr


def test_causal_flops_are_half():
    from cupyflash.benchmarking import attention_flops

    assert attention_flops(2, 16, 4096, 4096, 128, causal=True) == 2.0 * 2 * 16 * 4096 * 4096 * 128
    assert attention_flops(2, 16, 4096, 4096, 128) == 4.0 * 2 * 16 * 4096 * 4096 * 128


def _rec(impl, dtype, d_head, seq, tflops=None, status="ok", **extra):
    r = {"impl": impl, "dtype": dtype, "d_head": d_head, "seq": seq, "batch": 16384 // seq,
         "heads": 2048 // d_head, "status": status, **extra}
    if tflops is not None:
        r["tflops"] = tflops
    return r


def test_grid_table_layout_and_targets():
    recs = []
    for seq, cf, fl in ((512, 96.0, 100.0), (1024, 99.0, 100.0)):  # synthetic fixture values
        recs.append(_rec("cupyflash", "bf16", 128, seq, cf, config="CFG", config_source="heuristic"))
        recs.append(_rec("sdpa_flash", "bf16", 128, seq, fl))
        recs.append(_rec("sdpa_cudnn", "bf16", 128, seq, status="skipped", reason="no cuDNN"))
        recs.append(_rec("cupyflash_tune", "bf16", 128, seq, 50.0, config="T"))
    recs.append(_rec("cupyflash[1]", "bf16", 128, 512, status="refused", reason="relative L2 error 0.5 > 0.01",
                     config="X"))
    text = bench_report.format_grid(recs, causal=False)
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["dtype", "d_head", "seq", "B", "H"]
    assert "cupyflash[1]" in lines[0] and "sdpa_cudnn" in lines[0] and "cupyflash_tune" not in lines[0]
    row512 = next(line for line in lines if line.startswith("bf16") and " 512 " in line)
    row1k = next(line for line in lines if line.startswith("bf16") and " 1024 " in line)
    assert "0.960x" in row512 and "ok>=0.95" in row512 and "REFUSED" in row512 and "SKIPPED" in row512
    assert "0.990x" in row1k and "MISS>=1.00" in row1k and "CFG [heuristic]" in row1k
    assert "cupyflash[1] = X" in text and "not reported:" in text and "no cuDNN" in text


def test_target_rule():
    assert bench_report.target_ratio(128, 512, False) == 0.95
    assert bench_report.target_ratio(128, 16384, False) == 1.0
    assert bench_report.target_ratio(64, 1024, False) is None
    assert bench_report.target_ratio(64, 2048, False) == 1.0
    assert bench_report.target_ratio(128, 4096, True) == 1.0
    assert bench_report.target_ratio(128, 2048, True, "bf16") == 1.0
    assert bench_report.target_ratio(128, 1024, True, "bf16") is None
    assert bench_report.target_ratio(128, 4096, True, "fp16") is None
    assert bench_report.target_ratio(64, 4096, True) is None


def test_progression_and_overhead_text():
    recs = [_rec("cupyflash_prog", "bf16", 128, 4096, 100.0, step=1, config="A"),
            _rec("cupyflash_prog", "bf16", 128, 4096, 125.0, step=2, config="B"),
            _rec("cupyflash_prog", "bf16", 128, 4096, status="refused", reason="wrong", step=3, config="C")]
    text = bench_report.format_progression(recs, {"bf16,128,4096": 300.0})
    assert "+25.0%" in text and "REFUSED" in text and "sdpa_flash 300.0" in text
    over = {"shape": [1, 128, 8, 128], "dtype": "bf16", "config": "C",
            "cupyflash_auto": {"us_per_call": 12.0, "gpu_span_us_per_call": 5.0, "issue_us_per_call": 9.0,
                               "calls": 2000, "rounds": 3},
            "cupyflash_cfg_out": {"us_per_call": 10.0, "gpu_span_us_per_call": 5.0, "calls": 2000, "rounds": 3},
            "sdpa_flash": {"us_per_call": 30.0, "gpu_span_us_per_call": 6.0, "calls": 2000, "rounds": 3},
            "bare_launch": {"us_per_call": 4.0, "gpu_span_us_per_call": 4.0, "issue_us_per_call": 3.0},
            "ratio_cupyflash_auto_over_sdpa": 0.4, "ratio_cupyflash_issue_over_sdpa_wall": 0.3,
            "python_side_us_per_call": 6.0, "ratio_python_side_over_sdpa_wall": 0.2,
            "ratio_python_side_per_round": [0.18, 0.2, 0.25]}
    text = bench_report.format_overhead(over)
    assert "0.40" in text and "12.0 us/call" in text and "host issue 9.0 us/call" in text
    assert "whole host-side cost of cupyflash(auto) / sdpa_flash wall per call = 0.30" in text
    assert "6.0 us) / sdpa_flash wall per call = 0.20 (rounds 0.18-0.25) (target <= 0.50: ok)" in text
    over["ratio_python_side_over_sdpa_wall"] = 0.6
    assert "MISS" in bench_report.format_overhead(over)


def test_json_write_is_atomic_and_complete(tmp_path):
    path = tmp_path / "out" / "r.json"
    bench_report.write_json(path, {"grid": [1, 2], "complete": True})
    assert json.loads(path.read_text()) == {"grid": [1, 2], "complete": True}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    recs = [_rec(impl, "bf16", 128, seq, t) for seq in (512, 1024) for impl, t in (("cupyflash", 1.0),
                                                                                  ("sdpa_flash", 2.0))]
    path = tmp_path / "p.png"
    assert bench_report.plot(recs, path, "fixture") is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_orchestration_with_fake_gpu_side(tmp_path, monkeypatch, capsys):
    """bench.main end to end with the GPU side replaced: fixture timings, one wrong config, a
    skipped peer. Checks the exit code, the JSON and the printed summary, not any speed."""
    import types

    import bench
    import bench_impls
    from cupyflash.families.forward_sm80 import config_sets
    from cupyflash.benchmarking import Timing
    from cupyflash.config import DType

    bad = config_sets.autotune_configs([DType.BF16], [128])[0]
    props = types.SimpleNamespace(name="Fake GPU", major=9, minor=0, multi_processor_count=132,
                                  L2_cache_size=50 * 2**20, total_memory=80 * 2**30)
    cuda = types.SimpleNamespace(current_device=lambda: 0, get_device_properties=lambda d: props,
                                 is_available=lambda: True, synchronize=lambda: None, empty_cache=lambda: None)
    fake_torch = types.SimpleNamespace(__version__="fake", cuda=cuda, version=types.SimpleNamespace(cuda="13.0"),
                                       backends=types.SimpleNamespace(cudnn=types.SimpleNamespace(version=lambda: 1)))

    class FakeCupyflash(bench_impls.Impl):
        def __init__(self, cfg, name="cupyflash"):
            self.cfg, self.name = cfg, name

        def check(self, torch):
            return 0.5 if self.cfg == bad else 1e-3

        def time(self, torch, warmup, iters, sustain=0.0):
            ms = 1.0 + (hash(str(self.cfg)) % 7) / 10  # fixture value
            return Timing(ms, ms, ms, iters)

    class FakeSdpa(bench_impls.Impl):
        def __init__(self, torch, backend, name):
            if backend == "CUDNN_ATTENTION":
                raise bench_impls.Skip("fixture: backend unavailable")
            self.name = name

        def check(self, torch):
            return 1e-3

        def time(self, torch, warmup, iters, sustain=0.0):
            return Timing(1.2, 1.2, 1.2, iters)

    def fake_problem(torch, dtype, shape, causal, l2, seed=0, kv_group=1, seq_k=None):
        return bench_impls.Problem(dtype, shape, causal, 0.1, [None], kv_group,
                                   None if seq_k == shape.seq else seq_k)

    overhead = {"shape": [1, 128, 8, 128], "dtype": "bf16", "config": "C",
                "cupyflash_auto": {"us_per_call": 10.0, "gpu_span_us_per_call": 5.0, "calls": 10, "rounds": 3},
                "cupyflash_cfg_out": {"us_per_call": 9.0, "gpu_span_us_per_call": 5.0, "calls": 10, "rounds": 3},
                "sdpa_flash": {"us_per_call": 30.0, "gpu_span_us_per_call": 5.0, "calls": 10, "rounds": 3},
                "ratio_cupyflash_auto_over_sdpa": 1 / 3}
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setattr(bench, "_no_gpu_reason", lambda: None)
    monkeypatch.setattr(bench, "_prewarm", lambda configs, device, causal=False: {})
    monkeypatch.setattr(bench_impls, "CupyflashImpl", FakeCupyflash)
    monkeypatch.setattr(bench_impls, "SdpaImpl", FakeSdpa)
    monkeypatch.setattr(bench_impls, "make_problem", fake_problem)
    monkeypatch.setattr(bench_impls, "measure_overhead", lambda torch, n_calls: overhead)
    out_json = tmp_path / "r.json"
    rc = bench.main(["--seqs", "1k,4k", "--dtypes", "bf16", "--all-tune", "--progression",
                     "--configs", str(bad), "--json", str(out_json), "--plot", ""])
    printed = capsys.readouterr()
    assert rc == 1  # the wrong config is a cupyflash failure
    assert "FAILURES" in printed.err and "relative L2 error 0.5" in printed.err
    data = json.loads(out_json.read_text())
    assert data["complete"] and data["meta"]["gpu"] == "Fake GPU"
    impls = {r["impl"] for r in data["grid"]}
    assert {"cupyflash", "cupyflash[1]", "cupyflash_tune", "cupyflash_best", "sdpa_flash"} <= impls
    assert data["skipped_peers"]["sdpa_cudnn"].startswith("fixture")
    if importlib.util.find_spec("jax") is None:  # without JAX the peer is reported as skipped, not dropped
        assert "jax_cudnn" in data["skipped_peers"]
    assert [r["step"] for r in data["progression"]] == list(range(1, 8)) * 2  # S=1k and 4k (from --seqs)
    assert data["progression"][0]["gain_vs_previous"] is None
    assert data["progression"][1]["gain_vs_previous"] is not None
    assert data["overhead"]["ratio_cupyflash_auto_over_sdpa"] == pytest.approx(1 / 3)
    assert "cf/flash" in printed.out and "progression bf16 d_head 128 S=1024" in printed.out
    assert "cupyflash(auto) / sdpa_flash = 0.33" in printed.out


def test_rectangular_problems_count_visible_pairs_and_skip_top_left_peers():
    """--seq-k-factor: seq_k = round(F * seq); non-causal FLOPs are 4*B*H*S_q*S_k*D, causal ones
    count the bottom-right mask's visible pairs; SDPA and jax_cudnn (top-left is_causal) refuse
    rectangular causal problems with a Skip instead of being checked against another mask."""
    import bench
    import bench_impls
    from cupyflash.benchmarking import GridShape
    from cupyflash.config import DType

    shape = GridShape(2, 100, 4, 64)
    assert bench.seq_k_for(100, 2.5) == 250 and bench.seq_k_for(3, 0.1) == 1
    plain = bench_impls.Problem(DType.BF16, shape, False, 0.1, [None], 1, 250)
    assert plain.keys == 250 and plain.flops == 4.0 * 2 * 4 * 100 * 250 * 64
    causal = bench_impls.Problem(DType.BF16, shape, True, 0.1, [None], 1, 250)
    pairs = sum(min(250, i + 250 - 100 + 1) for i in range(100))
    assert causal.flops == 4.0 * 2 * 4 * 64 * pairs
    square = bench_impls.Problem(DType.BF16, shape, True, 0.1, [None], 1)
    assert square.keys == 100 and square.flops == 2.0 * 2 * 4 * 100 * 100 * 64  # the grid's half convention

    class FakeSdpa(bench_impls.SdpaImpl):
        def __init__(self):  # no torch needed for prepare()
            self.name = "sdpa_flash"

    with pytest.raises(bench_impls.Skip, match="top-left"):
        FakeSdpa().prepare(causal)
    FakeSdpa().prepare(plain)  # non-causal rectangles are the same attention for SDPA
    assert bench.build_parser().parse_args(["--seq-k-factor", "4"]).seq_k_factor == 4.0

