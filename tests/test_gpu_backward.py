"""GPU tests of `cupyflash.backward`: gradients of every tuning config and of the default configs
over lengths (tails, seq_q != seq_k), causal masking, GQA/MQA, d_head 64/96/128/256 and both
dtypes against a float64 reference (SPEC §5 on dq, dk, dv); deterministic mode bit-identical
over 3 runs. Skipped cleanly without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash.config import DType
from cupyflash.families.forward_sm80.config_sets import default_config as forward_default
from cupyflash.device import has_gpu
from cupyflash.families.backward_sm80.config import BackwardKernelConfig
from cupyflash.families.backward_sm80.config_sets import default_config, get_kernel_configs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU")]

if has_gpu():
    import cupy as cp

    import cupyflash
    from gpu_backward_reference import check_gradients
    from gpu_reference import poisoned, random_inputs

D_HEADS = (64, 96, 128, 256)
TUNE = sorted(set(c for c in get_kernel_configs("tune") if c.dtype is DType.BF16) | set(get_kernel_configs("prog")))
DEFAULTS = [default_config(dtype, d) for dtype in DType for d in D_HEADS]
DBUF = [BackwardKernelConfig.parse(t) for t in (
    "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf",
    "backward_sm80 (FP16, 64, 64, 128, 8): dsplit_1+swizzled+dbuf",
    "backward_sm80 (BF16, 256, 64, 64, 8): dsplit_2+swizzled+dbuf",
    "backward_sm80 (BF16, 128, 64, 64, 4): dsplit_1+swizzled+dbuf+pds",
    "backward_sm80 (FP16, 96, 64, 64, 4): dsplit_1+swizzled+dbuf+pds",
    "backward_sm80 (FP16, 128, 64, 128, 8): dsplit_1+dbuf+pds",   # plain (unswizzled) tiles
    "backward_sm80 (FP16, 64, 128, 128, 8): dsplit_1+swizzled+dbuf+pds",  # 64 x 32 S/dP warp tiles
    "backward_sm80 (BF16, 64, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+kvreg",  # K/V fragments in registers
    "backward_sm80 (FP16, 64, 64, 64, 4): dsplit_1+swizzled+dbuf+pds+kvreg",
    "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe",  # one barrier per iteration
    "backward_sm80 (FP16, 64, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+kvreg+pipe",
    # two Q/dO buffers with mbarrier arrival, dQ before dK/dV, copies issued after the first k-step
    "backward_sm80 (BF16, 64, 128, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+mbar+dqf+ldmid",
    "backward_sm80 (FP16, 64, 128, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+mbar",
    "backward_sm80 (BF16, 64, 128, 128, 8): dsplit_1+swizzled+dbuf+pds+dqf+ldmid",
    "backward_sm80 (FP16, 64, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+kvreg+pipe+mbar+ldmid",
    "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+ldmid",
    "backward_sm80 (FP16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+dqf+ldmid",
    "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+mbar+ldmid",
    # dQ reductions spread over phase B's k-steps
    "backward_sm80 (BF16, 64, 128, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+mbar+dqf+ldmid+dqs",
    "backward_sm80 (FP16, 64, 128, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+mbar+dqf+dqs",
    "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+dqf+dqs",
    # dQ tile reduced during the next block's phase A (the last one after the loop)
    "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+dql",
    "backward_sm80 (FP16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+dqf+dql",
    "backward_sm80 (BF16, 64, 128, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+mbar+dql",
    # dQ reductions as 4-column vectors after a lane-pair exchange
    "backward_sm80 (BF16, 64, 128, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+mbar+dqf+dqv",
    "backward_sm80 (FP16, 64, 128, 128, 8): dsplit_1+swizzled+dbuf+pds+ldmid+dqv",
    "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+ldmid+dqv",
    "backward_sm80 (FP16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+dqf+dqv",
    "backward_sm80 (BF16, 64, 64, 64, 4): dsplit_1+swizzled+dbuf+pds+dqv",  # 4 warps, 32-row S tiles
    # 8 warps over 64 keys: 16-row S tiles, 8 keys of the 1-D layout per warp (d_head 256's pick)
    "backward_sm80 (FP16, 128, 64, 64, 8): dsplit_1+swizzled+dbuf+pds",
    "backward_sm80 (FP16, 256, 64, 64, 8): dsplit_1+swizzled+dbuf+pds+dqf+ldmid+dqv",
)]
FIGURES: list[dict] = []


def prewarm_plan(arch: str, cc: int) -> list[tuple]:
    """What this module compiles, as gpu_prewarm.prewarm_groups groups, for a GPU of `arch` / `cc`
    (no GPU needed: scripts/prewarm_offdevice.py --test-modules builds it off the device)."""
    from cupyflash.families.backward_sm80 import BACKWARD_SM80

    return [(TUNE, [arch], dict(variants=[(False, False, False)])),
            (DEFAULTS, [arch], dict(variants=BACKWARD_SM80.all_variants())),
            (DBUF, [arch], dict(variants=[(False, False, False), (True, False, False), (True, True, False)])),
            ([forward_default(dt, d) for dt in DType for d in D_HEADS], [arch], dict(causal=(False, True)))]


@pytest.fixture(scope="module", autouse=True)
def prewarmed_cache():
    """Compile every variant the tests use in parallel, then run them warm."""
    from gpu_prewarm import prewarm_groups, this_arch, write_figures

    prewarm_groups(*prewarm_plan(this_arch(cp), 0))
    yield
    write_figures(FIGURES)


@pytest.fixture
def rng():
    return np.random.default_rng()


def run_case(cfg, dtype, d_head, batch, seq_q, seq_k, heads, kv_heads, causal, rng, deterministic=False,
             scale=None):
    q = random_inputs(cp, dtype, (batch, seq_q, heads, d_head), rng)
    k, v = (random_inputs(cp, dtype, (batch, seq_k, kv_heads, d_head), rng) for _ in range(2))
    dout = random_inputs(cp, dtype, q.shape, rng)
    out, lse = cupyflash.forward(forward_default(dtype, d_head), q, k, v, causal=causal, softmax_scale=scale,
                                 return_lse=True)
    dq, dk, dv = (poisoned(cp, dtype, x.shape) for x in (q, k, v))
    res = cupyflash.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, dq=dq, dk=dk, dv=dv,
                             deterministic=deterministic, cfg=cfg)
    assert res[0] is dq and res[1] is dk and res[2] is dv
    context = f"{cfg} B={batch} Sq={seq_q} Sk={seq_k} H={heads}/{kv_heads} causal={causal} det={deterministic}"
    figures = check_gradients(cp, dtype, q, k, v, dout, (dq, dk, dv), scale, causal=causal, context=context)
    FIGURES.append({"case": context, **figures})
    return dq, dk, dv


@pytest.mark.parametrize("cfg", TUNE, ids=str)
def test_tuning_config_matches_reference(cfg, rng):
    # lengths with tails in both directions; two q heads per k/v head
    run_case(cfg, cfg.dtype, cfg.d_head, 2, 2 * cfg.B_r + 37, cfg.B_c + 19, 4, 2, False, rng)


CASES = [
    # (batch, seq_q, seq_k, heads, kv_heads, causal)
    (2, 256, 256, 2, 2, False),
    (1, 300, 300, 2, 2, True),
    (2, 77, 203, 4, 1, True),      # seq_q < seq_k, MQA, causal (bottom-right)
    (1, 203, 77, 4, 2, True),      # seq_q > seq_k: the first rows see no key
    (1, 1, 129, 2, 2, False),
    (2, 129, 1, 2, 1, False),
    (1, 640, 513, 4, 4, False),
    # causal CTAs dealt out heaviest first in groups of (head, batch) pairs, the last group partial
    # (40 or 80 key blocks: groups of 7 or 4 of the 10 pairs)
    (2, 100, 5120, 5, 5, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_q{}_k{}_h{}-{}_{}".format(*c[:5], "causal" if c[5] else "full"))
@pytest.mark.parametrize("d_head", D_HEADS)
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_default_config_shapes(dtype, d_head, case, rng):
    batch, sq, sk, h, hk, causal = case
    run_case(None, dtype, d_head, batch, sq, sk, h, hk, causal, rng)


@pytest.mark.parametrize("d_head", D_HEADS)
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_is_correct_and_bit_identical(dtype, d_head, causal, rng):
    batch, sq, sk, h, hk = 2, 333, 270, 4, 2
    grads = run_case(None, dtype, d_head, batch, sq, sk, h, hk, causal, rng, deterministic=True, scale=0.2)
    # same inputs, three more runs: identical bits
    q = random_inputs(cp, dtype, (batch, sq, h, d_head), rng)
    k, v = (random_inputs(cp, dtype, (batch, sk, hk, d_head), rng) for _ in range(2))
    dout = random_inputs(cp, dtype, q.shape, rng)
    out, lse = cupyflash.forward(forward_default(dtype, d_head), q, k, v, causal=causal, return_lse=True)
    runs = [cupyflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True) for _ in range(3)]
    for name, i in (("dq", 0), ("dk", 1), ("dv", 2)):
        bits = [r[i].view(cp.uint16) for r in runs]
        assert bool((bits[0] == bits[1]).all()) and bool((bits[0] == bits[2]).all()), f"{name} differs between runs"
    assert grads[0].shape == q.shape




@pytest.mark.parametrize("cfg", DBUF, ids=str)
@pytest.mark.parametrize("causal, deterministic", [(False, False), (True, False), (True, True)])
def test_double_buffered_and_pds_variants(cfg, causal, deterministic, rng):
    run_case(cfg, cfg.dtype, cfg.d_head, 2, 333, 270, 4, 2, causal, rng, deterministic=deterministic)


def test_tuning_problem_checks_and_times_candidates():
    from cupyflash.families.backward_sm80 import BACKWARD_SM80

    problem = BACKWARD_SM80.tuning_problem(DType.BF16, 128, 1024, True, 50 * 2**20)
    try:
        assert problem.check(DBUF[0]) is None
        assert problem.check(DBUF[3]) is None
        ms = []
        for cfg in (default_config(DType.BF16, 128), DBUF[0]):
            run = problem.timed_call(cfg)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            run(0)
            end.record()
            end.synchronize()
            ms.append(cp.cuda.get_elapsed_time(start, end))
        assert all(m > 0 for m in ms)
    finally:
        problem.close()


def test_returns_new_arrays_and_default_scale(rng):
    dtype, d = DType.BF16, 128
    q, k, v, dout = (random_inputs(cp, dtype, (1, 100, 2, d), rng) for _ in range(4))
    out, lse = cupyflash.forward(forward_default(dtype, d), q, k, v, return_lse=True)
    dq, dk, dv = cupyflash.backward(dout, q, k, v, out, lse, cfg=default_config(dtype, d).short_form())
    assert dq.shape == q.shape and dk.shape == k.shape and dv.dtype == v.dtype
    check_gradients(cp, dtype, q, k, v, dout, (dq, dk, dv))


def test_torch_tensors_come_back_as_torch(rng):
    torch = pytest.importorskip("torch")
    q, k, v, dout = (torch.randn(2, 150, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = cupyflash.forward(forward_default(DType.BF16, 64), q, k, v, causal=True, return_lse=True)
    dq, dk, dv = cupyflash.backward(dout, q, k, v, out, lse, causal=True)
    assert all(isinstance(x, torch.Tensor) for x in (dq, dk, dv))
    # against torch autograd of an fp32 attention on the same (upcast) inputs
    q32, k32, v32 = (x.float().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q32.transpose(1, 2), k32.transpose(1, 2), v32.transpose(1, 2), is_causal=True).transpose(1, 2)
    ref.backward(dout.float())
    for got, want in ((dq, q32.grad), (dk, k32.grad), (dv, v32.grad)):
        rel = float((got.float() - want).norm() / want.norm())
        assert rel < 1e-2, rel


@pytest.mark.parametrize("causal", [False, True])
def test_cfg_none_replays_this_family_from_packed_blocks(rng, causal, monkeypatch):
    """cfg=None on this family (on Hopper too: backward_sm90 taken out of cfg=None's d_heads): a
    second call with a signature replays the first call's plan from a BackwardParams block packed
    once, with new outputs and the full path's bits (deterministic), GQA and ragged lengths, CuPy
    and torch."""
    from cupyflash import backward_api, backward_plans

    monkeypatch.setattr(backward_api, "AUTO_D_HEADS", ())
    backward_plans.clear()
    dtype, d = DType.BF16, 256
    q = random_inputs(cp, dtype, (2, 130, 4, d), rng)
    k, v = (random_inputs(cp, dtype, (2, 77, 2, d), rng) for _ in range(2))
    dout = random_inputs(cp, dtype, q.shape, rng)
    out, lse = cupyflash.forward(None, q, k, v, causal=causal, return_lse=True)
    first = cupyflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    (replay,) = backward_plans._TABLE.plans.values()
    assert type(replay.plan.cfg) is BackwardKernelConfig and replay.packed is not None
    for _ in range(2):
        again = cupyflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        for a, b in zip(first, again):
            assert a is not b and bool((a.view(cp.uint16) == b.view(cp.uint16)).all())
    cupyflash.backward(dout, q, k, v, out, lse, causal=causal)  # the atomic dQ signature
    got = cupyflash.backward(dout, q, k, v, out, lse, causal=causal)
    assert len(backward_plans._TABLE.plans) == 2
    check_gradients(cp, dtype, q, k, v, dout, got, None, causal=causal)
    torch = pytest.importorskip("torch")
    tensors = tuple(torch.from_dlpack(x) for x in (dout, q, k, v, out, lse))
    cupyflash.backward(*tensors, causal=causal, deterministic=True)
    replayed = cupyflash.backward(*tensors, causal=causal, deterministic=True)
    for a, b in zip(first, replayed):
        assert isinstance(b, torch.Tensor) and torch.equal(torch.from_dlpack(a), b)
    backward_plans.clear()


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_backward_on_a_side_stream_keeps_its_workspace(framework):
    """stream= other than the caller's current stream: the workspace (dropped when the call
    returns) must be stream-ordered on the launch stream, so that the caller's next allocations
    on its own stream, which reuse freed blocks at once, cannot overwrite it while the kernels
    still run. The caller's current stream is a non-blocking one of its own (the legacy default
    stream would wait for the launch stream and hide the race). Gradients after such
    allocations equal those of a call on the current stream, bit for bit; the stream= calls
    replay that call's plan."""
    torch = pytest.importorskip("torch")
    q, k, v, dout = (torch.randn(2, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = cupyflash.forward(None, q, k, v, return_lse=True)
    args = (dout, q, k, v, out, lse)
    if framework == "cupy":
        args = tuple(cp.from_dlpack(x) for x in args)
    want = cupyflash.backward(*args, deterministic=True)
    torch.cuda.synchronize()
    if framework == "torch":
        mine, side = torch.cuda.Stream(), torch.cuda.Stream()
        current = torch.cuda.stream(mine)
        fill = lambda n: torch.full((n,), float("nan"), device="cuda")  # noqa: E731
    else:
        mine, side = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        current = mine
        fill = lambda n: cp.full((n,), cp.nan, dtype=cp.float32)  # noqa: E731
    floats = 2 * 8192 * 8 * 128  # sizes of the workspace's pieces, to ask for the same blocks
    from cupyflash import backward_plans

    plans = len(backward_plans._TABLE.plans)
    with current:
        for _ in range(3):
            got = cupyflash.backward(*args, deterministic=True, stream=side)
            for n in (2 * 8 * 8192, 2 * 8 * 8192, floats, 3 * 2 * 8 * 8192, floats + 2 * 2 * 8 * 8192):
                fill(n)
            side.synchronize()
            mine.synchronize()
            for g, w in zip(got, want):
                assert torch.equal(g, w) if framework == "torch" else bool((g.view(cp.uint16) == w.view(cp.uint16)).all())
    assert len(backward_plans._TABLE.plans) == plans  # the stream= calls replayed the current stream's plan


def test_validation_errors_name_the_argument(rng):
    dtype, d = DType.FP16, 64
    q, k, v, dout = (random_inputs(cp, dtype, (1, 64, 2, d), rng) for _ in range(4))
    out, lse = cupyflash.forward(forward_default(dtype, d), q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="^lse"):
        cupyflash.backward(dout, q, k, v, out, lse[:, :1])
    with pytest.raises(TypeError, match="^dout"):
        cupyflash.backward(dout.astype(cp.float32), q, k, v, out, lse)
    with pytest.raises(TypeError, match="^deterministic"):
        cupyflash.backward(dout, q, k, v, out, lse, deterministic=1)
    with pytest.raises(ValueError, match="^cfg"):
        cupyflash.backward(dout, q, k, v, out, lse, cfg=default_config(DType.BF16, d))
