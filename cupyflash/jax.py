"""cupyflash.jax: attention as a JAX operation that works eagerly, under `jax.jit` and `jax.vmap`.

The kernel runs inside XLA's program through `jax.experimental.buffer_callback`: XLA hands the
callback its own device buffers (inputs, and the outputs to fill) and its compute stream, and the
callback launches the cupyflash kernel there. Nothing is copied and nothing synchronises; with
`command_buffer_compatible=True` XLA may record the launch into a CUDA graph (command buffer) and
replay it without calling Python again.

On Hopper the Hopper family (forward_sm90) runs where `forward(cfg=None)` would run it.
Everything that depends only on shapes happens once, while tracing: `forward`'s argument rules
(errors are raised to the caller as the same TypeError/ValueError), the config choice, the kernel
compile and load, the launch geometry. The callback then only reads five device pointers, packs
them into the prepared parameter block and calls cuLaunchKernel.

`jax.vmap` folds the mapped axis into the batch axis (the kernel's batch dimension is exactly a
map over independent problems), so a vmapped call is one launch; an unmapped k/v is broadcast to
the mapped size first.

Gradients: `attention(..., return_lse=False)` is a `jax.custom_vjp` whose forward also keeps the
log-sum-exp and whose backward runs `cupyflash.backward` (backward_sm90 on Hopper where it applies, else
backward_sm80) in a second
buffer_callback on XLA's buffers and stream. The backward is planned while tracing (cupyflash.
backward's validation and config choice, its errors raised to the caller, its kernels compiled and
loaded) and its fp32 workspace is a scratch result XLA allocates, so a run only packs pointers and
launches: it is command-buffer compatible like the forward. `jax.grad`, `jax.jit(jax.grad(...))` and
`jax.vmap(jax.grad(...))` work: the backward is a `custom_vmap` operation too, folding the mapped
axis into the batch as the forward does.

Packed ragged batches: `attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, ...)` runs `cupyflash.forward_varlen` in a buffer_callback on XLA's buffers and
stream, and its `jax.custom_vjp` backward `cupyflash.backward_varlen`; the max lengths and options
are static, the offsets are device arrays. Both are planned while tracing, as the dense ones:
forward_varlen's and backward_varlen's validation and config choice on the traced shapes (their
errors raised to the caller), kernels compiled and loaded, launches packed but for the pointers;
the backward's fp32 workspaces (lse2, dvec, dq_accum and the Hopper family's counters, which its
preprocess kernel resets) are one scratch result XLA allocates. A run only reads pointers, stores
them and launches on XLA's stream, so both callbacks are command-buffer compatible. Tokens past
cu_seqlens[-1] come back as 0 (out, lse and gradients) rather than as whatever XLA's buffer held:
the forward kernel and the backward's preprocess kernel zero them (memsets on XLA's stream where
nothing would launch or the preprocess does not run).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from . import op_launch
from .config import DType
from .interop import JAX, TensorView, contiguous_strides
from .validation import ALIGN_BYTES, LaunchPlan, check_flag, check_forward_args, check_softmax_scale

__all__ = ["attention", "attention_varlen", "plan_attention"]

_DTYPES = {np.dtype(jnp.float16): DType.FP16, np.dtype(jnp.bfloat16): DType.BF16}
_Tracer = jax.core.Tracer  # inputs inside jit/grad/vmap; concrete arrays are not


class _Spec(NamedTuple):
    """Shape and dtype of one operand: what tracing knows, and the key of the plan cache."""

    shape: tuple[int, ...]
    dtype: np.dtype


def _spec(x: Any, name: str) -> _Spec:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"{name}: expected a JAX array, got {type(x).__name__}")
    return _Spec(tuple(int(n) for n in shape), np.dtype(dtype))


def _view(spec: _Spec, device: int) -> TensorView:
    # XLA buffers passed to a custom call are dense row-major; the pointer is checked at launch.
    return TensorView(0, spec.shape, contiguous_strides(spec.shape), _DTYPES.get(spec.dtype), spec.dtype,
                      device, JAX, None)


# ------------------------------------------------------------------ GPU-facing steps (patchable)
def _trace_device() -> int:
    """The CUDA device kernels are prepared for while tracing: CuPy's current device (other
    devices load theirs at first launch)."""
    import cupy

    return cupy.cuda.runtime.getDevice()


def _select(dtype: DType, d_head: int, seq_q: int, seq_k: int, device: int, causal: bool) -> Any:
    from .api import _select_config

    return _select_config(dtype, d_head, seq_q, seq_k, device, causal)


def _prepare_kernel(callback: "_Callback") -> None:
    """Check the GPU, compile/load the kernel and pack its launch now, while tracing: outside any
    stream capture, and off the per-run path."""
    from . import api

    plan = callback.plan
    if not api._gpu_ready:
        api._ensure_gpu()
    if plan.device not in api._checked_devices:
        api._check_device(plan.device)
    if plan.launch:
        _launcher(callback, plan.device)


def _buffer_ptr(buf: Any) -> int:
    return buf.__cuda_array_interface__["data"][0]


def _stream_of(ctx: Any) -> int:
    stream = ctx.stream
    return int(stream() if callable(stream) else stream)  # a method in jaxlib 0.10/0.11


_POINTERS = op_launch.POINTERS  # q, k, v, o, lse: the first five ForwardParams fields
_launch_kernel: Any = None  # cuLaunchKernel and cudaGetDevice, bound at the first launch
_get_device: Any = None


def _launcher(callback: "_Callback", device: int) -> op_launch.OpLaunch:
    """The callback's plan on `device`, packed once (cupyflash.op_launch): kernel handle, grid
    and every parameter but the five pointers, which each run writes (for the Hopper family into
    its TMA descriptors' address words, or by re-encoding them)."""
    fast = op_launch.make_launch(callback.plan, callback.sm90, device)
    callback.launchers[device] = fast
    return fast


def _launch(callback: "_Callback", ctx: Any, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
    """Launch the callback's kernel on XLA's stream with XLA's buffers (the callback's body, per run:
    five pointers, one pack, one cuLaunchKernel)."""
    global _launch_kernel, _get_device
    if _launch_kernel is None:
        from cupy.cuda.runtime import getDevice
        from cupy_backends.cuda.api.driver import launchKernel

        _launch_kernel, _get_device = launchKernel, getDevice
    q_ptr, k_ptr, v_ptr, o_ptr = _buffer_ptr(q), _buffer_ptr(k), _buffer_ptr(v), _buffer_ptr(out)
    if (q_ptr | k_ptr | v_ptr | o_ptr) % ALIGN_BYTES:  # XLA aligns its buffers far more than this
        raise ValueError(f"q: XLA passed a buffer not {ALIGN_BYTES}-byte aligned: "
                         f"{[hex(p) for p in (q_ptr, k_ptr, v_ptr, o_ptr)]}")
    stream = ctx.stream
    stream = stream() if callable(stream) else stream  # a method in jaxlib 0.10/0.11
    device = q.__dlpack_device__()[1]
    fast = callback.launchers.get(device) or _launcher(callback, device)
    lse_ptr = _buffer_ptr(lse) if lse is not None else 0
    with fast.lock:  # cuLaunchKernel copies the parameters before it returns
        fast.write_pointers(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr)
        if _get_device() == device:  # XLA's thread has its device current; cuLaunchKernel needs it
            _launch_kernel(*fast.launch_head, stream, fast.argv_ptr, 0)
        else:
            import cupy

            with cupy.cuda.Device(device):
                _launch_kernel(*fast.launch_head, stream, fast.argv_ptr, 0)


# ------------------------------------------------------------------ planning and the operation
class _Callback:
    """The buffer_callback body for one plan. One object per plan (cached), so the primitive's
    parameters compare equal across traces and XLA's lowering and compile caches hit."""

    def __init__(self, plan: LaunchPlan, with_lse: bool, sm90: Any = None) -> None:
        self.plan = plan
        self.with_lse = with_lse
        self.sm90 = sm90  # (Sm90Plan, (q, k, v) views): the Hopper family runs this problem
        self.launchers: dict[int, op_launch.OpLaunch] = {}  # per device, made at first launch

    def __call__(self, ctx: Any, outs: Any, q: Any, k: Any, v: Any) -> None:
        if self.plan.launch:  # zero-size problems: empty outputs, nothing to compute
            _launch(self, ctx, q, k, v, outs[0], outs[1] if self.with_lse else None)


def plan_attention(q: Any, k: Any, v: Any, causal: bool = False, softmax_scale: float | None = None) -> LaunchPlan:
    """`forward`'s argument rules applied to JAX arrays or abstract values (shape and dtype);
    the launch plan, or the TypeError/ValueError `forward` would raise."""
    return _plan(_spec(q, "q"), _spec(k, "k"), _spec(v, "v"), causal, softmax_scale)


def _plan(q: _Spec, k: _Spec, v: _Spec, causal: bool, softmax_scale: float | None) -> LaunchPlan:
    device = _trace_device()
    return check_forward_args(None, _view(q, device), _view(k, device), _view(v, device), None,
                              softmax_scale, causal, select=_select)


def _hopper_plan(q: _Spec, k: _Spec, v: _Spec, causal: bool, softmax_scale: float | None,
                 device: int) -> tuple[Any, tuple[TensorView, ...]] | None:
    """(Sm90Plan, views) when forward(cfg=None) would run the Hopper family on this problem
    (sm_90 and a layout TMA takes), else None (the mma.sync plan)."""
    return op_launch.hopper_plan(_view(q, device), _view(k, device), _view(v, device), causal, softmax_scale,
                                 device)


@functools.lru_cache(maxsize=1024)
def _prepared(q: _Spec, k: _Spec, v: _Spec, causal: bool, softmax_scale: float | None,
              with_lse: bool) -> tuple[Any, tuple[jax.ShapeDtypeStruct, ...]]:
    """(callback, result types) for one problem signature; validates and loads the kernel once."""
    plan = _plan(q, k, v, causal, softmax_scale)
    callback = _Callback(plan, with_lse, _hopper_plan(q, k, v, causal, softmax_scale, plan.device))
    _prepare_kernel(callback)
    results = (jax.ShapeDtypeStruct(plan.out_shape, q.dtype),)
    if with_lse:
        results += (jax.ShapeDtypeStruct(plan.lse_shape, np.float32),)
    return callback, results


def _call(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, softmax_scale: float | None,
          with_lse: bool) -> tuple[jax.Array, ...]:
    """One unbatched launch: (out,) or (out, lse)."""
    callback, results = _prepared(_spec(q, "q"), _spec(k, "k"), _spec(v, "v"), causal, softmax_scale, with_lse)
    run = buffer_callback(callback, results, command_buffer_compatible=True)
    return tuple(run(q, k, v))


def _fold(x: jax.Array, batched: bool, axis_size: int) -> jax.Array:
    """(axis_size, batch, ...) -> (axis_size * batch, ...); an unmapped operand is broadcast."""
    if not batched:
        x = jnp.broadcast_to(x, (axis_size, *x.shape))
    return x.reshape((axis_size * x.shape[1], *x.shape[2:]))


@functools.lru_cache(maxsize=256)
def _operation(causal: bool, softmax_scale: float | None, with_lse: bool) -> Any:
    """The jitted, vmappable operation for one set of static options."""

    @jax.custom_batching.custom_vmap
    def op(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
        return _call(q, k, v, causal, softmax_scale, with_lse)

    @op.def_vmap
    def op_vmap(axis_size: int, in_batched: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[Any, Any]:
        # The mapped axis arrives first; each mapped entry is an independent problem, exactly what
        # the batch axis is, so one launch over (axis_size * batch) entries computes them all.
        # forward's rules first, on the per-entry operands, so errors name their real shapes.
        entries = [jax.ShapeDtypeStruct(x.shape[1:] if b else x.shape, x.dtype) for x, b in zip((q, k, v), in_batched)]
        plan_attention(*entries, causal, softmax_scale)
        batch = entries[0].shape[0]
        folded = op(*(_fold(x, b, axis_size) for x, b in zip((q, k, v), in_batched)))
        outs = tuple(o.reshape((axis_size, batch, *o.shape[1:])) for o in folded)
        return outs, tuple(True for _ in outs)

    return jax.jit(op)


# ------------------------------------------------------------------ gradients
class _BackwardCallback:
    """buffer_callback body of the backward: one traced call's replay (planned, with its kernels
    loaded, while tracing), relaunched on each run's buffers: XLA's q, k, v, out, dout, lse, the
    dq, dk, dv results and an fp32 scratch result as the workspace. A run only reads pointers,
    packs and launches, so XLA may record it into a command buffer."""

    def __init__(self, causal: bool, softmax_scale: float | None, specs: tuple, device: int, replay: Any) -> None:
        self.causal, self.softmax_scale = causal, softmax_scale
        self.specs = specs  # (dout, q, k, v, out, lse) _Specs: another device plans its own replay
        # device -> backward_plans.BackwardReplay (None: the call launches nothing); the trace
        # device's is made while tracing, another device's at its first run
        self.replays: dict[int, Any] = {device: replay}
        self.ws_floats = replay.ws_floats if replay is not None else 0  # the scratch result's size

    def __call__(self, ctx: Any, outs: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
        _backward_launch(self, ctx, outs, dout, q, k, v, out, lse)


def _backward_replay(dout: _Spec, q: _Spec, k: _Spec, v: _Spec, out: _Spec, lse: _Spec, causal: bool,
                     softmax_scale: float | None, device: int) -> Any:
    """While tracing: cupyflash.backward's validation and config choice for these shapes (its
    errors reach the caller), and the plan's replay with its kernels compiled and loaded; None
    when the call launches nothing. (GPU-facing; the CPU tests patch it.)"""
    from .backward_api import plan_backward, prepared_replay

    dov, qv, kv, vv, ov, lv = (_view(spec, device) for spec in (dout, q, k, v, out, lse))
    plan = plan_backward(None, dov, qv, kv, vv, ov, lv, None, None, None, causal, softmax_scale, False)
    return prepared_replay(plan, qv, kv, vv, dov)


def _backward_launch(callback: _BackwardCallback, ctx: Any, outs: Any, dout: Any, q: Any, k: Any, v: Any,
                     out: Any, lse: Any) -> None:
    """Relaunch the traced call's replay on this run's buffers (outs: dq, dk, dv, workspace) on
    XLA's stream."""
    import cupy

    device = q.__dlpack_device__()[1]
    if device in callback.replays:
        replay = callback.replays[device]
    else:  # a device the trace did not plan for (e.g. one shard of a multi-GPU program)
        replay = _backward_replay(*callback.specs, callback.causal, callback.softmax_scale, device)
        _check_workspace(callback, replay, device)
        callback.replays[device] = replay
    if replay is None:
        return
    ptrs = tuple(_buffer_ptr(b) for b in (q, k, v, out, dout, lse, *outs[:3]))
    ws = _buffer_ptr(outs[3])
    if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4] | ptrs[6] | ptrs[7] | ptrs[8] | ws) & 15 or ptrs[5] & 3:
        raise ValueError(f"cupyflash.jax backward: XLA buffer addresses {ptrs + (ws,)} break the 16-byte alignment the "
                         "kernels read with (4 bytes for lse)")
    with cupy.cuda.Device(device):
        replay.run(_stream_of(ctx), ptrs, ws)


def _check_workspace(callback: Any, replay: Any, device: int) -> None:
    """A replay planned at a device's first run must fit the scratch workspace the traced program
    allocates (its size came from the trace device's plan)."""
    if replay is not None and replay.ws_floats > callback.ws_floats:
        raise ValueError(f"cupyflash.jax backward: device {device} plans a {replay.ws_floats}-float workspace, "
                         f"the traced program allocated {callback.ws_floats} (GPUs of different kinds)")


def _backward_call(dout: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array,
                   causal: bool, softmax_scale: float | None) -> tuple[jax.Array, ...]:
    dout = dout.astype(q.dtype)
    specs = tuple(_spec(x, name) for x, name in ((dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"),
                                                 (lse, "lse")))
    device = _trace_device()
    replay = _backward_replay(*specs, causal, softmax_scale, device)
    callback = _BackwardCallback(causal, softmax_scale, specs, device, replay)
    workspace = jax.ShapeDtypeStruct((callback.ws_floats,), jnp.float32)
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)) + (workspace,)
    run = buffer_callback(callback, results, command_buffer_compatible=True)
    return tuple(run(dout, q, k, v, out, lse))[:3]


@functools.lru_cache(maxsize=256)
def _backward_operation(causal: bool, softmax_scale: float | None) -> Any:
    """The backward callback as a vmappable operation: (dout, q, k, v, out, lse) -> (dq, dk, dv).

    Under jax.vmap (e.g. vmap of grad: per-example gradients) the mapped axis folds into the batch
    axis of every operand, lse's (batch, heads, seq_q) included, as the forward's does: one
    backward launch; an unmapped operand is broadcast, so each entry gets its own dk/dv."""

    @jax.custom_batching.custom_vmap
    def op(dout: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array,
           lse: jax.Array) -> tuple[jax.Array, ...]:
        return _backward_call(dout, q, k, v, out, lse, causal, softmax_scale)

    @op.def_vmap
    def op_vmap(axis_size: int, in_batched: Any, *args: jax.Array) -> tuple[Any, Any]:
        folded = op(*(_fold(x, b, axis_size) for x, b in zip(args, in_batched)))
        grads = tuple(g.reshape((axis_size, g.shape[0] // axis_size, *g.shape[1:])) for g in folded)
        return grads, tuple(True for _ in grads)

    return op


@functools.lru_cache(maxsize=256)
def _differentiable(causal: bool, softmax_scale: float | None) -> Any:
    """attention(q, k, v) -> out with a custom VJP through cupyflash.backward."""

    @jax.custom_vjp
    def f(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return _operation(causal, softmax_scale, False)(q, k, v)[0]

    def f_fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, tuple]:
        out, lse = _operation(causal, softmax_scale, True)(q, k, v)
        return out, (q, k, v, out, lse)

    def f_bwd(residuals: tuple, dout: jax.Array) -> tuple[jax.Array, ...]:
        return _backward_operation(causal, softmax_scale)(dout, *residuals)

    f.defvjp(f_fwd, f_bwd)
    return f


def attention(q: Any, k: Any, v: Any, *, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False) -> Any:
    """softmax(q k^T * softmax_scale + mask) v on JAX arrays, inside or outside `jax.jit`.

    Same arguments and rules as `cupyflash.forward`: q (batch, seq_q, heads, d_head), k/v
    (batch, seq_k, kv_heads, d_head), fp16 or bf16, kv_heads dividing heads (GQA/MQA), causal
    masking aligned bottom-right; `causal`, `softmax_scale` and `return_lse` are static (Python
    values). Returns the output, or (out, lse) with return_lse=True (lse float32
    (batch, heads, seq_q)). Under `jax.vmap` the mapped axis is folded into the batch axis.
    With return_lse=False the result is differentiable in q, k and v (`jax.grad`).
    """
    if causal is not True and causal is not False:
        causal = check_flag(causal, "causal")
    if return_lse is not True and return_lse is not False:
        return_lse = check_flag(return_lse, "return_lse")
    if softmax_scale is not None:
        softmax_scale = check_softmax_scale(softmax_scale, 1)  # a hashable float for the caches
    if return_lse:
        return _operation(causal, softmax_scale, True)(q, k, v)
    if isinstance(q, _Tracer) or isinstance(k, _Tracer) or isinstance(v, _Tracer):
        return _differentiable(causal, softmax_scale)(q, k, v)  # jax.grad works through cupyflash.backward
    # Concrete arrays: no transformation can differentiate this call, and an eager custom_vjp
    # call costs ~250 us more than the jitted operation (measured on the H100 host).
    return _operation(causal, softmax_scale, False)(q, k, v)[0]


# ------------------------------------------------------------------ packed ragged batches
class _VarlenOptions(NamedTuple):
    """The static part of an attention_varlen call (hashable: the key of the caches)."""

    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    softmax_scale: float | None


_VARLEN_NAMES = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")


def _varlen_problem(specs: tuple[_Spec, ...], options: _VarlenOptions, device: int) -> tuple[Any, tuple]:
    """forward_varlen's argument rules on views of the traced shapes (q, k, v, cu_seqlens_q/k):
    (the VarlenProblem, the views), or the TypeError/ValueError forward_varlen raises."""
    from .varlen_checks import check_varlen_args

    views = tuple(_view(spec, device) for spec in specs)
    return check_varlen_args(*views, options.max_seqlen_q, options.max_seqlen_k, None, options.softmax_scale,
                             options.causal), views


def _varlen_forward_plan(problem: Any, views: tuple, with_lse: bool) -> Any:
    """While tracing (or at a new device's first run): forward_varlen(cfg=None)'s config for the
    validated problem, its kernel compiled and loaded and its launch packed but for the pointers
    (varlen_plans.VarlenLaunch, the kernel zeroing the tokens past cu_seqlens_q[-1]); None when
    there is nothing to launch. (GPU-facing; the CPU tests patch it.)"""
    from .varlen import prepared_launch

    return prepared_launch(problem, *views[:3], with_lse)


class _VarlenForwardCallback:
    """buffer_callback body of the varlen forward: the launch planned while tracing, relaunched on
    each run's buffers (XLA's q, k, v, cu_seqlens_q/k and the out, lse results) on XLA's stream. A
    run only reads pointers, stores them and launches (a problem with nothing to launch: memsets
    of the results), so XLA may record it into a command buffer."""

    def __init__(self, specs: tuple[_Spec, ...], options: _VarlenOptions, with_lse: bool, problem: Any,
                 device: int, launch: Any) -> None:
        self.specs, self.options, self.with_lse = specs, options, with_lse  # another device plans its own
        self.problem = problem  # the output shapes, for zero_outputs
        self.launches: dict[int, Any] = {device: launch}  # device -> VarlenLaunch (None: nothing to launch)

    def __call__(self, ctx: Any, outs: Any, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any) -> None:
        _varlen_forward_launch(self, ctx, outs, q, k, v, cu_q, cu_k)


def _varlen_forward_launch(callback: _VarlenForwardCallback, ctx: Any, outs: Any, q: Any, k: Any, v: Any, cu_q: Any,
                           cu_k: Any) -> None:
    """Relaunch the traced call's launch on this run's buffers (outs: out, and lse) on XLA's stream;
    the tokens past cu_seqlens_q[-1] get out 0 and lse 0 (the kernel's zero_tail, or memsets)."""
    import cupy

    device = q.__dlpack_device__()[1]
    if device in callback.launches:
        launch = callback.launches[device]
    else:  # a device the trace did not plan for (e.g. one shard of a multi-GPU program)
        problem, views = _varlen_problem(callback.specs, callback.options, device)
        launch = callback.launches[device] = _varlen_forward_plan(problem, views, callback.with_lse)
    ptrs = tuple(_buffer_ptr(b) for b in (q, k, v, outs[0], cu_q, cu_k))
    lse_ptr = _buffer_ptr(outs[1]) if callback.with_lse else 0
    if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) & 15 or (ptrs[4] | ptrs[5] | lse_ptr) & 3:
        raise ValueError(f"cupyflash.jax attention_varlen: XLA buffer addresses {ptrs + (lse_ptr,)} break the 16-byte "
                         "alignment the kernel reads with (4 bytes for cu_seqlens and lse)")
    with cupy.cuda.Device(device):
        if launch is None:
            from .varlen import zero_outputs

            zero_outputs(callback.problem, ptrs[3], lse_ptr, _stream_of(ctx))
        else:
            launch.replay(_stream_of(ctx), *ptrs[:4], lse_ptr, ptrs[4], ptrs[5])


@functools.lru_cache(maxsize=1024)
def _varlen_prepared(specs: tuple[_Spec, ...], options: _VarlenOptions, with_lse: bool,
                     device: int) -> tuple[_VarlenForwardCallback, tuple[jax.ShapeDtypeStruct, ...]]:
    """(callback, result types) for one traced signature: validated and planned once (one callback
    object per plan, so XLA's lowering and compile caches hit across traces)."""
    problem, views = _varlen_problem(specs, options, device)
    callback = _VarlenForwardCallback(specs, options, with_lse, problem, device,
                                      _varlen_forward_plan(problem, views, with_lse))
    results = (jax.ShapeDtypeStruct(problem.out_shape, specs[0].dtype),)
    if with_lse:
        results += (jax.ShapeDtypeStruct(problem.lse_shape, np.float32),)
    return callback, results


def _varlen_forward(q: jax.Array, k: jax.Array, v: jax.Array, cu_q: jax.Array, cu_k: jax.Array,
                    options: _VarlenOptions, with_lse: bool) -> tuple[jax.Array, ...]:
    specs = tuple(_spec(x, name) for x, name in zip((q, k, v, cu_q, cu_k), _VARLEN_NAMES))
    callback, results = _varlen_prepared(specs, options, with_lse, _trace_device())
    run = buffer_callback(callback, results, command_buffer_compatible=True)
    return tuple(run(q, k, v, cu_q, cu_k))


def _varlen_backward_plan(specs: tuple[_Spec, ...], options: _VarlenOptions, device: int) -> Any:
    """While tracing (or at a new device's first run): backward_varlen's validation and config
    choice for these shapes (dout, q, k, v, out, lse, cu_seqlens_q/k; its errors reach the caller)
    and its replay into contiguous outputs zeroed past the last sequence, kernels compiled and
    loaded. (GPU-facing; the CPU tests patch it.)"""
    from .backward_varlen import prepared_replay

    views = tuple(_view(spec, device) for spec in specs)
    return prepared_replay(*views, options.max_seqlen_q, options.max_seqlen_k, options.causal, options.softmax_scale)


class _VarlenBackwardCallback:
    """buffer_callback body of the varlen backward, as the dense one's (_BackwardCallback): the
    replay planned while tracing (backward_varlen.VarlenBackwardReplay), relaunched on each run's
    buffers (XLA's dout, q, k, v, out, lse, cu_seqlens_q/k, the dq, dk, dv results and an fp32
    scratch result as the workspaces) on XLA's stream: memsets and launches only, so XLA may
    record it into a command buffer. The tokens past cu_seqlens[-1] get zero gradients."""

    def __init__(self, specs: tuple[_Spec, ...], options: _VarlenOptions, device: int, replay: Any) -> None:
        self.specs, self.options = specs, options  # another device plans its own replay
        self.replays: dict[int, Any] = {device: replay}
        self.ws_floats = replay.ws_floats  # the scratch result's size

    def __call__(self, ctx: Any, outs: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, cu_q: Any,
                 cu_k: Any) -> None:
        _varlen_backward_launch(self, ctx, outs, dout, q, k, v, out, lse, cu_q, cu_k)


def _varlen_backward_launch(callback: _VarlenBackwardCallback, ctx: Any, outs: Any, dout: Any, q: Any, k: Any,
                            v: Any, out: Any, lse: Any, cu_q: Any, cu_k: Any) -> None:
    """Relaunch the traced call's replay on this run's buffers (outs: dq, dk, dv, workspace) on
    XLA's stream."""
    import cupy

    device = q.__dlpack_device__()[1]
    replay = callback.replays.get(device)
    if replay is None:  # a device the trace did not plan for
        replay = _varlen_backward_plan(callback.specs, callback.options, device)
        _check_workspace(callback, replay, device)
        callback.replays[device] = replay
    ptrs = tuple(_buffer_ptr(b) for b in (q, k, v, out, dout, lse, *outs[:3], cu_q, cu_k))
    ws = _buffer_ptr(outs[3])
    if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4] | ptrs[6] | ptrs[7] | ptrs[8] | ws) & 15 or \
            (ptrs[5] | ptrs[9] | ptrs[10]) & 3:
        raise ValueError(f"cupyflash.jax attention_varlen backward: XLA buffer addresses {ptrs + (ws,)} break the "
                         "16-byte alignment the kernels read with (4 bytes for lse and cu_seqlens)")
    with cupy.cuda.Device(device):
        replay.run(_stream_of(ctx), ptrs, ws)


def _varlen_backward(dout: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array,
                     cu_q: jax.Array, cu_k: jax.Array, options: _VarlenOptions) -> tuple[jax.Array, ...]:
    dout = dout.astype(q.dtype)
    args = (dout, q, k, v, out, lse, cu_q, cu_k)
    specs = tuple(_spec(x, name) for x, name in zip(args, ("dout", *_VARLEN_NAMES[:3], "out", "lse",
                                                              *_VARLEN_NAMES[3:])))
    device = _trace_device()
    callback = _VarlenBackwardCallback(specs, options, device, _varlen_backward_plan(specs, options, device))
    workspace = jax.ShapeDtypeStruct((callback.ws_floats,), jnp.float32)
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)) + (workspace,)
    run = buffer_callback(callback, results, command_buffer_compatible=True)
    return tuple(run(*args))[:3]


