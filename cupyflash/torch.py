"""cupyflash.torch: attention as PyTorch custom operators (torch.compile, CUDA graphs, opcheck).

Importing this module registers operators in the torch.library namespace `cupyflash`:

    cupyflash::attention_forward(Tensor q, Tensor k, Tensor v, bool causal=False,
                                 float? softmax_scale=None) -> Tensor
    cupyflash::attention_forward_lse(Tensor q, Tensor k, Tensor v, bool causal=False,
                                     float? softmax_scale=None) -> (Tensor out, Tensor lse)

Two operators rather than one with a `return_lse` flag: each has a fixed output arity, the plain
one allocates no placeholder log-sum-exp per call and keeps `cupyflash.forward`'s replayed launch
plan (calls asking for the lse take its full validation path), and a later autograd formula can
hang off the variant that saves the lse.

They are defined with `torch.library.Library` + `impl` (a C++ dispatcher entry calling a Python
kernel): on the H100 it costs about 5 us per call on top of `forward`, against 22-25 us for the
same body registered with `torch.library.custom_op` (`scripts/bench_frameworks.py`). Eager calls
of `attention()`, `attention_varlen()` and `attention_kvcache()` on CUDA tensors (and the training
forward and backward) skip even that, running the operators' CUDA kernel bodies directly, when
nothing could observe the dispatch (`_dispatch_free`: plain tensors, no torch function or dispatch
mode, no functorch transform, no TorchScript tracing, no profiler); everything else,
torch.compile included, calls the operators. The CUDA kernels call `cupyflash.forward`, which
launches on torch's current stream (the capture stream inside `torch.cuda.graph`) and allocates
its outputs with torch (the graph's pool during capture). The fake (meta) kernels apply the same
argument rules as `forward` to the tensors' metadata, so shape and dtype errors surface while
tracing, and return exactly what the CUDA kernels return: a contiguous output of q's shape and
dtype, and a contiguous float32 lse of shape (batch, heads, seq_q).

Gradients: a third operator, `cupyflash::attention_backward(dout, q, k, v, out, lse, causal,
softmax_scale, deterministic) -> (dq, dk, dv)`, runs `cupyflash.backward` (backward_sm90 on
Hopper at d_head 64 and 128 where it applies, else backward_sm80; after a signature's first call its
launch plan is replayed, cupyflash.backward_plans), and `attention_forward_lse` carries an autograd formula over it
(`torch.library.register_autograd`, so it composes with torch.compile). `attention()` routes
calls that need a gradient through the lse variant, which saves what the backward needs; the lse
output itself is not differentiable (as in FlashAttention). `attention_forward` called directly
has no autograd formula (it saves no lse).

Packed ragged batches: `cupyflash::attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int
max_seqlen_q, int max_seqlen_k, causal, softmax_scale) -> Tensor` runs `cupyflash.forward_varlen`;
`attention_varlen_lse` (same arguments, -> (out, lse)) carries an autograd formula over
`attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, causal, softmax_scale, deterministic) -> (dq, dk, dv)` (`cupyflash.backward_varlen`),
and `attention_varlen()` routes calls that need a gradient through it; `cupyflash::attention_kvcache(q, k_cache!, v_cache!,
cache_seqlens, block_table?, k_new?, v_new?, causal, softmax_scale, num_splits?) -> Tensor` runs
`cupyflash.forward_kvcache`, with the caches declared mutated (k_new/v_new are appended in place).
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from . import launch_plans, op_launch
from .config import DType
from .interop import TORCH, TensorView, as_view
from .validation import LaunchPlan, check_flag, check_forward_args, check_softmax_scale

__all__ = ["attention", "attention_varlen", "attention_kvcache", "attention_forward", "attention_forward_lse", "attention_backward",
           "attention_varlen_backward", "NAMESPACE"]

NAMESPACE = "cupyflash"
_ARGS = "(Tensor q, Tensor k, Tensor v, bool causal=False, float? softmax_scale=None)"
_VARLEN_ARGS = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
                "int max_seqlen_k, bool causal=False, float? softmax_scale=None)")
SCHEMAS = {
    "attention_forward": _ARGS + " -> Tensor",
    "attention_forward_lse": _ARGS + " -> (Tensor out, Tensor lse)",
    "attention_backward": ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal=False, "
                           "float? softmax_scale=None, bool deterministic=False) -> (Tensor dq, Tensor dk, Tensor dv)"),
    "attention_varlen": _VARLEN_ARGS + " -> Tensor",
    "attention_varlen_lse": _VARLEN_ARGS + " -> (Tensor out, Tensor lse)",
    "attention_varlen_backward": ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                                  "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
                                  "bool causal=False, float? softmax_scale=None, bool deterministic=False) "
                                  "-> (Tensor dq, Tensor dk, Tensor dv)"),
    # k_cache/v_cache are written in place (k_new/v_new appended at cache_seqlens) when k_new is given
    "attention_kvcache": ("(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
                          "Tensor? block_table=None, Tensor? k_new=None, Tensor? v_new=None, bool causal=True, "
                          "float? softmax_scale=None, int? num_splits=None) -> Tensor"),
}

# pt2_compliant: tested with opcheck and torch.compile. Exact strides: Inductor must hand the
# kernel the strides eager mode would (last dimension contiguous, rows 16-byte aligned), not a
# layout of its choosing.
_TAGS = tuple(getattr(torch.Tag, name) for name in ("pt2_compliant_tag", "needs_exact_strides")
              if hasattr(torch.Tag, name))

_LIB = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema, tags=_TAGS)

_TORCH_DTYPES = {torch.float16: DType.FP16, torch.bfloat16: DType.BF16}


def _forward(*args: Any, **kwargs: Any) -> Any:
    """cupyflash.forward, imported on first launch (it pulls in CuPy's runtime)."""
    global _forward
    from .api import forward

    _forward = forward
    return forward(*args, **kwargs)


# ------------------------------------------------------------------------- CUDA kernels
# The forward kernels keep their own launch plans, keyed by what the kernels' choices depend on
# (shapes, strides, dtypes, devices, causal, scale): the first call of a signature goes through
# cupyflash.forward (full validation, its errors, the launch), later calls read the pointers,
# allocate the outputs with torch and launch a pre-packed parameter block on torch's current
# stream. No CuPy array, view or stream object is made per call. The backward operator calls
# cupyflash.backward, whose cfg=None calls replay their own plans (cupyflash.backward_plans).
# The plans live in a launch_plans.PlanTable of their own (its cap, and cuLaunchKernel and the
# current-device query bound with the first plan); only torch's stream accessor is bound here.
_TABLE = launch_plans.PlanTable()
_PLANS = _TABLE.plans  # the same dict for the life of the process (clear() empties it in place)
_raw_stream: Any = None  # torch's current stream handle of a device, bound with the first plan


def _bind_stream() -> None:
    global _raw_stream
    from .interop import _torch_current_stream

    _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _torch_current_stream


class _ForwardPlan:
    """A validated forward signature: its replayable launch and output shapes."""

    __slots__ = ("fast", "device", "out_shape", "lse_shape", "like_q", "is_torch")  # is_torch: PlanTable.remember

    def __init__(self, fast: Any, device: int, out_shape: tuple[int, ...], lse_shape: tuple[int, ...],
                 like_q: bool) -> None:
        self.fast, self.device, self.out_shape, self.lse_shape = fast, device, out_shape, lse_shape
        # out is q's shape and q has row-major strides (the key holds them): torch.empty_like(q)
        # allocates the same contiguous tensor as q.new_empty(out_shape) for 60% of its cost
        self.like_q = like_q


def _forward_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Any) -> tuple:
    # One flat tuple: hashing nested tuples costs more. torch.Size and stride() are tuples already.
    return (q.shape, q.stride(), q.dtype, q.get_device(), k.shape, k.stride(), k.dtype, k.get_device(),
            v.shape, v.stride(), v.dtype, v.get_device(), causal, softmax_scale)


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (size-1 dimensions included: empty_like
    copies even those, and the fake kernels promise exactly these)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _remember_forward(key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      softmax_scale: Any) -> None:
    """Plan the signature of a call that `forward` has just run (so its arguments are valid)."""
    if key in _PLANS:  # planned already (this call was misaligned, or on another device)
        return
    if _raw_stream is None:
        _bind_stream()
    views = [as_view(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"))]
    plan, sm90 = op_launch.plan_views(*views, causal, softmax_scale)
    if not plan.launch:  # empty problems: forward allocates and returns, nothing to replay
        return
    fast = op_launch.make_launch(plan, sm90, plan.device)
    out_shape = tuple(plan.out_shape)
    _TABLE.remember(key, _ForwardPlan(fast, plan.device, out_shape, tuple(plan.lse_shape),
                                      out_shape == tuple(q.shape) and q.stride() == _row_major(out_shape)),
                    is_torch=True)  # the key starts with q's shape, not an array type


def _run_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Any,
                 with_lse: bool) -> Any:
    """The CUDA kernels' body: (out) or (out, lse) for a replayed plan, else None."""
    # _forward_key, inlined: a call frame is a visible share of this path
    plan = _PLANS.get((q.shape, q.stride(), q.dtype, q.get_device(), k.shape, k.stride(), k.dtype,
                       k.get_device(), v.shape, v.stride(), v.dtype, v.get_device(), causal, softmax_scale))
    if plan is None or _TABLE.get_device() != plan.device:
        return None
    out = torch.empty_like(q) if plan.like_q else q.new_empty(plan.out_shape)  # contiguous, q's dtype
    q_ptr, k_ptr, v_ptr, o_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    if (q_ptr | k_ptr | v_ptr | o_ptr) & 15:
        return None  # misaligned this time: forward raises the proper error
    if with_lse:
        lse = q.new_empty(plan.lse_shape, dtype=torch.float32)
        lse_ptr = lse.data_ptr()
    else:
        lse, lse_ptr = None, 0
    stream = _raw_stream(plan.device)
    fast = plan.fast
    with fast.lock:  # cuLaunchKernel copies the parameters before it returns
        fast.write_pointers(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr)
        _TABLE.launch_kernel(*fast.launch_head, stream, fast.argv_ptr, 0)
    return (out, lse) if with_lse else out


def _dispatch_free_checks() -> Any:
    """The predicate `_dispatch_free` uses, or one that is always False where this torch lacks
    one of the checks (then every call goes through the dispatcher)."""
    try:
        from torch.utils._python_dispatch import is_in_torch_dispatch_mode

        function_modes, dispatch_modes = torch._C._len_torch_function_stack, torch._C._len_torch_dispatch_stack
        transforms, tracing = torch._C._functorch.peek_interpreter_stack, torch._C._get_tracing_state
        profiler = torch.autograd.profiler
        profiler._is_profiler_enabled  # noqa: B018 (present, as read below)
    except AttributeError:
        return lambda q, k, v: False
    tensor = torch.Tensor

    def dispatch_free(q: Any, k: Any, v: Any) -> bool:
        return (type(q) is tensor and type(k) is tensor and type(v) is tensor and not function_modes()
                and not dispatch_modes() and not is_in_torch_dispatch_mode() and transforms() is None
                and tracing() is None and not profiler._is_profiler_enabled)

    return dispatch_free


# Eager calls skip the dispatcher (~4 us of a ~14 us call on the H200 host, NOTES.md item 269)
# when nothing between a call and the operator's CUDA kernel could observe or change it: plain
# tensors (no subclass, fake or functorch wrapper), no torch function or dispatch mode (fake,
# proxy and functional tracing included), no functorch transform, no TorchScript tracing, no
# profiler. Callers check torch.compiler.is_compiling() first, which Dynamo folds to True while
# tracing, so a compiled graph always holds the operator.
_dispatch_free = _dispatch_free_checks()


def _eager_cuda(q: Any, k: Any, v: Any, *others: Any) -> bool:
    """True when an eager call may run an operator's CUDA kernel body itself: CUDA tensors, not
    under torch.compile, `_dispatch_free`, and the call's other tensor arguments (None where
    optional) plain tensors too."""
    return (not torch.compiler.is_compiling() and q.is_cuda and _dispatch_free(q, k, v)
            and all(x is None or type(x) is torch.Tensor for x in others))


def _attention_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: float | None = None) -> torch.Tensor:
    out = _run_forward(q, k, v, causal, softmax_scale, False)
    if out is None:
        out = _forward(None, q, k, v, causal=causal, softmax_scale=softmax_scale)
        _remember_forward(_forward_key(q, k, v, causal, softmax_scale), q, k, v, causal, softmax_scale)
    return out


