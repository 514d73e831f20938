"""cupyflash.torch: the `cupyflash::` operators.

CPU tests (need torch, no GPU): schema, fake kernels on meta tensors (shapes, strides, dtypes,
errors), and the operator machinery (opcheck, torch.compile(fullgraph=True)) run over a NumPy
reference put in place of the kernel. GPU tests: the real kernel eagerly against the SPEC §5 rule,
opcheck, torch.compile with Inductor, CUDA graph capture and replay.
"""
from __future__ import annotations

import contextlib
import math
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyflash.torch as cft  # noqa: E402  (after the importorskip)
from cupyflash.config import DType  # noqa: E402
from cupyflash.device import has_gpu  # noqa: E402
from framework_support import numpy_attention, prewarm_problems  # noqa: E402

needs_gpu = pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU")
TORCH_DTYPES = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


def meta(*shape: int, dtype=torch.bfloat16) -> "torch.Tensor":
    return torch.empty(shape, dtype=dtype, device="meta")


# ----------------------------------------------------------------------------- CPU: registration
def test_import_cupyflash_stays_framework_free():
    code = ("import sys, cupyflash; bad = [m for m in ('torch', 'jax') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_schemas_and_tags():
    for name, schema in cft.SCHEMAS.items():
        op = getattr(torch.ops.cupyflash, name).default
        assert str(op._schema) == f"cupyflash::{name}{schema}"
        assert torch.Tag.pt2_compliant_tag in op.tags
    assert cft.attention_forward is torch.ops.cupyflash.attention_forward.default


# ----------------------------------------------------------------------------- CPU: fake kernels
@pytest.mark.parametrize("q_shape,kv_shape", [
    ((2, 100, 8, 128), (2, 300, 2, 128)),   # GQA, seq_q < seq_k
    ((1, 257, 4, 64), (1, 3, 4, 64)),       # seq_q > seq_k
    ((0, 16, 4, 64), (0, 16, 4, 64)),       # zero-size batch
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fake_shapes_strides_dtypes(q_shape, kv_shape, dtype):
    b, s, h, d = q_shape
    # q as a transposed view of (b, h, s, d): the output is contiguous all the same, like forward()'s
    q = meta(b, h, s, d, dtype=dtype).transpose(1, 2)
    k, v = meta(*kv_shape, dtype=dtype), meta(*kv_shape, dtype=dtype)
    out = cft.attention(q, k, v)
    assert out.shape == q_shape and out.dtype == dtype and out.is_contiguous()
    out, lse = cft.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == q_shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (b, h, s) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert lse.stride() == (h * s, s, 1)


@pytest.mark.parametrize("call,error,message", [
    (lambda: cft.attention(meta(1, 8, 2, 64, dtype=torch.float32), meta(1, 8, 2, 64), meta(1, 8, 2, 64)),
     TypeError, "q: dtype must be float16 or bfloat16"),
    (lambda: cft.attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64, dtype=torch.float16), meta(1, 8, 2, 64)),
     TypeError, "k: dtype"),
    (lambda: cft.attention(meta(1, 8, 2, 64), meta(1, 8, 2, 32), meta(1, 8, 2, 32)), ValueError, "k: d_head 32"),
    (lambda: cft.attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 9, 2, 64)), ValueError, "v: seq_len 9"),
    (lambda: cft.attention(meta(1, 8, 3, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64)), ValueError, "k: k and v have 2 heads"),
    (lambda: cft.attention(meta(8, 2, 64), meta(8, 2, 64), meta(8, 2, 64)), ValueError, "q: expected 4 dimensions"),
    (lambda: cft.attention(meta(1, 8, 2, 48), meta(1, 8, 2, 48), meta(1, 8, 2, 48)), ValueError, "q: d_head 48"),
    (lambda: cft.attention(meta(1, 8, 2, 128)[..., ::2], meta(1, 8, 2, 64), meta(1, 8, 2, 64)),
     ValueError, "q: the last dimension"),
    (lambda: cft.attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64), causal=1),
     TypeError, "causal: expected a bool"),
    (lambda: cft.attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64), return_lse="yes"),
     TypeError, "return_lse: expected a bool"),
    (lambda: cft.attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64), softmax_scale=-1.0),
     ValueError, "softmax_scale: expected a finite number > 0"),
    (lambda: cft.attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64), softmax_scale="0.1"),
     TypeError, "softmax_scale: expected None or a real number"),
    (lambda: cft.attention(*(torch.randn(1, 8, 2, 64, dtype=torch.float16) for _ in range(3))),
     TypeError, "q: expected a CUDA tensor"),
], ids=["q-dtype", "k-dtype", "d-head", "v-shape", "heads", "rank", "unsupported-d", "strided-d",
        "causal-int", "return-lse-str", "negative-scale", "scale-str", "host-tensors"])
def test_argument_errors_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ----------------------------------------------------------------------------- CPU: machinery
def _reference_kernel(q, k, v, causal, softmax_scale, return_lse):
    """NumPy stand-in for the CUDA kernel: outputs laid out exactly as forward() returns them."""
    out, lse = numpy_attention(*(x.detach().float().numpy() for x in (q, k, v)), softmax_scale, causal)
    out = torch.from_numpy(out).to(q.dtype).contiguous()
    return (out, torch.from_numpy(lse).float().contiguous()) if return_lse else out


@pytest.fixture
def reference_kernel(monkeypatch):
    monkeypatch.setattr(cft, "_host_kernel", _reference_kernel)


