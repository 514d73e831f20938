"""cupyflash.torch: attention as PyTorch custom operators (torch.compile, CUDA graphs, opcheck).

Importing this module registers two operators in the torch.library namespace `cupyflash`:

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
same body registered with `torch.library.custom_op` (`scripts/bench_frameworks.py`). The CUDA kernels call `cupyflash.forward`, which
launches on torch's current stream (the capture stream inside `torch.cuda.graph`) and allocates
its outputs with torch (the graph's pool during capture). The fake (meta) kernels apply the same
argument rules as `forward` to the tensors' metadata, so shape and dtype errors surface while
tracing, and return exactly what the CUDA kernels return: a contiguous output of q's shape and
dtype, and a contiguous float32 lse of shape (batch, heads, seq_q).

Gradients: a third operator, `cupyflash::attention_backward(dout, q, k, v, out, lse, causal,
softmax_scale, deterministic) -> (dq, dk, dv)`, runs `cupyflash.backward` (the backward_sm80
family), and `attention_forward_lse` carries an autograd formula over it
(`torch.library.register_autograd`, so it composes with torch.compile). `attention()` routes
calls that need a gradient through the lse variant, which saves what the backward needs; the lse
output itself is not differentiable (as in FlashAttention). `attention_forward` called directly
has no autograd formula (it saves no lse).
"""
from __future__ import annotations

from typing import Any

import torch

from .config import DType
from .interop import TORCH, TensorView, as_view
from .validation import LaunchPlan, check_flag, check_forward_args, check_softmax_scale

__all__ = ["attention", "attention_forward", "attention_forward_lse", "attention_backward", "NAMESPACE"]

NAMESPACE = "cupyflash"
_ARGS = "(Tensor q, Tensor k, Tensor v, bool causal=False, float? softmax_scale=None)"
SCHEMAS = {
    "attention_forward": _ARGS + " -> Tensor",
    "attention_forward_lse": _ARGS + " -> (Tensor out, Tensor lse)",
    "attention_backward": ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal=False, "
                           "float? softmax_scale=None, bool deterministic=False) -> (Tensor dq, Tensor dk, Tensor dv)"),
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
def _attention_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: float | None = None) -> torch.Tensor:
    return _forward(None, q, k, v, causal=causal, softmax_scale=softmax_scale)


def _attention_lse_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(None, q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)


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


def _attention_backward_cuda(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                             softmax_scale: float | None = None,
                             deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                     deterministic=deterministic)


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


# ------------------------------------------------------------------------- autograd
def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.mark_non_differentiable(lse)  # FlashAttention-style: no gradient flows back through the lse


def _attention_lse_backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple:
    q, k, v, out, lse = ctx.saved_tensors
    # autograd may hand a gradient of any layout (an expanded zero, a transposed view): the
    # kernels take a contiguous last dimension with 16-byte aligned rows.
    dq, dk, dv = torch.ops.cupyflash.attention_backward.default(dout.contiguous(), q, k, v, out, lse, ctx.causal,
                                                                ctx.softmax_scale, deterministic_backward)
    return dq, dk, dv, None, None


# True makes every gradient bit-identical run to run (dQ by a separate pass instead of atomics).
deterministic_backward = False

torch.library.register_autograd(f"{NAMESPACE}::attention_forward_lse", _attention_lse_backward,
                                setup_context=_setup_context, lib=_LIB)


# ------------------------------------------------------------------------- public API
attention_forward = torch.ops.cupyflash.attention_forward.default
attention_forward_lse = torch.ops.cupyflash.attention_forward_lse.default
attention_backward = torch.ops.cupyflash.attention_backward.default


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
    if return_lse:
        return attention_forward_lse(q, k, v, causal, softmax_scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return attention_forward_lse(q, k, v, causal, softmax_scale)[0]  # saves the lse for backward
    return attention_forward(q, k, v, causal, softmax_scale)
