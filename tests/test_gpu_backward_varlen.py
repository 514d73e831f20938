"""GPU tests of backward_varlen against the SPEC §5 rule, per sequence, on a float64 reference:
ragged batches with empty sequences (no queries, no keys, or both), lengths at tile boundaries,
seq_q != seq_k per sequence, causal and not, GQA/MQA, fp16/bf16, d_head 64/96/128/256, atomic and
deterministic dQ, poisoned outputs (pad tokens after the last sequence stay untouched; new outputs
are zero there), strided inputs, bit equality with the dense backward on equal lengths
(deterministic), the opt-in index check, queries whose every logit is far below zero next to key
tails, and torch autograd through cupyflash.torch.attention_varlen.
Skipped cleanly without a GPU."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash.config import DType
from cupyflash.device import has_gpu
from cupyflash.families.backward_sm80.config_sets import default_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU")]

if has_gpu():
    import cupy as cp

    import cupyflash
    from gpu_backward_reference import check_gradients
    from gpu_reference import packed_batch, poisoned, random_inputs

D_HEADS = (64, 96, 128, 256)
# the H100 table's d_head 128 pick (pipelined, one barrier per iteration) beside the defaults
PIPELINED = "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe"


def prewarm_plan(arch: str, cc: int) -> list[tuple]:
    """What this module compiles, as gpu_prewarm.prewarm_groups groups, for a GPU of `arch` / `cc`
    (no GPU needed: scripts/prewarm_offdevice.py --test-modules builds it off the device): the
    varlen variants, the dense ones the equality test uses, and on cc 9.0 the Hopper family's."""
    from cupyflash.families.backward_sm80 import BACKWARD_SM80
    from cupyflash.families.forward_sm80.config_sets import default_config as forward_default

    groups = [([default_config(dt, d) for dt in DType for d in D_HEADS] + [BACKWARD_SM80.parse(PIPELINED)], [arch],
               dict(variants=BACKWARD_SM80.all_variants())),
              ([forward_default(dt, d) for dt in DType for d in D_HEADS], [arch], dict(causal=(False, True)))]
    if cc == 90:  # the Hopper family's configs, every variant
        from cupyflash.families.backward_sm90 import BACKWARD_SM90

        hopper = sorted({hopper_config(f, dt, d, c, s) for f in ("sm90", "sm90_plain") for dt in DType
                         for d in D_HEADS for c in (False, True) for s in (1, 1500)}
                        | set(d96_configs()) | set(park_configs()), key=str)
        groups.append((hopper, ["sm_90a"], dict(variants=BACKWARD_SM90.all_variants())))
    return groups


@pytest.fixture(scope="module", autouse=True)
def prewarmed_cache():
    """Compile the varlen variants (and the dense ones the equality test uses) in parallel first."""
    from gpu_prewarm import prewarm_this_gpu

    prewarm_this_gpu(cp, prewarm_plan)


@pytest.fixture
def rng():
    return np.random.default_rng()


def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale=None):
    return cupyflash.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=scale,
                                    return_lse=True, cfg=_forward_cfg(q.dtype, q.shape[-1]))


def _forward_cfg(np_dtype, d):
    from cupyflash.families.forward_sm80.config_sets import default_config as forward_default

    return forward_default(DType.FP16 if np_dtype == np.float16 else DType.BF16, d)


def check_per_sequence(dtype, q, k, v, dout, grads, cu_q, cu_k, causal, scale=None):
    """Each sequence's dq, dk, dv against the reference; sequences without keys: dq 0; without
    queries: dk = dv = 0."""
    dq, dk, dv = grads
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        context = f"sequence {b}: {q1 - q0} queries, {k1 - k0} keys, causal={causal}"
        if q1 == q0 or k1 == k0:
            assert bool((dq[q0:q1].astype(cp.float32) == 0).all()), context
            assert bool((dk[k0:k1].astype(cp.float32) == 0).all()), context
            assert bool((dv[k0:k1].astype(cp.float32) == 0).all()), context
            continue
        check_gradients(cp, dtype, q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1],
                        (dq[None, q0:q1], dk[None, k0:k1], dv[None, k0:k1]), scale, causal=causal, context=context)


