"""cupyflash.jax: attention inside jax.jit and jax.vmap, through buffer_callback.

CPU tests (need jax, no GPU): the operation's machinery (tracing-time validation, jit, vmap folding,
lse, caching) with the GPU-facing steps replaced by a NumPy reference writing into XLA's CPU
buffers. GPU tests: the real kernel on XLA's stream, eagerly, in jit and under vmap, against the
SPEC §5 rule.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with CuPy/torch
jax = pytest.importorskip("jax")
jnp = jax.numpy

import cupyflash.jax as cfj  # noqa: E402  (after the importorskip)
from cupyflash.config import DType  # noqa: E402
from cupyflash.families.forward_sm80.config_sets import default_config  # noqa: E402
from cupyflash.device import has_gpu  # noqa: E402
from framework_support import numpy_attention, prewarm_problems  # noqa: E402

needs_gpu = pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU")
JAX_DTYPES = {DType.BF16: jnp.bfloat16, DType.FP16: jnp.float16}


def _clear_caches():
    cfj._prepared.cache_clear()
    cfj._varlen_prepared.cache_clear()
    cfj._operation.cache_clear()
    cfj._differentiable.cache_clear()
    cfj._backward_operation.cache_clear()


# ----------------------------------------------------------------------------- CPU
class ReferenceLaunches:
    """Stands in for the kernel launch on XLA's CPU buffers; records each plan it runs."""

    def __init__(self) -> None:
        self.plans = []

    def __call__(self, callback, ctx, q, k, v, out, lse) -> None:
        plan = callback.plan
        self.plans.append(plan)
        o, l = numpy_attention(np.asarray(q).astype(np.float32), np.asarray(k).astype(np.float32),
                               np.asarray(v).astype(np.float32), plan.softmax_scale, plan.causal)
        target = np.asarray(out)
        target[...] = o.astype(target.dtype)
        if lse is not None:
            np.asarray(lse)[...] = l


@pytest.fixture
def on_cpu(monkeypatch):
    """The operation with a NumPy stand-in for the GPU steps, on JAX's CPU device."""
    launches = ReferenceLaunches()
    monkeypatch.setattr(cfj, "_trace_device", lambda: 0)
    monkeypatch.setattr(cfj, "_select", lambda dtype, d_head, *_: default_config(dtype, d_head))
    monkeypatch.setattr(cfj, "_prepare_kernel", lambda callback: None)
    monkeypatch.setattr(cfj, "_launch", launches)
    # the backward's trace-time plan: a workspace size is all the CPU stand-ins need of it
    monkeypatch.setattr(cfj, "_backward_replay", lambda *args: SimpleNamespace(ws_floats=8))
    _clear_caches()
    with jax.default_device(jax.devices("cpu")[0]):
        yield launches
    _clear_caches()


def _inputs(seed, q_shape=(2, 40, 4, 64), kv_shape=(2, 56, 2, 64), dtype=jnp.bfloat16, lead=()):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(keys[0], lead + q_shape, dtype), jax.random.normal(keys[1], lead + kv_shape, dtype),
            jax.random.normal(keys[2], lead + kv_shape, dtype))


def _expected(q, k, v, scale=None, causal=False):
    return numpy_attention(np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32),
                           scale, causal)


def _assert_close(got, want, atol=3e-2):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=0)


def test_eager_and_jit_with_lse(on_cpu):
    q, k, v = _inputs(0)
    out = cfj.attention(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, _expected(q, k, v)[0])
    f = jax.jit(lambda q, k, v: cfj.attention(q * 2, k, v, causal=True, softmax_scale=0.1, return_lse=True))
    out, lse = f(q, k, v)
    want, want_lse = _expected(q * 2, k, v, 0.1, causal=True)
    assert lse.shape == (2, 4, 40) and lse.dtype == jnp.float32
    _assert_close(out, want)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4)
    assert on_cpu.plans[-1].causal and on_cpu.plans[-1].softmax_scale == pytest.approx(0.1)


def test_plans_are_made_once_per_signature(on_cpu):
    q, k, v = _inputs(1)
    f = jax.jit(lambda q, k, v: cfj.attention(q, k, v))
    for seed in (2, 3):
        f(*_inputs(seed))
    cfj.attention(q, k, v)
    assert cfj._prepared.cache_info().currsize == 1 and len(on_cpu.plans) == 3


def test_vmap_folds_the_mapped_axis_into_batch(on_cpu):
    q, k, v = _inputs(4, lead=(3,))
    out = jax.vmap(lambda q, k, v: cfj.attention(q, k, v))(q, k, v)
    assert out.shape == (3, 2, 40, 4, 64)
    assert on_cpu.plans[-1].out_shape == (6, 40, 4, 64)  # one launch for all mapped entries
    for i in range(3):
        _assert_close(out[i], _expected(q[i], k[i], v[i])[0])


