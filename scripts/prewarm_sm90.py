#!/usr/bin/env python
"""Compile forward_sm90 config sets for sm_90a into the kernel cache, in parallel (no GPU needed),
plain and causal. A thin wrapper over cupyflash.prewarm.prewarm for the device sessions.

    python scripts/prewarm_sm90.py [set key ...]      # default: prog_all defaults
"""
from __future__ import annotations

import sys
from pathlib import Path

try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.families.forward_sm90.config_sets import get_kernel_configs  # noqa: E402
from cupyflash.prewarm import format_summary, prewarm  # noqa: E402


def main(argv: list[str]) -> int:
    keys = argv or ["prog_all", "defaults"]
    configs = sorted({c for key in keys for c in get_kernel_configs(key)})
    report = prewarm(configs, ["sm_90a"], progress=None, causal=(False, True))
    print(format_summary(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