RAGGED = [
    # (lens_q, lens_k): empty sequences of every kind, tile boundaries, seq_q != seq_k
    ([1, 0, 17, 64, 65, 128, 3, 0], [1, 5, 0, 64, 63, 129, 300, 0]),
    ([200, 1, 127, 256], [200, 1, 127, 256]),
    ([0, 0, 33], [7, 0, 33]),
]


def family_config(family: str, dtype: DType, d: int, causal: bool, max_q: int):
    """cfg for backward_varlen: None (the library's pick: backward_sm90 on Hopper), backward_sm80's
    default, or backward_sm90's default made non-persistent with TMA-reduced dQ (the knobs its
    default does not cover; at every d_head, d_head 96's colsplit and 256's kv_split tiles too)."""
    if family == "auto":
        return None
    if family == "sm80":
        return default_config(dtype, d)
    from cupyflash.device import compute_capability

    if compute_capability(cp.cuda.runtime.getDevice()) != 90:
        pytest.skip("backward_sm90 needs an sm_90 GPU")
    return hopper_config(family, dtype, d, causal, max_q)


def hopper_config(family: str, dtype: DType, d: int, causal: bool, max_q: int):
    """backward_sm90's default ("sm90"), or made non-persistent with the companion's row kernels
    and TMA-reduced dQ ("sm90_plain")."""
    from cupyflash.families.backward_sm90.config_sets import default_config as sm90_default

    cfg = sm90_default(dtype, d, causal, max_q)
    if family == "sm90_plain":  # one CTA per tile, the companion's row kernels, TMA-reduced dQ
        return cfg.replace(persistent=False, dynamic=False, pdl=False, dq_early=False, dq_frag=False, lpt=False,
                           rotate=False)
    return cfg


@pytest.mark.parametrize("family", ["auto", "sm80", "sm90_plain"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
@pytest.mark.parametrize("d", D_HEADS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", RAGGED, ids=["mixed", "boundaries", "empty_first"])
def test_ragged_batches(rng, family, deterministic, dtype, d, causal, lens):
    lens_q, lens_k = lens
    cfg = family_config(family, dtype, d, causal, max(lens_q))
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, dtype, lens_q, lens_k, 8, 2, d, pad_q=5, pad_k=3)
    out, lse = forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal)
    dout = random_inputs(cp, dtype, q.shape, rng)
    dq, dk, dv = (poisoned(cp, dtype, x.shape) for x in (q, k, v))
    res = cupyflash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                    dq=dq, dk=dk, dv=dv, deterministic=deterministic, cfg=cfg)
    assert res[0] is dq and res[1] is dk and res[2] is dv
    check_per_sequence(dtype, q, k, v, dout, res, hq, hk, causal)
    # the pad tokens after the last sequence belong to none: never written into given outputs
    assert bool(cp.isnan(dq[int(hq[-1]):].astype(cp.float32)).all())
    assert bool(cp.isnan(dk[int(hk[-1]):].astype(cp.float32)).all())
    # new outputs are zero there (the pool's next blocks are poisoned first: stale bytes would show)
    stale = [poisoned(cp, dtype, x.shape) for x in (q, k, v)]
    del stale
    new = cupyflash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                    deterministic=deterministic, cfg=cfg)
    assert bool((new[0][int(hq[-1]):].astype(cp.float32) == 0).all())
    assert bool((new[2][int(hk[-1]):].astype(cp.float32) == 0).all())
    check_per_sequence(dtype, q, k, v, dout, new, hq, hk, causal)


