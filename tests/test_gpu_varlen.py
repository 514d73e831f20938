"""GPU tests of forward_varlen against the SPEC §5 rule, per sequence, on a float64 reference:
ragged batches with empty sequences (no queries, no keys, or both), lengths at tile boundaries,
seq_q != seq_k per sequence, causal and not, GQA/MQA, fp16/bf16, d_head 64/96/128/256, LSE,
strided inputs, poisoned outputs (rows past the last sequence stay untouched), agreement with
forward() on equal lengths, CUDA-graph replay, the opt-in index check, torch tensors, and each
family that serves varlen. Skipped cleanly without a GPU."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash.config import DType
from cupyflash.device import has_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU")]

if has_gpu():
    import cupy as cp

    import cupyflash
    from gpu_reference import check_attention, packed_batch, poisoned, random_inputs


@pytest.fixture
def rng():
    return np.random.default_rng()


def family_config(family: str, dtype: DType, d: int, causal: bool):
    """cfg for forward_varlen: None (the library's pick: forward_sm90 on Hopper), forward_sm80's
    default, or forward_sm90's default made persistent (its tile scheduler skips empty tiles), or
    with the cross-tile overlap as well, or with each warpgroup stopping at its own last visible
    key block (wg_blocks: per-sequence lengths decide it), or the default with causal grids
    started longest tiles first (lpt), or a persistent two-consumer tile whose Q K^T reads Q's
    fragments from registers (qreg), or the default with each warpgroup's last key block cut to its
    first half when none of its rows sees the second (halflast: per-sequence lengths decide it)."""
    if family == "auto":
        return None
    if family == "sm80":
        from cupyflash.families.forward_sm80.config_sets import default_config

        return default_config(dtype, d)
    import dataclasses

    from cupyflash.device import compute_capability
    from cupyflash.families.forward_sm90.config_sets import default_config

    if compute_capability(cp.cuda.runtime.getDevice()) != 90:
        pytest.skip("forward_sm90 needs an sm_90 GPU")
    if family == "sm90_xtile":  # cross-tile overlap: each tile's next first block under its last P V
        try:
            return default_config(dtype, d, causal).replace(persistent=True, double_q=True, turn_ring=True,
                                                            cross_tile=True)
        except ValueError:
            pytest.skip("no second Q tile fits at this d_head")
    if family == "sm90_lpt":  # causal grids: longest tiles first across the sequences' heads
        return dataclasses.replace(default_config(dtype, d, causal), lpt_mib=16)
    if family == "sm90_wgblocks":
        return dataclasses.replace(default_config(dtype, d, causal), persistent=True, wg_blocks=True)
    if family == "sm90_qreg":  # Q's fragments in registers on the two-consumer tile (the table's d64 causal 512-1k pick)
        from cupyflash.families.forward_sm90.config import HopperForwardKernelConfig

        try:
            return HopperForwardKernelConfig(dtype, d, 128, 128, 2, True, True, True, True, True, o_direct=True,
                                             lazy_rescale=True, turn_ring=True, q_regs=True)
        except ValueError:
            pytest.skip("Q's fragments do not fit beside the accumulators at this d_head")
    if family == "sm90_halflast":
        cfg = default_config(dtype, d, causal)
        if not cfg.intra_wg_overlap or cfg.cross_tile or cfg.B_c % 32:
            cfg = dataclasses.replace(cfg, B_c=64 if d == 256 else 128, cross_tile=False)
        return dataclasses.replace(cfg, half_last=True)
    return dataclasses.replace(default_config(dtype, d, causal), persistent=True)


def check_per_sequence(dtype, q, k, v, out, cu_q, cu_k, causal, lse=None, scale=None):
    """Each sequence against the reference; sequences with queries but no keys: out 0, lse -inf."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        context = f"sequence {b}: {q1 - q0} queries, {k1 - k0} keys, causal={causal}"
        if k1 == k0:
            assert bool((out[q0:q1].astype(cp.float32) == 0).all()), context
            if lse is not None:
                assert bool(cp.isneginf(lse[:, q0:q1]).all()), context
            continue
        seq_lse = None if lse is None else lse[None, :, q0:q1]
        check_attention(cp, dtype, q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1], scale,
                        causal=causal, lse=seq_lse, context=context)


RAGGED = [
    # (lens_q, lens_k): empty sequences of every kind, tile boundaries, seq_q != seq_k
    ([1, 0, 17, 64, 65, 128, 3, 0], [1, 5, 0, 64, 63, 129, 300, 0]),
    ([200, 1, 127, 256], [200, 1, 127, 256]),
    ([0, 0, 33], [7, 0, 33]),
]