def test_vmap_unmapped_kv_lse_and_nested(on_cpu):
    q, k, v = _inputs(5, lead=(3,))
    f = jax.jit(jax.vmap(lambda q, k, v: cfj.attention(q, k, v, causal=True, return_lse=True),
                         in_axes=(0, None, None)))
    out, lse = f(q, k[0], v[0])
    assert out.shape == (3, 2, 40, 4, 64) and lse.shape == (3, 2, 4, 40)
    for i in range(3):
        want, want_lse = _expected(q[i], k[0], v[0], causal=True)
        _assert_close(out[i], want)
        np.testing.assert_allclose(np.asarray(lse[i]), want_lse, atol=1e-4)
    # nested, over a non-leading axis of the outer array
    qq = jnp.stack([q, q * 0.5], axis=1)  # (3, 2, 2, 40, 4, 64)
    nested = jax.vmap(jax.vmap(lambda q: cfj.attention(q, k[1], v[1])), in_axes=1)(qq)
    assert nested.shape == (2, 3, 2, 40, 4, 64)
    _assert_close(nested[1, 2], _expected(q[2] * 0.5, k[1], v[1])[0])


@pytest.mark.parametrize("call,error,message", [
    (lambda q, k, v: cfj.attention(q.astype(jnp.float32), k, v), TypeError, "q: dtype must be float16 or bfloat16"),
    (lambda q, k, v: jax.jit(lambda q: cfj.attention(q, k[..., :32], v))(q), ValueError, "k: d_head 32"),
    (lambda q, k, v: cfj.attention(q, k, v[:, :9]), ValueError, "v: seq_len 9"),
    (lambda q, k, v: cfj.attention(q[0], k[0], v[0]), ValueError, "q: expected 4 dimensions"),
    (lambda q, k, v: jax.vmap(lambda q: cfj.attention(q, k, v))(jnp.stack([q[..., :32]] * 2)), ValueError,
     "k: d_head 64 does not match q's 32"),
    (lambda q, k, v: cfj.attention(q, k, v, causal=1), TypeError, "causal: expected a bool"),
    (lambda q, k, v: cfj.attention(q, k, v, return_lse=None), TypeError, "return_lse: expected a bool"),
    (lambda q, k, v: cfj.attention(q, k, v, softmax_scale=float("nan")), ValueError, "softmax_scale: expected a finite"),
    (lambda q, k, v: cfj.attention(q, k, v, softmax_scale="1"), TypeError, "softmax_scale: expected None or a real"),
], ids=["dtype", "d-head-jit", "v-shape", "rank", "vmap-d-head", "causal", "return-lse", "scale-nan", "scale-str"])
def test_argument_errors_name_the_argument(on_cpu, call, error, message):
    with pytest.raises(error, match=message):
        call(*_inputs(6))


def test_launch_packs_the_leading_pointer_fields():
    from cupyflash.families.forward_sm80.params import PARAM_FIELDS

    assert [(name, fmt) for name, _, fmt in PARAM_FIELDS[:5]] == [(n, "Q") for n in ("q", "k", "v", "o", "lse")]
    assert cfj._POINTERS.size == 5 * 8


def test_zero_size_batch_launches_nothing(on_cpu):
    q, k, v = (x[:0] for x in _inputs(7))
    out, lse = cfj.attention(q, k, v, return_lse=True)
    assert out.shape == (0, 40, 4, 64) and lse.shape == (0, 4, 40) and not on_cpu.plans


# ----------------------------------------------------------------------------- GPU
PROBLEMS = [(DType.BF16, 128, 256, 256, False), (DType.BF16, 128, 256, 256, True),
            (DType.FP16, 128, 256, 256, False)]


@pytest.fixture(scope="module")
def kernels():
    prewarm_problems(PROBLEMS)


def _cupy(cp, x):
    """A CuPy copy of a JAX array (bf16 as raw 16-bit patterns, which gpu_reference reads)."""
    host = np.asarray(x)
    return cp.asarray(host.view(np.uint16) if host.dtype == jnp.bfloat16 else host)


def _check(dtype, q, k, v, out, scale=None, causal=False, lse=None, context=""):
    import cupy as cp
    from gpu_reference import check_attention

    check_attention(cp, dtype, _cupy(cp, q), _cupy(cp, k), _cupy(cp, v), _cupy(cp, out), scale, causal=causal,
                    lse=cp.asarray(np.asarray(lse)) if lse is not None else None, context=context)