def _inputs(device, dtype=torch.bfloat16, shape=(2, 40, 4, 64), kv=(2, 56, 2, 64)):
    return (torch.randn(shape, device=device, dtype=dtype), torch.randn(kv, device=device, dtype=dtype),
            torch.randn(kv, device=device, dtype=dtype))


def test_opcheck_over_reference(reference_kernel):
    q, k, v = _inputs("cpu")
    for op, args, kwargs in [(cft.attention_forward, (q, k, v), {}),
                             (cft.attention_forward, (q, k, v), {"causal": True, "softmax_scale": 0.3}),
                             (cft.attention_forward_lse, (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, True),
                              {})]:
        result = torch.library.opcheck(op, args, kwargs)
        assert set(result.values()) == {"SUCCESS"}, result


class AttentionBlock(torch.nn.Module):
    """A pre-norm self-attention block with a fused QKV projection, as a transformer has."""

    def __init__(self, dim: int = 256, heads: int = 2, dtype=torch.bfloat16, device="cpu") -> None:
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(dim, dtype=dtype, device=device)
        self.qkv = torch.nn.Linear(dim, 3 * dim, dtype=dtype, device=device)
        self.proj = torch.nn.Linear(dim, dim, dtype=dtype, device=device)

    def forward(self, x: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        y, lse = cft.attention(q, k, v, causal=True, return_lse=True)
        return x + self.proj(y.reshape(b, n, d)), lse


def test_compile_fullgraph_over_reference(reference_kernel):
    torch._dynamo.reset()
    block = AttentionBlock()
    x = torch.randn(2, 33, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        explanation = torch._dynamo.explain(block)(x)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        for n in (33, 47):  # a second length: recompiled (or dynamic) without a break
            x = torch.randn(2, n, 256, dtype=torch.bfloat16)
            got, want = compiled(x), block(x)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])



def test_compile_reports_argument_errors_while_tracing(reference_kernel):
    torch._dynamo.reset()
    q, k, v = _inputs("cpu")
    compiled = torch.compile(lambda q, k, v: cft.attention(q, k, v), fullgraph=True, backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="k: d_head 32 does not match q's 64"):
        compiled(q, k[..., :32], v[..., :32])

# ----------------------------------------------------------------------------- CPU: launch plans
class LaunchRecorder:
    """Stands in for cuLaunchKernel / the backward launcher: records what would be launched."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, *args) -> None:
        self.calls.append(args)


def _host_view(x, name):
    from cupyflash.interop import TORCH, TensorView

    return TensorView(x.data_ptr(), tuple(x.shape), tuple(x.stride()), {torch.bfloat16: DType.BF16}.get(x.dtype),
                      x.dtype, 0, TORCH, x)


@pytest.fixture
def mocked_launch(monkeypatch):
    """The CUDA kernels' replay path on host tensors: device 0 current, stream 77, launches recorded."""
    recorder = LaunchRecorder()
    monkeypatch.setattr(cft._TABLE, "launch_kernel", recorder)
    monkeypatch.setattr(cft._TABLE, "get_device", lambda: 0)
    monkeypatch.setattr(cft, "_raw_stream", lambda device: 77)
    monkeypatch.setattr(cft, "as_view", _host_view)
    monkeypatch.setattr(cft, "_bind_context", lambda: None)  # no CUDA context to bind on the host
    cft.clear_plans()
    yield recorder
    cft.clear_plans()