@pytest.mark.parametrize("family", ["auto", "sm80", "sm90_persistent", "sm90_xtile", "sm90_wgblocks", "sm90_lpt",
                                    "sm90_qreg", "sm90_halflast"])
@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", RAGGED)
def test_ragged_batches(rng, family, dtype, d, causal, lens):
    lens_q, lens_k = lens
    cfg = family_config(family, dtype, d, causal)
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, dtype, lens_q, lens_k, 8, 2, d, pad_q=5)
    out = poisoned(cp, dtype, q.shape)
    got, lse = cupyflash.forward_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                        return_lse=True, out=out, cfg=cfg)
    assert got is out
    check_per_sequence(dtype, q, k, v, out, hq, hk, causal, lse)
    # the pad tokens after the last sequence belong to none: never written
    assert bool(cp.isnan(out[int(hq[-1]):].astype(cp.float32)).all())


@pytest.mark.parametrize("family", ["auto", "sm80"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 1), (16, 2)])
def test_gqa_mqa_and_scale(rng, family, heads):
    n_heads, n_kv = heads
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, DType.BF16, [50, 300, 9], [80, 300, 1], n_heads, n_kv, 128)
    out = cupyflash.forward_varlen(q, k, v, cu_q, cu_k, 300, 300, softmax_scale=0.3,
                                   cfg=family_config(family, DType.BF16, 128, False))
    check_per_sequence(DType.BF16, q, k, v, out, hq, hk, False, scale=0.3)


@pytest.mark.parametrize("family", ["auto", "sm80"])
def test_strided_inputs(rng, family):
    """q, k, v as head slices of wider arrays (free token and head strides)."""
    dtype = DType.FP16
    lens = [70, 0, 130]
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    total = sum(lens)
    wide_q = random_inputs(cp, dtype, (total, 12, 128), rng)
    wide_kv = random_inputs(cp, dtype, (total, 2, 6, 128), rng)
    q, k, v = wide_q[:, 2:10], wide_kv[:, 0, 1:3], wide_kv[:, 1, 3:5]
    out = cupyflash.forward_varlen(q, k, v, cu, cu, 130, 130, causal=True,
                                   cfg=family_config(family, dtype, 128, True))
    check_per_sequence(dtype, cp.ascontiguousarray(q), cp.ascontiguousarray(k), cp.ascontiguousarray(v), out,
                       cp.asnumpy(cu), cp.asnumpy(cu), True)


@pytest.mark.parametrize("family", ["sm80", "sm90_persistent"])
@pytest.mark.parametrize("causal", [False, True])
def test_equal_lengths_match_forward(rng, family, causal):
    """A packed batch of equal lengths gives forward()'s bits when both run the same config."""
    batch, s, h, d = 3, 200, 4, 128
    q, k, v = (random_inputs(cp, DType.BF16, (batch, s, h, d), rng) for _ in range(3))
    cu = cp.arange(0, (batch + 1) * s, s, dtype=cp.int32)
    cfg = family_config(family, DType.BF16, d, causal)
    dense = cupyflash.forward(cfg, q, k, v, causal=causal)
    var = cupyflash.forward_varlen(q.reshape(-1, h, d), k.reshape(-1, h, d), v.reshape(-1, h, d), cu, cu, s, s,
                                   causal=causal, cfg=cfg)
    assert bool((var.view(cp.uint16) == dense.reshape(-1, h, d).view(cp.uint16)).all())


@pytest.mark.parametrize("family", ["auto", "sm80"])
def test_cuda_graph_replay_with_new_offsets(rng, family):
    """Captured once; replayed after the offsets (same total, same max) change on the device."""
    dtype = DType.BF16
    cfg = family_config(family, dtype, 64, True)
    q, k, v, cu_q, cu_k, _, _ = packed_batch(cp, rng, dtype, [100, 100], [100, 100], 4, 4, 64)
    out = poisoned(cp, dtype, q.shape)
    cupyflash.forward_varlen(q, k, v, cu_q, cu_k, 150, 150, out=out, causal=True, cfg=cfg)  # compiles, warms up
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        cupyflash.forward_varlen(q, k, v, cu_q, cu_k, 150, 150, out=out, causal=True, cfg=cfg)
        graph = stream.end_capture()
    for lens in ([100, 100], [150, 50], [50, 150], [0, 150]):
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        cu_q[...] = cp.asarray(cu)
        cu_k[...] = cp.asarray(cu)
        out[...] = poisoned(cp, dtype, q.shape)
        graph.launch(stream)
        stream.synchronize()
        check_per_sequence(dtype, q, k, v, out, cu, cu, True)