def _gpu_inputs(seed, dtype, q_shape, kv_shape, lead=()):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(lead + s, dtype=np.float32)).astype(JAX_DTYPES[dtype])
                 for s in (q_shape, kv_shape, kv_shape))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype,causal,q_shape,kv_shape,scale", [
    (DType.BF16, False, (2, 256, 4, 128), (2, 256, 4, 128), None),
    (DType.BF16, True, (2, 200, 8, 128), (2, 256, 2, 128), 0.05),
    (DType.FP16, False, (1, 256, 2, 128), (1, 77, 2, 128), None),
])
def test_eager_and_jit_match_reference(kernels, dtype, causal, q_shape, kv_shape, scale):
    _clear_caches()
    q, k, v = _gpu_inputs(None, dtype, q_shape, kv_shape)
    out, lse = cfj.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == jnp.float32
    _check(dtype, q, k, v, out, scale, causal, lse, "eager")
    # in a jitted function between other XLA ops, over several fresh inputs (new buffers)
    f = jax.jit(lambda q, k, v: cfj.attention(q * 0.5, k, v + 1, causal=causal, softmax_scale=scale) * 2)
    for seed in range(3):
        q, k, v = _gpu_inputs(None, dtype, q_shape, kv_shape)
        got = f(q, k, v)
        want = cfj.attention(q * 0.5, k, v + 1, causal=causal, softmax_scale=scale)
        _check(dtype, q * 0.5, k, v + 1, want, scale, causal, context="eager, shifted inputs")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want * 2))


@pytest.mark.gpu
@needs_gpu
def test_vmap_matches_per_entry_calls(kernels):
    q, k, v = _gpu_inputs(None, DType.BF16, (2, 256, 4, 128), (2, 256, 4, 128), lead=(3,))
    f = jax.jit(jax.vmap(lambda q, k, v: cfj.attention(q, k, v, return_lse=True), in_axes=(0, None, 0)))
    out, lse = f(q, k[0], v)
    assert out.shape == q.shape and lse.shape == (3, 2, 4, 256)
    for i in range(3):
        want, want_lse = cfj.attention(q[i], k[0], v[i], return_lse=True)
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(want))  # the same kernel rows
        np.testing.assert_array_equal(np.asarray(lse[i]), np.asarray(want_lse))
    _check(DType.BF16, q[1], k[0], v[1], out[1], lse=lse[1], context="vmap entry 1")