def test_forward_plan_replays_with_each_calls_pointers(mocked_launch, monkeypatch):
    import struct

    from cupyflash import op_launch
    from cupyflash.families.forward_sm80.config_sets import default_config
    from cupyflash.validation import check_forward_args

    select = lambda dtype, d_head, *_: default_config(dtype, d_head)  # noqa: E731
    monkeypatch.setattr(op_launch, "plan_views", lambda q, k, v, causal, scale: (
        check_forward_args(None, q, k, v, None, scale, causal, select=select), None))
    def make_launch(plan, sm90, device):  # op_launch.make_launch's mma.sync branch, minus the registry
        fast = op_launch.OpLaunch(1234, plan.grid, plan.block, plan.smem_bytes, device, plan.pack(0, 0, 0, 0, 0),
                                  plan.out_shape, None, None)
        fast.write_pointers = op_launch.leading_writer(fast.buf)
        return fast

    monkeypatch.setattr(op_launch, "make_launch", make_launch)
    full_path = []
    monkeypatch.setattr(cft, "_forward", lambda *args, **kwargs: full_path.append(kwargs) or "full path")
    q, k, v = _inputs("cpu", shape=(2, 40, 4, 64), kv=(2, 56, 2, 64))
    assert cft._attention_lse_cuda(q, k, v, True, 0.25) == "full path"  # first call: validated, planned
    plan = check_forward_args(None, *(_host_view(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))), None, 0.25,
                              True, select=select)
    for _ in range(2):  # new inputs, same signature: replayed with their pointers
        q, k, v = _inputs("cpu", shape=(2, 40, 4, 64), kv=(2, 56, 2, 64))
        out, lse = cft._attention_lse_cuda(q, k, v, True, 0.25)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        assert lse.shape == (2, 4, 40) and lse.dtype == torch.float32
        head = mocked_launch.calls[-1]
        assert head[:7] == (1234, *plan.grid, plan.block, 1, 1) and head[7:9] == (plan.smem_bytes, 77)
        buf = cft._PLANS[cft._forward_key(q, k, v, True, 0.25)].fast.buf.raw
        assert buf == plan.pack(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
    out = cft._attention_cuda(q, k, v, True, 0.25)  # no lse: the same plan, lse pointer 0
    assert len(full_path) == 1 and out.shape == q.shape
    assert struct.unpack_from("<5Q", cft._PLANS[cft._forward_key(q, k, v, True, 0.25)].fast.buf)[4] == 0
    flat = torch.randn(2 * 40 * 4 * 64 + 1, dtype=torch.bfloat16)
    misaligned = flat[1:].view(2, 40, 4, 64)  # same signature, pointer off by 2 bytes: the full path
    def refuse(*args, **kwargs):
        raise ValueError("q: data pointer is not 16-byte aligned")

    monkeypatch.setattr(cft, "_forward", refuse)
    with pytest.raises(ValueError, match="q: data pointer"):
        cft._attention_cuda(misaligned, k, v, True, 0.25)
    monkeypatch.setattr(cft, "_forward", lambda *args, **kwargs: "full path")
    calls = len(mocked_launch.calls)
    monkeypatch.setattr(cft._TABLE, "get_device", lambda: 1)  # another device current: the full path
    assert cft._attention_cuda(q, k, v, True, 0.25) == "full path" and len(mocked_launch.calls) == calls


@pytest.mark.parametrize("layout", ["contiguous", "odd size-1 stride", "heads-major"])
def test_replayed_outputs_are_row_major_whatever_q_is(mocked_launch, monkeypatch, layout):
    from cupyflash import op_launch
    from cupyflash.families.forward_sm80.config_sets import default_config
    from cupyflash.validation import check_forward_args

    select = lambda dtype, d_head, *_: default_config(dtype, d_head)  # noqa: E731
    monkeypatch.setattr(op_launch, "plan_views", lambda q, k, v, causal, scale: (
        check_forward_args(None, q, k, v, None, scale, causal, select=select), None))
    monkeypatch.setattr(op_launch, "make_launch", lambda plan, sm90, device: op_launch.OpLaunch(
        1234, plan.grid, plan.block, plan.smem_bytes, device, plan.pack(0, 0, 0, 0, 0), plan.out_shape, None, None))
    monkeypatch.setattr(op_launch.OpLaunch, "write_pointers", lambda *ptrs: None, raising=False)
    monkeypatch.setattr(cft, "_forward", lambda *args, **kwargs: "full path")

    def make_q() -> torch.Tensor:
        if layout == "heads-major":
            return torch.randn(1, 4, 40, 64, dtype=torch.bfloat16).transpose(1, 2)
        q = torch.randn(1, 40, 4, 64, dtype=torch.bfloat16)
        return q.as_strided(q.shape, (7, 256, 64, 1)) if layout == "odd size-1 stride" else q

    k, v = (torch.randn(1, 56, 4, 64, dtype=torch.bfloat16) for _ in range(2))
    assert cft._attention_cuda(make_q(), k, v, False, None) == "full path"
    out = cft._attention_cuda(make_q(), k, v, False, None)
    assert out.shape == (1, 40, 4, 64) and out.stride() == (40 * 4 * 64, 4 * 64, 64, 1)


def _watched_contexts():
    """Contexts under which an eager call must reach the operator (something observes the dispatch)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Function(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    return {"dispatch mode": Dispatch, "function mode": Function,
            "profiler": lambda: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])}


@pytest.mark.parametrize("watcher", ["dispatch mode", "function mode", "profiler"])
def test_dispatch_free_refuses_watched_calls(watcher):
    """Under anything that observes the dispatcher, eager calls go through the operators."""
    q, k, v = _inputs("cpu")
    assert cft._dispatch_free(q, k, v)
    with _watched_contexts()[watcher]():
        assert not cft._dispatch_free(q, k, v)
    assert cft._dispatch_free(q, k, v)
    assert not cft._eager_cuda(q, k, v)  # host tensors: the operator (its CPU kernel refuses them)


def test_dispatch_free_refuses_wrapped_and_traced_tensors():
    q, k, v = _inputs("cpu")
    assert cft._dispatch_free(q, k, v)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        assert not cft._dispatch_free(fq, k, v)
    assert torch.func.vmap(lambda x: torch.tensor(float(cft._dispatch_free(x, k, v))))(q).sum() == 0
    seen = []
    torch.jit.trace(lambda x: seen.append(cft._dispatch_free(x, k, v)) or x * 2, (q,), check_trace=False)
    assert seen == [False]


# ----------------------------------------------------------------------------- GPU
PROBLEMS = [(DType.BF16, 128, 256, 256, False), (DType.BF16, 128, 256, 256, True),
            (DType.FP16, 128, 256, 256, False)]


@pytest.fixture(scope="module")
def kernels():
    prewarm_problems(PROBLEMS)


def _cupy(cp, t):
    """A CuPy view of a CUDA tensor (bf16 as its raw 16-bit patterns, which gpu_reference reads)."""
    return cp.asarray(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)


def _poison_allocator(shape, dtype):
    """Leave a NaN-filled block of this size in torch's caching allocator, so the operator's
    output allocation (same size, same stream) gets it and an unwritten element shows as NaN."""
    block = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del block


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype,causal,q_shape,kv_shape,scale", [
    (DType.BF16, False, (2, 256, 4, 128), (2, 256, 4, 128), None),
    (DType.BF16, True, (2, 200, 8, 128), (2, 256, 2, 128), 0.05),   # causal GQA, seq_q < seq_k
    (DType.FP16, False, (1, 256, 2, 128), (1, 77, 2, 128), None),   # seq_k not a block multiple
])
@pytest.mark.parametrize("return_lse", [False, True])
def test_eager_matches_reference(kernels, dtype, causal, q_shape, kv_shape, scale, return_lse):
    import cupy as cp
    from gpu_reference import check_attention

    tdtype = TORCH_DTYPES[dtype]
    q = torch.randn(q_shape, device="cuda", dtype=tdtype)
    k, v = (torch.randn(kv_shape, device="cuda", dtype=tdtype) for _ in range(2))
    _poison_allocator(q_shape, tdtype)
    if return_lse:
        _poison_allocator((q_shape[0], q_shape[2], q_shape[1]), torch.float32)
    result = cft.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=return_lse)
    out, lse = result if return_lse else (result, None)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == tdtype and out.is_contiguous()
    check_attention(cp, dtype, _cupy(cp, q), _cupy(cp, k), _cupy(cp, v), _cupy(cp, out), scale, causal=causal,
                    lse=cp.asarray(lse) if lse is not None else None, context="cupyflash.torch.attention")


@pytest.mark.gpu
@needs_gpu
def test_opcheck_cuda(kernels):
    q, k, v = _inputs("cuda", shape=(2, 256, 4, 128), kv=(2, 256, 2, 128))
    for op, args in [(cft.attention_forward, (q, k, v)), (cft.attention_forward, (q, k, v, True, 0.1)),
                     (cft.attention_forward_lse, (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, True))]:
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.gpu
@needs_gpu
def test_eager_errors_from_the_kernel_path(kernels):
    # A pointer the fake kernel cannot see: misaligned by one element, caught by forward() itself.
    flat = torch.randn(2 * 256 * 4 * 128 + 1, device="cuda", dtype=torch.bfloat16)
    q = flat[1:].view(2, 256, 4, 128)
    k = v = torch.randn(2, 256, 4, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q: data pointer 0x[0-9a-f]+ is not 16-byte aligned"):
        cft.attention(q, k, v)
    with pytest.raises(TypeError, match="k: expected a CUDA tensor"):
        cft.attention(k, k.cpu(), v)


@pytest.mark.gpu
@needs_gpu
def test_compile_inductor_fullgraph_block(kernels):
    torch._dynamo.reset()
    block = AttentionBlock(dim=512, heads=4, device="cuda")  # d_head 128
    x = torch.randn(2, 256, 512, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        explanation = torch._dynamo.explain(block)(x)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True)
        got, want = compiled(x), block(x)
    torch.testing.assert_close(got[1], want[1], atol=2e-2, rtol=1e-2)  # lse: fp32, same kernel
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)  # Inductor fuses the norm/bias


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_capture_and_replay(kernels):
    shape = (2, 256, 4, 128)
    static = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs asks
        for _ in range(2):
            cft.attention(*static)
            cft.attention(*static, causal=True, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cft.attention(*static)
        out_c, lse_c = cft.attention(*static, causal=True, return_lse=True)
    for _ in range(2):  # new inputs each replay, compared with eager calls on the same values
        for t in static:
            t.copy_(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        want = cft.attention(*static)
        want_c, want_lse = cft.attention(*static, causal=True, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(out_c, want_c) and torch.equal(lse_c, want_lse)
        assert not torch.isnan(out).any()
    expected = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in static)).transpose(1, 2)
    assert (out.float() - expected.float()).abs().max().item() < 2e-2



@pytest.mark.gpu
@needs_gpu
def test_compile_reduce_overhead_cuda_graphs(kernels):
    # Inductor's CUDA graph trees record the operator's launch and replay it on new inputs.
    torch._dynamo.reset()

    def f(q, k, v):
        return cft.attention(q * 2, k, v, causal=True) + 1

    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        q, k, v = _inputs("cuda", shape=(2, 256, 4, 128), kv=(2, 256, 4, 128))
        got = compiled(q, k, v).clone()  # the graph's output buffer is reused by the next replay
        assert torch.equal(got, f(q, k, v))


# ----------------------------------------------------------------------------- autograd
def _torch_attention(q, k, v, causal, softmax_scale):
    """Attention in plain torch ops (GQA by repeat, bottom-right causal mask), differentiable."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        seq_q, seq_k = q.shape[1], k.shape[1]
        hidden = torch.arange(seq_k)[None, :] > torch.arange(seq_q)[:, None] + (seq_k - seq_q)
        s = s.masked_fill(hidden.to(s.device), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see no key: 0
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _reference_backward(dout, q, k, v, out, lse, causal, softmax_scale):
    """The gradients the CUDA backward returns, in float64 by the closed-form formulas (a kernel
    runs below autograd, so no autograd here), laid out alike: dS = P * (dP - rowsum(dP * P))."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    group = q.shape[2] // k.shape[2]
    qd, kd, vd, dod = (x.detach().double() for x in (q, k, v, dout))
    kr, vr = kd.repeat_interleave(group, dim=2), vd.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kr) * scale
    if causal:
        seq_q, seq_k = q.shape[1], k.shape[1]
        hidden = torch.arange(seq_k)[None, :] > torch.arange(seq_q)[:, None] + (seq_k - seq_q)
        s = s.masked_fill(hidden, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dod)
    dp = torch.einsum("bqhd,bkhd->bhqk", dod, vr)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qd) * scale

    def fold(g):  # sum the query heads of each k/v group
        b, n, h, d = g.shape
        return g.view(b, n, h // group, group, d).sum(3)

    return tuple(g.to(x.dtype).contiguous() for g, x in zip((dq, fold(dk), fold(dv)), (q, k, v)))


@pytest.fixture
def reference_kernels(monkeypatch):
    monkeypatch.setattr(cft, "_host_kernel", _reference_kernel)
    monkeypatch.setattr(cft, "_host_backward_kernel", _reference_backward)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_flow_through_the_operators(reference_kernels, causal):
    """q, k, v get the backward operator's dq, dk, dv (each to its own input, with the forward's
    causal flag and scale); the lse is not differentiable."""
    q, k, v = (x.requires_grad_() for x in _inputs("cpu"))
    dout = torch.randn_like(q)
    cft.attention(q, k, v, causal=causal, softmax_scale=0.2).backward(dout)
    want = _reference_backward(dout, q, k, v, None, None, causal, 0.2)
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        assert got.shape == ref.shape and torch.equal(got, ref)
    with torch.enable_grad():  # and the closed form is autograd's answer
        qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
        _torch_attention(qd, kd, vd, causal, 0.2).backward(dout.double())
    for got, ref in zip((q.grad, k.grad, v.grad), (qd.grad, kd.grad, vd.grad)):
        assert torch.allclose(got.double(), ref, rtol=2e-2, atol=2e-2)
    out, lse = cft.attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    with torch.no_grad():  # no gradient needed: the plain operator, nothing saved
        assert not cft.attention(q, k, v).requires_grad


def test_opcheck_backward_operator_over_reference(reference_kernels):
    q, k, v = _inputs("cpu")
    dout = torch.randn_like(q)
    out, lse = cft.attention_forward_lse(q.detach(), k.detach(), v.detach(), True, None)
    result = torch.library.opcheck(cft.attention_backward, (dout, q.detach(), k.detach(), v.detach(), out, lse, True))
    assert set(result.values()) == {"SUCCESS"}, result


def test_compile_fullgraph_forward_and_backward_over_reference(reference_kernels):
    torch._dynamo.reset()
    block = AttentionBlock()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 33, 256, dtype=torch.bfloat16)
    grads = []
    for model in (block, compiled):
        block.zero_grad()
        model(x)[0].float().square().mean().backward()
        grads.append([p.grad.clone() for p in block.parameters()])
    for eager, comp in zip(*grads):
        assert torch.equal(eager, comp)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16], ids=lambda d: d.name)
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_on_the_gpu_match_the_reference(dtype, causal):
    """dq, dk, dv through torch autograd against float64 autograd of the same math (relative L2
    within SPEC §5's bounds), GQA and ragged lengths included."""
    tdt = TORCH_DTYPES[dtype]
    for attempt in range(2):  # fresh inputs of one signature: the full path, then the replayed plans
        q = torch.randn(2, 77, 8, 128, device="cuda", dtype=tdt, requires_grad=True)
        k = torch.randn(2, 130, 2, 128, device="cuda", dtype=tdt, requires_grad=True)
        v = torch.randn(2, 130, 2, 128, device="cuda", dtype=tdt, requires_grad=True)
        dout = torch.randn_like(q)
        cft.attention(q, k, v, causal=causal).backward(dout)
        qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
        _torch_attention(qd, kd, vd, causal, None).backward(dout.double())
        bound = 1e-2 if dtype is DType.BF16 else 2e-3
        for got, ref, name in ((q.grad, qd.grad, "dq"), (k.grad, kd.grad, "dk"), (v.grad, vd.grad, "dv")):
            rel = ((got.double() - ref).norm() / ref.norm()).item()
            assert rel <= bound, (name, attempt, rel)


@needs_gpu
@pytest.mark.gpu
def test_training_calls_skip_the_dispatcher(monkeypatch):
    """Eager training steps with planned signatures (dense and packed): the forward with the lse
    and the backward launch without their operators (stand-ins in their place see no call) and
    give the operators' bits (deterministic backward); under a dispatch mode both go through the
    operators."""
    q, k, v = (torch.randn(2, 256, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    vq, vk, vv, cu_q, cu_k, max_q, max_k = _varlen_inputs("cuda", (90, 0, 200, 33), (100, 7, 200, 0), (8, 2), 128)
    vdout = torch.randn_like(vq)
    monkeypatch.setattr(cft, "deterministic_backward", True)

    def step(attention, inputs, grad):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out = attention(*leaves)
        out.backward(grad)
        return [out.detach()] + [x.grad for x in leaves]

    steps = {"dense": lambda: step(lambda *a: cft.attention(*a, causal=True), (q, k, v), dout),
             "varlen": lambda: step(lambda *a: cft.attention_varlen(*a, cu_q, cu_k, max_q, max_k, causal=True),
                                    (vq, vk, vv), vdout)}
    want = {name: (run(), run())[1] for name, run in steps.items()}  # the first call plans each signature
    seen = []
    for name in ("attention_forward_lse", "attention_backward", "attention_varlen_lse_op", "attention_varlen_backward"):
        op = getattr(cft, name)
        monkeypatch.setattr(cft, name, lambda *a, _op=op, _name=name: seen.append(_name) or _op(*a))
    for watched in (False, True):
        with _watched_contexts()["dispatch mode"]() if watched else contextlib.nullcontext():
            got = {name: run() for name, run in steps.items()}
        assert seen == (["attention_forward_lse", "attention_backward", "attention_varlen_lse_op",
                         "attention_varlen_backward"] if watched else []), watched
        for name in steps:
            assert all(torch.equal(a, b) for a, b in zip(want[name], got[name])), (name, watched)
        seen.clear()


@needs_gpu
@pytest.mark.gpu
def test_deterministic_gradients_are_bit_identical(monkeypatch):
    """deterministic_backward: the same bits on every run (the replayed plan, no dQ accumulator),
    and the same gradients as the atomic path within bf16 rounding."""
    q, k, v = (torch.randn(2, 200, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)

    def grads():
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        cft.attention(*leaves, causal=True).backward(dout)
        return [x.grad for x in leaves]

    atomic = grads()
    monkeypatch.setattr(cft, "deterministic_backward", True)
    runs = [grads() for _ in range(3)]
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))
    for a, b in zip(atomic, runs[0]):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


@needs_gpu
@pytest.mark.gpu
def test_compile_inductor_trains_a_block_on_the_gpu():
    """torch.compile(fullgraph=True) with Inductor over forward and backward: no graph break,
    the same gradients as eager within bf16 rounding."""
    torch._dynamo.reset()
    block = AttentionBlock(device="cuda")
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(block, fullgraph=True)
    grads = []
    for model in (block, compiled):
        block.zero_grad()
        model(x)[0].float().square().mean().backward()
        grads.append([p.grad.float().clone() for p in block.parameters()])
    for eager, comp in zip(*grads):
        assert ((eager - comp).norm() / eager.norm().clamp_min(1e-12)).item() < 2e-2


# ----------------------------------------------------------------------------- varlen operator
def _reference_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale):
    """NumPy stand-in for the varlen CUDA kernel: per sequence; no keys -> 0; past the last
    sequence's end the rows are left as torch.empty gives them (zeroed here, for comparisons)."""
    out = np.zeros(q.shape, dtype=np.float64)
    qn, kn, vn = (x.detach().float().numpy() for x in (q, k, v))
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] > cq[b] and ck[b + 1] > ck[b]:
            o, _ = numpy_attention(qn[None, cq[b]:cq[b + 1]], kn[None, ck[b]:ck[b + 1]], vn[None, ck[b]:ck[b + 1]],
                                   softmax_scale, causal)
            out[cq[b]:cq[b + 1]] = o[0]
    return torch.from_numpy(out).to(q.dtype).contiguous()


def _varlen_inputs(device, lens_q=(5, 0, 17, 9), lens_k=(7, 3, 17, 0), heads=(4, 2), d=64):
    cu_q = torch.tensor([0, *np.cumsum(lens_q)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *np.cumsum(lens_k)], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), heads[0], d, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), heads[1], d, device=device, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def test_varlen_operator_fake_kernel_and_errors():
    q, k, v = meta(100, 8, 128), meta(300, 2, 128), meta(300, 2, 128)
    cu = meta(5, dtype=torch.int32)
    out = cft.attention_varlen(q, k, v, cu, cu, 60, 200, causal=True)
    assert out.shape == (100, 8, 128) and out.dtype == torch.bfloat16 and out.is_contiguous()
    with pytest.raises(TypeError, match="^cu_seqlens_k: expected dtype int32"):
        cft.attention_varlen(q, k, v, cu, meta(5, dtype=torch.int64), 60, 200)
    with pytest.raises(ValueError, match="^cu_seqlens_k: has 4 entries"):
        cft.attention_varlen(q, k, v, cu, meta(4, dtype=torch.int32), 60, 200)
    with pytest.raises(TypeError, match="^max_seqlen_q: expected an int"):
        cft.attention_varlen(q, k, v, cu, cu, 60.0, 200)
    with pytest.raises(ValueError, match="^k: d_head 64"):
        cft.attention_varlen(q, meta(300, 2, 64), meta(300, 2, 64), cu, cu, 60, 200)