def _attention_lse_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _bind_context()  # the training forward: activation checkpointing reruns it on autograd's thread
    result = _run_forward(q, k, v, causal, softmax_scale, True)
    if result is None:
        result = _forward(None, q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)
        _remember_forward(_forward_key(q, k, v, causal, softmax_scale), q, k, v, causal, softmax_scale)
    return result


def _refuse_host_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         softmax_scale: float | None, return_lse: bool) -> Any:
    """The CPU kernel's body: the TypeError `forward` gives for host tensors (rather than the
    dispatcher's 'could not run ... with arguments from the CPU backend')."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if not x.is_cuda:
            as_view(x, name)  # raises "<name>: expected a CUDA tensor, got a torch tensor on cpu"
    raise TypeError("q: expected CUDA tensors")


# The CPU kernels call through this name, so the tests can put a reference implementation here
# and run opcheck and torch.compile over the operators on a machine without a GPU.
_host_kernel = _refuse_host_tensors


def _attention_host(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: float | None = None) -> torch.Tensor:
    return _host_kernel(q, k, v, causal, softmax_scale, False)


def _attention_lse_host(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _host_kernel(q, k, v, causal, softmax_scale, True)


def _backward(*args: Any, **kwargs: Any) -> Any:
    """cupyflash.backward, imported on first use."""
    global _backward
    from .backward_api import backward

    _backward = backward
    return backward(*args, **kwargs)


_bound = threading.local()


def _bind_context() -> None:
    """Make the current device's primary context current on this thread, once per thread. The
    backward operators run on autograd's device threads, where torch may not have made a runtime
    call yet (its set_device skips a device that is already current): the library's driver calls
    (cuTensorMapEncodeTiled, cuLaunchKernel) would find no context (CUresult 201)."""
    if not getattr(_bound, "done", False):
        import cupy

        cupy.cuda.runtime.free(0)  # cudaFree(0): binds the primary context to the calling thread
        _bound.done = True


def _attention_backward_cuda(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                             softmax_scale: float | None = None,
                             deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # cfg=None: after a signature's first call, backward replays its plan (backward_plans)
    _bind_context()
    return _backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, deterministic=deterministic)


def clear_plans() -> None:
    """Forget every replayable launch (tests; or after a tuning table changed)."""
    _TABLE.clear()
    from . import backward_plans
    from .backward_varlen import clear as clear_varlen_backward

    backward_plans.clear()
    clear_varlen_backward()


def _attention_backward_host(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                             softmax_scale: float | None = None,
                             deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _host_backward_kernel(dout, q, k, v, out, lse, causal, softmax_scale)


def _refuse_host_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any) -> Any:
    for x, name in ((dout, "dout"), (q, "q"), (k, "k"), (v, "v")):
        if not x.is_cuda:
            as_view(x, name)
    raise TypeError("q: expected CUDA tensors")


# As _host_kernel, for the backward operator's CPU kernel (tests put a reference here).
_host_backward_kernel = _refuse_host_backward

def _attention_varlen_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                          softmax_scale: float | None = None) -> torch.Tensor:
    from .varlen import forward_varlen  # its own per-signature fast path; torch's current stream

    return forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                          softmax_scale=softmax_scale)


def _attention_varlen_lse_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                              softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _bind_context()  # as _attention_lse_cuda
    from .varlen import forward_varlen

    return forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                          softmax_scale=softmax_scale, return_lse=True)


def _attention_varlen_backward_cuda(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                    causal: bool = False, softmax_scale: float | None = None,
                                    deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .backward_varlen import backward_varlen

    _bind_context()
    return backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=causal, softmax_scale=softmax_scale, deterministic=deterministic)


# As _host_kernel, for the varlen operator's CPU kernel (tests put a reference here).
_host_varlen_kernel = _refuse_host_tensors


def _attention_varlen_lse_host(q: torch.Tensor, *args: Any) -> Any:
    _refuse_host_tensors(q, *args[:2], False, None, False)


def _attention_varlen_backward_host(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    *_: Any) -> Any:
    _refuse_host_backward(dout, q, k, v)


def _attention_varlen_host(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                           softmax_scale: float | None = None) -> torch.Tensor:
    return _host_varlen_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)


def _attention_kvcache_cuda(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                           k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, causal: bool = True,
                           softmax_scale: float | None = None, num_splits: int | None = None) -> torch.Tensor:
    from .kvcache import forward_kvcache  # its own per-signature fast path; torch's current stream

    return forward_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k_new,
                           v_new=v_new, causal=causal, softmax_scale=softmax_scale, num_splits=num_splits)


# As _host_kernel, for the kvcache operator's CPU kernel (tests put a reference here).
_host_kvcache_kernel = _refuse_host_tensors


def _attention_kvcache_host(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                            k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, causal: bool = True,
                            softmax_scale: float | None = None, num_splits: int | None = None) -> torch.Tensor:
    return _host_kvcache_kernel(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, softmax_scale,
                                num_splits)


_LIB.impl("attention_kvcache", _attention_kvcache_cuda, "CUDA")
_LIB.impl("attention_kvcache", _attention_kvcache_host, "CPU")
_LIB.impl("attention_varlen", _attention_varlen_cuda, "CUDA")
_LIB.impl("attention_varlen", _attention_varlen_host, "CPU")
_LIB.impl("attention_varlen_lse", _attention_varlen_lse_cuda, "CUDA")
_LIB.impl("attention_varlen_lse", _attention_varlen_lse_host, "CPU")
_LIB.impl("attention_varlen_backward", _attention_varlen_backward_cuda, "CUDA")
_LIB.impl("attention_varlen_backward", _attention_varlen_backward_host, "CPU")
_LIB.impl("attention_backward", _attention_backward_cuda, "CUDA")
_LIB.impl("attention_backward", _attention_backward_host, "CPU")
_LIB.impl("attention_forward", _attention_cuda, "CUDA")
_LIB.impl("attention_forward_lse", _attention_lse_cuda, "CUDA")
_LIB.impl("attention_forward", _attention_host, "CPU")
_LIB.impl("attention_forward_lse", _attention_lse_host, "CPU")


# ------------------------------------------------------------------------- fake kernels
def _meta_view(x: torch.Tensor, name: str) -> TensorView:
    """A TensorView of a fake/meta tensor's metadata (no pointer: 0 passes the alignment rule;
    the CUDA kernel checks the real one)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    index = x.device.index
    return TensorView(0, tuple(x.shape), tuple(x.stride()), _TORCH_DTYPES.get(x.dtype), x.dtype,
                      index if index is not None else 0, TORCH, None)