@pytest.mark.gpu
@needs_gpu
def test_jit_in_a_loop_and_errors(kernels):
    q, k, v = _gpu_inputs(None, DType.BF16, (1, 256, 4, 128), (1, 256, 4, 128))
    step = jax.jit(lambda x, k, v: jax.lax.fori_loop(0, 4, lambda i, x: cfj.attention(x, k, v, causal=True), x))
    got = step(q, k, v)
    want = q
    for _ in range(4):
        want = cfj.attention(want, k, v, causal=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(TypeError, match="q: dtype must be float16 or bfloat16"):
        jax.jit(lambda q: cfj.attention(q.astype(jnp.float32), k, v))(q)


@pytest.mark.gpu
@needs_gpu
def test_unrolled_chain_replayed_with_new_buffers(kernels):
    # Enough launches in one program for XLA to record them into a command buffer (CUDA graph):
    # later runs replay the recorded launches, and fresh inputs (new buffer addresses) must still
    # reach the kernel.
    def chain(q, k, v):
        for _ in range(6):
            q = cfj.attention(q, k, v)
        return q

    f = jax.jit(chain)
    for _ in range(3):
        q, k, v = _gpu_inputs(None, DType.BF16, (1, 256, 4, 128), (1, 256, 4, 128))
        np.testing.assert_array_equal(np.asarray(f(q, k, v)), np.asarray(chain(q, k, v)))


# ----------------------------------------------------------------------------- gradients
def _numpy_grads(dout, q, k, v, scale, causal):
    """float64 closed-form attention gradients (dS = P * (dP - rowsum(dP * P))), GQA folded."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    if causal:
        hidden = np.arange(k.shape[1])[None, :] > np.arange(q.shape[1])[:, None] + (k.shape[1] - q.shape[1])
        s = np.where(hidden, -np.inf, s)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    dv = np.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vr)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    fold = lambda g: g.reshape(g.shape[0], g.shape[1], g.shape[2] // group, group, g.shape[3]).sum(3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def test_grad_runs_the_backward_callback(on_cpu, monkeypatch):
    """jax.grad reaches the backward callback with the forward's residuals (out, lse, causal,
    scale) and puts dq, dk, dv on q, k, v (a NumPy stand-in for cupyflash.backward)."""
    seen = []

    def reference_backward(callback, ctx, outs, dout, q, k, v, out, lse):
        seen.append((callback.causal, callback.softmax_scale, np.asarray(lse).shape))
        grads = _numpy_grads(np.asarray(dout).astype(np.float32),
                             *(np.asarray(x).astype(np.float32) for x in (q, k, v)),
                             callback.softmax_scale, callback.causal)
        for target, g in zip(outs, grads):
            np.asarray(target)[...] = g.astype(np.asarray(target).dtype)

    monkeypatch.setattr(cfj, "_backward_launch", reference_backward)
    q, k, v = _inputs(3)
    w = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.float32)
    loss = lambda q, k, v: (cfj.attention(q, k, v, causal=True, softmax_scale=0.2).astype(jnp.float32) * w).sum()  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert seen == [(True, 0.2, (2, 4, 40))]
    want = _numpy_grads(np.asarray(w), *(np.asarray(x, np.float32) for x in (q, k, v)), 0.2, True)
    for got, ref, x in zip(grads, want, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=5e-2, rtol=5e-2)


def _reference_backward_launch(seen):
    """A NumPy stand-in for the backward callback's launch (records each call's batch size)."""

    def launch(callback, ctx, outs, dout, q, k, v, out, lse):
        seen.append(np.asarray(q).shape[0])
        grads = _numpy_grads(np.asarray(dout).astype(np.float32),
                             *(np.asarray(x).astype(np.float32) for x in (q, k, v)),
                             callback.softmax_scale, callback.causal)
        for target, g in zip(outs, grads):
            np.asarray(target)[...] = g.astype(np.asarray(target).dtype)

    return launch


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None)], ids=["all-mapped", "shared-kv"])
def test_vmap_of_grad_is_one_backward_launch(on_cpu, monkeypatch, in_axes):
    """jax.jit(jax.vmap(jax.grad(...))): per-entry gradients, the mapped axis folded into the batch
    of the forward and of the backward (one launch each); an unmapped k/v gets per-entry dk/dv."""
    seen = []
    monkeypatch.setattr(cfj, "_backward_launch", _reference_backward_launch(seen))
    q, k, v = _inputs(8, lead=(3,))
    k, v = (x[0] if axis is None else x for x, axis in zip((k, v), in_axes[1:]))
    w = jax.random.normal(jax.random.PRNGKey(4), q.shape[1:], jnp.float32)
    loss = lambda q, k, v: (cfj.attention(q, k, v, causal=True).astype(jnp.float32) * w).sum()  # noqa: E731
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=in_axes))(q, k, v)
    assert seen == [6]  # 3 mapped entries x batch 2, one backward call
    assert on_cpu.plans[-1].out_shape == (6, 40, 4, 64)
    for i in range(3):
        ki, vi = (x if axis is None else x[i] for x, axis in zip((k, v), in_axes[1:]))
        want = _numpy_grads(np.asarray(w), *(np.asarray(x, np.float32) for x in (q[i], ki, vi)), None, True)
        for got, ref in zip(grads, want):
            assert got.shape[0] == 3
            np.testing.assert_allclose(np.asarray(got[i], np.float64), ref, atol=5e-2, rtol=5e-2)


@needs_gpu
@pytest.mark.gpu
def test_vmap_of_grad_on_the_gpu_matches_per_entry_grads():
    """vmap(grad) through the batched backward against grad of each entry on its own (same
    kernels: equal within fp32 atomics' ordering) and against float64 closed-form gradients."""
    _clear_caches()
    q, k, v = _inputs(12, q_shape=(2, 77, 8, 128), kv_shape=(2, 130, 2, 128), lead=(3,))
    w = jax.random.normal(jax.random.PRNGKey(13), q.shape[1:], jnp.float32)
    loss = lambda q, k, v: (cfj.attention(q, k, v, causal=True).astype(jnp.float32) * w).sum()  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1, 2))
    batched = jax.jit(jax.vmap(grad, in_axes=(0, None, 0)))(q, k[0], v)
    for i in range(3):
        single = jax.jit(grad)(q[i], k[0], v[i])
        want = _numpy_grads(np.asarray(w), *(np.asarray(x, np.float32) for x in (q[i], k[0], v[i])), None, True)
        for got, one, ref, name in zip(batched, single, want, ("dq", "dk", "dv")):
            got = np.asarray(got[i], np.float64)
            rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert rel <= 1e-2, (name, i, rel)
            np.testing.assert_allclose(got, np.asarray(one, np.float64), atol=2e-2, rtol=2e-2)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_grad_on_the_gpu_matches_the_reference(causal):
    """jax.jit(jax.grad(...)) through cupyflash.backward against float64 closed-form gradients
    (relative L2 within SPEC §5's bf16 bound), GQA and ragged lengths."""
    _clear_caches()
    q, k, v = _inputs(5, q_shape=(2, 77, 8, 128), kv_shape=(2, 130, 2, 128))
    w = jax.random.normal(jax.random.PRNGKey(11), q.shape, jnp.float32)
    loss = lambda q, k, v: (cfj.attention(q, k, v, causal=causal).astype(jnp.float32) * w).sum()  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = _numpy_grads(np.asarray(w), *(np.asarray(x, np.float32) for x in (q, k, v)), None, causal)
    for got, ref, name in zip(grads, want, ("dq", "dk", "dv")):
        got = np.asarray(got, np.float64)
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert rel <= 1e-2, (name, rel)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_grad_reruns_replay_the_first_plan(causal):
    """A jitted grad run again on new inputs: every run relaunches the plan made while tracing on
    XLA's new buffers (and its scratch workspace), and every run's gradients match the float64
    reference."""
    _clear_caches()
    step = None
    for seed in (21, 22, 23):
        q, k, v = _inputs(seed, q_shape=(2, 77, 8, 128), kv_shape=(2, 130, 2, 128))
        w = jax.random.normal(jax.random.PRNGKey(seed), q.shape, jnp.float32)
        if step is None:
            step = jax.jit(jax.grad(lambda q, k, v, w: (cfj.attention(q, k, v, causal=causal).astype(jnp.float32)
                                                        * w).sum(), argnums=(0, 1, 2)))
        grads = step(q, k, v, w)
        want = _numpy_grads(np.asarray(w), *(np.asarray(x, np.float32) for x in (q, k, v)), None, causal)
        for got, ref, name in zip(grads, want, ("dq", "dk", "dv")):
            got = np.asarray(got, np.float64)
            rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert rel <= 1e-2, (seed, name, rel)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["fori_loop", "unrolled"])
