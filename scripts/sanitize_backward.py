#!/usr/bin/env python
"""backward() on small ragged, causal and GQA shapes, sized for compute-sanitizer.

    python scripts/sanitize_backward.py                       # once plainly: fills the kernel cache
    compute-sanitizer --tool memcheck  python scripts/sanitize_backward.py
    compute-sanitizer --tool racecheck python scripts/sanitize_backward.py
    compute-sanitizer --tool memcheck  python scripts/sanitize_backward.py --varlen   # backward_varlen

Default configs for d_head 64 and 128 (bf16) plus --configs, shapes with tails, S_q != S_k,
GQA and MQA, causal off and on, atomic and deterministic dQ. CuPy's memory pool is off, so every
array is its own exact-size cudaMalloc and memcheck sees any overrun. Loose check (the accuracy
test is tests/test_gpu_backward.py): gradients finite and within 3e-2 relative L2 of a float64
host reference; dq/dk/dv are NaN-poisoned before the call. Exit 0 when all pass, 1 when any
fails, 2 without a GPU. `sanitize_check.py --family backward_sm80` runs the same launches.
--varlen runs backward_varlen instead, on packed ragged batches (VARLEN_LENS: empty sequences of
each kind, tile tails, S_q != S_k per sequence) with exact-size packed arrays.
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
from cupyflash.families.forward_sm80.config_sets import default_config as forward_default  # noqa: E402
from cupyflash.backward_validation import resolve_backward_config  # noqa: E402
from cupyflash.families.backward_sm80.config import BackwardKernelConfig  # noqa: E402
from cupyflash.families.backward_sm80.config_sets import default_config  # noqa: E402
from sanitize_common import Launch, run_launches  # noqa: E402

SHAPES = ((1, 77, 200, 4, 1),   # MQA, S_q < S_k
          (1, 130, 63, 4, 2),   # GQA, S_q > S_k: causal rows 0..66 see no key
          (1, 129, 129, 2, 2))  # one row past a block
# --many-tiles: 9 key blocks x 16 kv heads = 144 tiles of 128 keys, more than an H100's 132 SMs,
# so persistent backward_sm90 CTAs walk two tiles
MANY_TILES = (1, 130, 1100, 32, 16)
REL_L2_BOUND = 3e-2
# backward_varlen: (lens_q, lens_k, H, H_kv) of packed ragged batches
VARLEN_LENS = (([77, 0, 130, 1, 64], [200, 9, 63, 0, 64], 4, 2),
               ([129, 3], [129, 300], 2, 1))


def reference(q, k, v, do, causal: bool):
    """float64 (dq, dk, dv) on the host; GQA sums dk/dv over each group."""
    batch, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    hidden = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq)
    scale = 1 / np.sqrt(d)
    for b in range(batch):
        for hh in range(h):
            kk, vv = k[b, :, hh // g], v[b, :, hh // g]
            s = q[b, :, hh] @ kk.T * scale
            if causal:
                s = np.where(hidden, -np.inf, s)
            m = s.max(axis=1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0)
            e = np.exp(s - m)
            t = e.sum(axis=1, keepdims=True)
            p = e / np.where(t > 0, t, 1)
            o = p @ vv
            dp = do[b, :, hh] @ vv.T
            ds = p * (dp - (do[b, :, hh] * o).sum(axis=1, keepdims=True))
            dq[b, :, hh] = scale * ds @ kk
            dk[b, :, hh // g] += scale * ds.T @ q[b, :, hh]
            dv[b, :, hh // g] += p.T @ do[b, :, hh]
    return dq, dk, dv


def pick_configs(d_heads: str, extra: str = "") -> list[BackwardKernelConfig]:
    """The bf16 default config of each head dim in `d_heads` ('64,128'), then the '|'-separated
    short forms in `extra`."""
    configs = [default_config(DType.BF16, int(d)) for d in d_heads.split(",") if d.strip()]
    # either backward family's short forms (backward_sm90 ones run on sm_90 only)
    return configs + [resolve_backward_config(s) for s in extra.split("|") if s.strip()]


def launches(configs: list[BackwardKernelConfig], shapes: tuple, rng: np.random.Generator) -> Iterator[Launch]:
    """One launch per (config, shape, causal, deterministic): a forward for out/lse, then the
    backward checked against the float64 host reference."""
    for cfg in configs:
        for shape in shapes:
            for causal in (False, True):
                for det in (False, True):
                    batch, sq, sk, h, hk = shape
                    label = f"{cfg} B={batch} S_q={sq} S_k={sk} H={h}/{hk} causal={int(causal)} det={int(det)}"
                    yield Launch(cfg.FAMILY, label, functools.partial(_once, cfg, shape, causal, det, rng))


def varlen_launches(configs: list[BackwardKernelConfig], rng: np.random.Generator) -> Iterator[Launch]:
    """One backward_varlen launch per (config, ragged batch, causal, deterministic)."""
    for cfg in configs:  # either family (backward_sm90 configs on sm_90 only)
        for lens in VARLEN_LENS:
            for causal in (False, True):
                for det in (False, True):
                    label = f"{cfg} varlen q={lens[0]} k={lens[1]} H={lens[2]}/{lens[3]} causal={int(causal)} det={int(det)}"
                    yield Launch(cfg.FAMILY, label, functools.partial(_once_varlen, cfg, lens, causal, det, rng))


def _once_varlen(cfg: BackwardKernelConfig, lens: tuple, causal: bool, det: bool,
                 rng: np.random.Generator) -> tuple[bool, str]:
    import cupy as cp

    import cupyflash

    lens_q, lens_k, h, hk = lens
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    npd = cfg.dtype.numpy_dtype
    hq, hdo = (rng.standard_normal((int(cu_q[-1]), h, cfg.d_head), dtype=np.float32).astype(npd) for _ in range(2))
    hkk, hv = (rng.standard_normal((int(cu_k[-1]), hk, cfg.d_head), dtype=np.float32).astype(npd) for _ in range(2))
    q, k, v, do = (cp.asarray(x) for x in (hq, hkk, hv, hdo))
    dcu_q, dcu_k = cp.asarray(cu_q), cp.asarray(cu_k)
    max_q, max_k = max(lens_q), max(lens_k)
    out, lse = cupyflash.forward_varlen(q, k, v, dcu_q, dcu_k, max_q, max_k, causal=causal, return_lse=True,
                                        cfg=forward_default(cfg.dtype, cfg.d_head))
    grads = tuple(cp.asarray(np.full(x.shape, np.nan, dtype=npd)) for x in (hq, hkk, hv))  # poisoned
    cupyflash.backward_varlen(do, q, k, v, out, lse, dcu_q, dcu_k, max_q, max_k, causal=causal, deterministic=det,
                              cfg=cfg, dq=grads[0], dk=grads[1], dv=grads[2])
    cp.cuda.runtime.deviceSynchronize()
    got = [cp.asnumpy(g).astype(np.float64) for g in grads]
    ref = [np.zeros_like(g) for g in got]
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 > q0 and k1 > k0:
            parts = reference(hq[None, q0:q1], hkk[None, k0:k1], hv[None, k0:k1], hdo[None, q0:q1], causal)
            ref[0][q0:q1], ref[1][k0:k1], ref[2][k0:k1] = (x[0] for x in parts)
    figs, ok = [], True
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        rel = float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))
        ok = ok and bool(np.isfinite(g).all()) and rel <= REL_L2_BOUND
        figs.append(f"{name} {rel:.1e}")
    return ok, " ".join(figs)


def _once(cfg: BackwardKernelConfig, shape: tuple, causal: bool, det: bool,
          rng: np.random.Generator) -> tuple[bool, str]:
    import cupy as cp

    import cupyflash

    batch, sq, sk, h, hk = shape
    npd = cfg.dtype.numpy_dtype
    hq, hdo = (rng.standard_normal((batch, sq, h, cfg.d_head), dtype=np.float32).astype(npd) for _ in range(2))
    hkk, hv = (rng.standard_normal((batch, sk, hk, cfg.d_head), dtype=np.float32).astype(npd) for _ in range(2))
    q, k, v, do = (cp.asarray(x) for x in (hq, hkk, hv, hdo))
    out, lse = cupyflash.forward(forward_default(cfg.dtype, cfg.d_head), q, k, v, causal=causal, return_lse=True)
    grads = tuple(cp.asarray(np.full(x.shape, np.nan, dtype=npd)) for x in (hq, hkk, hv))  # poisoned
    cupyflash.backward(do, q, k, v, out, lse, causal=causal, deterministic=det, cfg=cfg,
                       dq=grads[0], dk=grads[1], dv=grads[2])
    cp.cuda.runtime.deviceSynchronize()
    ref = reference(hq, hkk, hv, hdo, causal)
    figs, ok = [], True
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        g = cp.asnumpy(g).astype(np.float64)
        rel = float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))
        ok = ok and bool(np.isfinite(g).all()) and rel <= REL_L2_BOUND
        figs.append(f"{name} {rel:.1e}")
    return ok, " ".join(figs)


def main(argv=None) -> int:
    """Thin wrapper: the same launches run by `sanitize_check.py --family backward_sm80`."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="", help="extra short forms, '|'-separated")
    ap.add_argument("--d-heads", default="64,128", help="default configs (bf16) of these head dims")
    ap.add_argument("--max-shapes", type=int, default=len(SHAPES), help="use only the first N shapes")
    ap.add_argument("--many-tiles", action="store_true", help=f"add the shape {MANY_TILES} (B, S_q, S_k, H, H_kv)")
    ap.add_argument("--varlen", action="store_true", help="run backward_varlen on packed ragged batches instead")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from cupyflash.device import has_gpu

    if not has_gpu():
        print("sanitize_backward: no CUDA GPU found", file=sys.stderr)
        return 2
    import cupy as cp

    cp.cuda.set_allocator(None)
    shapes = SHAPES[:args.max_shapes] + ((MANY_TILES,) if args.many_tiles else ())
    rng = np.random.default_rng(args.seed)
    configs = pick_configs(args.d_heads, args.configs)
    calls = varlen_launches(configs, rng) if args.varlen else launches(configs, shapes, rng)
    done = run_launches(calls, lambda line: print(line, flush=True))
    print(f"sanitize_backward: {done.runs} backward calls, {done.ok} ok, {len(done.failures)} failed "
          f"in {done.seconds:.1f} s")
    return 1 if done.failures else 0


if __name__ == "__main__":
    sys.exit(main())