def _no_vmap(axis_size: int, in_batched: Any, *args: Any) -> Any:
    raise NotImplementedError("attention_varlen: jax.vmap is not supported (a packed batch has no batch axis to "
                              "fold into); concatenate the mapped problems into one packed batch instead")


@functools.lru_cache(maxsize=256)
def _varlen_operation(options: _VarlenOptions, with_lse: bool) -> Any:
    @jax.custom_batching.custom_vmap
    def op(q: jax.Array, k: jax.Array, v: jax.Array, cu_q: jax.Array, cu_k: jax.Array) -> tuple[jax.Array, ...]:
        return _varlen_forward(q, k, v, cu_q, cu_k, options, with_lse)

    op.def_vmap(_no_vmap)
    return op


@functools.lru_cache(maxsize=256)
def _varlen_differentiable(options: _VarlenOptions) -> Any:
    """attention_varlen(q, k, v, cu_q, cu_k) -> out with a custom VJP through backward_varlen."""

    @jax.custom_vjp
    def f(q: jax.Array, k: jax.Array, v: jax.Array, cu_q: jax.Array, cu_k: jax.Array) -> jax.Array:
        return _varlen_operation(options, False)(q, k, v, cu_q, cu_k)[0]

    def f_fwd(q: jax.Array, k: jax.Array, v: jax.Array, cu_q: jax.Array, cu_k: jax.Array) -> tuple[jax.Array, tuple]:
        out, lse = _varlen_operation(options, True)(q, k, v, cu_q, cu_k)
        return out, (q, k, v, out, lse, cu_q, cu_k)

    def f_bwd(residuals: tuple, dout: jax.Array) -> tuple[Any, ...]:
        q, k, v, out, lse, cu_q, cu_k = residuals
        dq, dk, dv = _varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, options)
        # the offsets are integers: their cotangent type is float0
        zero = tuple(np.zeros(x.shape, dtype=jax.dtypes.float0) for x in (cu_q, cu_k))
        return (dq, dk, dv) + zero

    f.defvjp(f_fwd, f_bwd)
    return f


def attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False, softmax_scale: float | None = None,
                     return_lse: bool = False) -> Any:
    """`cupyflash.forward_varlen` on JAX arrays, inside or outside `jax.jit`: packed ragged batches.

    q (total_q, heads, d_head), k/v (total_k, kv_heads, d_head), fp16 or bf16; cu_seqlens_q/k
    int32 (batch + 1,) device arrays of token offsets; max_seqlen_q/k, `causal`, `softmax_scale`
    and `return_lse` static (Python values). Returns the output, or (out, lse) with
    return_lse=True (lse float32 (heads, total_q)). Tokens past cu_seqlens[-1] get 0. With
    return_lse=False the result is differentiable in q, k and v (`jax.grad`, through
    `cupyflash.backward_varlen`). Not vmappable (NotImplementedError).
    """
    if causal is not True and causal is not False:
        causal = check_flag(causal, "causal")
    if return_lse is not True and return_lse is not False:
        return_lse = check_flag(return_lse, "return_lse")
    if softmax_scale is not None:
        softmax_scale = check_softmax_scale(softmax_scale, 1)
    from .varlen_checks import check_max_seqlen

    options = _VarlenOptions(check_max_seqlen(max_seqlen_q, "max_seqlen_q"),
                             check_max_seqlen(max_seqlen_k, "max_seqlen_k"), causal, softmax_scale)
    if return_lse:
        return _varlen_operation(options, True)(q, k, v, cu_seqlens_q, cu_seqlens_k)
    return _varlen_differentiable(options)(q, k, v, cu_seqlens_q, cu_seqlens_k)
