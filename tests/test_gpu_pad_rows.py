"""GPU tests: values outside a sequence never reach its results.

The rows past the last sequence of a packed batch (forward_varlen, backward_varlen: q, k, v, dout,
out), one sequence's own rows (its neighbours' results must not see them: a sequence's last
block reads the next one's rows) and the cache rows past a sequence's keys (forward_kvcache: a
contiguous cache's capacity, a paged cache's unused slots and pages) hold NaN or +-inf here. Each
output and gradient of the other sequences must equal, bit for bit, the one computed with zeros
there (deterministic dQ; atomic dQ within its rounding), for each family that serves the call.
Skipped cleanly without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash.config import DType
from cupyflash.device import has_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU")]

if has_gpu():
    import cupy as cp

    import cupyflash
    from gpu_prewarm import prewarm_this_gpu
    from gpu_reference import packed_batch, random_inputs, to_float32

# The last sequence's length is no multiple of any tile; "trailing_empty" ends with empty
# sequences, so the rows past the last offset follow a sequence that is not the batch's last;
# in "short_last" the first sequence's last block reaches past the second, short one into them.
LENGTHS = {"ragged": ([300, 1000, 77], [300, 1000, 77]),
           "cross": ([64, 129, 200], [517, 33, 333]),
           "trailing_empty": ([300, 77, 0, 0], [250, 91, 0, 0]),
           "short_last": ([130, 77], [130, 77])}
PAD = 50
_BITS = {"nan": (0x7FC0, 0x7FC0), "inf": (0x7F80, 0xFF80)}  # bf16: NaN; +inf / -inf


def pad_bits(shape, kind: str | None):
    """bf16 bit patterns of `shape`: zeros (kind None), NaN, or +inf / -inf alternating."""
    if kind is None:
        return cp.zeros(shape, dtype=cp.uint16)
    even, odd = _BITS[kind]
    index = cp.arange(int(np.prod(shape))).reshape(shape)
    return cp.where(index % 2 == 0, even, odd).astype(cp.uint16)


# Where the poison goes: the rows past the last sequence, or sequence 1's own rows (sequence 0's
# last blocks read them; in "short_last" sequence 1 is the last, followed by the rows past it).
POISONED = ["past_last", "sequence_1"]


def with_rows(arrays, rows: tuple[int, int | None], kind: str | None):
    """Copies of the bf16 `arrays` with rows rows[0] .. rows[1] - 1 (None: to the end) zeroed (kind
    None) or filled with `kind`."""
    copies = [a.copy() for a in arrays]
    for c in copies:
        bits = c.view(cp.uint16)
        bits[rows[0]:rows[1]] = pad_bits(bits[rows[0]:rows[1]].shape, kind)
    return copies


def poisoned_rows(where: str, offsets) -> tuple[int, int | None]:
    """The rows `where` names, of a packed array with host offsets `offsets`."""
    return (int(offsets[-1]), None) if where == "past_last" else (int(offsets[1]), int(offsets[2]))


def kept_rows(where: str, offsets):
    """The rows of the sequences whose results must not change: every sequence's but the poisoned."""
    poisoned = poisoned_rows(where, offsets)
    rows = np.arange(int(offsets[-1]))
    if poisoned[1] is not None:
        rows = rows[(rows < poisoned[0]) | (rows >= poisoned[1])]
    return cp.asarray(rows)


def assert_same(context: str, clean, dirty, rows, exact: bool = True) -> None:
    """Rows `rows` (an index array) of each pair: finite where the clean one is, and equal."""
    for name, (a, b) in enumerate(zip(clean, dirty)):
        a32, b32 = to_float32(cp, a)[rows], to_float32(cp, b)[rows]
        bad = int((cp.isfinite(a32) & ~cp.isfinite(b32)).any(axis=tuple(range(1, a32.ndim))).sum())
        assert bad == 0, f"{context}: output {name}: {bad} of {len(rows)} rows non-finite"
        if exact:
            assert bool((a.view(cp.uint16)[rows] == b.view(cp.uint16)[rows]).all()), \
                f"{context}: output {name} differs from the call with zeros there"
        else:
            assert bool(cp.allclose(a32, b32, rtol=2e-2, atol=2e-3)), f"{context}: output {name}"


def sm90() -> bool:
    from cupyflash.device import compute_capability

    return compute_capability(cp.cuda.runtime.getDevice()) == 90