def test_grad_steps_replayed_from_command_buffers(loop):
    """Training steps x <- x - lr * grad(loss)(x) inside one jit (a fori_loop, or unrolled): XLA may
    record the backward's launches into a command buffer and replay them on the loop's changing
    buffers; the result must equal the same steps run one jitted step at a time."""
    _clear_caches()
    q, k, v = _inputs(31, q_shape=(2, 77, 8, 128), kv_shape=(2, 130, 2, 128))
    w = jax.random.normal(jax.random.PRNGKey(32), q.shape, jnp.float32)
    loss = lambda y: (cfj.attention(y, k, v, causal=True).astype(jnp.float32) * w).sum()  # noqa: E731
    _check_steps_in_one_jit(loss, q, loop)


def _check_steps_in_one_jit(loss, x0, loop, steps=6):
    """Steps x <- x - 0.05 grad(loss)(x) in one jit (`loop`: a fori_loop, or unrolled), run twice
    (a second run replays whatever the first recorded), against the same steps jitted one at a
    time; returns the result."""
    def step(i, x):
        g = jax.grad(loss)(x)
        return (x.astype(jnp.float32) - 0.05 * g.astype(jnp.float32)).astype(x.dtype)

    if loop == "fori_loop":
        many = jax.jit(lambda x: jax.lax.fori_loop(0, steps, step, x))
    else:
        def unrolled(x):
            for i in range(steps):
                x = step(i, x)
            return x
        many = jax.jit(unrolled)
    one = jax.jit(lambda x: step(0, x))
    want = x0
    for _ in range(steps):
        want = one(want)
    for _ in range(2):
        got = many(x0)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
    assert not np.allclose(np.asarray(want, np.float32), np.asarray(x0, np.float32), atol=1e-3)  # the steps moved x
    return got