def _any_config(dtype: DType, d_head: Any, *_: Any) -> Any:
    # The output shapes do not depend on the config; the CUDA kernel picks the real one.
    from .families.forward_sm80.config_sets import default_config

    return default_config(dtype, int(d_head))


def check_metadata(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   softmax_scale: Any) -> LaunchPlan:
    """`forward`'s argument rules applied to tensor metadata (fake, meta or real tensors); raises
    the same TypeError/ValueError. Returns the plan, whose out_shape/lse_shape the fake kernels use."""
    views = [_meta_view(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"))]
    kinds = {x.device.type for x in (q, k, v)}
    if len(kinds) > 1:
        raise ValueError(f"k: q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (softmax_scale is None or isinstance(softmax_scale, (int, float))):
        softmax_scale = None  # a symbolic float while tracing: the CUDA kernel checks the value
    return check_forward_args(None, *views, None, softmax_scale, causal, select=_any_config)


@torch.library.register_fake(f"{NAMESPACE}::attention_forward", lib=_LIB)
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: float | None = None) -> torch.Tensor:
    plan = check_metadata(q, k, v, causal, softmax_scale)
    return q.new_empty(plan.out_shape)  # contiguous, q's dtype and device, like forward()'s


@torch.library.register_fake(f"{NAMESPACE}::attention_forward_lse", lib=_LIB)
def _attention_lse_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    plan = check_metadata(q, k, v, causal, softmax_scale)
    return q.new_empty(plan.out_shape), q.new_empty(plan.lse_shape, dtype=torch.float32)


@torch.library.register_fake(f"{NAMESPACE}::attention_backward", lib=_LIB)
def _attention_backward_fake(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                             softmax_scale: float | None = None,
                             deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_metadata(q, k, v, causal, softmax_scale)
    # contiguous, of the shapes and dtype of q, k, v, as cupyflash.backward allocates them
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                    softmax_scale: Any) -> Any:
    """forward_varlen's argument rules on tensor metadata (the varlen fake kernels)."""
    from .varlen_checks import check_varlen_args

    views = [_meta_view(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"),
                                                 (cu_seqlens_k, "cu_seqlens_k"))]
    if softmax_scale is not None and not isinstance(softmax_scale, (int, float)):
        softmax_scale = None  # a symbolic float while tracing: the CUDA kernel checks the value
    return check_varlen_args(*views, max_seqlen_q, max_seqlen_k, None, softmax_scale, causal)


@torch.library.register_fake(f"{NAMESPACE}::attention_varlen", lib=_LIB)
def _attention_varlen_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                           softmax_scale: float | None = None) -> torch.Tensor:
    problem = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    return q.new_empty(problem.out_shape)  # contiguous (total_q, heads, d), as forward_varlen allocates


@torch.library.register_fake(f"{NAMESPACE}::attention_varlen_lse", lib=_LIB)
def _attention_varlen_lse_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                               softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    problem = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    return q.new_empty(problem.out_shape), q.new_empty(problem.lse_shape, dtype=torch.float32)


@torch.library.register_fake(f"{NAMESPACE}::attention_varlen_backward", lib=_LIB)
def _attention_varlen_backward_fake(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                    causal: bool = False, softmax_scale: float | None = None,
                                    deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    # contiguous, of the shapes and dtype of q, k, v, as cupyflash.backward_varlen allocates them
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake(f"{NAMESPACE}::attention_kvcache", lib=_LIB)
def _attention_kvcache_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                            k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, causal: bool = True,
                            softmax_scale: float | None = None, num_splits: int | None = None) -> torch.Tensor:
    from .kvcache_checks import check_kvcache_args, check_num_splits

    named = ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (cache_seqlens, "cache_seqlens"),
             (block_table, "block_table"), (k_new, "k_new"), (v_new, "v_new"))
    views = [_meta_view(x, name) if x is not None else None for x, name in named]
    if softmax_scale is not None and not isinstance(softmax_scale, (int, float)):
        softmax_scale = None  # a symbolic float while tracing: the CUDA kernel checks the value
    check_num_splits(num_splits)
    plan = check_kvcache_args(*views, None, causal, softmax_scale, False)
    return q.new_empty(plan.out_shape)  # contiguous, q's shape and dtype, as forward_kvcache allocates