@pytest.mark.parametrize("family", ["auto", "sm80", "sm90_plain"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_new_outputs_zero_a_long_tail(rng, family, deterministic):
    """Many more pad tokens after the last sequence than the preprocess grid has threads: every
    pad row of new outputs is zeroed (the preprocess's grid-stride loop), the sequences' rows are
    the gradients."""
    dtype, d, lens_q, lens_k = DType.BF16, 128, [3, 40], [70, 5]
    cfg = family_config(family, dtype, d, False, max(lens_q))
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, dtype, lens_q, lens_k, 8, 2, d, pad_q=5000, pad_k=7000)
    out, lse = forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), False)
    dout = random_inputs(cp, dtype, q.shape, rng)
    stale = [poisoned(cp, dtype, x.shape) for x in (q, k, v)]
    del stale
    grads = cupyflash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                      deterministic=deterministic, cfg=cfg)
    for g, end in zip(grads, (hq[-1], hk[-1], hk[-1])):
        assert bool((g[int(end):].astype(cp.float32) == 0).all())
    check_per_sequence(dtype, q, k, v, dout, grads, hq, hk, False)


def _replay_problem(rng, lens_q, lens_k, causal, d_head=128):
    """The replay tests' call: its eight arrays (bf16, 8 query heads on 2 KV heads, d_head 128 by
    default, padding rows past the last sequence, out and lse from the forward) and the host offsets."""
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, DType.BF16, lens_q, lens_k, 8, 2, d_head, pad_q=4, pad_k=2)
    out, lse = forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal)
    dout = random_inputs(cp, DType.BF16, q.shape, rng)
    return (dout, q, k, v, out, lse, cu_q, cu_k), hq, hk


def test_replays_on_a_given_stream(rng):
    """stream= (a CuPy stream object or its handle) replays the current stream's plan on that
    stream, its workspace in that stream's order: the same bits (deterministic) after the caller
    allocated on its own non-blocking stream."""
    from cupyflash.backward_varlen import _PLANS, clear

    clear()
    arrays, _, _ = _replay_problem(rng, [500, 0, 1290], [700, 3, 1290], True)
    first = cupyflash.backward_varlen(*arrays, 1290, 1290, causal=True, deterministic=True)
    cp.cuda.Device().synchronize()
    mine, side = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with mine:
        for i in range(4):
            again = cupyflash.backward_varlen(*arrays, 1290, 1290, causal=True, deterministic=True,
                                              stream=side if i % 2 else side.ptr)
            cp.full((8 * 2048,), cp.nan, dtype=cp.float32)  # the caller's next allocations
            side.synchronize()
            mine.synchronize()
            for a, b in zip(first, again):
                assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())
    assert len(_PLANS) == 1


@pytest.mark.parametrize("d_head", [128, 96, 256, -256], ids=["d128", "d96", "d256", "d256-backward_sm80"])
@pytest.mark.parametrize("causal", [False, True])
def test_cfg_none_replays_its_call(rng, causal, d_head, monkeypatch):
    """Later calls with the first one's signature (new outputs, the current stream) replay its
    launch from parameter blocks packed once: the full path's bits (deterministic), zeros past the
    last sequence, new outputs each time; CuPy arrays and torch tensors each get their own replay.
    -256: d_head 256 with backward_sm90 taken out of cfg=None's d_heads (backward_sm80 on every GPU)."""
    from cupyflash import backward_api
    from cupyflash.backward_varlen import _PLANS, clear
    from cupyflash.device import compute_capability

    sm80 = d_head < 0 or compute_capability(cp.cuda.runtime.getDevice()) != 90
    if d_head < 0:
        monkeypatch.setattr(backward_api, "AUTO_D_HEADS", ())
        d_head = -d_head
    clear()
    dtype = DType.BF16
    arrays, hq, hk = _replay_problem(rng, [50, 0, 129], [70, 3, 129], causal, d_head)
    dout, q, k, v = arrays[:4]

    def call(*xs):
        return cupyflash.backward_varlen(*xs, 129, 129, causal=causal, deterministic=True)

    first = call(*arrays)
    assert len(_PLANS) == 1
    (replay,) = _PLANS.values()  # its pointers go into blocks packed once (both families)
    assert replay.packed is not None and sm80 == (type(replay.plan.cfg).__name__ == "BackwardKernelConfig")
    for _ in range(2):
        stale = [poisoned(cp, dtype, x.shape) for x in (q, k, v)]
        del stale
        again = call(*arrays)
        for a, b in zip(first, again):
            assert a is not b and bool((a.view(cp.uint16) == b.view(cp.uint16)).all())
        assert bool((again[0][int(hq[-1]):].astype(cp.float32) == 0).all())
        assert bool((again[1][int(hk[-1]):].astype(cp.float32) == 0).all())
    assert len(_PLANS) == 1
    check_per_sequence(dtype, q, k, v, dout, again, hq, hk, causal)
    torch = pytest.importorskip("torch")
    tensors = tuple(torch.from_dlpack(x) for x in arrays)
    call(*tensors)
    replayed = call(*tensors)
    assert len(_PLANS) == 2
    for a, b in zip(first, replayed):
        assert isinstance(b, torch.Tensor) and torch.equal(torch.from_dlpack(a), b)