# ----------------------------------------------------------------------------- packed ragged batches
@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_and_grad_on_the_gpu(causal):
    """attention_varlen under jax.jit (with its lse) and jax.jit(jax.grad(...)) through
    backward_varlen (the checked runs are second runs: the forward's and the backward's replays
    of their first runs' launches on new buffers), per sequence against float64 (a
    sequence without keys: out 0, dq 0; without queries: dk = dv = 0; three pad tokens past the
    last sequence: out 0, dq 0)."""
    lens_q, lens_k = [37, 0, 128, 5], [50, 9, 128, 0]
    cq, ck = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    cu_q, cu_k = jnp.asarray(cq), jnp.asarray(ck)
    keys = jax.random.split(jax.random.PRNGKey(21), 4)
    q = jax.random.normal(keys[0], (int(cq[-1]) + 3, 8, 128), jnp.bfloat16)
    k, v = (jax.random.normal(key, (int(ck[-1]), 2, 128), jnp.bfloat16) for key in keys[1:3])
    w = jax.random.normal(keys[3], q.shape, jnp.float32)
    forward = jax.jit(lambda *a: cfj.attention_varlen(*a, 128, 128, causal=causal, return_lse=True))
    forward(q * 0.5, k, v, cu_q, cu_k)
    out, lse = forward(q, k, v, cu_q, cu_k)
    loss = lambda q, k, v: (cfj.attention_varlen(q, k, v, cu_q, cu_k, 128, 128,  # noqa: E731
                                                 causal=causal).astype(jnp.float32) * w).sum()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    grad(q * 0.5, k, v)  # the first run plans; the checked run below replays that plan on new buffers
    dq, dk, dv = (np.asarray(g, np.float64) for g in grad(q, k, v))
    out, lse = np.asarray(out, np.float64), np.asarray(lse)
    qn, kn, vn, wn = (np.asarray(x, np.float32) for x in (q, k, v, w))
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0 or k1 == k0:
            assert (out[q0:q1] == 0).all() and (dq[q0:q1] == 0).all(), b
            assert (dk[k0:k1] == 0).all() and (dv[k0:k1] == 0).all(), b
            continue
        want, want_lse = numpy_attention(qn[None, q0:q1], kn[None, k0:k1], vn[None, k0:k1], None, causal)
        _assert_close(out[q0:q1], want[0])
        np.testing.assert_allclose(lse[:, q0:q1], want_lse[0], atol=1e-2)
        ref = _numpy_grads(wn[None, q0:q1], qn[None, q0:q1], kn[None, k0:k1], vn[None, k0:k1], None, causal)
        for got, r, name in zip((dq[q0:q1], dk[k0:k1], dv[k0:k1]), ref, ("dq", "dk", "dv")):
            rel = np.linalg.norm(got - r[0]) / np.linalg.norm(r[0])
            assert rel <= 1e-2, (b, name, rel)
    assert (out[cq[-1]:] == 0).all() and (dq[cq[-1]:] == 0).all() and (lse[:, cq[-1]:] == 0).all()  # the pad tokens


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["fori_loop", "unrolled"])
def test_varlen_grad_steps_replayed_from_command_buffers(loop):
    """attention_varlen training steps inside one jit (a fori_loop, or unrolled): both callbacks
    are command-buffer compatible, so XLA may record their launches (and the memsets) and replay
    them on the loop's changing buffers; the result must equal the same steps run one jitted step
    at a time. Ragged lengths (a sequence without keys, one without queries) with the last
    sequence ending 5 tokens before q's end: those tokens get dq = 0 every step (zero-tail rule),
    so they never move."""
    _clear_caches()
    lens_q, lens_k = [37, 0, 128, 5], [50, 9, 128, 0]
    cq, ck = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    cu_q, cu_k = jnp.asarray(cq), jnp.asarray(ck)
    keys = jax.random.split(jax.random.PRNGKey(41), 4)
    q = jax.random.normal(keys[0], (int(cq[-1]) + 5, 8, 128), jnp.bfloat16)
    k, v = (jax.random.normal(key, (int(ck[-1]) + 3, 2, 128), jnp.bfloat16) for key in keys[1:3])
    w = jax.random.normal(keys[3], q.shape, jnp.float32)
    loss = lambda y: (cfj.attention_varlen(y, k, v, cu_q, cu_k, 128, 128, causal=True)  # noqa: E731
                      .astype(jnp.float32) * w).sum()
    got = _check_steps_in_one_jit(loss, q, loop)
    tail = int(cq[-1])
    np.testing.assert_array_equal(np.asarray(got[tail:]), np.asarray(q[tail:]))  # dq 0 past the last sequence


# ----------------------------------------------------------------------------- packed ragged batches, CPU
LENS_Q, LENS_K, PAD_Q, PAD_K = (5, 9, 3), (7, 9, 4), 2, 1


def _packed_inputs(seed):
    cq, ck = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (LENS_Q, LENS_K))
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (int(cq[-1]) + PAD_Q, 4, 64), jnp.bfloat16)
    k, v = (jax.random.normal(key, (int(ck[-1]) + PAD_K, 2, 64), jnp.bfloat16) for key in keys[1:3])
    return q, k, v, jnp.asarray(cq), jnp.asarray(ck), jax.random.normal(keys[3], q.shape, jnp.float32)


def _f32(buf):
    """An XLA buffer (or array) as float32 NumPy (buffers take no dtype= in np.asarray)."""
    return np.asarray(buf).astype(np.float32)