@pytest.fixture
def reference_varlen_kernel(monkeypatch):
    monkeypatch.setattr(cft, "_host_varlen_kernel", _reference_varlen_kernel)


def test_varlen_opcheck_and_compile_over_reference(reference_varlen_kernel):
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs("cpu")
    for args in [(q, k, v, cu_q, cu_k, max_q, max_k), (q, k, v, cu_q, cu_k, max_q, max_k, True, 0.3)]:
        result = torch.library.opcheck(cft.attention_varlen_op, args)
        assert set(result.values()) == {"SUCCESS"}, result
    torch._dynamo.reset()
    f = torch.compile(lambda *a: cft.attention_varlen(*a, causal=True), fullgraph=True, backend="aot_eager")
    assert torch.equal(f(q, k, v, cu_q, cu_k, max_q, max_k), _reference_varlen_kernel(q, k, v, cu_q, cu_k, max_q,
                                                                                        max_k, True, None))


@pytest.mark.gpu
@needs_gpu
def test_varlen_operator_on_the_gpu():
    import cupy as cp
    from gpu_reference import check_attention

    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs("cuda", (90, 0, 200, 33), (100, 7, 200, 0), (8, 2), 128)
    out = cft.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    torch.cuda.synchronize()
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(4):
        if cq[b + 1] == cq[b]:
            continue
        if ck[b + 1] == ck[b]:
            assert bool((out[cq[b]:cq[b + 1]] == 0).all())
            continue
        check_attention(cp, DType.BF16, *(_cupy(cp, x[None]) for x in (q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]],
                                                                       v[ck[b]:ck[b + 1]], out[cq[b]:cq[b + 1]])),
                        causal=True, context=f"attention_varlen sequence {b}")
    result = torch.library.opcheck(cft.attention_varlen_op, (q, k, v, cu_q, cu_k, max_q, max_k, True, None))
    assert set(result.values()) == {"SUCCESS"}, result
    torch._dynamo.reset()
    f = torch.compile(lambda *a: cft.attention_varlen(*a, causal=True), fullgraph=True)
    assert torch.equal(f(q, k, v, cu_q, cu_k, max_q, max_k), out)