@pytest.mark.parametrize("cfg", ["auto", PIPELINED])
@pytest.mark.parametrize("heads", [(8, 8), (8, 1), (16, 2)])
def test_gqa_mqa_scale_and_configs(rng, cfg, heads):
    n_heads, n_kv = heads
    lens_q, lens_k = [50, 300, 9, 64], [80, 300, 1, 640]
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, DType.BF16, lens_q, lens_k, n_heads, n_kv, 128)
    out, lse = forward(q, k, v, cu_q, cu_k, 300, 640, True, scale=0.3)
    dout = random_inputs(cp, DType.BF16, q.shape, rng)
    grads = cupyflash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 300, 640, causal=True,
                                      softmax_scale=0.3, cfg=cfg)
    check_per_sequence(DType.BF16, q, k, v, dout, grads, hq, hk, True, scale=0.3)


def test_strided_inputs_and_outputs(rng):
    """q, k, v, dout as head slices of wider arrays, dq/dk/dv written into strided views."""
    dtype = DType.FP16
    lens = [70, 0, 130]
    hcu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu = cp.asarray(hcu)
    total = sum(lens)
    wide_q = random_inputs(cp, dtype, (total, 12, 128), rng)
    wide_kv = random_inputs(cp, dtype, (total, 2, 6, 128), rng)
    q, k, v = wide_q[:, 2:10], wide_kv[:, 0, 1:3], wide_kv[:, 1, 3:5]
    out, lse = cupyflash.forward_varlen(q, k, v, cu, cu, 130, 130, causal=True, return_lse=True)
    dout = random_inputs(cp, dtype, (total, 16, 128), rng)[:, ::2]
    dq_wide, dkv_wide = poisoned(cp, dtype, (total, 9, 128)), poisoned(cp, dtype, (total, 2, 3, 128))
    dq, dk, dv = dq_wide[:, 1:9], dkv_wide[:, 0, :2], dkv_wide[:, 1, 1:]
    cupyflash.backward_varlen(dout, q, k, v, out, lse, cu, cu, 130, 130, causal=True, dq=dq, dk=dk, dv=dv)
    assert bool(cp.isnan(dq_wide[:, 0].astype(cp.float32)).all())  # the untouched head column
    contiguous = [cp.ascontiguousarray(x) for x in (q, k, v, dout)]
    check_per_sequence(dtype, *contiguous, (dq, dk, dv), hcu, hcu, True)