def _per_sequence(cu_q, cu_k):
    """(query rows, key rows) slices of each packed sequence."""
    cq, ck = np.asarray(cu_q), np.asarray(cu_k)
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]


class VarlenStandIns:
    """NumPy stand-ins for the varlen callbacks' GPU steps, recording what they were given: the
    plans made (trace time) and each run's buffers; outputs past the last sequence are zeroed as
    the kernels do."""

    def __init__(self) -> None:
        self.forward_plans, self.backward_plans, self.forward_runs, self.workspaces = [], [], [], []

    def forward_plan(self, problem, views, with_lse):
        self.forward_plans.append((problem, with_lse))
        return SimpleNamespace(problem=problem)

    def forward_launch(self, callback, ctx, outs, q, k, v, cu_q, cu_k):
        self.forward_runs.append(callback.with_lse)
        o = callback.options
        out, lse = np.asarray(outs[0]), (np.asarray(outs[1]) if callback.with_lse else None)
        out[...] = 0
        if lse is not None:
            lse[...] = 0
        for rq, rk in _per_sequence(cu_q, cu_k):
            got, got_lse = numpy_attention(*(_f32(x)[None, r] for x, r in ((q, rq), (k, rk), (v, rk))),
                                           o.softmax_scale, o.causal)
            out[rq] = got[0].astype(out.dtype)
            if lse is not None:
                lse[:, rq] = got_lse[0]

    def backward_plan(self, specs, options, device):
        self.backward_plans.append((specs, options))
        return SimpleNamespace(ws_floats=8)

    def backward_launch(self, callback, ctx, outs, dout, q, k, v, out, lse, cu_q, cu_k):
        self.workspaces.append(np.asarray(outs[3]).shape)
        dq, dk, dv = (np.asarray(x) for x in outs[:3])
        for g in (dq, dk, dv):
            g[...] = 0
        for rq, rk in _per_sequence(cu_q, cu_k):
            grads = _numpy_grads(*(_f32(x)[None, r] for x, r in ((dout, rq), (q, rq), (k, rk), (v, rk))),
                                 callback.options.softmax_scale, callback.options.causal)
            for target, r, grad in zip((dq, dk, dv), (rq, rk, rk), grads):
                target[r] = grad[0].astype(target.dtype)


@pytest.fixture
def varlen_on_cpu(on_cpu, monkeypatch):
    stand_ins = VarlenStandIns()
    monkeypatch.setattr(cfj, "_varlen_forward_plan", stand_ins.forward_plan)
    monkeypatch.setattr(cfj, "_varlen_forward_launch", stand_ins.forward_launch)
    monkeypatch.setattr(cfj, "_varlen_backward_plan", stand_ins.backward_plan)
    monkeypatch.setattr(cfj, "_varlen_backward_launch", stand_ins.backward_launch)
    flags = []
    real = cfj.buffer_callback

    def recording(callback, results, **kwargs):  # every callback must allow command buffers
        flags.append(kwargs.get("command_buffer_compatible"))
        return real(callback, results, **kwargs)

    monkeypatch.setattr(cfj, "buffer_callback", recording)
    stand_ins.command_buffer_flags = flags
    return stand_ins


def test_varlen_grad_plans_while_tracing(varlen_on_cpu):
    """jax.jit(jax.grad(attention_varlen)): the forward (with its lse) and the backward are planned
    once, while tracing, with the validated problem and the static options; each run gets the
    backward's planned workspace as a scratch result, both callbacks are command-buffer
    compatible, and the gradients (zero past the last sequence) match float64 per sequence."""
    q, k, v, cu_q, cu_k, w = _packed_inputs(51)
    loss = lambda q, k, v: (cfj.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, causal=True, softmax_scale=0.3)  # noqa: E731
                            .astype(jnp.float32) * w).sum()
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for scale in (1.0, 0.5):  # the second run replays the first's plans
        grads = jax.block_until_ready(step(q * scale, k, v))
    (problem, with_lse), = varlen_on_cpu.forward_plans
    assert with_lse and problem.max_seqlen_q == 9 and problem.causal and problem.softmax_scale == pytest.approx(0.3)
    assert problem.total_q == q.shape[0] and problem.batch == 3
    (specs, options), = varlen_on_cpu.backward_plans
    assert [spec.shape for spec in specs] == [q.shape, q.shape, k.shape, v.shape, q.shape, (4, q.shape[0]), (4,), (4,)]
    assert options == cfj._VarlenOptions(9, 9, True, 0.3)
    assert varlen_on_cpu.workspaces == [(8,), (8,)] and varlen_on_cpu.forward_runs == [True, True]
    assert varlen_on_cpu.command_buffer_flags == [True, True]
    for (rq, rk) in _per_sequence(cu_q, cu_k):
        want = _numpy_grads(np.asarray(w)[None, rq], *(np.asarray(x, np.float32)[None, r]
                                                        for x, r in ((q * 0.5, rq), (k, rk), (v, rk))), 0.3, True)
        for got, r, ref in zip(grads, (rq, rk, rk), want):
            np.testing.assert_allclose(np.asarray(got[r], np.float64), ref[0], atol=5e-2, rtol=5e-2)
    tail_q, tail_k = int(cu_q[-1]), int(cu_k[-1])
    assert not np.asarray(grads[0][tail_q:], np.float32).any()
    assert not np.asarray(grads[1][tail_k:], np.float32).any() and not np.asarray(grads[2][tail_k:], np.float32).any()


