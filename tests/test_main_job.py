"""The main job (scripts/run_attention.py, `python -m cupyflash run`) on any machine."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cupyflash.config import DType
from cupyflash.families.forward_sm80.config_sets import default_config
from cupyflash.device import has_gpu

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "run_attention.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU: the GPU path is exercised by the GPU tests")
def test_main_job_without_gpu_says_so_and_exits_0():
    done = _run(str(SCRIPT))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "q (2, 1024, 16, 128)" in out and "bf16" in out
    assert "config      (BF16, 128," in out  # the library's pick, in short form
    cfg = default_config(DType.BF16, 128)
    assert f"config      {cfg.short_form()}" in out
    assert f"launch      grid ({1024 // cfg.B_r}, 16, 2), block {cfg.n_warps * 32}" in out
    assert "no CUDA GPU found: " in out and "would have run" in out


@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU")
def test_cli_run_with_flags():
    cfg = "(FP16, 64, 64, 64, 4): async+load_0_0_0_tiles"
    done = _run("-m", "cupyflash", "run", "--dtype", "fp16", "--d-head", "64", "--seq", "256",
                "--batch", "1", "--heads", "2", "--config", cfg)
    assert done.returncode == 0, done.stderr
    assert f"config      {cfg}" in done.stdout and "grid (4, 2, 1)" in done.stdout


@pytest.mark.parametrize("args,message", [
    (["--d-head", "80"], "q: d_head 80 is not supported"),
    (["--config", "nonsense"], "cfg: cannot parse"),
    (["--dtype", "fp16", "--config", "(BF16, 128, 64, 64, 4): async+load_0_0_0_tiles"], "cfg: config dtype BF16"),
])
def test_main_job_rejects_bad_arguments_before_running(args, message):
    done = _run(str(SCRIPT), *args)
    assert done.returncode == 2 and message in done.stderr