@pytest.mark.gpu
@needs_gpu
def test_varlen_gradients_opcheck_and_compile(monkeypatch):
    """attention_varlen is differentiable (attention_varlen_lse's autograd formula over
    attention_varlen_backward): opcheck on both operators, and the gradients of a loss eagerly
    and under torch.compile(fullgraph=True) agree bit for bit in deterministic mode."""
    monkeypatch.setattr(cft, "deterministic_backward", True)
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs("cuda", (90, 0, 200, 33), (100, 7, 200, 0), (8, 2), 128)
    for x in (q, k, v):
        x.requires_grad_()
    args = (q, k, v, cu_q, cu_k, max_q, max_k, True, None)
    result = torch.library.opcheck(cft.attention_varlen_lse_op, args)
    assert set(result.values()) == {"SUCCESS"}, result
    out, lse = cft.attention_varlen_lse_op(*args)
    dout = torch.randn_like(out)
    bargs = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, cu_q, cu_k, max_q, max_k, True, None, True)
    result = torch.library.opcheck(cft.attention_varlen_backward, bargs)
    assert set(result.values()) == {"SUCCESS"}, result
    weight = torch.randn(out.shape, device="cuda")

    def loss(q, k, v):
        return (cft.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True).float() * weight).sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    for name, a, b in zip(("dq", "dk", "dv"), eager, compiled):
        assert torch.equal(a, b), name
    # the sequence with queries but no keys (the last) gets dq = 0, the one without queries dk = dv = 0
    assert bool((eager[0][290:] == 0).all()) and bool((eager[1][100:107] == 0).all())


