#!/usr/bin/env python
"""forward_sm90 configs at the power cap: what a config's speed is made of (NOTES.md items 282-283).

    python scripts/probe_sm90_power.py clocks --seqs 4k,8k,16k "CFG" "CFG" ...
    python scripts/probe_sm90_power.py tile-cost "CFG" "CFG" ...

`clocks`: bench.py's grid (batch*seq = 16384, heads*d_head = 2048, non-causal, the configs' dtype
and d_head), the configs checked against the first one, then (after a 1 s warm-up) each run
sustained for 1 s while
nvidia-smi samples the SM clock and board power (the second half of the window is averaged),
then timed in 6 interleaved rounds (median of round medians); --cudnn adds SDPA's cuDNN backend
as a peer on the same inputs. A config that idles less draws
more power and, at the cap, clocks lower: the printed MHz and W say whether a speed difference
is the schedule or the cap.

`tile-cost`: S_q = 4224 (a whole number of 128- and 192-row tiles), heads chosen so the tiles fill
at least 4 whole waves of the device's SMs, S_k from 1k to 8k; the time per wave is fitted as
key blocks x b + o. b is one key block's time, o what a tile costs beyond its blocks (loads
before the first S, the pipeline's fill and drain, the epilogue, the CTA switch).

Needs a Hopper GPU with CuPy and PyTorch; nvidia-smi for `clocks`.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.benchmarking import parse_ints  # noqa: E402

ROUNDS = 6
TILE_COST_SQ = 4224  # 22 x 192 = 33 x 128
TILE_COST_SK = (1024, 2048, 4096, 8192)
SMI_QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ys against xs (at least two distinct xs)."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("xs: need at least two distinct points, as many as ys")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def parse_smi_line(line: str) -> tuple[float, float] | None:
    """(MHz, W) of one `clocks.sm,power.draw` CSV line, or None for anything else."""
    try:
        mhz, watts = (float(x) for x in line.strip().split(","))
    except ValueError:
        return None
    return mhz, watts


def waves_heads(tiles_per_head: int, sms: int, min_waves: int = 4) -> tuple[int, int]:
    """(heads, waves): the fewest heads whose tiles fill at least `min_waves` whole waves."""
    heads = next(h for h in range(1, 100 * sms) if (tiles_per_head * h) % sms == 0 and tiles_per_head * h >= min_waves * sms)
    return heads, tiles_per_head * heads // sms


class ClockSampler:
    """nvidia-smi in the background; mean (MHz, W) over a time window."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self.proc = subprocess.Popen(SMI_QUERY, stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parsed = parse_smi_line(line)
            if parsed:
                self.samples.append((time.time(), *parsed))

    def mean(self, t0: float, t1: float) -> tuple[float, float]:
        win = [(m, w) for t, m, w in self.samples if t0 <= t <= t1]
        if not win:
            return float("nan"), float("nan")
        return statistics.fmean(m for m, _ in win), statistics.fmean(w for _, w in win)

    def close(self) -> None:
        self.proc.terminate()


def _torch_dtype(torch, cfg):
    return {"BF16": torch.bfloat16, "FP16": torch.float16}[cfg.dtype.name]


def _timed(torch, runs: dict, iters: int = 20) -> dict:
    from bench_impls import time_events  # scripts/: bench.py's CUDA-event timing

    samples = {c: [] for c in runs}
    cfgs = list(runs)
    for r in range(ROUNDS):
        for c in cfgs[r % len(cfgs):] + cfgs[:r % len(cfgs)]:
            samples[c].append(time_events(torch, runs[c], 1, 3, iters, 0.3).median_ms)
    return {c: statistics.median(v) for c, v in samples.items()}


def clocks(cfgs: list, seqs: list[int], cudnn: bool = False) -> None:
    import contextlib

    import torch
    from cupyflash.families.forward_sm90 import forward_sm90

    context = contextlib.nullcontext()
    if cudnn:  # SDPA restricted to cuDNN, entered once (an entry costs microseconds)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        context = sdpa_kernel([SDPBackend.CUDNN_ATTENTION])
    with context:
        _clocks(torch, forward_sm90, cfgs, seqs, cudnn)