def forward_cfg(family: str, d: int, causal: bool):
    if family == "auto":
        return None
    from cupyflash.families.forward_sm80.config_sets import default_config

    return default_config(DType.BF16, d)


def backward_cfg(family: str, d: int, causal: bool, max_q: int):
    if family == "auto":
        return None
    if family == "sm80":
        from cupyflash.families.backward_sm80.config_sets import default_config

        return default_config(DType.BF16, d)
    if not sm90():
        pytest.skip("backward_sm90 needs an sm_90 GPU")
    return plain_hopper_backward(DType.BF16, d, causal, max_q)


def plain_hopper_backward(dtype: DType, d: int, causal: bool, max_q: int):
    """backward_sm90's varlen default with one CTA per tile, the companion's row kernels and
    TMA-reduced dQ: no park, so no tail zeroer."""
    from cupyflash.families.backward_sm90.config_sets import varlen_default_config

    return varlen_default_config(dtype, d, causal, max_q).replace(
        persistent=False, dynamic=False, pdl=False, dq_early=False, dq_frag=False, lpt=False, rotate=False,
        park=False, dq_mid=False)


def prewarm_plan(arch: str, cc: int) -> list[tuple]:
    """What this module compiles, as gpu_prewarm.prewarm_groups groups, for a GPU of `arch` / `cc`
    (no GPU needed: scripts/prewarm_offdevice.py --test-modules builds it off the device): the
    varlen variants of the families' defaults (forward_kvcache's decode kernels compile on use)."""
    from cupyflash.families.backward_sm80 import BACKWARD_SM80
    from cupyflash.families.backward_sm80.config_sets import default_config as backward_sm80_default
    from cupyflash.families.forward_sm80 import FORWARD_SM80
    from cupyflash.families.forward_sm80.config_sets import default_config as forward_sm80_default

    def varlen(family):
        return [v for v in family.all_variants() if dict(zip(family.variant_flags, v))["varlen"]]

    forward_sm80 = [forward_sm80_default(DType.BF16, 128)]
    groups = [(forward_sm80, [arch], dict(variants=varlen(FORWARD_SM80))),
              ([backward_sm80_default(DType.BF16, 128)], [arch], dict(variants=varlen(BACKWARD_SM80)))]
    if cc == 90:
        from cupyflash.families.backward_sm90 import BACKWARD_SM90
        from cupyflash.families.backward_sm90.config_sets import varlen_default_config as backward_default
        from cupyflash.families.forward_sm90 import FORWARD_SM90
        from cupyflash.families.forward_sm90.config_sets import varlen_default_config as forward_default

        max_qs = {max(lens_q) for lens_q, _ in LENGTHS.values()}
        forward = {forward_default(DType.BF16, d, c) for d in (64, 128, 256) for c in (False, True)}
        backward = {backward_default(DType.BF16, d, c, m) for d in (64, 128, 256) for c in (False, True) for m in max_qs}
        backward |= {plain_hopper_backward(DType.BF16, 128, c, m) for c in (False, True) for m in max_qs}
        groups += [(sorted(forward, key=str), ["sm_90a"], dict(variants=varlen(FORWARD_SM90))),
                   (sorted(backward, key=str), ["sm_90a"], dict(variants=varlen(BACKWARD_SM90)))]
    return groups


