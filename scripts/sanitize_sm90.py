#!/usr/bin/env python
"""forward_sm90 on small ragged, causal and GQA shapes, sized for compute-sanitizer.

    python scripts/sanitize_sm90.py                       # plainly first: fills the kernel cache
    compute-sanitizer --tool memcheck  python scripts/sanitize_sm90.py
    compute-sanitizer --tool racecheck python scripts/sanitize_sm90.py
    compute-sanitizer --tool synccheck python scripts/sanitize_sm90.py
    ... python scripts/sanitize_sm90.py --quick           # 4 configs x 2 shapes x 2
    ... python scripts/sanitize_sm90.py --multi-tile      # persistent CTAs taking several tiles
    ... python scripts/sanitize_sm90.py --configs "SHORT|SHORT"   # only these configs (every shape)
    ... python scripts/sanitize_sm90.py --multi-tile --configs "SHORT|SHORT"   # these, on many tiles

Every progression config of bf16 d_head 128 plus the d_head 64 and 256 defaults, on three
shapes (ragged lengths, S_q < S_k and S_q > S_k, MQA/GQA), causal off and on, LSE on. CuPy's
memory pool is off so each array is its own allocation and memcheck sees any access past it.
Loose checks (the pytest matrix is the accuracy test): output finite, relative L2 <= 2e-2 against
a float64 host reference. Exit 0 when all pass, 1 otherwise. `sanitize_check.py --family
forward_sm90` runs the same launches (imported from here).
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.config import DType  # noqa: E402
from cupyflash.families.forward_sm90.config import HopperForwardKernelConfig  # noqa: E402
from cupyflash.families.forward_sm90.config_sets import default_config, progression_configs  # noqa: E402
from sanitize_common import Launch, run_launches  # noqa: E402

SHAPES = ((1, 77, 200, 4, 1), (2, 130, 63, 4, 2), (1, 257, 257, 2, 2))  # (B, S_q, S_k, H, H_kv)
THREE_CONSUMERS = "forward_sm90(BF16, 64, 192, 128, 2): tma+ws+pingpong+overlap"  # ping-pong ring of 3
# --multi-tile: persistent configs with two Q tiles on 48 heads of 3 query blocks each (144 tiles,
# 96 causal pairs: more than 132 SMs' worth, so CTAs go on to a second tile, alternating Q tiles,
# and under causal masking from a pair's long tile to its short one; the middle block runs alone).
MULTI_TILE = ("forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2",
              "forward_sm90(BF16, 64, 192, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2")
MULTI_TILE_HEADS = (48, 8)


def reference(q, k, v, causal):
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    k = np.repeat(k, h // hkv, axis=2)
    v = np.repeat(v, h // hkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    if causal:
        hidden = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq)
        s = np.where(hidden, -np.inf, s)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    tot = e.sum(-1, keepdims=True)
    p = e / np.where(tot > 0, tot, 1)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def sanitize_configs(quick: bool = False) -> list[HopperForwardKernelConfig]:
    """Every progression config, the d_head 64 and 256 defaults and a three-consumer ping-pong
    ring; --quick: the first (cp.async loads), second (TMA) and sixth (persistent) progression
    steps and the three-consumer one."""
    configs = progression_configs() + [default_config(DType.BF16, 64), default_config(DType.BF16, 256),
                                       HopperForwardKernelConfig.parse(THREE_CONSUMERS)]
    return [configs[0], configs[1], configs[5], configs[-1]] if quick else configs


def multi_tile_launches(rng: np.random.Generator,
                        configs: list[HopperForwardKernelConfig] | None = None) -> Iterator[Launch]:
    """MULTI_TILE's configs (or `configs`), causal off and on, on 3 query blocks (the last one
    ragged) x 48 heads."""
    for cfg in configs or [HopperForwardKernelConfig.parse(text) for text in MULTI_TILE]:
        seq = 2 * cfg.B_r + 44
        shape = (1, seq, seq, *MULTI_TILE_HEADS)
        for causal in (False, True):
            yield Launch("forward_sm90", f"{cfg} {shape} causal={causal}",
                         functools.partial(_once, cfg, shape, causal, rng))


def launches(rng: np.random.Generator, quick: bool = False,
             configs: list[HopperForwardKernelConfig] | None = None) -> Iterator[Launch]:
    """One launch per (config, shape, causal); --quick: 4 configs x the first 2 shapes;
    `configs`: these instead of sanitize_configs'."""
    shapes = SHAPES[:2] if quick else SHAPES
    for cfg in configs or sanitize_configs(quick):
        for shape in shapes:
            for causal in (False, True):
                yield Launch("forward_sm90", f"{cfg} {shape} causal={causal}",
                             functools.partial(_once, cfg, shape, causal, rng))


def _once(cfg: HopperForwardKernelConfig, shape: tuple, causal: bool, rng: np.random.Generator) -> tuple[bool, str]:
    """Inputs in the config's dtype, NaN-poisoned out and lse; finite output within 2e-2 relative
    L2, lse written."""
    import cupy as cp

    from cupyflash.families.forward_sm90 import forward_sm90

    b, sq, sk, h, hkv = shape
    dtype = cfg.dtype.numpy_dtype
    host = [rng.standard_normal(s).astype(dtype)
            for s in ((b, sq, h, cfg.d_head), (b, sk, hkv, cfg.d_head), (b, sk, hkv, cfg.d_head))]
    q, k, v = (cp.asarray(x) for x in host)
    out = cp.asarray(np.full(q.shape, np.nan, dtype=np.float32).astype(dtype))
    lse = cp.full((b, h, sq), np.nan, dtype=cp.float32)
    forward_sm90(cfg, q, k, v, out=out, causal=causal, return_lse=True, lse=lse)
    got = cp.asnumpy(out).astype(np.float64)
    ref = reference(*(x.astype(np.float64) for x in host), causal)
    rel = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    ok = bool(np.isfinite(got).all() and rel <= 2e-2 and not np.isnan(cp.asnumpy(lse)).any())
    return ok, f"rel_l2={rel:.2e}"


def main(argv: list[str] | None = None) -> int:
    """Thin wrapper: the same launches run by `sanitize_check.py --family forward_sm90`."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 configs x the first 2 shapes")
    ap.add_argument("--multi-tile", action="store_true", help="persistent CTAs taking several tiles (MULTI_TILE)")
    ap.add_argument("--configs", default="", help="only these short forms, '|'-separated")
    args = ap.parse_args(argv)
    try:
        configs = [HopperForwardKernelConfig.parse(t.strip()) for t in args.configs.split("|") if t.strip()] or None
    except ValueError as exc:
        ap.error(f"--configs: {exc}")
    from cupyflash.device import has_gpu

    if not has_gpu():
        print("sanitize_sm90: no CUDA GPU found", file=sys.stderr)
        return 2
    import cupy as cp

    cp.cuda.set_allocator(None)  # no pool: memcheck sees every allocation's exact bounds
    rng = np.random.default_rng(0)
    todo = multi_tile_launches(rng, configs) if args.multi_tile else launches(rng, args.quick, configs)
    done = run_launches(todo, lambda line: print(line, flush=True))
    print(f"sanitize_sm90: {len(done.failures)} failure(s) in {done.runs} launches")
    return 1 if done.failures else 0

if __name__ == "__main__":
    sys.exit(main())
