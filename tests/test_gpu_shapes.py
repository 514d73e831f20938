"""GPU shape matrix (issue 4): causal, any lengths, GQA/MQA, return_lse, every head dim, strides.

Every case checks the SPEC §5 rule (tests/gpu_reference.py) on fresh inputs, writing into a
NaN-poisoned `out` that is a strided view into the middle of a larger NaN buffer (padded in seq,
heads and d_head on both sides): an element the kernel fails to write stays NaN, and a write
outside the view shows up as a non-NaN guard element.

- test_shape_matrix: every (S_q, S_k) pair of SEQS once; batch, heads (with and without GQA),
  d_head, dtype, causal, config (library pick, sometimes one explicit config per head dim),
  input layouts and return_lse drawn from a generator seeded per run. The seed is printed in every
  failure; CUPYFLASH_TEST_SEED=<seed> replays a run.
- test_sweep: every d_head x dtype x causal x GQA combination at two ragged shapes, with lse.
- test_explicit_config: one explicit config per head dim (both dtypes) on ragged shapes, so
  other block shapes than the library's pick see ragged tails.
- lse (values, -inf rows, merging partial results), packed-QKV inputs, fully masked causal rows,
  the fast path with causal, PyTorch SDPA (is_causal, enable_gqa) and JAX.

Skipped cleanly without a GPU.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from cupyflash.config import SUPPORTED_D_HEADS, DType
from cupyflash.families.forward_sm80.config import FlashForwardKernelConfig
from cupyflash.families.forward_sm80.config_sets import default_config, get_kernel_configs
from cupyflash.device import has_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU")]

if has_gpu():
    import cupy as cp

    import cupyflash
    from gpu_reference import (REL_L2_TOLERANCE, attention_reference, check_attention, check_lse, poisoned,
                               random_inputs, to_float32)

SEQS = (1, 7, 63, 64, 65, 127, 128, 129, 1000, 2048, 3001)
HEAD_PAIRS = ((4, 4), (4, 2), (4, 1), (6, 3), (2, 1))  # (n_heads, n_kv_heads): MHA, GQA, MQA
SWEEP_HEADS = ((4, 4), (4, 2), (4, 1))
SWEEP_SHAPES = ((2, 129, 77), (1, 65, 300))  # (batch, S_q, S_k): fully masked causal rows, then none
SEED = int(os.environ.get("CUPYFLASH_TEST_SEED") or time.time_ns() % 2**31)
PAD_SEQ, PAD_HEADS, PAD_D = 3, 1, 8  # guard band around `out`, each side (PAD_D keeps rows 16-byte aligned)
LSE_PAD = 64


def explicit_configs() -> dict[tuple[DType, int], FlashForwardKernelConfig]:
    """One config per (dtype, d_head) from the 'all' set, preferring block shapes the library's
    default does not use, and a different one per head dim, so several shapes see ragged tails."""
    configs = get_kernel_configs("all")
    picked = {}
    for i, d in enumerate(SUPPORTED_D_HEADS):
        mine = sorted(c for c in configs if c.d_head == d)
        if not mine:
            continue
        shape = lambda c: (c.B_r, c.B_c, c.n_warps)  # noqa: E731
        shapes = sorted({shape(c) for c in mine})
        default = shape(default_config(DType.BF16, d))
        others = [s for s in shapes if s != default] or shapes
        chosen = others[i % len(others)]
        cfg = next(c for c in mine if shape(c) == chosen)
        for dtype in DType:
            picked[(dtype, d)] = cfg.replace(dtype=dtype)
    return picked


EXPLICIT = explicit_configs()


@pytest.fixture(scope="module", autouse=True)
def prewarmed_cache():
    """Compile every config these tests can launch once, in parallel, before the tests."""
    from cupyflash.api import resolve_config
    from cupyflash.prewarm import prewarm_for_device

    device = cp.cuda.runtime.getDevice()
    needed = set(EXPLICIT.values())
    for dtype in DType:
        for d in SUPPORTED_D_HEADS:
            for seq_q in SEQS:
                for seq_k in SEQS + (77, 300):
                    for causal in (False, True):
                        needed.add(resolve_config(None, dtype, d, seq_q, seq_k, device, causal))
    for report in prewarm_for_device(needed, device, causal=(False, True)):
        assert all(r.ok for r in report.results), [r for r in report.results if not r.ok][:3]
    yield


# ----------------------------------------------------------------------------- one case
@dataclass
class Case:
    batch: int
    seq_q: int
    seq_k: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    dtype: DType
    causal: bool
    cfg: FlashForwardKernelConfig | None = None
    return_lse: bool = False
    lse_buffer: bool = False  # pass lse= (a poisoned, guarded buffer) instead of letting forward allocate
    heads_major: tuple[bool, bool, bool] = (False, False, False)  # q, k, v as (B, H, S, D) memory

    def describe(self) -> str:
        layouts = "".join("H" if m else "S" for m in self.heads_major)
        return (f"B={self.batch} S_q={self.seq_q} S_k={self.seq_k} H={self.n_heads} H_kv={self.n_kv_heads} "
                f"d={self.d_head} {self.dtype.name} causal={self.causal} lse={self.return_lse}"
                f"{'(buffer)' if self.lse_buffer else ''} layouts(qkv)={layouts} cfg={self.cfg or 'auto'}")


def make_input(dtype: DType, shape: tuple[int, int, int, int], rng: np.random.Generator, heads_major: bool):
    """(B, S, H, D) values; heads_major: stored as (B, H, S, D) and viewed through a transpose."""
    if heads_major:
        b, s, h, d = shape
        return random_inputs(cp, dtype, (b, h, s, d), rng).transpose(0, 2, 1, 3)
    return random_inputs(cp, dtype, shape, rng)


def guarded_out(dtype: DType, shape: tuple[int, int, int, int]):
    """(out, check): out a view into the middle of a NaN buffer padded in seq, heads and d_head;
    check() asserts every element outside the view is still NaN."""
    b, s, h, d = shape
    buf = poisoned(cp, dtype, (b, s + 2 * PAD_SEQ, h + 2 * PAD_HEADS, d + 2 * PAD_D))
    inner = (slice(None), slice(PAD_SEQ, PAD_SEQ + s), slice(PAD_HEADS, PAD_HEADS + h), slice(PAD_D, PAD_D + d))
    out = buf[inner]

    def check(context: str) -> None:
        f = to_float32(cp, buf)
        f[inner] = cp.nan
        written = int((~cp.isnan(f)).sum())
        assert written == 0, f"{written} elements of the guard band around out were written ({context})"

    return out, check


def guarded_lse(shape: tuple[int, int, int]):
    """(lse, check) for a C-contiguous fp32 (B, H, S_q) view inside a NaN buffer."""
    n = int(np.prod(shape))
    buf = cp.full(n + 2 * LSE_PAD, cp.nan, dtype=cp.float32)
    lse = buf[LSE_PAD:LSE_PAD + n].reshape(shape)

    def check(context: str) -> None:
        guard = cp.concatenate([buf[:LSE_PAD], buf[LSE_PAD + n:]])
        written = int((~cp.isnan(guard)).sum())
        assert written == 0, f"{written} elements of the guard band around lse were written ({context})"

    return lse, check


def _poison_pool_for_lse(shape: tuple[int, int, int]) -> None:
    """Best effort: leave a NaN block of the lse's size in CuPy's pool, so that an lse allocated
    by forward() most likely starts as NaN and an unwritten element fails the check."""
    junk = cp.full(shape, cp.nan, dtype=cp.float32)
    del junk


def run_case(case: Case, rng: np.random.Generator, context: str = "") -> dict:
    context = f"{case.describe()}; {context}" if context else case.describe()
    q = make_input(case.dtype, (case.batch, case.seq_q, case.n_heads, case.d_head), rng, case.heads_major[0])
    kv_shape = (case.batch, case.seq_k, case.n_kv_heads, case.d_head)
    k = make_input(case.dtype, kv_shape, rng, case.heads_major[1])
    v = make_input(case.dtype, kv_shape, rng, case.heads_major[2])
    out, check_out_guard = guarded_out(case.dtype, q.shape)
    lse_shape = (case.batch, case.n_heads, case.seq_q)
    kwargs: dict[str, Any] = {"causal": case.causal}
    check_lse_guard = None
    if case.return_lse:
        kwargs["return_lse"] = True
        if case.lse_buffer:
            kwargs["lse"], check_lse_guard = guarded_lse(lse_shape)
        else:
            _poison_pool_for_lse(lse_shape)
    result = cupyflash.forward(case.cfg, q, k, v, out=out, **kwargs)
    cp.cuda.get_current_stream().synchronize()
    lse = None
    if case.return_lse:
        assert isinstance(result, tuple) and len(result) == 2, f"return_lse=True must return (out, lse) ({context})"
        result, lse = result
        assert isinstance(lse, cp.ndarray) and lse.dtype == cp.float32 and lse.shape == lse_shape, \
            f"lse: {type(lse).__name__} {getattr(lse, 'dtype', None)} {getattr(lse, 'shape', None)} ({context})"
        if case.lse_buffer:
            assert lse is kwargs["lse"]
            check_lse_guard(context)
    assert result is out, f"forward must return the out= array it was given ({context})"
    check_out_guard(context)
    return check_attention(cp, case.dtype, q, k, v, out, causal=case.causal, lse=lse, context=context)


def _repro(test_id: str) -> str:
    return f"seed {SEED}: rerun with CUPYFLASH_TEST_SEED={SEED} pytest tests/test_gpu_shapes.py -k '{test_id}'"


# ----------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("seq_k", SEQS, ids=lambda s: f"sk{s}")
@pytest.mark.parametrize("seq_q", SEQS, ids=lambda s: f"sq{s}")
def test_shape_matrix(seq_q, seq_k):
    rng = np.random.default_rng([SEED, seq_q, seq_k])  # per run and per pair: one case replays alone
    dtype = list(DType)[rng.integers(len(DType))]
    d_head = int(rng.choice(SUPPORTED_D_HEADS))
    n_heads, n_kv_heads = HEAD_PAIRS[rng.integers(len(HEAD_PAIRS))]
    explicit = EXPLICIT.get((dtype, d_head))
    return_lse = bool(rng.random() < 0.5)
    case = Case(
        batch=int(rng.integers(1, 5)), seq_q=seq_q, seq_k=seq_k, n_heads=n_heads, n_kv_heads=n_kv_heads,
        d_head=d_head, dtype=dtype, causal=bool(rng.random() < 0.5),
        cfg=explicit if explicit is not None and rng.random() < 0.25 else None,
        return_lse=return_lse, lse_buffer=return_lse and bool(rng.random() < 0.5),
        heads_major=tuple(bool(x) for x in rng.random(3) < 0.25),
    )
    run_case(case, rng, _repro(f"sq{seq_q}-sk{seq_k}]"))


@pytest.mark.parametrize("n_heads,n_kv_heads", SWEEP_HEADS, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
@pytest.mark.parametrize("d_head", SUPPORTED_D_HEADS, ids=lambda d: f"d{d}")
def test_sweep(d_head, dtype, causal, n_heads, n_kv_heads):
    """Every head dim x dtype x causal x (MHA, GQA, MQA), library pick, lse checked."""
    rng = np.random.default_rng([SEED, d_head, int(dtype), int(causal), n_kv_heads])
    for i, (batch, seq_q, seq_k) in enumerate(SWEEP_SHAPES):
        case = Case(batch, seq_q, seq_k, n_heads, n_kv_heads, d_head, dtype, causal,
                    return_lse=True, lse_buffer=bool(i % 2))
        run_case(case, rng, f"seed {SEED}")


@pytest.mark.parametrize("cfg", sorted(EXPLICIT.values()), ids=str)
def test_explicit_config(cfg):
    """One explicit config per head dim and dtype on ragged shapes, causal and not, GQA."""
    rng = np.random.default_rng([SEED, cfg.d_head, int(cfg.dtype), cfg.B_r, cfg.B_c])
    for batch, seq_q, seq_k in ((1, 1, 1), (2, 65, 129), (1, 1000, 63), (3, 127, 1000)):
        for causal in (False, True):
            case = Case(batch, seq_q, seq_k, 4, 2, cfg.d_head, cfg.dtype, causal, cfg=cfg, return_lse=True)
            run_case(case, rng, f"seed {SEED}")


# ----------------------------------------------------------------------------- masking and lse
@pytest.mark.parametrize("d_head", SUPPORTED_D_HEADS, ids=lambda d: f"d{d}")
def test_rows_that_see_no_key_are_zero_with_minus_inf_lse(d_head):
    # S_q > S_k, causal, bottom-right: query i sees keys j <= i - (S_q - S_k); rows i < 200 see none.
    rng = np.random.default_rng([SEED, d_head, 7])
    dtype = DType.BF16 if d_head % 128 else DType.FP16
    q = random_inputs(cp, dtype, (2, 300, 4, d_head), rng)
    k, v = (random_inputs(cp, dtype, (2, 100, 2, d_head), rng) for _ in range(2))
    out, lse = cupyflash.forward(None, q, k, v, causal=True, return_lse=True)
    cp.cuda.get_current_stream().synchronize()
    masked = to_float32(cp, out[:, :200])
    assert bool((masked == 0).all()), "rows that see no key must be exactly 0 (never NaN)"
    assert bool(cp.isneginf(lse[:, :, :200]).all()), "their lse must be -inf"
    assert bool(cp.isfinite(lse[:, :, 200:]).all())
    check_attention(cp, dtype, q, k, v, out, causal=True, lse=lse, context=f"seed {SEED}")


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
@pytest.mark.parametrize("d_head", [64, 128])
def test_lse_merges_partial_results(dtype, d_head):
    """Attention over keys split in two chunks, merged with the lse, equals attention over all of
    them: out = sum_i exp(lse_i - lse) * out_i, lse = logsumexp_i lse_i (README recipe)."""
    rng = np.random.default_rng([SEED, d_head, int(dtype), 11])
    q = random_inputs(cp, dtype, (2, 333, 8, d_head), rng)
    k, v = (random_inputs(cp, dtype, (2, 1000, 2, d_head), rng) for _ in range(2))
    full, full_lse = cupyflash.forward(None, q, k, v, return_lse=True)
    parts = [cupyflash.forward(None, q, k[:, a:b], v[:, a:b], return_lse=True) for a, b in ((0, 419), (419, 1000))]
    lses = cp.stack([p[1] for p in parts])                      # (2, B, H, S_q)
    lse = cp.logaddexp(lses[0], lses[1])
    weights = cp.exp(lses - lse)                                # (2, B, H, S_q)
    outs = cp.stack([to_float32(cp, p[0]) for p in parts])      # (2, B, S_q, H, D)
    merged = (outs * cp.transpose(weights, (0, 1, 3, 2))[..., None]).sum(axis=0)
    cp.cuda.get_current_stream().synchronize()
    assert float(cp.abs(lse - full_lse).max()) <= 1e-3
    ref, ref_lse = attention_reference(cp, q, k, v, 1.0 / math.sqrt(d_head))
    check_lse(cp, lse, ref_lse, "merged")
    rel = float(cp.linalg.norm(merged - ref) / cp.linalg.norm(ref))
    assert rel <= REL_L2_TOLERANCE[dtype], f"merged rel L2 {rel:.3g} (seed {SEED})"
    check_attention(cp, dtype, q, k, v, full, lse=full_lse, context=f"seed {SEED}")


# ----------------------------------------------------------------------------- strided inputs
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d_head", SUPPORTED_D_HEADS, ids=lambda d: f"d{d}")
def test_packed_qkv_slices(d_head, causal):
    """q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2] of one (B, S, 3, H, D) tensor: no copies."""
    rng = np.random.default_rng([SEED, d_head, int(causal), 3])
    dtype = DType.BF16 if causal else DType.FP16
    qkv = random_inputs(cp, dtype, (2, 300, 3, 4, d_head), rng)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    out, check_guard = guarded_out(dtype, q.shape)
    _, lse = cupyflash.forward(None, q, k, v, out=out, causal=causal, return_lse=True)
    cp.cuda.get_current_stream().synchronize()
    check_guard("packed qkv")
    check_attention(cp, dtype, q, k, v, out, causal=causal, lse=lse, context=f"packed qkv, seed {SEED}")


@pytest.mark.parametrize("d_head", SUPPORTED_D_HEADS, ids=lambda d: f"d{d}")
def test_fused_gqa_projection_slices(d_head):
    """A fused (B, S, H_q + 2 * H_kv, D) projection sliced along heads: GQA with strided k/v."""
    rng = np.random.default_rng([SEED, d_head, 5])
    h_q, h_kv = 8, 2
    x = random_inputs(cp, DType.BF16, (1, 257, h_q + 2 * h_kv, d_head), rng)
    q, k, v = x[:, :, :h_q], x[:, :, h_q:h_q + h_kv], x[:, :, h_q + h_kv:]
    out = cupyflash.forward(None, q, k, v, causal=True)
    check_attention(cp, DType.BF16, q, k, v, out, causal=True, context=f"fused projection, seed {SEED}")


# ----------------------------------------------------------------------------- fast path
def test_causal_and_full_calls_never_share_a_fast_path_plan():
    """Same shapes, alternating causal: each call replays its own plan and is right."""
    rng = np.random.default_rng([SEED, 13])
    for i in range(6):
        causal = bool(i % 2)
        q = random_inputs(cp, DType.BF16, (2, 200, 4, 128), rng)
        k, v = (random_inputs(cp, DType.BF16, (2, 200, 1, 128), rng) for _ in range(2))
        out = cupyflash.forward(None, q, k, v, causal=causal)
        check_attention(cp, DType.BF16, q, k, v, out, causal=causal, context=f"call {i}, seed {SEED}")


# ----------------------------------------------------------------------------- frameworks
@pytest.mark.parametrize("seq,h_q,h_kv,d_head", [(1000, 8, 2, 128), (129, 4, 1, 64), (2048, 4, 4, 128),
                                                 (300, 6, 3, 256)])
def test_torch_causal_gqa_matches_sdpa(seq, h_q, h_kv, d_head):
    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda").manual_seed(SEED + seq)
    q = torch.randn(2, seq, h_q, d_head, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, seq, h_kv, d_head, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    out, lse = cupyflash.forward(None, q, k, v, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == q.shape
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.shape == (2, h_q, seq)
    assert lse.device == q.device and lse.is_contiguous()
    qt, kt, vt = (x.transpose(1, 2).float() for x in (q, k, v))
    try:
        expected = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    except TypeError:  # torch < 2.5 has no enable_gqa: repeat the k/v heads instead
        g = h_q // h_kv
        expected = torch.nn.functional.scaled_dot_product_attention(
            qt, kt.repeat_interleave(g, dim=1), vt.repeat_interleave(g, dim=1), is_causal=True)
    expected = expected.transpose(1, 2)
    rel = ((out.float() - expected).norm() / expected.norm()).item()
    assert rel < REL_L2_TOLERANCE[DType.BF16], f"rel L2 vs SDPA {rel:.3g} (seed {SEED})"
    # lse against torch's own masked logsumexp (fp32)
    g = h_q // h_kv
    scores = (qt @ kt.repeat_interleave(g, dim=1).transpose(-1, -2)) / math.sqrt(d_head)
    hidden = torch.ones(seq, seq, device="cuda", dtype=torch.bool).triu(1)
    expected_lse = torch.logsumexp(scores.masked_fill(hidden, -math.inf), dim=-1)
    assert (lse - expected_lse).abs().max().item() <= 1e-3


def test_torch_out_and_lse_buffers():
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 65, 4, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 130, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    out = torch.full_like(q, math.nan)
    lse = torch.full((1, 4, 65), math.nan, device="cuda", dtype=torch.float32)
    result = cupyflash.forward(None, q, k, v, out=out, causal=True, return_lse=True, lse=lse)
    torch.cuda.synchronize()
    assert result[0] is out and result[1] is lse
    qc, kc, vc, oc = (cp.from_dlpack(x) for x in (q, k, v, out))
    check_attention(cp, DType.FP16, qc, kc, vc, oc, causal=True, lse=cp.from_dlpack(lse), context=f"seed {SEED}")


def test_jax_causal_gqa_with_lse():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    keys = jax.random.split(jax.random.PRNGKey(SEED), 3)
    q = jax.random.normal(keys[0], (2, 100, 4, 128), dtype=jnp.bfloat16)
    k, v = (jax.random.normal(kk, (2, 37, 1, 128), dtype=jnp.bfloat16) for kk in keys[1:])
    out, lse = cupyflash.forward(None, q, k, v, causal=True, return_lse=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert lse.dtype == jnp.float32 and lse.shape == (2, 4, 100)
    qc, kc, vc, oc, lc = (cp.from_dlpack(x) for x in (q, k, v, out, lse))
    check_attention(cp, DType.BF16, qc, kc, vc, oc, causal=True, lse=lc, context=f"seed {SEED}")