def _clocks(torch, forward_sm90, cfgs: list, seqs: list[int], cudnn: bool) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sampler = ClockSampler()
    time.sleep(1.0)
    dtype = _torch_dtype(torch, cfgs[0])
    d = cfgs[0].d_head
    for seq in seqs:
        batch, heads = 16384 // seq, 2048 // d
        q, k, v = (torch.randn(batch, seq, heads, d, device="cuda", dtype=dtype) for _ in range(3))
        out = torch.empty_like(q)
        ref = forward_sm90(cfgs[0], q, k, v).float()
        for c in cfgs[1:]:
            err = ((forward_sm90(c, q, k, v).float() - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                raise SystemExit(f"{c}: relative L2 {err:.2e} against {cfgs[0]}")
        runs = {c: (lambda _i, c=c: forward_sm90(c, q, k, v, out=out)) for c in cfgs}
        if cudnn:
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            runs["sdpa_cudnn"] = lambda _i: sdpa(qt, kt, vt)
            err = ((runs["sdpa_cudnn"](0).transpose(1, 2).float() - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                raise SystemExit(f"sdpa_cudnn: relative L2 {err:.2e} against {cfgs[0]}")
        names = list(runs)
        power = {}
        for c in [names[0]] + names:  # the first window brings the GPU to its cap; not reported
            t0 = time.time()
            while time.time() - t0 < 1.0:
                for _ in range(20):
                    runs[c](0)
                torch.cuda.synchronize()
            power[c] = sampler.mean(t0 + 0.5, time.time())
        ms = _timed(torch, runs)
        flops = 4 * batch * seq * seq * heads * d
        for c in names:
            mhz, watts = power[c]
            print(f"S={seq:5d} {flops / ms[c] / 1e9:6.1f} TFLOP/s x{ms[cfgs[0]] / ms[c]:.3f}  {mhz:6.0f} MHz "
                  f"{watts:5.0f} W  {c}", flush=True)
    sampler.close()


def tile_cost(cfgs: list) -> None:
    import torch
    from cupyflash.families.forward_sm90 import forward_sm90

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for c in cfgs:
        heads, waves = waves_heads(-(-TILE_COST_SQ // c.B_r), sms)
        runs = {}
        for sk in TILE_COST_SK:
            q = torch.randn(1, TILE_COST_SQ, heads, c.d_head, device="cuda", dtype=_torch_dtype(torch, c))
            k, v = (torch.randn(1, sk, heads, c.d_head, device="cuda", dtype=q.dtype) for _ in range(2))
            out = torch.empty_like(q)
            runs[sk] = lambda _i, q=q, k=k, v=v, out=out: forward_sm90(c, q, k, v, out=out)
        ms = _timed(torch, runs, iters=10)
        xs = [sk / c.B_c for sk in TILE_COST_SK]
        ys = [ms[sk] / waves * 1000 for sk in TILE_COST_SK]
        b, o = fit_line(xs, ys)
        print(f"{b:.3f} us per key block, {o:.2f} us per tile ({o / b:.2f} blocks; {waves} waves of {heads} heads); "
              f"residuals {' '.join(f'{y - (o + b * x):+.2f}' for x, y in zip(xs, ys))}  {c}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("clocks", "tile-cost"))
    ap.add_argument("configs", nargs="+", help="forward_sm90 short forms (one dtype and d_head for `clocks`)")
    ap.add_argument("--seqs", default="4k,8k,16k", help="clocks: sequence lengths ('k' = 1024)")
    ap.add_argument("--cudnn", action="store_true", help="clocks: SDPA's cuDNN backend too, as a peer")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cupyflash.families.forward_sm90.config import HopperForwardKernelConfig

    try:
        cfgs = [HopperForwardKernelConfig.parse(t) for t in args.configs]
    except ValueError as exc:
        ap.error(f"configs: {exc}")
    if args.mode == "clocks":
        if len({(c.dtype, c.d_head) for c in cfgs}) > 1:
            ap.error("configs: `clocks` compares configs of one dtype and d_head")
        clocks(cfgs, parse_ints(args.seqs), args.cudnn)
    else:
        tile_cost(cfgs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
