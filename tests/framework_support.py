"""Shared by test_torch_ops.py and test_jax_ops.py.

- `numpy_attention`: a float64 NumPy attention (GQA, bottom-right causal mask, lse), the stand-in
  kernel of the CPU tests, which run the framework machinery (opcheck, torch.compile, jax.jit,
  jax.vmap) over a reference instead of the GPU kernel.
- `prewarm_problems`: compile, in parallel, the configs `cfg=None` picks for the GPU tests'
  problems, so the tests do not compile them one at a time.
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from cupyflash.config import DType


def numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float | None = None,
                    causal: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(out (B, S_q, H, D), lse (B, H, S_q)) in float64 for (B, S, H, D) inputs of any float type.
    Rows that see no key: output 0, lse -inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        seq_q, seq_k = q.shape[1], k.shape[1]
        hidden = np.arange(seq_k)[None, :] > np.arange(seq_q)[:, None] + (seq_k - seq_q)
        s = np.where(hidden, -np.inf, s)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    seen = total > 0
    p = e / np.where(seen, total, 1.0)
    lse = np.where(seen, m + np.log(np.where(seen, total, 1.0)), -np.inf)[..., 0]
    return np.einsum("bhqk,bkhd->bqhd", p, v), lse


def prewarm_problems(problems: Iterable[tuple[DType, int, int, int, bool]]) -> None:
    """Compile the kernels `forward(cfg=None)` launches for (dtype, d_head, seq_q, seq_k, causal)
    on the current device, in parallel worker processes."""
    import cupy as cp

    from cupyflash.api import resolve_config
    from cupyflash.prewarm import prewarm_for_device

    device = cp.cuda.runtime.getDevice()
    by_causal: dict[bool, set] = {False: set(), True: set()}
    for dtype, d_head, seq_q, seq_k, causal in problems:
        by_causal[causal].add(resolve_config(None, dtype, d_head, seq_q, seq_k, device, causal))
    for causal, configs in by_causal.items():
        if configs:
            for report in prewarm_for_device(configs, device, causal=(causal,)):
                failed = [r for r in report.results if not r.ok]
                assert not failed, failed[:3]
