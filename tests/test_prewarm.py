"""Prewarm command: compiles named configs without a GPU into a cache a later process uses as is."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cupyflash import prewarm as prewarm_mod
from cupyflash import registry as registry_mod
from cupyflash.cache import KernelCache
from cupyflash.config import DType
from cupyflash.families.forward_sm80.config_sets import progression_configs
from cupyflash.progress import ProgressBar
from cupyflash.registry import config_cache_key

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "prewarm_cache.py"
CONFIGS = progression_configs(DType.FP16, 64)[-2:]  # two small, fast configs


def _run(args, env_extra=None):
    # the script must import this tree's cupyflash (as the test does), not another installed copy
    # whose kernel sources, and so cache keys, may differ
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, **(env_extra or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


def test_script_compiles_then_reports_all_cached(tmp_path):
    args = [str(SCRIPT), "--arch", "sm_80,sm_90", "--cache-dir", str(tmp_path), "--jobs", "2"]
    for cfg in CONFIGS:
        args += ["--config", cfg.short_form()]
    first = _run(args)
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert "prewarm: 2 configs x 2 archs (sm_80,sm_90) = 4 modules in" in out
    assert "compiled 4" in out and "cached 0" in out and "failed 0" in out
    rows = [line for line in out.splitlines() if line.startswith("(FP16, 64,")]
    assert len(rows) == 4
    for cfg in CONFIGS:
        for arch in ("sm_80", "sm_90"):
            (row,) = [r for r in rows if r.startswith(cfg.short_form() + " ") and f" {arch} " in r]
            regs, spill_st, spill_ld, seconds, status = row[len(cfg.short_form()):].split()[1:]
            if regs != "-":  # '-': NVRTC answered from its own cache without a ptxas report
                assert 0 < int(regs) <= 255 and int(spill_st) >= 0 and int(spill_ld) >= 0
            else:
                assert spill_st == spill_ld == "-"
            assert float(seconds) > 0 and status == "compiled"
    assert "prewarm [" in first.stderr and "4/4" in first.stderr  # the progress bar
    cache = KernelCache(tmp_path)
    assert len(cache.entries()) == 4
    for cfg in CONFIGS:
        for arch in ("sm_80", "sm_90"):
            assert cache.get(config_cache_key(cfg, arch)) is not None  # the registry's key

    second = _run(args)
    assert second.returncode == 0, second.stderr
    assert "compiled 0" in second.stdout and "cached 4" in second.stdout
    assert all(line.endswith("cached") for line in second.stdout.splitlines() if line.startswith("(FP16"))
    assert len(cache.entries()) == 4


def test_later_process_with_cache_dir_compiles_nothing(tmp_path):
    sf = CONFIGS[0].short_form()
    assert _run([str(SCRIPT), "--arch", "sm_80", "--config", sf, "--cache-dir", str(tmp_path), "--quiet"]).returncode == 0
    code = (
        "from cupyflash import FlashForwardKernelConfig\n"
        "from cupyflash.compiler import compile_count\n"
        "from cupyflash.registry import compile_config\n"
        f"lookup = compile_config(FlashForwardKernelConfig.parse({sf!r}), 'sm_80')\n"
        "print(compile_count(), lookup.cached)\n"
    )
    done = _run(["-c", code], {"CUPYFLASH_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "True"]


def test_module_command_with_named_set(tmp_path):
    done = _run(["-m", "cupyflash", "prewarm", "--arch", "sm_90", "--set", "prog", "--cache-dir", str(tmp_path),
                 "--jobs", "2", "--quiet"])
    assert done.returncode == 0, done.stderr
    assert "prewarm: 7 configs x 1 archs (sm_90) = 7 modules" in done.stdout
    assert done.stderr == ""  # --quiet
    assert len(KernelCache(tmp_path).entries()) == 7


@pytest.mark.parametrize("args, message", [
    (["--arch", "sm_81"], "arch"),
    (["--arch", "sm_80", "--set", "nonsense"], "KERNELS key"),
    (["--arch", "sm_80", "--config", "(FP16, 64): what"], "cannot parse"),
    (["--arch", "sm_80", "--jobs", "0"], "--jobs"),
])
def test_bad_arguments_exit_2_with_message(args, message, tmp_path, capsys):
    assert prewarm_mod.main(args + ["--cache-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_failed_compile_is_reported_and_exit_code_1(tmp_path, monkeypatch, capsys):
    broken = "template <class C> __global__ void flash_forward_kernel() { this is not C++ }\n"
    monkeypatch.setattr(registry_mod, "render_family_source", lambda family: broken)
    code = prewarm_mod.main(["--arch", "sm_80", "--config", CONFIGS[0].short_form(), "--cache-dir", str(tmp_path),
                             "--jobs", "1"])
    captured = capsys.readouterr()
    assert code == 1
    assert "failed 1" in captured.out and "FAILED" in captured.out
    assert "NVRTC log" in captured.err and "error" in captured.err
    assert KernelCache(tmp_path).entries() == []


def test_prewarm_function_inline(tmp_path):
    report = prewarm_mod.prewarm(CONFIGS[:1] * 2, ["sm_80"], cache_dir=tmp_path, jobs=1, progress=None)
    assert report.ok and report.n_configs == 1 and len(report.results) == 1  # duplicates dropped
    (result,) = report.results
    assert result.short_form == CONFIGS[0].short_form() and result.arch == "sm_80" and not result.cached
    assert result.compile_seconds > 0
    if result.registers is not None:  # None: NVRTC answered from its own cache without a report
        assert result.registers > 0 and result.spill_bytes == 0
    again = prewarm_mod.prewarm(CONFIGS[:1], ["sm_80"], cache_dir=tmp_path, jobs=4, progress=None)
    assert again.results[0].cached and again.results[0].registers == result.registers
    assert "cached" in prewarm_mod.format_summary(again)


def test_prewarm_rejects_non_configs(tmp_path):
    with pytest.raises(TypeError, match="configs"):
        prewarm_mod.prewarm(["(FP16, 64, 64, 64, 4): async+load_0_0_0_tiles"], ["sm_80"], cache_dir=tmp_path)
    with pytest.raises(ValueError, match="arch"):
        prewarm_mod.prewarm(CONFIGS, [], cache_dir=tmp_path)


def test_parse_archs():
    assert prewarm_mod.parse_archs("sm_80, sm_90,sm_80") == ("sm_80", "sm_90")
    assert prewarm_mod.parse_archs(["sm_90a"]) == ("sm_90a",)
    with pytest.raises(ValueError, match="arch"):
        prewarm_mod.parse_archs("sm_80,sm_11")


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_progress_bar_log_mode_prints_a_line_per_step():
    stream = _Stream(tty=False)
    bar = ProgressBar(100, stream, label="job")
    for i in range(100):
        bar.advance(f"item {i}", failed=(i == 50))
    bar.finish()
    lines = stream.getvalue().splitlines()
    assert 20 <= len(lines) <= 22  # one per 5 % step, plus the failure
    assert lines[-1].startswith("job [" + "#" * ProgressBar.WIDTH + "] 100/100 100.0%")
    assert any("1 failed" in line and "item 50" in line for line in lines)


def test_progress_bar_tty_mode_redraws_in_place():
    stream = _Stream(tty=True)
    bar = ProgressBar(3, stream, label="job")
    for i in range(3):
        bar.advance(f"item {i}")
    bar.finish()
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and "3/3" in text


def test_progress_bar_silent_without_stream():
    bar = ProgressBar(2, None)
    bar.advance()
    bar.advance()
    bar.finish()
    assert bar.done == 2
