"""The GPU test modules' prewarm fixtures: compile what a module runs, in parallel, before its tests
(NVRTC needs no GPU; the prewarm's worker processes are spawned, not forked from the CUDA process),
and write the figures a module measured where CUPYFLASH_TEST_FIGURES says."""
from __future__ import annotations

import json
import os
from typing import Any


def this_arch(cp: Any) -> str:
    """The current GPU's arch string ('sm_90', ...), as the registry compiles for it."""
    from cupyflash.device import device_arch

    return device_arch(cp.cuda.runtime.getDevice())[0]


def prewarm_groups(*groups: tuple[list, list[str], dict[str, Any]]) -> None:
    """Build each (configs, archs, prewarm keyword arguments) group with one worker per core (up to
    16); AssertionError naming the first failures."""
    from cupyflash.prewarm import prewarm

    jobs = max(1, min(16, os.cpu_count() or 1))
    reports = [prewarm(configs, archs, jobs=jobs, progress=None, **options) for configs, archs, options in groups]
    failed = [f"{r.label} {r.arch}: {r.error}" for report in reports for r in report.failed]
    assert not failed, "\n".join(failed[:3])


def prewarm_this_gpu(cp: Any, prewarm_plan) -> None:
    """Build a module's `prewarm_plan(arch, compute capability)` groups for the current GPU."""
    from cupyflash.device import compute_capability

    prewarm_groups(*prewarm_plan(this_arch(cp), compute_capability(cp.cuda.runtime.getDevice())))


def write_figures(figures: dict) -> None:
    """The module's measured figures as JSON at $CUPYFLASH_TEST_FIGURES, when it is set."""
    path = os.environ.get("CUPYFLASH_TEST_FIGURES")
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)