@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_equal_lengths_match_the_dense_backward_bit_for_bit(rng, family, causal, d):
    """Deterministic mode on a batch of equal lengths: the packed call and the dense call run the
    same code on the same numbers, so every bit agrees (the packed rows past a sequence's end
    are the next sequence's, which P = 0 hides as the dense call's zero fill)."""
    batch, seq, heads = 3, 200, 4
    cfg = default_config(DType.BF16, d) if family == "sm80" else family_config("sm90", DType.BF16, d, causal, seq)
    q, k, v, dout = (random_inputs(cp, DType.BF16, (batch, seq, heads, d), rng) for _ in range(4))
    out, lse = cupyflash.forward(_forward_cfg(q.dtype, d), q, k, v, causal=causal, return_lse=True)
    dense = cupyflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, cfg=cfg)
    cu = cp.arange(0, (batch + 1) * seq, seq, dtype=cp.int32)
    flat = [x.reshape(batch * seq, heads, d) for x in (dout, q, k, v, out)]
    lse_packed = cp.ascontiguousarray(cp.transpose(lse, (1, 0, 2)).reshape(heads, batch * seq))
    packed_grads = cupyflash.backward_varlen(*flat, lse_packed, cu, cu, seq, seq, causal=causal,
                                             deterministic=True, cfg=cfg)
    for name, a, b in zip(("dq", "dk", "dv"), dense, packed_grads):
        assert bool((a.reshape(b.shape).view(cp.uint16) == b.view(cp.uint16)).all()), name


def park_pair(causal: bool, max_q: int):
    """backward_varlen's d_head 128 pick (park) and the previous default: without park and the
    knob whose varlen build ptxas serialised without it (dq_frag causal, dq_mid non-causal)."""
    from cupyflash.families.backward_sm90.config_sets import varlen_default_config

    parked = varlen_default_config(DType.BF16, 128, causal, max_q)
    assert parked.park and parked.dq_frag and parked.dq_mid
    return parked, parked.replace(park=False, **({"dq_frag": False} if causal else {"dq_mid": False}))


def park_configs():
    """The park pairs of both masks, short and long calls."""
    return sorted({c for causal in (False, True) for s in (1, 1500, 8192) for c in park_pair(causal, s)}, key=str)


def d96_configs():
    """backward_varlen's d_head 96 picks on Hopper (bf16, both masks, short and long calls) and
    their twins with the other dq_colsplit setting (dQ's columns 64 + 32 over the warpgroups)."""
    from cupyflash.families.backward_sm90.config_sets import varlen_default_config

    picks = {varlen_default_config(DType.BF16, 96, c, s) for c in (False, True) for s in (1, 1500, 8192)}
    return sorted(picks | {c.replace(dq_colsplit=not c.dq_colsplit) for c in picks}, key=str)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("colsplit", [False, True], ids=["by_keys", "dq_colsplit"])