# ------------------------------------------------------------------------- autograd
def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.mark_non_differentiable(lse)  # FlashAttention-style: no gradient flows back through the lse
    # the backward never reads the lse's gradient: without this autograd fills a zero tensor for
    # it on every step (aten::zeros + fill_, ~48 us of a tiny step's host time on an H200 host)
    ctx.set_materialize_grads(False)


def _attention_lse_backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple:
    if dout is None:  # the loss does not depend on out (grads are not materialised)
        return None, None, None, None, None
    q, k, v, out, lse = ctx.saved_tensors
    # autograd may hand a gradient of any layout (an expanded zero, a transposed view): the
    # kernels take a contiguous last dimension with 16-byte aligned rows.
    dout = dout.contiguous()
    if _eager_cuda(dout, q, k, v, out, lse):
        dq, dk, dv = _attention_backward_cuda(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                                              deterministic_backward)
    else:
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, deterministic_backward)
    return dq, dk, dv, None, None


# True makes every gradient bit-identical run to run (dQ by a separate pass instead of atomics).
deterministic_backward = False

torch.library.register_autograd(f"{NAMESPACE}::attention_forward_lse", _attention_lse_backward,
                                setup_context=_setup_context, lib=_LIB)


def _setup_varlen_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.max_seqlens, ctx.causal, ctx.softmax_scale = (max_seqlen_q, max_seqlen_k), causal, softmax_scale
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # as _setup_context: no zero lse gradient per step


