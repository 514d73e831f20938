#!/usr/bin/env python
"""Compile forward_sm90 config sets for sm_90a into the kernel cache, in parallel (no GPU needed).

    python scripts/prewarm_sm90.py [set key ...]      # default: prog_all defaults tune
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.families.forward_sm90.config_sets import get_kernel_configs  # noqa: E402
from cupyflash.families.forward_sm90.launch import prewarm_sm90  # noqa: E402


def main(argv: list[str]) -> int:
    keys = argv or ["prog_all", "defaults", "tune"]
    configs = sorted({c for key in keys for c in get_kernel_configs(key)})
    start = time.perf_counter()
    results = prewarm_sm90(configs)
    failed = [r for r in results if r[2]]
    for r in failed:
        print("FAILED", r)
    print(f"prewarm_sm90: {len(results)} modules, {len(failed)} failed, {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