# ----------------------------------------------------------------------------- kvcache operator
def _reference_kvcache_kernel(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, softmax_scale,
                              num_splits):
    """NumPy/torch stand-in for the decode CUDA kernels (contiguous caches): append k_new/v_new at
    cache_seqlens in place, then attend over each sequence's rows."""
    assert block_table is None, "the stand-in serves contiguous caches"
    lens = cache_seqlens.tolist()
    seq_new = 0 if k_new is None else k_new.shape[1]
    for b, n in enumerate(lens):
        if seq_new:
            k_cache[b, n:n + seq_new] = k_new[b]
            v_cache[b, n:n + seq_new] = v_new[b]
    out = np.zeros(q.shape, dtype=np.float64)
    for b, n in enumerate(lens):
        keys = n + seq_new
        if keys:
            o, _ = numpy_attention(*(x[b:b + 1, :rows].detach().float().numpy()
                                     for x, rows in ((q, q.shape[1]), (k_cache, keys), (v_cache, keys))),
                                   softmax_scale, causal)
            out[b] = o[0]
    return torch.from_numpy(out).to(q.dtype).contiguous()


def _kvcache_inputs(device, batch=3, seq_q=2, cap=64, heads=(4, 2), d=64, seq_new=2):
    q = torch.randn(batch, seq_q, heads[0], d, device=device, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(batch, cap, heads[1], d, device=device, dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([0, 17, 40][:batch], dtype=torch.int32, device=device)
    k_new, v_new = (torch.randn(batch, seq_new, heads[1], d, device=device, dtype=torch.bfloat16) for _ in range(2))
    return q, k_cache, v_cache, seqlens, k_new, v_new


def test_kvcache_operator_fake_kernel_and_errors():
    q, kc, vc = meta(2, 1, 8, 128), meta(2, 256, 2, 128), meta(2, 256, 2, 128)
    lens = meta(2, dtype=torch.int32)
    out = cft.attention_kvcache(q, kc, vc, cache_seqlens=lens)
    assert out.shape == (2, 1, 8, 128) and out.dtype == torch.bfloat16 and out.is_contiguous()
    paged = cft.attention_kvcache(q, meta(64, 16, 2, 128), meta(64, 16, 2, 128), cache_seqlens=lens,
                                  block_table=meta(2, 32, dtype=torch.int32))
    assert paged.shape == (2, 1, 8, 128)
    with pytest.raises(TypeError, match="^cache_seqlens: expected dtype int32"):
        cft.attention_kvcache(q, kc, vc, cache_seqlens=meta(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="^num_splits"):
        cft.attention_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=0)


@pytest.fixture
def reference_kvcache_kernel(monkeypatch):
    monkeypatch.setattr(cft, "_host_kvcache_kernel", _reference_kvcache_kernel)


def test_kvcache_opcheck_and_compile_over_reference(reference_kvcache_kernel):
    q, kc, vc, lens, kn, vn = _kvcache_inputs("cpu")
    for args in [(q, kc.clone(), vc.clone(), lens), (q, kc.clone(), vc.clone(), lens, None, kn, vn, True, 0.3)]:
        result = torch.library.opcheck(cft.attention_kvcache_op, args)
        assert set(result.values()) == {"SUCCESS"}, result
    torch._dynamo.reset()
    f = torch.compile(lambda q, kc, vc, lens, kn, vn: cft.attention_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn,
                                                                             v_new=vn),
                      fullgraph=True, backend="aot_eager")
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    got = f(q, kc1, vc1, lens, kn, vn)
    want = _reference_kvcache_kernel(q, kc2, vc2, lens, None, kn, vn, True, None, None)
    assert torch.equal(got, want)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)  # the append reached the caller's caches
    assert torch.equal(kc1[1, 17:19], kn[1]) and not torch.equal(kc1, kc)