def _attention_varlen_lse_backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple:
    if dout is None:
        return (None,) * 9
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    args = (dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens, ctx.causal,
            ctx.softmax_scale, deterministic_backward)
    if _eager_cuda(*args[:8]):
        dq, dk, dv = _attention_varlen_backward_cuda(*args)
    else:
        dq, dk, dv = attention_varlen_backward(*args)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd(f"{NAMESPACE}::attention_varlen_lse", _attention_varlen_lse_backward,
                                setup_context=_setup_varlen_context, lib=_LIB)


class _AttentionFunction(torch.autograd.Function):
    """The same formula as the operator's registered autograd, for eager calls: the registered
    one runs a Python autograd kernel inside the dispatcher and then re-dispatches, ~2.5x the
    cost of this (measured on a CPU: 19 us vs 7.7 us per call around a no-op kernel); torch.compile
    traces the registered one. The forward(ctx, ...) form: a separate setup_context costs
    another ~17 us per call (functorch's custom_function_call)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                softmax_scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        if _eager_cuda(q, k, v):
            out, lse = _attention_lse_cuda(q, k, v, causal, softmax_scale)
        else:
            with torch._C._AutoDispatchBelowAutograd():  # straight to the CUDA (or meta/fake) kernel
                out, lse = attention_forward_lse(q, k, v, causal, softmax_scale)
        _setup_context(ctx, (q, k, v, causal, softmax_scale), (out, lse))
        return out, lse

    backward = staticmethod(_attention_lse_backward)


class _AttentionVarlenFunction(torch.autograd.Function):
    """_AttentionFunction's counterpart for packed batches: the varlen lse operator's registered
    autograd formula as an eager Function (torch.compile traces the registered one)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                softmax_scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
        if _eager_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k):
            out, lse = _attention_varlen_lse_cuda(*args)
        else:
            with torch._C._AutoDispatchBelowAutograd():
                out, lse = attention_varlen_lse_op(*args)
        _setup_varlen_context(ctx, args, (out, lse))
        return out, lse

    backward = staticmethod(_attention_varlen_lse_backward)


