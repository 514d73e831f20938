"""Kernel-level times of `cupyflash.backward` on the GPU: per call, how long the preprocess, the
dK/dV kernel and the dQ convert run (torch.profiler's CUDA activity), and the call period (start
of one dK/dV kernel to the next, back-to-back calls). The dK/dV kernel alone against the whole
call shows what the row kernels around it cost; the dK/dV kernel over S (the same 2048 tiles of
a persistent grid at batch * S = 16k, more query blocks per tile as S grows) shows what a tile
boundary costs (NOTES.md items 152-153).

    python scripts/backward_kernel_times.py [--d-heads 128] [--dtypes bf16] [--seqs 1k,2k,4k,16k]
                                            [--causal both] [--sustain 0.5] [--calls 6] [--json out.json]

Grid as bench.py --mode backward: batch * S = 16384 tokens, 16 heads, S_q = S_k = S, cfg=None.
Each point first runs back to back for --sustain seconds (the GPU at its power cap), then
profiles --calls calls.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from bench_backward import HEADS, TOKENS, backward_flops, sustain_load  # scripts/: the backward bench's grid
from cupyflash.benchmarking import parse_ints

# Kernel name fragments -> the role reported (the first that matches).
ROLES = (("dkdv", "dkdv"), ("preprocess", "preprocess"), ("convert", "convert"))


def role_of(name: str) -> str:
    for fragment, role in ROLES:
        if fragment in name:
            return role
    return "other"


@dataclass
class PointTimes:
    """One grid point: mean kernel durations (us), the median call period (us) and TFLOP/s."""

    dtype: str
    d_head: int
    seq: int
    causal: bool
    period_us: float
    kernels_us: dict[str, float]
    tflops: float
    dkdv_tflops: float


def summarize(events: Iterable[tuple[str, float, float]], flops: float) -> tuple[float, dict[str, float], float, float]:
    """(period, mean duration per role, TFLOP/s of the period, of the dK/dV kernel alone) from
    CUDA kernel events (name, start us, end us) of back-to-back calls."""
    by_role: dict[str, list[tuple[float, float]]] = {}
    for name, start, end in sorted(events, key=lambda e: e[1]):
        if end > start:
            by_role.setdefault(role_of(name), []).append((start, end))
    dkdv = by_role.get("dkdv", [])
    if len(dkdv) < 2:
        raise ValueError("need at least two dK/dV kernels to measure a call period")
    gaps = sorted(b[0] - a[0] for a, b in zip(dkdv, dkdv[1:]))
    period = gaps[len(gaps) // 2]
    means = {role: sum(e - s for s, e in spans) / len(spans) for role, spans in by_role.items()}
    return period, means, flops / period / 1e6, flops / means["dkdv"] / 1e6


def measure(torch, cupyflash, dtype: str, d_head: int, seq: int, causal: bool, sustain: float, calls: int) -> PointTimes:
    from torch.profiler import ProfilerActivity, profile

    batch = TOKENS // seq
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    q, k, v, dout = (torch.randn(batch, seq, HEADS, d_head, device="cuda", dtype=tdtype) for _ in range(4))
    out, lse = cupyflash.forward(None, q, k, v, causal=causal, return_lse=True)

    def run():
        cupyflash.backward(dout, q, k, v, out, lse, causal=causal)

    run()
    sustain_load(run, sustain, torch.cuda.synchronize)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
              if e.device_type.name == "CUDA"]
    flops = backward_flops(batch, HEADS, seq, d_head, causal)
    period, means, tflops, dkdv_tflops = summarize(events, flops)
    return PointTimes(dtype, d_head, seq, causal, period, means, tflops, dkdv_tflops)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-heads", default="128")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--seqs", default="1k,2k,4k,16k")
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--sustain", type=float, default=0.5)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.calls < 3:
        ap.error("--calls: at least 3 (the period is a median of the gaps between calls)")
    try:
        import torch
    except ImportError:
        print("backward_kernel_times: needs PyTorch (torch.profiler); nothing measured")
        return 0
    if not torch.cuda.is_available():
        print("backward_kernel_times: no CUDA device; nothing measured")
        return 0
    import cupyflash

    masks = {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]
    rows = []
    for dtype in args.dtypes.split(","):
        for d_head in parse_ints(args.d_heads, "--d-heads"):
            for causal in masks:
                for seq in parse_ints(args.seqs, "--seqs"):
                    r = measure(torch, cupyflash, dtype, d_head, seq, causal, args.sustain, args.calls)
                    rows.append(r)
                    kernels = " ".join(f"{k}={v:.0f}" for k, v in sorted(r.kernels_us.items()))
                    print(f"{dtype} d{d_head} {'causal' if causal else 'non-causal'} S={seq}: period {r.period_us:.0f} us "
                          f"({r.tflops:.0f} TFLOP/s), kernels (us) {kernels}, dK/dV alone {r.dkdv_tflops:.0f} TFLOP/s",
                          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "points": [asdict(r) for r in rows]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