def test_index_check_raises_before_launch(rng):
    q, k, v, cu_q, cu_k, _, _ = packed_batch(cp, rng, DType.BF16, [10, 20], [10, 20], 4, 4, 64)
    with pytest.raises(ValueError, match="^max_seqlen_q: 15 is less than sequence 1"):
        cupyflash.forward_varlen(q, k, v, cu_q, cu_k, 15, 20, check_indices=True)
    bad = cp.asarray(np.array([0, 10, 31], dtype=np.int32))
    with pytest.raises(ValueError, match="^cu_seqlens_k: the last offset 31"):
        cupyflash.forward_varlen(q, k, v, cu_q, bad, 20, 21, check_indices=True)


def test_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    lens = [33, 0, 257]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = cupyflash.forward_varlen(q, k, v, cu, cu, 257, 257, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and lse.shape == (4, sum(lens))
    for b in range(len(lens)):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        if s1 == s0:
            continue
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(x[s0:s1].transpose(0, 1).float() for x in (q, k, v)), is_causal=True).transpose(0, 1)
        assert (out[s0:s1].float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("family", ["auto", "sm80"])
def test_repeated_calls_take_the_fast_path(rng, family):
    """A second call with the same signature (new arrays, new pointers) replays the remembered
    launch and still computes its own inputs."""
    from cupyflash import varlen_plans

    dtype = DType.FP16
    cfg = family_config(family, dtype, 128, True)
    lens_q, lens_k = [90, 0, 200], [100, 30, 200]
    for _ in range(3):
        q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, dtype, lens_q, lens_k, 8, 4, 128)
        key = varlen_plans.signature(cfg, None, True, False, 200, 200, q, k, v, cu_q, cu_k, None)
        out = cupyflash.forward_varlen(q, k, v, cu_q, cu_k, 200, 200, causal=True, cfg=cfg)
        assert key in varlen_plans._TABLE.plans
        check_per_sequence(dtype, q, k, v, out, hq, hk, True)


def test_calls_with_stream_replay_on_that_stream(rng):
    """stream= (a CuPy stream object or its handle) replays the signature's launch on that stream."""
    from cupyflash import varlen_plans

    varlen_plans.clear()
    side = cp.cuda.Stream(non_blocking=True)
    for i in range(4):
        q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, DType.BF16, [90, 0, 200], [100, 30, 200], 8, 4, 128)
        cp.cuda.get_current_stream().synchronize()
        out, lse = cupyflash.forward_varlen(q, k, v, cu_q, cu_k, 200, 200, causal=True, return_lse=True,
                                            stream=side if i % 2 else side.ptr)
        side.synchronize()
        check_per_sequence(DType.BF16, q, k, v, out, hq, hk, True, lse)
    assert len(varlen_plans._TABLE.plans) == 1


@pytest.mark.parametrize("family", ["auto", "sm80"])
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_repeated_lse_calls_take_the_fast_path(rng, family, framework):
    """return_lse=True calls (torch's autograd forward) replay too: each later call gets a new
    output and a new lse of its own inputs, and a call without lse keeps a plan of its own."""
    from cupyflash import varlen_plans

    if framework == "torch":
        torch = pytest.importorskip("torch")
    dtype = DType.BF16
    cfg = family_config(family, dtype, 128, True)
    lens_q, lens_k = [90, 0, 200], [100, 30, 200]
    seen = []
    for _ in range(3):
        q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, dtype, lens_q, lens_k, 8, 4, 128)
        args = (q, k, v, cu_q, cu_k)
        if framework == "torch":
            args = tuple(torch.from_dlpack(x) for x in args)
        key = varlen_plans.signature(cfg, None, True, True, 200, 200, *args, None)
        out, lse = cupyflash.forward_varlen(*args, 200, 200, causal=True, cfg=cfg, return_lse=True)
        assert key in varlen_plans._TABLE.plans
        assert tuple(lse.shape) == (8, q.shape[0]) and lse.dtype == (torch.float32 if framework == "torch"
                                                                       else cp.float32)
        seen.append((out.data_ptr(), lse.data_ptr()) if framework == "torch" else (out.data.ptr, lse.data.ptr))
        out_c, lse_c = (cp.from_dlpack(x) for x in (out, lse)) if framework == "torch" else (out, lse)
        check_per_sequence(dtype, q, k, v, out_c, hq, hk, True, lse_c)
        plain = cupyflash.forward_varlen(*args, 200, 200, causal=True, cfg=cfg)
        assert (cp.from_dlpack(plain) == out_c).all()
    assert varlen_plans.signature(cfg, None, True, False, 200, 200, *args, None) in varlen_plans._TABLE.plans


