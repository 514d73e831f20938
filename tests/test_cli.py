"""`python -m cupyflash` dispatcher and the `info` command."""
import json
import os
import subprocess
import sys

from cupyflash import cli
from cupyflash.cache import KernelCache
from cupyflash.device import has_gpu
from tiny_kernels import TINY_NAMES, tiny_source


def _run(args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "cupyflash", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_info_reports_versions_device_and_cache(tmp_path):
    cache = KernelCache(tmp_path)
    for i in range(2):
        cache.get_or_compile(tiny_source(i), TINY_NAMES, "sm_80")
    done = _run(["info"], {"CUPYFLASH_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for word in ("cupyflash", "cupy", "numpy", "jinja2", "ml_dtypes", "nvrtc", "sm_80", "sm_90", "driver", "runtime"):
        assert word in out
    assert f"cache        {tmp_path}: 2 entries" in out
    if has_gpu():
        assert "device 0" in out and "compute capability" in out
    else:
        assert "no GPU found" in out


def test_info_json(tmp_path):
    done = _run(["info", "--json"], {"CUPYFLASH_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert set(info["packages"]) == {"cupyflash", "cupy", "numpy", "jinja2", "ml_dtypes"}
    assert info["cache"] == {"dir": str(tmp_path), "entries": 0, "size_bytes": 0, "entries_per_family": {}}
    assert [f["family"] for f in info["families"]] == ["forward_sm80", "forward_sm90", "backward_sm80", "backward_sm90", "decode"]
    assert "sm_90" in info["nvrtc"]["archs"]
    assert isinstance(info["cuda"]["devices"], list)


def test_no_command_and_unknown_command_exit_2():
    assert _run([]).returncode == 2
    done = _run(["frobnicate"])
    assert done.returncode == 2 and "invalid choice" in done.stderr


def test_help_lists_commands():
    done = _run(["--help"])
    assert done.returncode == 0 and "info" in done.stdout and "prewarm" in done.stdout


def test_subcommand_table_modules_follow_the_protocol():
    import importlib

    names = [c.name for c in cli.SUBCOMMANDS]
    assert len(names) == len(set(names)) and {"info", "prewarm"} <= set(names)
    for cmd in cli.SUBCOMMANDS:
        module = importlib.import_module(cmd.module)
        assert callable(module.build_parser) and callable(module.run_from_args)
