#!/usr/bin/env python
"""backward_sm90 launch knobs beside SDPA cuDNN, and where one call's time goes.

    python scripts/bench_sm90_backward_knobs.py [--dtypes bf16,fp16] [--seqs 1k,4k,16k] [--rounds 15]
                                                [--json knobs.json] [--winner-file winner.txt]

Grid of bench.py --mode backward (batch*seq = 16384, 16 heads, d_head 128, S_q = S_k). Per point:
SDPA cuDNN (torch.autograd.grad of its output) and cupyflash.backward with each config of
KNOB_SETS (the dq_tma+dq_mid tile of d_head 128 with two stages and no launch knob, with lpt / pdl /
pdl+dq_early / lpt+pdl+dq_early, and with three stages, plain and with all three knobs; or the
sets given as --knob-sets), timed in interleaved
rounds (each round times every implementation once, in a rotated order, each sample behind a
~1 ms GPU spin so only GPU time is measured); the median of the rounds is reported. Each config's gradients are checked once against the default's (relative
L2 <= 1e-2; tests/test_gpu_backward_sm90.py holds the float64 checks). Then the first config's
three kernels are timed one by one (CUDA events between the launches), and the last config's:
the preprocess, dK/dV and convert shares of one call.

Prints a table of TFLOP/s (backward FLOPs = 2.5 x forward, half when causal) and ratios to
cuDNN, and writes the config with the best geometric-mean ratio to --winner-file.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_backward as bb  # noqa: E402

# (n_stages, the launch knobs on) of the d_head 128 dq_tma+dq_mid tile; the first is the reference
# the others' gradients are checked against and whose kernels are timed one by one
KNOB_SETS = ((2, ()), (2, ("lpt",)), (2, ("pdl",)), (2, ("pdl", "dq_early")), (2, ("lpt", "pdl", "dq_early")),
             (3, ()), (3, ("lpt", "pdl", "dq_early")))
LAUNCH_KNOBS = ("lpt", "pdl", "dq_early", "rotate", "persistent", "dynamic", "nomask")  # (nomask: a schedule knob, sweepable here too)


def parse_knob_sets(text: str) -> tuple:
    """'2:pdl+dq_early,3:' -> ((2, ('pdl', 'dq_early')), (3, ()))."""
    out = []
    for item in text.split(","):
        stages, _, knobs = item.strip().partition(":")
        names = tuple(k for k in knobs.split("+") if k)
        bad = [k for k in names if k not in LAUNCH_KNOBS]
        if bad:
            raise SystemExit(f"--knob-sets: unknown knob(s) {bad}; expected some of {LAUNCH_KNOBS}")
        out.append((int(stages), names))
    return tuple(out)


def configs(dtype, knob_sets=None):
    from cupyflash.families.backward_sm90.config_sets import default_config

    tile = default_config(dtype, 128).replace(dq_tma=True, dq_mid=True, **{k: False for k in LAUNCH_KNOBS})
    return [tile.replace(n_stages=st, **{k: True for k in ks}) for st, ks in (knob_sets or KNOB_SETS)]


def timed_rounds(torch, fns: dict, rounds: int) -> dict:
    """Median ms of each fn over `rounds` interleaved rounds (rotated order, spin before each)."""
    names = list(fns)
    samples = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(bb.SPIN_CYCLES)
            start.record()
            fns[n]()
            end.record()
            end.synchronize()
            samples[n].append(start.elapsed_time(end))
    return {n: statistics.median(v) for n, v in samples.items()}


def kernel_breakdown(torch, fn, reps: int) -> dict:
    """Median ms of each kernel of fn()'s backward_sm90 launch sequence (events between launches)."""
    import cupyflash.families.backward_sm90.launch as launch

    original = launch.launch_backward_sm90
    times: dict[str, list] = {}

    def timed(plan, sm80_params, hopper_params, stream_ptr):
        kernels = launch.get_kernels(plan.cfg, plan.device, plan.causal, plan.deterministic)
        for step in launch.launch_sequence(plan):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            kernels[step.role].launch(step.grid, step.block, step.smem, stream_ptr,
                                      hopper_params if step.hopper_params else sm80_params)
            end.record()
            times.setdefault(step.role, []).append((start, end))

    launch.launch_backward_sm90 = timed
    try:
        for _ in range(reps):
            torch.cuda._sleep(bb.SPIN_CYCLES)
            fn()
        torch.cuda.synchronize()
    finally:
        launch.launch_backward_sm90 = original
    return {role: statistics.median(s.elapsed_time(e) for s, e in pairs) for role, pairs in times.items()}


