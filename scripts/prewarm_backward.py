#!/usr/bin/env python
"""Compile backward_sm80 configs into the kernel cache in parallel, without a GPU (NVRTC only).

    python scripts/prewarm_backward.py --arch sm_90 --set tune --variants all --jobs 16
    python scripts/prewarm_backward.py --arch sm_80 --configs 'backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled'

Prints registers and spill bytes of each variant's dK/dV (and dQ) kernel, and a summary line.
(The family joins the generic prewarm once the kernel-family seam lands.)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.families.backward_sm80.config import BackwardKernelConfig  # noqa: E402
from cupyflash.families.backward_sm80.config_sets import get_kernel_configs  # noqa: E402

VARIANTS = {"plain": [(False, False)], "causal": [(True, False)],
            "all": [(c, d) for c in (False, True) for d in (False, True)]}


def _one(job):
    from cupyflash.families.backward_sm80.kernels import compile_variant
    from cupyflash.families.backward_sm80.render import name_expressions

    cfg, arch, causal, det = job
    t = time.perf_counter()
    try:
        module = compile_variant(cfg, arch, causal, det).module
    except Exception as exc:  # reported, not raised: one bad config must not stop the rest
        return job, None, f"{type(exc).__name__}: {str(exc)[:500]}", time.perf_counter() - t
    names = name_expressions(cfg, causal, det)
    res = {r: module.resources.get(n) for r, n in names.items() if r in ("dkdv", "dq")}
    return job, res, None, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", required=True, help="comma-separated, e.g. sm_80,sm_90")
    ap.add_argument("--set", default="", help="tune, prog, prog_all or all")
    ap.add_argument("--configs", default="", help="'|'-separated short forms")
    ap.add_argument("--variants", choices=tuple(VARIANTS), default="all")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    configs = list(get_kernel_configs(args.set)) if args.set else []
    configs += [BackwardKernelConfig.parse(s) for s in args.configs.split("|") if s.strip()]
    jobs = [(c, a, causal, det) for c in dict.fromkeys(configs) for a in args.arch.split(",")
            for causal, det in VARIANTS[args.variants]]
    t0 = time.perf_counter()
    failed = 0
    with ProcessPoolExecutor(max(1, args.jobs)) as ex:
        for (cfg, arch, causal, det), res, err, sec in ex.map(_one, jobs):
            label = f"{arch} {cfg}{' [causal]' if causal else ''}{' [deterministic]' if det else ''}"
            if err:
                failed += 1
                print(f"FAIL {label}: {err}", flush=True)
                continue
            figs = ", ".join(f"{r} {x.registers} regs {x.spill_bytes} B spill" if x else f"{r} -"
                             for r, x in res.items())
            print(f"ok   {label}: {figs} ({sec:.1f} s)", flush=True)
    print(f"prewarm_backward: {len(jobs)} variants, {failed} failed, {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
