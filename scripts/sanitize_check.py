#!/usr/bin/env python
"""forward() on small ragged, causal and GQA shapes, sized for compute-sanitizer.

    python scripts/sanitize_check.py                      # once plainly first: fills the kernel cache
    compute-sanitizer --tool memcheck  python scripts/sanitize_check.py
    compute-sanitizer --tool racecheck python scripts/sanitize_check.py

One config per head dim (the first config of get_kernel_configs('all') with that d_head; with
--pick default the library's default config instead, with --pick both the two of them), three
shapes (ragged lengths, S_q < S_k and S_q > S_k so that causal leaves rows with no visible key,
MHA / GQA / MQA, all S <= 300), causal off and on, return_lse on: 4 x 3 x 2 = 24 kernel launches.
Nothing else runs on the GPU: inputs and NaN-poisoned out/lse buffers are uploaded from the host,
results copied back, and the float64 reference computed on the host. CuPy's memory pool is turned
off, so every array is its own cudaMalloc of exactly its size and memcheck sees any access past
it (the pool would hide accesses that stay inside its larger blocks).

Checks are loose (the shape matrix in tests/test_gpu_shapes.py is the accuracy test): output
finite, relative L2 error against the reference <= 2e-2; lse -inf exactly on rows that see no key,
finite elsewhere and within 1e-2 of the reference. Prints one line per launch and a one-line
summary; exit 0 when all pass, 1 when any fails, 2 without a GPU or on bad arguments.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

try:
    import cupyflash  # noqa: F401  (an installed or editable cupyflash)
except ImportError:  # a plain checkout: use the package next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.config import SUPPORTED_D_HEADS, DType  # noqa: E402
from cupyflash.families.forward_sm80.config import FlashForwardKernelConfig  # noqa: E402
from cupyflash.families.forward_sm80.config_sets import default_config, get_kernel_configs  # noqa: E402

# (batch, S_q, S_k, n_heads, n_kv_heads)
SHAPES = ((1, 77, 200, 4, 1),    # MQA, S_q < S_k: bottom-right causal offset +123
          (2, 130, 63, 4, 2),    # GQA, S_q > S_k: causal rows 0..66 see no key
          (1, 257, 257, 2, 2))   # MHA, square, one row past a multiple of 64/128
REL_L2_BOUND = 2e-2
LSE_BOUND = 1e-2


def pick_configs(d_heads, pick: str = "first") -> list[FlashForwardKernelConfig]:
    """Per head dim: the first config of the 'all' set ('first'), the library default for bf16
    ('default': the fully optimised kernel, eager prefetch and all), or both."""
    configs = get_kernel_configs("all")
    picked = []
    for d in d_heads:
        if d not in SUPPORTED_D_HEADS:
            raise ValueError(f"--d-heads: {d} is not supported (expected {SUPPORTED_D_HEADS})")
        if pick in ("first", "both"):
            mine = [c for c in configs if c.d_head == d]
            if not mine:
                raise ValueError(f"no config with d_head {d} in get_kernel_configs('all')")
            picked.append(mine[0])
        if pick in ("default", "both"):
            cfg = default_config(DType.BF16, d)
            if cfg not in picked:
                picked.append(cfg)
    return picked


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """float64 (out (B, S_q, H, D), lse (B, H, S_q)); GQA by k/v head h // group; bottom-right
    causal; rows with no visible key: out 0, lse -inf."""
    batch, seq_q, n_heads, d = q.shape
    seq_k, n_kv = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    out = np.zeros((batch, seq_q, n_heads, d))
    lse = np.full((batch, n_heads, seq_q), -np.inf)
    hidden = np.arange(seq_k)[None, :] > np.arange(seq_q)[:, None] + (seq_k - seq_q)
    for b in range(batch):
        for h in range(n_heads):
            s = q[b, :, h] @ k[b, :, h // group].T / np.sqrt(d)
            if causal:
                s = np.where(hidden, -np.inf, s)
            m = s.max(axis=1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            e = np.exp(s - m)
            total = e.sum(axis=1, keepdims=True)
            seen = total[:, 0] > 0
            out[b, seen, h] = (e[seen] / total[seen]) @ v[b, :, h // group]
            lse[b, h, seen] = (m + np.log(np.where(total > 0, total, 1.0)))[seen, 0]
    return out, lse


def check(out: np.ndarray, lse: np.ndarray, ref: np.ndarray, ref_lse: np.ndarray) -> tuple[bool, str]:
    out = out.astype(np.float64)
    if not np.isfinite(out).all():
        return False, f"{int((~np.isfinite(out)).sum())} non-finite output elements"
    rel = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
    masked = np.isneginf(ref_lse)
    if np.isnan(lse).any():
        return False, f"{int(np.isnan(lse).sum())} NaN lse entries (unwritten?)"
    if not np.isneginf(lse[masked]).all():
        return False, "lse of a row that sees no key is not -inf"
    if not np.isfinite(lse[~masked]).all():
        return False, "lse not finite where the reference is"
    lse_err = float(np.abs(lse[~masked] - ref_lse[~masked]).max()) if (~masked).any() else 0.0
    ok = rel <= REL_L2_BOUND and lse_err <= LSE_BOUND
    return ok, f"rel_l2 {rel:.2e} lse_err {lse_err:.1e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-heads", default=",".join(map(str, SUPPORTED_D_HEADS)),
                   help=f"comma-separated head dims (default all: {SUPPORTED_D_HEADS})")
    p.add_argument("--pick", choices=("first", "default", "both"), default="first",
                   help="which config per head dim (default: the first of the 'all' set)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        d_heads = [int(x) for x in args.d_heads.split(",") if x.strip()]
        configs = pick_configs(d_heads, args.pick)
    except ValueError as exc:
        print(f"sanitize_check: error: {exc}", file=sys.stderr)
        return 2

    from cupyflash.device import has_gpu

    if not has_gpu():
        print("sanitize_check: no CUDA GPU found; nothing was run", file=sys.stderr)
        return 2
    import cupy as cp

    import cupyflash

    cp.cuda.set_allocator(None)  # exact-size cudaMalloc per array: memcheck sees every overrun
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    runs, failures = 0, []
    for cfg in configs:
        np_dtype = cfg.dtype.numpy_dtype
        for batch, seq_q, seq_k, n_heads, n_kv in SHAPES:
            host_q = rng.standard_normal((batch, seq_q, n_heads, cfg.d_head), dtype=np.float32).astype(np_dtype)
            host_k, host_v = (rng.standard_normal((batch, seq_k, n_kv, cfg.d_head), dtype=np.float32).astype(np_dtype)
                              for _ in range(2))
            q, k, v = (cp.asarray(x) for x in (host_q, host_k, host_v))
            for causal in (False, True):
                out = cp.asarray(np.full(host_q.shape, np.nan, dtype=np_dtype))
                lse = cp.asarray(np.full((batch, n_heads, seq_q), np.nan, dtype=np.float32))
                label = (f"d{cfg.d_head} {cfg.dtype.name} B={batch} S_q={seq_q} S_k={seq_k} H={n_heads} "
                         f"H_kv={n_kv} causal={int(causal)}")
                runs += 1
                try:
                    cupyflash.forward(cfg, q, k, v, out=out, causal=causal, return_lse=True, lse=lse)
                    cp.cuda.runtime.deviceSynchronize()
                    ref, ref_lse = reference(host_q, host_k, host_v, causal)
                    ok, figures = check(cp.asnumpy(out), cp.asnumpy(lse), ref, ref_lse)
                except Exception as exc:  # a launch error (e.g. under memcheck) is a failure, not a crash
                    ok, figures = False, f"{type(exc).__name__}: {exc}"
                print(f"{'ok  ' if ok else 'FAIL'} {label}: {figures}", flush=True)
                if not ok:
                    failures.append(label)
    seconds = time.perf_counter() - t0
    print(f"sanitize_check: {runs} launches, {runs - len(failures)} ok, {len(failures)} failed "
          f"({len(configs)} configs: " + "; ".join(str(c) for c in configs) + f") in {seconds:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
