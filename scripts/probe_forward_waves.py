#!/usr/bin/env python
"""Where the bf16 d_head 128 non-causal forward at S = 4k loses to 16k (NOTES.md items 229, 232):
key-block padding (B_c 176 over 4096 keys computes 4224) and wave quantization (2048 tiles on 132
SMs). Times the table's 4k-16k pick (128x176) and the 1k-2k pick (128x128 persistent) on shapes
with and without each loss, in interleaved rounds of CUDA-event calls (medians, TFLOP/s):

    4096 B4 H16   both losses           4224 B4 H16   neither (24 x 176 keys, 16 waves)
    4096 B3 H11   padding, exact waves  4224 B3 H11   no padding, 8.25 waves
    16384 / 16544 B1 H16                the long rows, with and without padding

    python scripts/probe_forward_waves.py [--rounds 3] [--calls 10] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

try:
    import cupyflash  # an installed or editable cupyflash
except ImportError:  # a plain checkout: use the package next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import cupyflash

CONFIGS = {"128x176": "forward_sm90(BF16, 128, 128, 176, 2): tma+ws+pingpong+overlap",
           "128x128p": "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2"}
ROWS = (("4096 B4 H16", 4, 4096, 16), ("4224 B4 H16", 4, 4224, 16), ("4096 B3 H11", 3, 4096, 11),
        ("4224 B3 H11", 3, 4224, 11), ("16384 B1 H16", 1, 16384, 16), ("16544 B1 H16", 1, 16544, 16))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=10, help="CUDA-event calls per round (median)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    import cupy as cp
    import ml_dtypes
    import numpy as np

    from cupyflash.families.forward_sm90.config import HopperForwardKernelConfig

    configs = {tag: HopperForwardKernelConfig.parse(text) for tag, text in CONFIGS.items()}
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    rng = cp.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    figures: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, batch, seq, heads in ROWS:
            # random bits of finite bf16 values (fp16 bit patterns read as bf16); timing does not
            # depend on the values
            q, k, v = (rng.standard_normal((batch, seq, heads, 128), dtype=cp.float32).astype(cp.float16)
                       .view(cp.uint16).view(bf16) for _ in range(3))
            out = cp.empty_like(q)
            flops = 4 * batch * heads * seq * seq * 128
            for tag, cfg in configs.items():
                call = lambda: cupyflash.forward(cfg, q, k, v, out)  # noqa: E731
                call()
                cp.cuda.Device().synchronize()
                times = []
                for _ in range(args.calls):
                    start.record()
                    call()
                    stop.record()
                    stop.synchronize()
                    times.append(cp.cuda.get_elapsed_time(start, stop))
                figures.setdefault(f"{name} {tag}", []).append(round(flops / statistics.median(times) / 1e9, 1))
    for key, values in figures.items():
        print(f"{key:24s} {values}  median {statistics.median(values)}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