def test_hopper_d96_ragged_batches(rng, causal, colsplit):
    """d_head 96 on the Hopper family, dQ by keys and by columns (dq_colsplit): the ragged
    batches above and one with more tiles than SMs, GQA 4."""
    from cupyflash.device import compute_capability
    from cupyflash.families.backward_sm90.config_sets import varlen_default_config

    if compute_capability(cp.cuda.runtime.getDevice()) != 90:
        pytest.skip("backward_sm90 needs an sm_90 GPU")
    for lens_q, lens_k in RAGGED + [([1, 700, 64, 1000, 0, 333, 129, 1500],) * 2]:
        max_q, max_k = max(lens_q), max(lens_k)
        cfg = varlen_default_config(DType.BF16, 96, causal, max_q).replace(dq_colsplit=colsplit)
        q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, DType.BF16, lens_q, lens_k, 16, 4, 96)
        out, lse = forward(q, k, v, cu_q, cu_k, max_q, max_k, causal)
        dout = random_inputs(cp, DType.BF16, q.shape, rng)
        grads = cupyflash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal, cfg=cfg)
        check_per_sequence(DType.BF16, q, k, v, dout, grads, hq, hk, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_walks_many_tiles_and_sequences(rng, causal):
    """The Hopper default on a ragged batch with more tiles than SMs (persistent CTAs walking
    many, dynamic claims when causal), GQA 4, both dtypes' defaults (bf16 here)."""
    family_config("sm90", DType.BF16, 128, causal, 1)  # skips off Hopper
    lens = [1, 700, 64, 1000, 0, 333, 129, 1500]
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, DType.BF16, lens, lens, 16, 4, 128)
    out, lse = forward(q, k, v, cu_q, cu_k, 1500, 1500, causal)
    dout = random_inputs(cp, DType.BF16, q.shape, rng)
    grads = cupyflash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 1500, 1500, causal=causal)
    check_per_sequence(DType.BF16, q, k, v, dout, grads, hq, hk, causal)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_park_matches_the_unparked_kernel(rng, causal, deterministic):
    """backward_varlen's d_head 128 defaults park each tile's sequence values in shared memory
    (`park`; non-causal, the tail zeroer zeroes a sequence's K/V rows past its end and every
    block clamps the exponent): on a ragged batch with more tiles than SMs (persistent CTAs
    walking many tiles of different sequences, lengths off the 128-key blocks), GQA 4, dK and dV
    agree bit for bit with the previous default, without park and the knob it allows (dq_frag
    causal, dq_mid non-causal: the same products in the same order), dQ too when deterministic
    (its own pass) and within rounding of the atomic order otherwise."""
    family_config("sm90", DType.BF16, 128, causal, 1)  # skips off Hopper
    lens = [1, 700, 64, 1000, 0, 333, 129, 1500, 257, 1024]
    parked, unparked = park_pair(causal, 1500)
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, DType.BF16, lens, lens, 16, 4, 128)
    out, lse = forward(q, k, v, cu_q, cu_k, 1500, 1500, causal)
    dout = random_inputs(cp, DType.BF16, q.shape, rng)
    grads = [cupyflash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 1500, 1500, causal=causal,
                                       deterministic=deterministic, cfg=cfg)
             for cfg in (parked, unparked)]
    check_per_sequence(DType.BF16, q, k, v, dout, grads[0], hq, hk, causal)
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        if name == "dq" and not deterministic:
            assert float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max()) <= 2e-2 * float(cp.abs(b).max())
        else:
            assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all()), name


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
@pytest.mark.parametrize("causal", [False, True])
def test_very_negative_logits_next_to_key_tails(rng, causal, dtype, deterministic):
    """cfg=None on a packed batch whose every score is far below zero (lse2 < -128), with lengths
    off the 128-key blocks (each sequence's last key block reaches into the next sequence's keys)
    and some dO rows zero (dvec 0). On Hopper the non-causal d_head 128 kernel runs every block
    unmasked on the tail zeroer's zero K/V rows: those keys' score is 0 and exp2(0 - lse2) would
    overflow, and dS^T = inf * (0 - 0) would be NaN where dO is zero and reach dQ through K's zero
    rows (without the kernel's clamp of the exponent at 0, every dq row: NOTES.md item 362). dQ
    must stay finite, rows of zero dO exactly 0. Judged per sequence by SPEC §5's first rule alone,
    as the dense test_very_negative_logits_with_a_key_tail (the inputs' large common component
    cancels in dQ)."""
    from gpu_backward_reference import attention_backward_reference
    from gpu_reference import to_float32

    lens = [130, 77, 300, 1, 200]
    heads, d = 4, 128

    def shifted(mean):  # mean + 0.1 N(0, 1) in `dtype` (bf16 through ml_dtypes on the host)
        host = (mean + 0.1 * rng.standard_normal((sum(lens), heads, d), dtype=np.float32)).astype(dtype.numpy_dtype)
        return cp.asarray(host)

    q, k = shifted(3.0), shifted(-3.0)
    v = random_inputs(cp, dtype, k.shape, rng)
    dout = cp.asnumpy(random_inputs(cp, dtype, q.shape, rng))
    dout[::3] = 0  # dvec 0 on every third token
    dout = cp.asarray(dout)
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    out, lse = forward(q, k, v, cu, cu, max(lens), max(lens), causal)
    assert float(lse.max()) < -80  # every row's logits are far below zero
    grads = cupyflash.backward_varlen(dout, q, k, v, out, lse, cu, cu, max(lens), max(lens), causal=causal,
                                      deterministic=deterministic)
    assert bool((to_float32(cp, grads[0][::3]) == 0).all()), "dq of the rows whose dO is zero"
    scale = 1.0 / d ** 0.5
    for b in range(len(lens)):
        t0, t1 = int(cu[b]), int(cu[b + 1])
        seq = [x[None, t0:t1] for x in (q, k, v, dout)]
        ref = attention_backward_reference(cp, *seq, scale, causal)
        low = attention_backward_reference(cp, *seq, scale, causal, dtype)
        for name, got_raw, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
            got = to_float32(cp, got_raw[None, t0:t1]).astype(cp.float64)
            context = f"{name}, sequence {b} ({t1 - t0} tokens)"
            assert bool(cp.isfinite(got).all()), f"{context}: {int((~cp.isfinite(got)).sum())} non-finite values"
            err, low_err = float(cp.abs(got - r).max()), float(cp.abs(lo - r).max())
            assert err <= 2 * low_err + 1e-5, f"{context}: max abs error {err:.3g} > 2 x same-precision {low_err:.3g}"


