"""Reference gradients of attention and the SPEC §5 rule applied to dQ, dK, dV (CuPy only)."""
from __future__ import annotations

import math

from cupyflash.config import DType
from gpu_reference import REL_L2_TOLERANCE, _expand_kv, causal_mask, round_to, to_float32


def attention_backward_reference(cp, q, k, v, dout, scale: float, causal: bool = False,
                                 dtype: DType | None = None):
    """(dq, dk, dv) as float64 arrays of the inputs' shapes (dk, dv summed over each GQA group).

    dtype None: float64 on upcast inputs. With a dtype, the same computation in that precision
    (fp32 accumulation, every matmul product and elementwise result that a kernel would hold in
    16 bits rounded to it): the baseline of the FlashAttention test rule.
    """
    batch, seq_q, n_heads, d = q.shape
    seq_k, n_kv = k.shape[1], k.shape[2]
    work = cp.float64 if dtype is None else cp.float32
    rnd = (lambda x: x) if dtype is None else (lambda x: round_to(cp, dtype, x.astype(cp.float32)))
    q32, do32 = to_float32(cp, q), to_float32(cp, dout)
    k32 = to_float32(cp, _expand_kv(cp, k, n_heads))
    v32 = to_float32(cp, _expand_kv(cp, v, n_heads))
    hidden = causal_mask(cp, seq_q, seq_k) if causal else None
    dq = cp.empty((batch, seq_q, n_heads, d), dtype=cp.float64)
    dk = cp.empty((batch, seq_k, n_heads, d), dtype=cp.float64)
    dv = cp.empty((batch, seq_k, n_heads, d), dtype=cp.float64)
    for b in range(batch):
        qh, kh, vh, doh = (cp.transpose(x[b].astype(work), (1, 0, 2)) for x in (q32, k32, v32, do32))
        s = rnd(qh @ cp.swapaxes(kh, -1, -2)) * scale
        if hidden is not None:
            s = cp.where(hidden, -cp.inf, s)
        m = s.max(axis=-1, keepdims=True)
        m = cp.where(cp.isfinite(m), m, 0)
        e = cp.exp(s - m)
        total = e.sum(axis=-1, keepdims=True)
        p = e / cp.where(total > 0, total, 1)
        o = rnd(rnd(p) @ vh)
        dp = rnd(doh @ cp.swapaxes(vh, -1, -2))
        delta = (doh * o).sum(axis=-1, keepdims=True)
        ds = rnd(p * (dp - delta))
        dq[b] = cp.transpose(rnd(scale * (ds @ kh)), (1, 0, 2))
        dk[b] = cp.transpose(scale * (cp.swapaxes(ds, -1, -2) @ qh), (1, 0, 2))
        dv[b] = cp.transpose(cp.swapaxes(rnd(p), -1, -2) @ doh, (1, 0, 2))
    group = n_heads // n_kv
    dk = dk.reshape(batch, seq_k, n_kv, group, d).sum(axis=3)
    dv = dv.reshape(batch, seq_k, n_kv, group, d).sum(axis=3)
    if dtype is not None:
        dk, dv = rnd(dk).astype(cp.float64), rnd(dv).astype(cp.float64)
    return dq, dk, dv


def check_gradients(cp, dtype: DType, q, k, v, dout, grads, scale: float | None = None, *,
                    causal: bool = False, context: str = "") -> dict:
    """SPEC §5 on each of dq, dk, dv: max abs error <= 2x the same-precision computation's
    error, relative L2 within the dtype's tolerance, no NaN. Returns the figures."""
    where = f" ({context})" if context else ""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ref = attention_backward_reference(cp, q, k, v, dout, scale, causal)
    low = attention_backward_reference(cp, q, k, v, dout, scale, causal, dtype)
    figures = {}
    for name, got_raw, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
        got = to_float32(cp, got_raw).astype(cp.float64)
        n_nan = int(cp.isnan(got).sum())
        assert n_nan == 0, f"{name} has {n_nan} NaN (unwritten elements?){where}"
        err = float(cp.abs(got - r).max())
        low_err = float(cp.abs(lo - r).max())
        ref_norm = float(cp.linalg.norm(r))
        diff = float(cp.linalg.norm(got - r))
        rel = diff / ref_norm if ref_norm > 0 else diff
        figures[name] = {"max_abs": err, "max_abs_same_precision": low_err, "rel_l2": rel}
        assert err <= 2 * low_err + 1e-5, f"{name}: max abs error {err:.3g} > 2 x same-precision {low_err:.3g}{where}"
        assert rel <= REL_L2_TOLERANCE[dtype], f"{name}: relative L2 error {rel:.3g} > {REL_L2_TOLERANCE[dtype]}{where}"
    return figures
