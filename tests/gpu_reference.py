"""Reference attention and the SPEC §5 acceptance rule, for the GPU tests (CuPy only)."""
from __future__ import annotations

import math

import numpy as np

from cupyflash.config import DType

REL_L2_TOLERANCE = {DType.BF16: 1e-2, DType.FP16: 2e-3}


def random_inputs(cp, dtype: DType, shape: tuple[int, ...], rng: np.random.Generator):
    """Fresh standard-normal values of `dtype` on the GPU (bf16 through ml_dtypes on the host)."""
    host = rng.standard_normal(shape, dtype=np.float32).astype(dtype.numpy_dtype)
    return cp.asarray(host)


def to_float32(cp, x):
    """fp16/bf16 CuPy array -> float32, by bits for bf16 (no reliance on CuPy bf16 arithmetic)."""
    if x.dtype == np.float16:
        return x.astype(cp.float32)
    bits = cp.ascontiguousarray(x).view(cp.uint16).astype(cp.uint32) << 16
    return bits.view(cp.float32)


def round_to(cp, dtype: DType, x32):
    """Round float32 values to `dtype` (nearest even) and return them as float32."""
    if dtype is DType.FP16:
        return x32.astype(cp.float16).astype(cp.float32)
    bits = cp.ascontiguousarray(x32).view(cp.uint32)
    rounded = (bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))) & cp.uint32(0xFFFF0000)
    return rounded.view(cp.float32)


def _expand_kv(cp, x, n_heads: int):
    return x if x.shape[2] == n_heads else cp.repeat(x, n_heads // x.shape[2], axis=2)


def attention_reference(cp, q, k, v, scale: float, dtype: DType | None = None):
    """softmax(q k^T * scale) v over (batch, seq, heads, d). With `dtype` None the computation is
    float64 on upcast inputs; with a dtype it mimics that precision (products rounded after each
    matmul, probabilities rounded before P V), the baseline of the FlashAttention test rule."""
    n_heads = q.shape[2]
    q32 = to_float32(cp, q)
    k32 = to_float32(cp, _expand_kv(cp, k, n_heads))
    v32 = to_float32(cp, _expand_kv(cp, v, n_heads))
    work = cp.float64 if dtype is None else cp.float32
    qh, kh, vh = (cp.transpose(x.astype(work), (0, 2, 1, 3)) for x in (q32, k32, v32))
    s = qh @ cp.swapaxes(kh, -1, -2)
    if dtype is not None:
        s = round_to(cp, dtype, s)
    s = s * scale
    m = s.max(axis=-1, keepdims=True)
    e = cp.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    p = e / total
    lse = (m + cp.log(total))[..., 0]
    if dtype is not None:
        p = round_to(cp, dtype, p.astype(cp.float32))
    o = p @ vh
    if dtype is not None:
        o = round_to(cp, dtype, o.astype(cp.float32))
    return cp.transpose(o, (0, 2, 1, 3)).astype(cp.float64), lse


def check_attention(cp, dtype: DType, q, k, v, out, scale: float | None = None) -> dict:
    """Apply the SPEC §5 rule to `out`; returns the figures, raises AssertionError on failure."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ref, _ = attention_reference(cp, q, k, v, scale)
    low, _ = attention_reference(cp, q, k, v, scale, dtype)
    got = to_float32(cp, out).astype(cp.float64)
    assert not bool(cp.isnan(got).any()), "output has NaN (an element was not written)"
    err = float(cp.abs(got - ref).max())
    low_err = float(cp.abs(low - ref).max())
    rel = float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref))
    figures = {"max_abs": err, "max_abs_same_precision": low_err, "rel_l2": rel}
    assert err <= 2 * low_err + 1e-6, f"max abs error {err:.3g} > 2 x same-precision error {low_err:.3g}"
    assert rel <= REL_L2_TOLERANCE[dtype], f"relative L2 error {rel:.3g} > {REL_L2_TOLERANCE[dtype]}"
    return figures


_NAN_BITS = {DType.FP16: 0x7E00, DType.BF16: 0x7FC0}


def poisoned(cp, dtype: DType, shape):
    """An output buffer full of NaN, so any element the kernel fails to write fails the test."""
    return cp.full(shape, _NAN_BITS[dtype], dtype=cp.uint16).view(dtype.numpy_dtype)