# ------------------------------------------------------------------------- public API
attention_forward = torch.ops.cupyflash.attention_forward.default
attention_forward_lse = torch.ops.cupyflash.attention_forward_lse.default
attention_backward = torch.ops.cupyflash.attention_backward.default
attention_varlen_op = torch.ops.cupyflash.attention_varlen.default
attention_varlen_lse_op = torch.ops.cupyflash.attention_varlen_lse.default
attention_varlen_backward = torch.ops.cupyflash.attention_varlen_backward.default
attention_kvcache_op = torch.ops.cupyflash.attention_kvcache.default


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: float | None = None, return_lse: bool = False) -> Any:
    """softmax(q k^T * softmax_scale + mask) v through the `cupyflash::` operators.

    Same arguments and rules as `cupyflash.forward` (q: (batch, seq_q, heads, d_head), k/v:
    (batch, seq_k, kv_heads, d_head), fp16/bf16 CUDA tensors, any strides with a contiguous last
    dimension), minus `cfg`, `out`, `lse` and `stream`: the library picks the config, allocates the
    outputs and launches on the current stream. Works eagerly, under
    `torch.compile(fullgraph=True)` and inside CUDA graph capture. Differentiable in q, k and v
    (cupyflash.backward; set `cupyflash.torch.deterministic_backward = True` for bit-identical
    gradients run to run); the lse is not. Returns the output, or
    (out, lse) with return_lse=True (lse float32 (batch, heads, seq_q)).

    Bad arguments raise `forward`'s TypeError/ValueError; under torch.compile, those found while
    tracing reach the caller as torch._dynamo.exc.TorchRuntimeError with the same message.
    """
    if causal is not True and causal is not False:
        causal = check_flag(causal, "causal")
    if return_lse is not True and return_lse is not False:
        return_lse = check_flag(return_lse, "return_lse")
    if softmax_scale is not None and type(softmax_scale) is not float:
        # ints and numpy scalars become floats (the schema's type); anything else gets forward()'s
        # TypeError rather than the dispatcher's RuntimeError
        softmax_scale = check_softmax_scale(softmax_scale, 1)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # the lse variant saves what the backward needs
        if torch.compiler.is_compiling():
            result = attention_forward_lse(q, k, v, causal, softmax_scale)
        else:
            result = _AttentionFunction.apply(q, k, v, causal, softmax_scale)
        return result if return_lse else result[0]
    if _eager_cuda(q, k, v):  # the operators' CUDA kernels, without the dispatcher
        return (_attention_lse_cuda if return_lse else _attention_cuda)(q, k, v, causal, softmax_scale)
    if return_lse:
        return attention_forward_lse(q, k, v, causal, softmax_scale)
    return attention_forward(q, k, v, causal, softmax_scale)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     softmax_scale: float | None = None, return_lse: bool = False) -> Any:
    """`cupyflash.forward_varlen` through the `cupyflash::attention_varlen` operators: packed ragged
    batches (q (total_q, heads, d), k/v (total_k, kv_heads, d), int32 cu_seqlens of batch + 1
    offsets, host-int max lengths), eagerly, under torch.compile(fullgraph=True) and in CUDA graphs.
    Differentiable in q, k and v (`cupyflash.backward_varlen`; tokens past cu_seqlens[-1] get zero
    gradients; `cupyflash.torch.deterministic_backward = True` for bit-identical gradients); the
    lse is not. Returns the output, or (out, lse) with return_lse=True (lse float32 (heads, total_q))."""
    if causal is not True and causal is not False:
        causal = check_flag(causal, "causal")
    if return_lse is not True and return_lse is not False:
        return_lse = check_flag(return_lse, "return_lse")
    if softmax_scale is not None and type(softmax_scale) is not float:
        softmax_scale = check_softmax_scale(softmax_scale, 1)
    from .varlen_checks import check_max_seqlen

    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, check_max_seqlen(max_seqlen_q, "max_seqlen_q"),
            check_max_seqlen(max_seqlen_k, "max_seqlen_k"), causal, softmax_scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # the lse variant saves what the backward needs
        if torch.compiler.is_compiling():
            result = attention_varlen_lse_op(*args)
        else:
            result = _AttentionVarlenFunction.apply(*args)
        return result if return_lse else result[0]
    if _eager_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k):  # the operators' CUDA kernels, without the dispatcher
        return (_attention_varlen_lse_cuda if return_lse else _attention_varlen_cuda)(*args)
    return (attention_varlen_lse_op if return_lse else attention_varlen_op)(*args)


def attention_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, cache_seqlens: torch.Tensor,
                      block_table: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                      v_new: torch.Tensor | None = None, causal: bool = True, softmax_scale: float | None = None,
                      num_splits: int | None = None) -> torch.Tensor:
    """`cupyflash.forward_kvcache` through the `cupyflash::attention_kvcache` operator (k_cache and
    v_cache declared mutated: k_new/v_new are appended in place), eagerly, under
    torch.compile(fullgraph=True) and in CUDA graphs. Inference only: no autograd formula."""
    if causal is not True and causal is not False:
        causal = check_flag(causal, "causal")
    if softmax_scale is not None and type(softmax_scale) is not float:
        softmax_scale = check_softmax_scale(softmax_scale, 1)
    if num_splits is not None:
        from .kvcache_checks import check_num_splits

        num_splits = check_num_splits(num_splits)
    args = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, softmax_scale, num_splits)
    if _eager_cuda(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new):
        return _attention_kvcache_cuda(*args)  # (k_cache/v_cache mutated in place, as the operator declares)
    return attention_kvcache_op(*args)
