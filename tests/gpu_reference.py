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


def packed_batch(cp, rng: np.random.Generator, dtype: DType, lens_q, lens_k, n_heads: int, n_kv_heads: int, d: int,
                 pad_q: int = 0, pad_k: int = 0):
    """A packed ragged batch: q (sum(lens_q) + pad_q, H, d), k/v (sum(lens_k) + pad_k, H_kv, d), the
    int32 offsets on the GPU and on the host: (q, k, v, cu_q, cu_k, cu_q_host, cu_k_host)."""
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = random_inputs(cp, dtype, (int(cu_q[-1]) + pad_q, n_heads, d), rng)
    k = random_inputs(cp, dtype, (int(cu_k[-1]) + pad_k, n_kv_heads, d), rng)
    v = random_inputs(cp, dtype, (int(cu_k[-1]) + pad_k, n_kv_heads, d), rng)
    return q, k, v, cp.asarray(cu_q), cp.asarray(cu_k), cu_q, cu_k


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
    """(B, S, H_kv, D) -> (B, S, n_heads, D): q head h reads k/v head h // (n_heads // H_kv)."""
    return x if x.shape[2] == n_heads else cp.repeat(x, n_heads // x.shape[2], axis=2)


def causal_mask(cp, seq_q: int, seq_k: int):
    """True where key j is hidden from query i: bottom-right aligned, j > i + seq_k - seq_q."""
    rows = cp.arange(seq_q)[:, None]
    cols = cp.arange(seq_k)[None, :]
    return cols > rows + (seq_k - seq_q)


def attention_reference(cp, q, k, v, scale: float, dtype: DType | None = None, causal: bool = False):
    """softmax(q k^T * scale + mask) v over (batch, seq, heads, d), and the log-sum-exp.

    k and v may have fewer heads than q (GQA/MQA: q head h reads k/v head h // group). `causal`
    masks bottom-right aligned (key j visible to query i iff j <= i + S_k - S_q); rows that see no
    key give output 0 and lse -inf. With `dtype` None the computation is float64 on upcast inputs;
    with a dtype it mimics that precision (products rounded after each matmul, probabilities
    rounded before P V), the baseline of the FlashAttention test rule.

    Returns (out (B, S_q, H, D) float64, lse (B, H, S_q) natural log). Computed one batch entry
    at a time so that S = 3001 with several heads fits comfortably.
    """
    batch, seq_q, n_heads, d = q.shape
    seq_k = k.shape[1]
    work = cp.float64 if dtype is None else cp.float32
    q32 = to_float32(cp, q)
    k32 = to_float32(cp, _expand_kv(cp, k, n_heads))
    v32 = to_float32(cp, _expand_kv(cp, v, n_heads))
    hidden = causal_mask(cp, seq_q, seq_k) if causal else None
    out = cp.empty((batch, seq_q, n_heads, d), dtype=cp.float64)
    lse = cp.empty((batch, n_heads, seq_q), dtype=work)
    for b in range(batch):
        qh, kh, vh = (cp.transpose(x[b].astype(work), (1, 0, 2)) for x in (q32, k32, v32))  # (H, S, D)
        s = qh @ cp.swapaxes(kh, -1, -2)
        if dtype is not None:
            s = round_to(cp, dtype, s)
        s = s * scale
        if hidden is not None:
            s = cp.where(hidden, -cp.inf, s)
        m = s.max(axis=-1, keepdims=True)
        m = cp.where(cp.isfinite(m), m, 0)  # fully masked rows: exp(-inf - 0) = 0 everywhere
        e = cp.exp(s - m)
        del s
        total = e.sum(axis=-1, keepdims=True)
        seen = total > 0
        safe_total = cp.where(seen, total, 1)
        p = e / safe_total
        del e
        lse[b] = cp.where(seen, m + cp.log(safe_total), -cp.inf)[..., 0]
        if dtype is not None:
            p = round_to(cp, dtype, p.astype(cp.float32))
        o = p @ vh
        if dtype is not None:
            o = round_to(cp, dtype, o.astype(cp.float32))
        out[b] = cp.transpose(o, (1, 0, 2))
    return out, lse


# |lse - reference| allowed: fp32 score accumulation, exp2/log approximations and the online
# rescaling stay below 1e-4 for these lengths; a key wrongly in or out of a row moves its lse by
# exp(s_j - lse) (and its output far more, which the output check catches).
LSE_ATOL = 1e-3


def check_lse(cp, lse, ref_lse, context: str = "") -> float:
    """The kernel's log-sum-exp against the float64 reference: -inf exactly where the reference is
    (rows that see no key), finite and within LSE_ATOL elsewhere. Returns the max abs error."""
    where = f" ({context})" if context else ""
    assert tuple(lse.shape) == tuple(ref_lse.shape), f"lse shape {lse.shape} != {ref_lse.shape}{where}"
    got = lse.astype(cp.float64)
    masked = cp.isneginf(ref_lse)
    assert not bool(cp.isnan(got).any()), f"lse has NaN (unwritten or 0/0){where}"
    bad_masked = int((masked & ~cp.isneginf(got)).sum())
    assert bad_masked == 0, f"{bad_masked} lse entries of rows that see no key are not -inf{where}"
    bad_inf = int((~masked & ~cp.isfinite(got)).sum())
    assert bad_inf == 0, f"{bad_inf} lse entries are infinite where the reference is finite{where}"
    if bool((~masked).any()):
        err = float(cp.abs(cp.where(masked, 0, got) - cp.where(masked, 0, ref_lse)).max())
    else:
        err = 0.0
    assert err <= LSE_ATOL, f"lse max abs error {err:.3g} > {LSE_ATOL}{where}"
    return err


def check_attention(cp, dtype: DType, q, k, v, out, scale: float | None = None, *, causal: bool = False,
                    lse=None, context: str = "") -> dict:
    """Apply the SPEC §5 rule to `out` (and check `lse` when given); returns the figures, raises
    AssertionError (with `context` in the message) on failure."""
    where = f" ({context})" if context else ""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ref, ref_lse = attention_reference(cp, q, k, v, scale, causal=causal)
    low, _ = attention_reference(cp, q, k, v, scale, dtype, causal=causal)
    got = to_float32(cp, out).astype(cp.float64)
    n_nan = int(cp.isnan(got).sum())
    assert n_nan == 0, f"output has {n_nan} NaN (unwritten elements, or 0/0 in a masked row){where}"
    err = float(cp.abs(got - ref).max())
    low_err = float(cp.abs(low - ref).max())
    ref_norm = float(cp.linalg.norm(ref))
    diff_norm = float(cp.linalg.norm(got - ref))
    # an all-zero reference (every row masked) has no relative error: the output must be 0 too
    rel = diff_norm / ref_norm if ref_norm > 0 else diff_norm
    figures = {"max_abs": err, "max_abs_same_precision": low_err, "rel_l2": rel}
    assert err <= 2 * low_err + 1e-6, \
        f"max abs error {err:.3g} > 2 x same-precision error {low_err:.3g}{where}"
    assert rel <= REL_L2_TOLERANCE[dtype], f"relative L2 error {rel:.3g} > {REL_L2_TOLERANCE[dtype]}{where}"
    if lse is not None:
        figures["lse_max_abs"] = check_lse(cp, lse, ref_lse, context)
    return figures


_NAN_BITS = {DType.FP16: 0x7E00, DType.BF16: 0x7FC0}


def poisoned(cp, dtype: DType, shape):
    """An output buffer full of NaN, so any element the kernel fails to write fails the test."""
    return cp.full(shape, _NAN_BITS[dtype], dtype=cp.uint16).view(dtype.numpy_dtype)