def rel_l2(torch, a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def point(torch, dtype, seq: int, causal: bool, rounds: int, knob_sets=None) -> dict:
    import cupyflash
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch = bb.TOKENS // seq
    tdt = {"BF16": torch.bfloat16, "FP16": torch.float16}[dtype.name]
    gen = torch.Generator(device="cuda").manual_seed(seq)
    q, k, v, do = (torch.randn(batch, seq, bb.HEADS, 128, device="cuda", dtype=tdt, generator=gen) for _ in range(4))
    out, lse = cupyflash.forward(None, q, k, v, causal=causal, return_lse=True)
    fns, grads = {}, {}
    for cfg in configs(dtype, knob_sets):
        g = tuple(torch.full_like(x, math.nan) for x in (q, k, v))
        grads[str(cfg)] = g
        fns[str(cfg)] = (lambda cfg=cfg, g=g: cupyflash.backward(do, q, k, v, out, lse, causal=causal, cfg=cfg,
                                                                  dq=g[0], dk=g[1], dv=g[2]))
        fns[str(cfg)]()
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    dot = do.transpose(1, 2)
    fns["sdpa_cudnn"] = lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)
    torch.cuda.synchronize()
    names = [str(c) for c in configs(dtype, knob_sets)]
    ref = grads[names[0]]
    checks = {n: max(rel_l2(torch, a, b) for a, b in zip(grads[n], ref)) for n in names[1:]}
    for _ in range(3):  # warm-up
        for fn in fns.values():
            fn()
    ms = timed_rounds(torch, fns, rounds)
    flops = bb.backward_flops(batch, bb.HEADS, seq, 128, causal)
    parts = kernel_breakdown(torch, fns[names[0]], rounds)
    last_parts = kernel_breakdown(torch, fns[names[-1]], rounds) if len(names) > 1 else parts
    rec = {"dtype": dtype.name.lower(), "seq": seq, "causal": causal, "batch": batch, "flops": flops,
           "ms": ms, "tflops": {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items()},
           "ratio_cudnn": {n: ms["sdpa_cudnn"] / ms[n] for n in names}, "check_vs_default": checks,
           "default_kernels_ms": parts, "last_kernels_ms": last_parts}
    del out, lse, o, grads
    torch.cuda.empty_cache()
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--seqs", default="1k,4k,16k")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default="knobs.json")
    ap.add_argument("--winner-file", default="")
    ap.add_argument("--knob-sets", default="",
                    help="stages:knob+knob,... (e.g. '2:pdl+dq_early,3:pdl+dq_early'); default: KNOB_SETS")
    args = ap.parse_args(argv)
    import torch

    from cupyflash.benchmarking import parse_dtypes, parse_ints

    knob_sets = parse_knob_sets(args.knob_sets) if args.knob_sets else None
    records = []
    for dtype in parse_dtypes(args.dtypes):
        for seq in parse_ints(args.seqs):
            for causal in (False, True):
                rec = point(torch, dtype, seq, causal, args.rounds, knob_sets)
                records.append(rec)
                print(json.dumps(rec), flush=True)
    Path(args.json).write_text(json.dumps(records, indent=1))
    names = list(records[0]["ratio_cudnn"])
    short = {n: n.split(", ")[-1].partition(": ")[0].rstrip(")") + "st " + n.partition(": ")[2] for n in names}
    print("\ndtype causal S    cuDNN | " + " | ".join(short[n].replace("dq_tma+dq_mid", "dflt") for n in names)
          + " | pre/dkdv/conv us (first; last)")
    for r in records:
        own = list(r["ratio_cudnn"])  # this record's dtype's config names, in the same order as `names`
        cells = " | ".join(f"{r['tflops'][n]:5.0f} {r['ratio_cudnn'][n]:.3f}x" for n in own)
        parts = ["/".join(f"{r[key].get(k, 0) * 1e3:.0f}" for k in ("preprocess", "dkdv", "convert"))
                 for key in ("default_kernels_ms", "last_kernels_ms") if key in r]
        print(f"{r['dtype']:<5} {int(r['causal'])}      {r['seq']:<5} {r['tflops']['sdpa_cudnn']:5.0f} | {cells} | "
              f"{parts[0]} of {r['ms'][own[0]] * 1e3:.0f}; {parts[-1]} of {r['ms'][own[-1]] * 1e3:.0f}")
    bad = [(r["dtype"], r["seq"], r["causal"], n, x)
           for r in records for n, x in r["check_vs_default"].items() if x > 1e-2]
    print("checks vs default:", "all <= 1e-2" if not bad else bad)
    # configs by position: each dtype's records name their own dtype's configs in the same order
    ratios = [[list(r["ratio_cudnn"].values())[i] for r in records] for i in range(len(names))]
    geo = {n: math.exp(statistics.mean(math.log(x) for x in ratios[i])) for i, n in enumerate(names)}
    for i, n in enumerate(names):
        print(f"geomean x cuDNN {geo[n]:.3f}  worst {min(ratios[i]):.3f}  {short[n]}")
    flagged = {short[b[3]] if b[3] in short else b[3].replace("FP16", "BF16") for b in bad}
    winner = max((n for n in names if n != "sdpa_cudnn" and short[n] not in flagged and n not in flagged), key=geo.get)
    print("WINNER:", winner)
    if args.winner_file:
        Path(args.winner_file).write_text(winner)
    return 0


if __name__ == "__main__":
    sys.exit(main())
