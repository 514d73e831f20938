"""The GPU tests' reference (tests/gpu_reference.py) checked on the CPU, with numpy standing in for
CuPy: causal bottom-right masking, GQA head mapping, lse, rows with no visible key, and that the
checks reject what they should. A wrong oracle would pass wrong kernels."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from cupyflash.config import DType
from gpu_reference import attention_reference, causal_mask, check_attention, check_lse, poisoned, to_float32


def naive(q, k, v, scale, causal):
    """Per (b, h, i) loops in float64: the definition, written the slow way."""
    batch, seq_q, n_heads, d = q.shape
    seq_k, n_kv = k.shape[1], k.shape[2]
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    out = np.zeros((batch, seq_q, n_heads, d))
    lse = np.full((batch, n_heads, seq_q), -np.inf)
    for b in range(batch):
        for h in range(n_heads):
            kh = h // (n_heads // n_kv)
            for i in range(seq_q):
                keys = [j for j in range(seq_k) if not causal or j <= i + seq_k - seq_q]
                if not keys:
                    continue
                s = np.array([scale * q[b, i, h] @ k[b, j, kh] for j in keys])
                lse[b, h, i] = math.log(np.exp(s).sum())
                p = np.exp(s - lse[b, h, i])
                out[b, i, h] = sum(pj * v[b, j, kh] for pj, j in zip(p, keys))
    return out, lse


def inputs(rng, shape_q, shape_kv, dtype=ml_dtypes.bfloat16):
    q = rng.standard_normal(shape_q).astype(dtype)
    k, v = (rng.standard_normal(shape_kv).astype(dtype) for _ in range(2))
    return q, k, v


def test_causal_mask_is_bottom_right_aligned():
    assert causal_mask(np, 3, 5).tolist() == [[False, False, False, True, True],
                                               [False, False, False, False, True],
                                               [False] * 5]
    assert causal_mask(np, 4, 2).tolist() == [[True, True], [True, True], [False, True], [False, False]]
    assert causal_mask(np, 3, 3).tolist() == [[False, True, True], [False, False, True], [False] * 3]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k,n_heads,n_kv", [(5, 9, 4, 2), (9, 5, 4, 1), (7, 7, 3, 3), (1, 1, 2, 1)])
def test_reference_matches_the_definition(seq_q, seq_k, n_heads, n_kv, causal):
    rng = np.random.default_rng(seq_q * 100 + seq_k)
    q, k, v = inputs(rng, (2, seq_q, n_heads, 16), (2, seq_k, n_kv, 16))
    out, lse = attention_reference(np, q, k, v, 0.3, causal=causal)
    want, want_lse = naive(q, k, v, 0.3, causal)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12)
    if causal and seq_q > seq_k:
        assert (out[:, : seq_q - seq_k] == 0).all() and np.isneginf(lse[:, :, : seq_q - seq_k]).all()


def test_low_precision_reference_keeps_masked_rows_zero():
    rng = np.random.default_rng(1)
    q, k, v = inputs(rng, (1, 6, 2, 16), (1, 2, 1, 16))
    out, lse = attention_reference(np, q, k, v, 0.25, DType.BF16, causal=True)
    assert not np.isnan(out).any() and (out[:, :4] == 0).all() and np.isneginf(lse[:, :, :4]).all()


def test_check_attention_accepts_a_rounded_reference_and_rejects_a_wrong_mask():
    rng = np.random.default_rng(2)
    q, k, v = inputs(rng, (2, 9, 4, 16), (2, 5, 2, 16))
    ref, lse = attention_reference(np, q, k, v, 0.25, causal=True)
    good = ref.astype(np.float32).astype(ml_dtypes.bfloat16)
    figures = check_attention(np, DType.BF16, q, k, v, good, 0.25, causal=True, lse=lse.astype(np.float32))
    assert figures["rel_l2"] < 1e-2 and figures["lse_max_abs"] < 1e-6
    with pytest.raises(AssertionError, match="max abs error"):  # a causal result is not the full one
        check_attention(np, DType.BF16, q, k, v, good, 0.25, causal=False)
    wrong_heads = attention_reference(np, q, k[:, :, ::-1], v[:, :, ::-1], 0.25, causal=True)[0]
    with pytest.raises(AssertionError, match="max abs error"):  # k/v heads mapped the wrong way
        check_attention(np, DType.BF16, q, k, v, wrong_heads.astype(np.float32).astype(ml_dtypes.bfloat16),
                        0.25, causal=True)
    with pytest.raises(AssertionError, match="NaN"):
        check_attention(np, DType.BF16, q, k, v, poisoned(np, DType.BF16, q.shape), 0.25, causal=True)


def test_check_lse_rules():
    ref = np.array([[[-np.inf, 1.0, 2.0]]])
    check_lse(np, np.array([[[-np.inf, 1.0005, 2.0]]], np.float32), ref)
    for bad, match in (([0.0, 1.0, 2.0], "not -inf"), ([-np.inf, np.inf, 2.0], "infinite"),
                       ([-np.inf, 1.1, 2.0], "max abs error"), ([-np.inf, np.nan, 2.0], "NaN")):
        with pytest.raises(AssertionError, match=match):
            check_lse(np, np.array([[bad]], np.float32), ref)


def test_bf16_widening_is_exact():
    x = np.array([1.5, -2.25, 3e-3], dtype=ml_dtypes.bfloat16)
    assert to_float32(np, x).tolist() == x.astype(np.float32).tolist()