@pytest.mark.gpu
@needs_gpu
def test_kvcache_operator_on_the_gpu():
    q, kc, vc, lens, kn, vn = _kvcache_inputs("cuda", d=128)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out = cft.attention_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn)
    want = _reference_kvcache_kernel(q.cpu(), kc_ref.cpu(), vc_ref.cpu(), lens.cpu(), None, kn.cpu(), vn.cpu(), True,
                                     None, None)
    assert torch.equal(kc[1, 17:19], kn[1]) and torch.equal(vc[2, 40:42], vn[2])
    assert (out.float().cpu() - want.float()).norm() / want.float().norm() < 1e-2
    result = torch.library.opcheck(cft.attention_kvcache_op, (q, kc.clone(), vc.clone(), lens, None, kn, vn))
    assert set(result.values()) == {"SUCCESS"}, result
    torch._dynamo.reset()
    f = torch.compile(lambda *a: cft.attention_kvcache(a[0], a[1], a[2], cache_seqlens=a[3]), fullgraph=True)
    assert torch.equal(f(q, kc, vc, lens), cft.attention_kvcache(q, kc, vc, cache_seqlens=lens))


@needs_gpu
@pytest.mark.gpu
def test_inference_calls_skip_the_dispatcher(monkeypatch):
    """Eager inference calls run the operators' CUDA kernels without the dispatcher (stand-ins in
    the operators' place see no call) and give the operators' results; under a dispatch mode they
    go through the operators (dense with and without the lse, varlen, kvcache)."""
    q, k, v = _inputs("cuda", shape=(2, 256, 4, 128), kv=(2, 256, 4, 128))
    vq, vk, vv, cu_q, cu_k, max_q, max_k = _varlen_inputs("cuda", (90, 0, 200, 33), (100, 7, 200, 0), (8, 2), 128)
    kq, kc, vc, lens, _, _ = _kvcache_inputs("cuda", d=128)
    calls = {
        "attention_forward": lambda: cft.attention(q, k, v, causal=True),
        "attention_forward_lse": lambda: cft.attention(q, k, v, return_lse=True),
        "attention_varlen_op": lambda: cft.attention_varlen(vq, vk, vv, cu_q, cu_k, max_q, max_k, causal=True),
        "attention_kvcache_op": lambda: cft.attention_kvcache(kq, kc, vc, cache_seqlens=lens),
    }
    want = {name: call() for name, call in calls.items()}  # through the operators' planning calls too
    seen = []
    for name in calls:
        op = getattr(cft, name)
        monkeypatch.setattr(cft, name, lambda *a, _op=op, _name=name: seen.append(_name) or _op(*a))
    for watched in (False, True):
        with _watched_contexts()["dispatch mode"]() if watched else contextlib.nullcontext():
            got = {name: call() for name, call in calls.items()}
        assert seen == (list(calls) if watched else []), watched
        for name, result in got.items():
            pairs = zip(result, want[name]) if isinstance(result, tuple) else [(result, want[name])]
            assert all(torch.equal(a, b) for a, b in pairs), (name, watched)


