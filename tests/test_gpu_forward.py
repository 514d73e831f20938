"""GPU tests: every config of the tune and progression sets against the SPEC §5 rule, the
forward() options, and PyTorch/JAX DLPack round trips. Skipped cleanly without a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from cupyflash.config import DType
from cupyflash.families.forward_sm80.config_sets import get_kernel_configs
from cupyflash.device import has_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU")]

if has_gpu():
    import cupy as cp

    import cupyflash
    from gpu_reference import check_attention, poisoned, random_inputs

CONFIGS = sorted(set(get_kernel_configs("tune")) | set(get_kernel_configs("prog_all")))
FIGURES: list[dict] = []  # collected per test and written by the session fixture below


def prewarm_plan(arch: str, cc: int) -> list[tuple]:
    """What this module compiles, as gpu_prewarm.prewarm_groups groups, for a GPU of `arch` / `cc`
    (no GPU needed: scripts/prewarm_offdevice.py --test-modules builds it off the device)."""
    return [(CONFIGS, [arch], {})]


@pytest.fixture(scope="module", autouse=True)
def prewarmed_cache():
    """Compile every config once, in parallel, before the tests use them one at a time."""
    from gpu_prewarm import prewarm_groups, this_arch, write_figures

    prewarm_groups(*prewarm_plan(this_arch(cp), 0))
    yield
    write_figures(FIGURES)


@pytest.fixture
def rng():
    return np.random.default_rng()


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_config_matches_reference(cfg, rng):
    batch, heads = 2, 3
    seq = 2 * max(cfg.B_r, cfg.B_c)
    q, k, v = (random_inputs(cp, cfg.dtype, (batch, seq, heads, cfg.d_head), rng) for _ in range(3))
    out = poisoned(cp, cfg.dtype, q.shape)
    result = cupyflash.forward(cfg, q, k, v, out=out)
    assert result is out
    figures = check_attention(cp, cfg.dtype, q, k, v, out)
    FIGURES.append({"config": str(cfg), "dtype": cfg.dtype.name, "d_head": cfg.d_head, **figures})


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
@pytest.mark.parametrize("d_head", [64, 128])
def test_default_config_longer_sequence(dtype, d_head, rng):
    q, k, v = (random_inputs(cp, dtype, (1, 1024, 4, d_head), rng) for _ in range(3))
    out = cupyflash.forward(None, q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    check_attention(cp, dtype, q, k, v, out)


def test_short_form_string_and_softmax_scale(rng):
    cfg = get_kernel_configs("prog")[-1]
    q, k, v = (random_inputs(cp, cfg.dtype, (2, 128, 2, cfg.d_head), rng) for _ in range(3))
    out = cupyflash.forward(cfg.short_form(), q, k, v, softmax_scale=0.3)
    check_attention(cp, cfg.dtype, q, k, v, out, scale=0.3)


def test_runs_on_the_current_cupy_stream(rng):
    q, k, v = (random_inputs(cp, DType.FP16, (2, 256, 4, 64), rng) for _ in range(3))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = cupyflash.forward(None, q, k, v)
    stream.synchronize()
    check_attention(cp, DType.FP16, q, k, v, out)


def test_torch_round_trip_on_torch_stream():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(2, 256, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = cupyflash.forward(None, q, k, v)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float()).transpose(1, 2)
    stream.synchronize()
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.device == q.device
    rel = ((out.float() - expected).norm() / expected.norm()).item()
    assert rel < 1e-2
    # zero-copy: the same memory seen through CuPy is the output
    assert cp.from_dlpack(out).data.ptr == out.data_ptr()


def test_torch_out_argument_and_fp16():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    result = cupyflash.forward(None, q, k, v, out=out)
    torch.cuda.synchronize()
    assert result is out and not torch.isnan(out).any()
    check_attention(cp, DType.FP16, cp.from_dlpack(q), cp.from_dlpack(k), cp.from_dlpack(v), cp.from_dlpack(out))


def test_jax_round_trip():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    key = jax.random.PRNGKey(int(time.time()))
    q, k, v = (jax.random.normal(kk, (1, 256, 2, 128), dtype=jnp.bfloat16) for kk in jax.random.split(key, 3))
    out = cupyflash.forward(None, q, k, v)
    assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16 and out.shape == q.shape
    qc, kc, vc, oc = (cp.from_dlpack(x) for x in (q, k, v, out))
    check_attention(cp, DType.BF16, qc, kc, vc, oc)


def test_warm_process_compiles_nothing(tmp_path):
    """A second process on a filled cache directory launches without compiling."""
    script = (
        "import time, cupy as cp, numpy as np, cupyflash\n"
        "from cupyflash.compiler import compile_count\n"
        "t = time.perf_counter()\n"
        "q = cp.asarray(np.random.standard_normal((1, 128, 2, 128)).astype(np.float16))\n"
        "cupyflash.forward(None, q, q, q); cp.cuda.runtime.deviceSynchronize()\n"
        "print(compile_count(), time.perf_counter() - t)\n"
    )
    env = dict(os.environ, CUPYFLASH_CACHE_DIR=str(tmp_path))
    cold = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    warm = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    cold_count, cold_s = cold.stdout.split()
    warm_count, warm_s = warm.stdout.split()
    assert int(cold_count) == 1 and int(warm_count) == 0
    FIGURES.append({"warm_start": {"cold_first_call_s": float(cold_s), "warm_first_call_s": float(warm_s)}})


def test_compiles_and_runs_after_torch_import(tmp_path):
    """Kernels compiled by whichever NVRTC PyTorch's wheels load first are valid too."""
    pytest.importorskip("torch")
    script = (
        "import torch; torch.ones(1, device='cuda')\n"
        "import cupy as cp, numpy as np, cupyflash, math\n"
        "from cupyflash.compiler import compile_count\n"
        "q, k, v = (torch.randn(1, 256, 2, 64, device='cuda', dtype=torch.float16) for _ in range(3))\n"
        "o = cupyflash.forward(None, q, k, v)\n"
        "ref = torch.softmax((q.transpose(1, 2).float() @ k.transpose(1, 2).float().mT) / 8.0, -1) @ v.transpose(1, 2).float()\n"
        "print(compile_count(), float((o.transpose(1, 2).float() - ref).norm() / ref.norm()))\n"
    )
    env = dict(os.environ, CUPYFLASH_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    count, rel = done.stdout.split()
    assert int(count) == 1 and float(rel) < 2e-3


@pytest.mark.parametrize("family", ["auto", "sm80"])
def test_repeated_lse_calls_replay_the_launch_plan(rng, family):
    """return_lse=True calls replay too (each with a new lse of its own inputs), for torch tensors
    and CuPy arrays, and give the bits of the full path (a given lse= keeps a call off the replay)."""
    from cupyflash import launch_plans
    from cupyflash.families.forward_sm80.config_sets import default_config as sm80_default

    cfg = None if family == "auto" else sm80_default(DType.BF16, 128)
    for framework in ("cupy", "torch"):
        for causal in (False, True):
            for _ in range(3):
                q, k, v = (random_inputs(cp, DType.BF16, (2, 200, 4, 128), rng) for _ in range(3))
                args = (q, k, v)
                if framework == "torch":
                    torch = pytest.importorskip("torch")
                    args = tuple(torch.from_dlpack(x) for x in args)
                key = launch_plans.signature(cfg, *args, None, None, causal, True)
                out, lse = cupyflash.forward(cfg, *args, causal=causal, return_lse=True)
                assert key in launch_plans._TABLE.plans
                given = cp.empty((2, 4, 200), dtype=cp.float32)
                if framework == "torch":
                    given = torch.from_dlpack(given)
                full_out, full_lse = cupyflash.forward(cfg, *args, causal=causal, return_lse=True, lse=given)
                if framework == "torch":
                    assert torch.equal(out, full_out) and torch.equal(lse, full_lse)
                    out, lse = cp.from_dlpack(out), cp.from_dlpack(lse)
                else:
                    assert bool((out == full_out).all()) and bool((lse == full_lse).all())
                check_attention(cp, DType.BF16, q, k, v, out, causal=causal, lse=lse)


def test_calls_with_stream_replay_on_that_stream(rng):
    """stream= (a CuPy stream object, its int handle, a torch stream) replays the signature's plan
    on that stream: each call computes its own inputs there, and the plan is the one of calls
    without stream=."""
    from cupyflash import launch_plans

    launch_plans.clear()
    side = cp.cuda.Stream(non_blocking=True)
    for i in range(4):
        q, k, v = (random_inputs(cp, DType.BF16, (2, 256, 4, 128), rng) for _ in range(3))
        cp.cuda.get_current_stream().synchronize()  # the inputs are ready before the side stream reads them
        stream = side if i % 2 == 0 else side.ptr
        out = cupyflash.forward(None, q, k, v, causal=True, stream=stream)
        side.synchronize()
        check_attention(cp, DType.BF16, q, k, v, out, causal=True)
    assert len(launch_plans._TABLE.plans) == 1, "stream= calls did not share one plan"
    torch = pytest.importorskip("torch")
    ts = torch.cuda.Stream()
    q, k, v = (random_inputs(cp, DType.BF16, (2, 256, 4, 128), rng) for _ in range(3))
    cp.cuda.get_current_stream().synchronize()
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    for _ in range(2):
        out = cupyflash.forward(None, tq, tk, tv, causal=True, stream=ts)
        ts.synchronize()
        check_attention(cp, DType.BF16, q, k, v, cp.from_dlpack(out), causal=True)


def test_repeated_calls_replay_the_launch_plan(rng):
    """Second and later calls with one signature take the fast path; each must still be right."""
    from cupyflash import launch_plans

    for framework in ("cupy", "torch"):
        for _ in range(3):
            q, k, v = (random_inputs(cp, DType.BF16, (2, 256, 4, 128), rng) for _ in range(3))
            if framework == "torch":
                torch = pytest.importorskip("torch")
                tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
                out = cp.from_dlpack(cupyflash.forward(None, tq, tk, tv))
                torch.cuda.synchronize()
            else:
                out = cupyflash.forward(None, q, k, v)
            check_attention(cp, DType.BF16, q, k, v, out)
        assert launch_plans._TABLE.plans, "the fast path never remembered a plan"
