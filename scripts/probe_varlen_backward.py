#!/usr/bin/env python
"""Where backward_varlen's time goes against the dense backward and FA3's varlen backward, d_head 128.

    python scripts/probe_varlen_backward.py [--cases ragged,sorted,eq4k,eq8k] [--dtypes bf16,fp16]
        [--causal both|yes|no] [--cfgs "SHORT|SHORT"] [--rounds 3] [--sustain 0.4] [--json PATH]

Cases: `ragged` is the varlen bench's batch (bench.py --mode varlen: lengths drawn from 1..8192
until 32768 tokens, seed 0), `sorted` the same lengths longest first (the claim order follows the
packing), `eqNk` equal lengths of N k tokens (32768 in all). Runs, each on the same packed tensors:
backward_varlen with cfg=None (`varlen`), with each --cfgs config (its dtype taken from the point),
and on equal lengths the dense backward with cfg=None (`dense`) and with backward_varlen's own pick
(`dense_with_varlen_cfg`: the varlen kernel's knobs on the dense instance, which separates the
knobs from the varlen code), and FA3's varlen backward (flash_attn3_jax, jitted) when installed.
Every run is timed alike: `--sustain` seconds of back-to-back calls, then 4 samples of 8 calls by
host clock (JAX gives no CUDA events); the runs alternate over --rounds rounds (order reversed
every other round), the median reported. Each cupyflash run's gradients are first checked against
the deterministic backward_varlen (relative L2 < 1e-2). TFLOP/s = 2.5 x the forward's FLOPs.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from typing import Any, Callable

import numpy as np

from bench_mode_varlen import cu_seqlens, draw_lengths, varlen_flops

HEADS, D_HEAD, TOKENS = 16, 128, 32768


def lengths_of(case: str) -> list[int]:
    ragged = draw_lengths(TOKENS, 8192, 0)
    if case == "ragged":
        return ragged
    if case == "sorted":
        return sorted(ragged, reverse=True)
    if case.startswith("eq") and case.endswith("k"):
        n = int(case[2:-1]) * 1024
        return [n] * (TOKENS // n)
    raise ValueError(f"--cases: unknown case {case!r} (ragged, sorted, eq<N>k)")


def host_time(run: Callable[[], Any], block: Callable[[Any], Any], sustain: float) -> float:
    """Seconds per call: after `sustain` s of load, the median of 4 samples of 8 calls."""
    out = run()
    block(out)
    end = time.perf_counter() + sustain
    while time.perf_counter() < end:
        for _ in range(4):
            out = run()
        block(out)
    samples = []
    for _ in range(4):
        t0 = time.perf_counter()
        for _ in range(8):
            out = run()
        block(out)
        samples.append((time.perf_counter() - t0) / 8)
    return float(np.median(samples))


def point(torch: Any, case: str, dtype: str, causal: bool, cfgs: list[str]) -> dict[str, tuple]:
    """The runs of one (case, dtype, mask): name -> (call, block)."""
    import cupyflash
    from cupyflash.backward_api import resolve_backward_config
    from cupyflash.config import DType

    lengths = lengths_of(case)
    total, mx, scale = sum(lengths), max(lengths), 1 / math.sqrt(D_HEAD)
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn((total, HEADS, D_HEAD), generator=gen, device="cuda").to(tdt) for _ in range(4))
    cu = torch.tensor(cu_seqlens(lengths), dtype=torch.int32, device="cuda")
    out, lse = cupyflash.forward_varlen(q, k, v, cu, cu, mx, mx, causal=causal, softmax_scale=scale, return_lse=True)
    sync = lambda _x: torch.cuda.synchronize()  # noqa: E731

    def varlen(cfg: Any = None, deterministic: bool = False) -> Callable[[], Any]:
        return lambda: cupyflash.backward_varlen(do, q, k, v, out, lse, cu, cu, mx, mx, causal=causal,
                                                 softmax_scale=scale, cfg=cfg, deterministic=deterministic)

    runs: dict[str, tuple] = {"varlen": (varlen(), sync)}
    for short in cfgs:
        cfg = resolve_backward_config(short).replace(dtype=DType.parse(dtype), d_head=D_HEAD)
        runs[f"varlen {cfg.short_form()}"] = (varlen(cfg), sync)
    if len(set(lengths)) == 1:
        from cupyflash.families.backward_sm90.config_sets import varlen_default_config

        b, s = len(lengths), lengths[0]
        q4, k4, v4, do4 = (x.view(b, s, HEADS, D_HEAD) for x in (q, k, v, do))
        o4, l4 = cupyflash.forward(None, q4, k4, v4, causal=causal, softmax_scale=scale, return_lse=True)

        def dense(cfg: Any = None) -> Callable[[], Any]:
            return lambda: cupyflash.backward(do4, q4, k4, v4, o4, l4, causal=causal, softmax_scale=scale, cfg=cfg)

        runs["dense"] = (dense(), sync)
        runs["dense_with_varlen_cfg"] = (dense(varlen_default_config(DType.parse(dtype), D_HEAD, causal, mx)), sync)
    reference = varlen(deterministic=True)()
    for name, (run, _) in runs.items():
        got = run()
        err = max(float((a.reshape(-1).float() - b.reshape(-1).float()).norm() / b.float().norm())
                  for a, b in zip(got, reference))
        if not err < 1e-2:
            raise AssertionError(f"{case} {dtype} causal={causal} {name}: relative L2 {err:.1e} against the "
                                 "deterministic gradients")
    try:
        import jax
        from flash_attn3_jax.varlen_bwd import flash_mha_varlen_bwd
        from flash_attn3_jax.varlen_fwd import flash_mha_varlen_fwd
    except Exception as exc:  # FA3 is optional
        print(f"  fa3 skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return runs
    torch.cuda.synchronize()
    jq, jk, jv, jdo, jcu = (jax.dlpack.from_dlpack(x) for x in (q, k, v, do, cu))
    config = dict(max_seqlen_q=mx, max_seqlen_k=mx, softmax_scale=scale, is_causal=causal)
    jo, jlse = jax.jit(lambda *a: flash_mha_varlen_fwd(*a, None, **config))(jq, jk, jv, jcu, jcu)
    bwd = jax.jit(functools.partial(flash_mha_varlen_bwd, **config))
    runs["fa3_varlen"] = (lambda: bwd(jdo, jq, jk, jv, jo, jlse, jcu, jcu),
                          lambda grads: [g.block_until_ready() for g in grads])
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="ragged,sorted,eq4k,eq8k")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--cfgs", default="", help="'|'-separated backward_sm90 short forms run beside cfg=None")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sustain", type=float, default=0.4)
    p.add_argument("--json", default="probe_varlen_backward.json")
    args = p.parse_args(argv)
    import torch

    masks = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    cfgs = [s for s in args.cfgs.split("|") if s.strip()]
    records = []
    for dtype in args.dtypes.split(","):
        for causal in masks:
            for case in args.cases.split(","):
                runs = point(torch, case, dtype, causal, cfgs)
                lengths = lengths_of(case)
                flops = 2.5 * varlen_flops(lengths, lengths, HEADS, D_HEAD, causal)
                times: dict[str, list[float]] = {name: [] for name in runs}
                for r in range(args.rounds):
                    for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                        times[name].append(host_time(*runs[name], args.sustain))
                print(f"{dtype} causal={int(causal)} {case}", flush=True)
                for name, ts in times.items():
                    tflops = [flops / t / 1e12 for t in ts]
                    records.append(dict(dtype=dtype, causal=causal, case=case, run=name,
                                        tflops=float(np.median(tflops)), rounds=tflops))
                    print(f"   {name:28s} {np.median(tflops):7.1f} TFLOP/s  rounds "
                          + " ".join(f"{x:.1f}" for x in tflops), flush=True)
    with open(args.json, "w") as f:
        json.dump({"cases": {c: lengths_of(c) for c in args.cases.split(",")}, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