_FRESH_PROCESS_BACKWARD = """
import torch, cupyflash.torch as cft
q, k, v, dout = (torch.randn(1, 200, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
q.requires_grad_()
cft.attention(q, k, v, causal=True).backward(dout)  # autograd's device thread: its first CUDA work
torch.cuda.synchronize()
assert q.grad is not None and bool(torch.isfinite(q.grad).all())
print("ok")
"""


@needs_gpu
@pytest.mark.gpu
def test_backward_on_a_fresh_autograd_thread():
    """In a new process the backward operator is the first CUDA work of autograd's device thread,
    which torch has not bound to a context (the lse's gradient is not materialised, so no zero
    fill runs before it): the operator binds it before its driver calls."""
    _run_in_a_fresh_process(_FRESH_PROCESS_BACKWARD)


def _run_in_a_fresh_process(script: str) -> None:
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


_FRESH_PROCESS_CHECKPOINT = """
import torch, cupyflash.torch as cft
from torch.utils.checkpoint import checkpoint
q, k, v, dout = (torch.randn(1, 200, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
q.requires_grad_()
out = checkpoint(lambda q, k, v: cft.attention(q, k, v, causal=True), q, k, v, use_reentrant=False)
out.backward(dout)  # autograd's device thread reruns the forward, then runs the backward
torch.cuda.synchronize()
assert q.grad is not None and bool(torch.isfinite(q.grad).all())
print("ok")
"""


@needs_gpu
@pytest.mark.gpu
def test_checkpointed_attention_on_a_fresh_autograd_thread():
    """Activation checkpointing reruns the training forward on autograd's device thread: in a new
    process that is the thread's first CUDA work, so the forward operator binds its context too."""
    _run_in_a_fresh_process(_FRESH_PROCESS_CHECKPOINT)
