#!/usr/bin/env python
"""Where the d_head 128 non-causal forward at S = 4k loses to 16k (NOTES.md items 229, 233):
key-block padding (B_c 176 over 4096 keys computes 4224) and wave quantization (2048 tiles on 132
SMs). Times the table's 4k-16k pick (128x176) and the 1k-2k pick (128x128 persistent) on shapes
with and without each loss, in interleaved rounds of CUDA-event calls (medians, TFLOP/s):

    4096 B4 H16   both losses           4224 B4 H16   neither (24 x 176 keys, 16 waves)
    4096 B3 H11   padding, exact waves  4224 B3 H11   no padding, 8.25 waves
    8192 B2 H16, 16384 / 16544 B1 H16   the long rows, with and without padding

--baseline DIR times an older tree beside this one in the same process, call for call (DIR
holds its cupyflash/, kernels_cu/ and templates/, e.g. `git archive REV cupyflash kernels_cu
templates | tar x -C DIR`): each round times both on the same inputs, in alternating order, so
clock drift falls on both alike; the last column is this tree's time over the baseline's.

    python scripts/probe_forward_waves.py [--rounds 3] [--calls 10] [--dtype bf16|fp16]
                                          [--baseline DIR] [--rows 4096,8192] [--json out.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from types import ModuleType

try:
    import cupyflash  # an installed or editable cupyflash
except ImportError:  # a plain checkout: use the package next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import cupyflash

CONFIGS = {"128x176": "forward_sm90({dtype}, 128, 128, 176, 2): tma+ws+pingpong+overlap",
           "128x128p": "forward_sm90({dtype}, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2"}
ROWS = (("4096 B4 H16", 4, 4096, 16), ("4224 B4 H16", 4, 4224, 16), ("4096 B3 H11", 3, 4096, 11),
        ("4224 B3 H11", 3, 4224, 11), ("8192 B2 H16", 2, 8192, 16), ("16384 B1 H16", 1, 16384, 16),
        ("16544 B1 H16", 1, 16544, 16))


def load_baseline(root: Path) -> ModuleType:
    """The cupyflash package under `root` as the module `cupyflash_baseline` (its imports are
    relative, and it finds kernels_cu/ and templates/ next to itself)."""
    init = root / "cupyflash" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"--baseline: no cupyflash/__init__.py under {root}")
    spec = importlib.util.spec_from_file_location("cupyflash_baseline", init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["cupyflash_baseline"] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=10, help="CUDA-event calls per round (median)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--rows", default="", help="comma-separated sequence lengths: only the rows of these")
    p.add_argument("--baseline", type=Path, help="an older tree to time beside this one")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    import cupy as cp
    import ml_dtypes
    import numpy as np

    trees = {"": cupyflash}
    if args.baseline:
        trees = {"": cupyflash, "base ": load_baseline(args.baseline)}
    dtype_name = "BF16" if args.dtype == "bf16" else "FP16"
    configs = {(tree, tag): mod.families.forward_sm90.config.HopperForwardKernelConfig.parse(text.format(dtype=dtype_name))
               for tree, mod in trees.items() for tag, text in CONFIGS.items()}
    wanted = {int(s) for s in args.rows.split(",") if s}
    rows = [r for r in ROWS if not wanted or r[2] in wanted]
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    rng = cp.random.default_rng(0)
    element = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bf16" else np.dtype(np.float16)
    figures: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for name, batch, seq, heads in rows:
            # random bits of finite values (fp16 bit patterns, read as bf16 for bf16); timing does
            # not depend on the values
            q, k, v = (rng.standard_normal((batch, seq, heads, 128), dtype=cp.float32).astype(cp.float16)
                       .view(cp.uint16).view(element) for _ in range(3))
            out = cp.empty_like(q)
            flops = 4 * batch * heads * seq * seq * 128
            order = list(configs.items())
            if round_ % 2:
                order.reverse()
            for (tree, tag), cfg in order:
                call = lambda: trees[tree].forward(cfg, q, k, v, out)  # noqa: E731
                call()
                cp.cuda.Device().synchronize()
                times = []
                for _ in range(args.calls):
                    start.record()
                    call()
                    stop.record()
                    stop.synchronize()
                    times.append(cp.cuda.get_elapsed_time(start, stop))
                figures.setdefault(f"{name} {tree}{tag}", []).append(round(flops / statistics.median(times) / 1e9, 1))
    for key, values in figures.items():
        line = f"{key:29s} {values}  median {statistics.median(values)}"
        if args.baseline and not key.split(" ")[3] == "base":
            name, tag = key.rsplit(" ", 1)
            base = figures[f"{name} base {tag}"]
            ratios = [n / b for n, b in zip(values, base)]
            line += f"  x{statistics.median(ratios):.3f} of base (rounds {min(ratios):.3f}-{max(ratios):.3f})"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