def test_varlen_forward_plan_is_cached_per_signature(varlen_on_cpu):
    q, k, v, cu_q, cu_k, _ = _packed_inputs(52)
    f = jax.jit(lambda q, k, v: cfj.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, return_lse=True))
    g = jax.jit(lambda q, k, v: cfj.attention_varlen(q * 2, k, v, cu_q, cu_k, 9, 9, return_lse=True))
    out, lse = f(q, k, v)
    jax.block_until_ready(g(q, k, v))
    assert len(varlen_on_cpu.forward_plans) == 1 and cfj._varlen_prepared.cache_info().currsize == 1
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]) and lse.dtype == jnp.float32
    assert not np.asarray(out[int(cu_q[-1]):], np.float32).any() and not np.asarray(lse[:, int(cu_q[-1]):]).any()


@pytest.mark.parametrize("call,error,message", [
    (lambda q, k, v, cu: cfj.attention_varlen(q.astype(jnp.float32), k, v, cu, cu, 9, 9), TypeError, "^q: dtype"),
    (lambda q, k, v, cu: cfj.attention_varlen(q, k[..., :32], v[..., :32], cu, cu, 9, 9), ValueError, "^k: d_head 32"),
    (lambda q, k, v, cu: cfj.attention_varlen(q, k, v, cu, cu, -1, 9), ValueError, "^max_seqlen_q: -1"),
    (lambda q, k, v, cu: cfj.attention_varlen(q, k, v, cu, cu, 9, 2 ** 31), ValueError, "^max_seqlen_k"),
    (lambda q, k, v, cu: cfj.attention_varlen(q, k, v, cu, cu, 9.0, 9), TypeError, "^max_seqlen_q: expected an int"),
    (lambda q, k, v, cu: cfj.attention_varlen(q, k, v, cu, cu[:-1], 9, 9), ValueError, "^cu_seqlens_k: has 3 entries"),
    (lambda q, k, v, cu: cfj.attention_varlen(q, k, v, cu.astype(jnp.int16), cu, 9, 9), TypeError,
     "^cu_seqlens_q: expected dtype int32"),
    (lambda q, k, v, cu: cfj.attention_varlen(q[None], k, v, cu, cu, 9, 9), ValueError, "^q: expected 3 dimensions"),
    (lambda q, k, v, cu: cfj.attention_varlen(q, k, v, cu, cu, 9, 9, causal="yes"), TypeError, "^causal"),
], ids=["dtype", "d-head", "max-seqlen-negative", "max-seqlen-big", "max-seqlen-float", "cu-count", "cu-dtype",
        "rank", "causal"])
@pytest.mark.parametrize("under", ["jit-grad", "jit-lse", "eager"])
def test_varlen_errors_raise_while_tracing(varlen_on_cpu, call, error, message, under):
    """forward_varlen's argument errors reach the caller while tracing (under jit and grad too),
    before any plan is made or any callback runs."""
    q, k, v, cu, _, _ = _packed_inputs(53)
    if under == "jit-grad":
        run = lambda: jax.jit(jax.grad(lambda q: call(q, k, v, cu).astype(jnp.float32).sum()))(q)  # noqa: E731
    elif under == "jit-lse":
        run = lambda: jax.jit(lambda q: call(q, k, v, cu))(q)  # noqa: E731
    else:
        run = lambda: call(q, k, v, cu)  # noqa: E731
    with pytest.raises(error, match=message):
        run()
    assert not varlen_on_cpu.forward_plans and not varlen_on_cpu.backward_plans and not varlen_on_cpu.forward_runs


def test_varlen_refuses_vmap(varlen_on_cpu):
    q, k, v, cu_q, cu_k, _ = _packed_inputs(54)
    with pytest.raises(NotImplementedError, match="vmap"):
        jax.vmap(lambda q: cfj.attention_varlen(q, k, v, cu_q, cu_k, 9, 9))(q[None])