def test_deterministic_is_bit_identical_run_to_run(rng):
    lens = [333, 64, 1, 700]
    q, k, v, cu_q, cu_k, _, _ = packed_batch(cp, rng, DType.BF16, lens, lens, 8, 2, 128)
    out, lse = forward(q, k, v, cu_q, cu_k, 700, 700, True)
    dout = random_inputs(cp, DType.BF16, q.shape, rng)
    runs = [cupyflash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 700, 700, causal=True,
                                      deterministic=True) for _ in range(3)]
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())


def test_index_check_refuses_bad_offsets(rng):
    q, k, v, cu_q, cu_k, _, _ = packed_batch(cp, rng, DType.BF16, [10, 20], [10, 20], 2, 2, 64)
    out, lse = forward(q, k, v, cu_q, cu_k, 20, 20, False)
    dout = random_inputs(cp, DType.BF16, q.shape, rng)
    with pytest.raises(ValueError, match="^max_seqlen_k"):
        cupyflash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 20, 19, check_indices=True)
    bad = cp.asarray(np.array([0, 10, 31], dtype=np.int32))
    with pytest.raises(ValueError, match="^cu_seqlens_k"):
        cupyflash.backward_varlen(dout, q, k, v, out, lse, cu_q, bad, 20, 21, check_indices=True)


def test_torch_autograd_through_attention_varlen(rng):
    torch = pytest.importorskip("torch")
    import cupyflash.torch as cft

    lens_q, lens_k = [37, 128, 0, 250], [37, 128, 5, 250]
    dtype = torch.bfloat16
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=dtype, requires_grad=True)
    out = cft.attention_varlen(q, k, v, cu_q, cu_k, 250, 250, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    # the same gradients from the CuPy entry points on the same tensors
    ref_out, lse = cupyflash.forward_varlen(q.detach(), k.detach(), v.detach(), cu_q, cu_k, 250, 250, causal=True,
                                            return_lse=True)
    grads = cupyflash.backward_varlen(dout, q.detach(), k.detach(), v.detach(), ref_out, lse, cu_q, cu_k, 250, 250,
                                      causal=True, deterministic=True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), grads):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=name)
    # and the references per sequence (CuPy views: bf16 through its 16-bit patterns)
    def as_cp(t):
        return cp.asarray(t.detach().view(torch.int16)).view(DType.BF16.numpy_dtype)

    check_per_sequence(DType.BF16, *(as_cp(x) for x in (q, k, v, dout)), tuple(as_cp(g) for g in (q.grad, k.grad, v.grad)),
                       cu_q.cpu().numpy(), cu_k.cpu().numpy(), True)