@pytest.mark.parametrize("family", ["auto", "sm80", "sm90_persistent", "sm90_xtile", "sm90_wgblocks", "sm90"])
@pytest.mark.parametrize("d", [64, 128])
def test_kernels_zero_the_tail_when_asked(rng, family, d):
    """zero_tail (cupyflash.jax's output buffers): every family's varlen kernel writes out 0 and
    lse 0 for the tokens past cu_seqlens_q[-1] into poisoned arrays, and the sequences' rows as
    without it; on a replay too; a call with nothing to launch (max_seqlen_q 0) zeroes all."""
    from cupyflash.varlen import _forward_varlen

    dtype = DType.BF16
    cfg = family_config(family, dtype, d, True) if family != "sm90" else _sm90_default(dtype, d)
    lens_q, lens_k = [90, 0, 200, 7], [100, 30, 200, 0]
    pad = 301  # more tail rows than one CTA's share
    for run in range(2):  # the first call plans, the second replays its launch
        q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, dtype, lens_q, lens_k, 8, 4, d, pad_q=pad)
        out = poisoned(cp, dtype, q.shape)
        lse = cp.full((8, q.shape[0]), cp.nan, dtype=cp.float32)
        stream = cp.cuda.get_current_stream().ptr
        args = (q, k, v, cu_q, cu_k, 200, 200, True, None, True, out, lse, stream, cfg, None, True, True)
        (got, got_lse), launch = _forward_varlen(*args)
        assert got is out and got_lse is lse
        if run and launch is not None:
            out.view(cp.uint16).fill(0x7FC0)  # NaN again
            lse.fill(cp.nan)
            launch.replay(stream, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr, cu_q.data.ptr,
                          cu_k.data.ptr)
        tail = int(hq[-1])
        assert bool((out[tail:].astype(cp.float32) == 0).all()) and bool((lse[:, tail:] == 0).all())
        check_per_sequence(dtype, q, k, v, out, hq, hk, True, lse)
    out.view(cp.uint16).fill(0x7FC0)
    lse.fill(cp.nan)
    _forward_varlen(q, k, v, cu_q, cu_k, 0, 200, True, None, True, out, lse, stream, cfg, None, True, True)
    assert bool((out.astype(cp.float32) == 0).all()) and bool((lse == 0).all())


def _sm90_default(dtype, d):
    """forward_sm90's default (non-persistent) config, on sm_90 only."""
    from cupyflash.device import compute_capability
    from cupyflash.families.forward_sm90.config_sets import default_config

    if compute_capability(cp.cuda.runtime.getDevice()) != 90:
        pytest.skip("forward_sm90 needs an sm_90 GPU")
    return default_config(dtype, d, True)


@pytest.mark.parametrize("causal", [False, True])
def test_batch_without_keys(rng, causal):
    """No key in any sequence (k and v have zero tokens): every query row gets 0, lse -inf."""
    dtype = DType.BF16
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, dtype, [5, 0, 40], [0, 0, 0], 4, 2, 128)
    assert k.shape[0] == 0
    out, lse = cupyflash.forward_varlen(q, k, v, cu_q, cu_k, 40, 0, causal=causal, return_lse=True)
    check_per_sequence(dtype, q, k, v, out, hq, hk, causal, lse)


def test_lse_into_a_given_array(rng):
    """lse= takes a C-contiguous float32 (n_heads, total_q) array (what the JAX operation hands
    over from XLA), fills it and returns it as given; wrong ones are refused naming lse."""
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, DType.BF16, [40, 0, 130], [40, 9, 200], 4, 2, 64)
    lse = cp.full((4, q.shape[0]), cp.nan, dtype=cp.float32)
    out, got = cupyflash.forward_varlen(q, k, v, cu_q, cu_k, 130, 200, causal=True, return_lse=True, lse=lse)
    assert got is lse
    check_per_sequence(DType.BF16, q, k, v, out, hq, hk, True, lse)
    with pytest.raises(ValueError, match="^lse: expected shape"):
        cupyflash.forward_varlen(q, k, v, cu_q, cu_k, 130, 200, return_lse=True, lse=lse[:, :-1])
    with pytest.raises(ValueError, match="^lse: an lse buffer was given"):
        cupyflash.forward_varlen(q, k, v, cu_q, cu_k, 130, 200, lse=lse)
    with pytest.raises(ValueError, match="^lse: must be C-contiguous"):
        cupyflash.forward_varlen(q, k, v, cu_q, cu_k, 130, 200, return_lse=True,
                                 lse=cp.empty((q.shape[0], 4), cp.float32).T)