@pytest.fixture(scope="module", autouse=True)
def prewarmed_cache():
    """Compile what the module runs in parallel first (a fixed seed per test: rng)."""
    prewarm_this_gpu(cp, prewarm_plan)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("family", ["auto", "sm80"])
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("where", POISONED)
def test_forward_varlen(rng, where, lengths, family, d, causal, kind):
    if family == "sm80" and d != 128:
        pytest.skip("one d_head for the mma.sync family")
    lens_q, lens_k = LENGTHS[lengths]
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, DType.BF16, lens_q, lens_k, 8, 2, d, pad_q=PAD, pad_k=PAD)
    cfg = forward_cfg(family, d, causal)
    results = []
    for pad in (None, kind):
        qq, = with_rows([q], poisoned_rows(where, hq), pad)
        kk, vv = with_rows([k, v], poisoned_rows(where, hk), pad)
        results.append(cupyflash.forward_varlen(qq, kk, vv, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                return_lse=True, cfg=cfg))
    (o0, l0), (o1, l1) = results
    rows = kept_rows(where, hq)
    assert_same(f"{where} {lengths} {family} d{d} causal={causal} {kind}", [o0], [o1], rows)
    assert bool((l0[:, rows] == l1[:, rows]).all())


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("family", ["auto", "sm80", "sm90_plain"])
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("where", POISONED)
def test_backward_varlen(rng, where, lengths, family, d, causal, deterministic, kind):
    if family != "auto" and d != 128:
        pytest.skip("one d_head for the named families")
    lens_q, lens_k = LENGTHS[lengths]
    max_q, max_k = max(lens_q), max(lens_k)
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, DType.BF16, lens_q, lens_k, 8, 2, d, pad_q=PAD, pad_k=PAD)
    dout = random_inputs(cp, DType.BF16, q.shape, rng)
    out, lse = cupyflash.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True)
    cfg = backward_cfg(family, d, causal, max_q)
    rows_q, rows_k = poisoned_rows(where, hq), poisoned_rows(where, hk)
    results = []
    for pad in (None, kind):
        qq, oo, dd = with_rows([q, out, dout], rows_q, pad)
        kk, vv = with_rows([k, v], rows_k, pad)
        ll = lse.copy()
        if pad is not None:  # (the poisoned sequence's own log-sum-exp too)
            ll[:, rows_q[0]:rows_q[1]] = cp.nan
        results.append(cupyflash.backward_varlen(dd, qq, kk, vv, oo, ll, cu_q, cu_k, max_q, max_k, causal=causal,
                                                 deterministic=deterministic, cfg=cfg))
    context = f"{where} {lengths} {family} d{d} causal={causal} det={deterministic} {kind}"
    assert_same(context + " dq", results[0][:1], results[1][:1], kept_rows(where, hq), exact=deterministic)
    assert_same(context + " dk dv", results[0][1:], results[1][1:], kept_rows(where, hk), exact=deterministic)


def kvcache_problem(rng, d: int, paged: bool, seq_q: int):
    """bf16, 3 sequences with 300 / 1000 / 77 cached rows, 8 query and 2 cache heads; paged: 64-row
    pages in a shuffled order with spare pages. Returns (q, k_cache, v_cache, seqlens, table,
    k_new, v_new, mask of the cache rows past each sequence's keys)."""
    lens, new, capacity = [300, 1000, 77], 3, 1152
    q = random_inputs(cp, DType.BF16, (3, seq_q, 8, d), rng)
    k_new = random_inputs(cp, DType.BF16, (3, new, 2, d), rng)
    v_new = random_inputs(cp, DType.BF16, (3, new, 2, d), rng)
    if paged:
        per_seq, page = capacity // 64, 64
        n_pages = 3 * per_seq + 5
        order = rng.permutation(n_pages).astype(np.int32)
        table = order[:3 * per_seq].reshape(3, per_seq)
        shape = (n_pages, page, 2, d)
        used = np.zeros((n_pages, page), dtype=bool)
        for b, n in enumerate(lens):
            for j in range(n + new):
                used[table[b, j // page], j % page] = True
        table = cp.asarray(table)
    else:
        table, shape = None, (3, capacity, 2, d)
        used = np.zeros((3, capacity), dtype=bool)
        for b, n in enumerate(lens):
            used[b, :n + new] = True
    k_cache = random_inputs(cp, DType.BF16, shape, rng)
    v_cache = random_inputs(cp, DType.BF16, shape, rng)
    return q, k_cache, v_cache, cp.asarray(np.array(lens, dtype=np.int32)), table, k_new, v_new, cp.asarray(~used)


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("appended", [False, True], ids=["cached", "k_new"])
@pytest.mark.parametrize("seq_q", [1, 4])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("d", [64, 128])
def test_forward_kvcache(rng, d, paged, seq_q, appended, kind):
    q, k_cache, v_cache, seqlens, table, k_new, v_new, unused = kvcache_problem(rng, d, paged, seq_q)
    results = []
    for pad in (None, kind):
        kc, vc = k_cache.copy(), v_cache.copy()
        for c in (kc, vc):
            bits = c.view(cp.uint16)
            outside = unused.reshape(unused.shape + (1, 1))
            bits[...] = cp.where(outside, pad_bits(bits.shape, pad), bits)
        extra = dict(k_new=k_new, v_new=v_new) if appended else {}
        results.append(cupyflash.forward_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, causal=True,
                                                 return_lse=True, **extra))
    (o0, l0), (o1, l1) = results
    context = f"d{d} paged={paged} seq_q={seq_q} k_new={appended} {kind}"
    assert_same(context, [o0], [o1], cp.arange(q.shape[0]))
    assert bool((l0 == l1).all()), context
