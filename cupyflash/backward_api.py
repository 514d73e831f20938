"""`cupyflash.backward`: FlashAttention-2 backward on CuPy arrays, PyTorch tensors and JAX arrays."""
from __future__ import annotations

import functools
from typing import Any

from . import backward_plans
from .backward_validation import BackwardPlan, check_backward_args, resolve_backward_config
from .config import DType
from .families.backward_sm80.config_sets import default_config
from .families.backward_sm90.config import D_HEADS as SM90_D_HEADS
from .families.backward_sm90.config import HopperBackwardKernelConfig
from .interop import (TensorView, _cupy, allocate_output, as_view, output_view, resolve_stream,
                      scratch_f32 as _workspace, wrap_output)

__all__ = ["backward", "hopper_reason", "plan_backward", "prepared_replay"]


@functools.lru_cache(maxsize=64)
def _default(dtype: DType, d_head: int):
    return default_config(dtype, d_head)


def _select(dtype: DType, d_head: int, seq_len_q: int, seq_len_k: int, device: int, causal: bool):
    """cfg=None: the user's or the shipped tuning table of the backward_sm80 family for this GPU
    (`cupyflash autotune --family backward_sm80` writes one), else the family's default."""
    from .tuning import tuned_config

    cfg = tuned_config(dtype, d_head, seq_len_q, seq_len_k, device, causal, "backward_sm80")
    return cfg if cfg is not None else _default(dtype, d_head)


@functools.lru_cache(maxsize=256)
def _hopper_default(dtype: DType, d_head: int, causal: bool, seq_len_q: int = 0) -> HopperBackwardKernelConfig:
    from .families.backward_sm90.config_sets import default_config as sm90_default

    return sm90_default(dtype, d_head, causal, seq_len_q)


# d_head values where cfg=None prefers backward_sm90 (where it measured faster than backward_sm80's
# table on the H100). d_head 64 joined in the eighth session (NOTES.md item 111): with 128 query
# rows per iteration split over the two consumer warpgroups and dQ added by TMA reductions it runs
# 1.6-1.8x backward_sm80's table (before, its dQ was reduced twice per key block and it was slower).
# d_head 96 joined in the thirty-second session (NOTES.md item 297): with 64-byte swizzled Q/K/V/dO
# tiles it runs 1.6-1.9x backward_sm80's d96 default on the H200 (cuDNN's level).
# d_head 256 joined in the thirty-third session (NOTES.md item 302): two warpgroups sharing 64 keys,
# each with half of dK/dV's columns, 1.24-1.28x backward_sm80's pds pick on the H200.
AUTO_D_HEADS = (64, 96, 128, 256)


def hopper_reason(dout: TensorView, q: TensorView, k: TensorView, v: TensorView) -> str | None:
    """Why cfg=None runs backward_sm80 instead of backward_sm90 for these views, or None when the
    Hopper family takes the call: `pick_family("backward", cc)` prefers it (compute capability
    9.0), d_head is one where it measured faster (AUTO_D_HEADS) and every input is a layout TMA
    can read. Invalid
    arguments also give a reason here: the shared validation then raises their error."""
    from . import api as _api
    from .families import pick_family
    from .families.backward_sm90 import BACKWARD_SM90
    from .families.forward_sm90.tma import tma_layout_problem

    try:
        cc = _api._compute_capability(q.device)
        family = pick_family("backward", cc)
    except Exception as exc:  # no device to ask, or one below sm_80 (validation reports it)
        return f"no compute capability for device {q.device}: {exc}"
    if family is not BACKWARD_SM90:
        return f"device {q.device} has compute capability {cc // 10}.{cc % 10}; backward_sm90 needs 9.0"
    if q.dtype is None or len(q.shape) != 4:
        return "q: not a 4-D fp16/bf16 array"
    if q.shape[3] not in SM90_D_HEADS:
        return f"q: d_head {q.shape[3]} is not supported by backward_sm90 (supported: {SM90_D_HEADS})"
    if q.shape[3] not in AUTO_D_HEADS:
        return (f"q: d_head {q.shape[3]}: backward_sm80 measured faster than backward_sm90 on the H100 "
                f"(an explicit backward_sm90 cfg runs it)")
    for view, name in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout")):
        if len(view.shape) != 4:
            return f"{name}: not 4-D"
        problem = tma_layout_problem(name, tuple(view.shape), tuple(view.strides))
        if problem:
            return problem
    return None


def backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *, causal: bool = False,
             softmax_scale: float | None = None, dq: Any = None, dk: Any = None, dv: Any = None,
             deterministic: bool = False, stream: Any = None, cfg: Any = None) -> tuple[Any, Any, Any]:
    """Gradients of attention: (dq, dk, dv) for out = softmax(q k^T * scale + mask) v.

    Args:
        dout: gradient of the loss w.r.t. out, shape and dtype of q.
        q, k, v, out: the forward's inputs and output (q, out: (batch, seq_len_q, n_heads, d_head);
            k, v: (batch, seq_len_k, n_kv_heads, d_head), n_heads a multiple of n_kv_heads).
        lse: the forward's float32 (batch, n_heads, seq_len_q) natural-log log-sum-exp,
            `forward(..., return_lse=True)[1]` (-inf for rows that saw no key).
        causal, softmax_scale: as given to the forward (bottom-right aligned causal mask).
        dq, dk, dv: optional outputs (shapes and dtype of q, k, v; not JAX arrays), else new arrays.
            With GQA/MQA, dk and dv hold the sum over the query heads of each group.
        deterministic: True computes dQ by a separate pass per query block instead of fp32 atomics,
            so the results have the same bits on every run (costs S and dP a second time).
        stream: default the caller's current stream (torch's for torch tensors, CuPy's otherwise).
        cfg: None/'auto' (the library picks: backward_sm90's default on compute capability 9.0
            when d_head is 64 or 128 and every input is TMA-readable, else backward_sm80's tuned
            or default config; `hopper_reason` says why not); a BackwardKernelConfig or a
            HopperBackwardKernelConfig, or either's short form, runs that config (the Hopper
            family on compute capability 9.0 only: ValueError elsewhere).

    Returns:
        (dq, dk, dv) in the framework of q.
    """
    key = None
    if cfg is None:
        key = backward_plans.signature(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, dq, dk, dv)
        result = backward_plans.run(key, dout, q, k, v, out, lse, dq, dk, dv, stream)
        if result is not None:
            return result
    result, replay = backward_and_replay(dout, q, k, v, out, lse, causal, softmax_scale, dq, dk, dv, deterministic,
                                         stream, cfg)
    if key is not None and replay is not None:  # later calls with this signature replay the plan
        backward_plans.remember(key, replay)
    return result


def backward_and_replay(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: Any, softmax_scale: Any,
                        dq: Any, dk: Any, dv: Any, deterministic: Any, stream: Any, cfg: Any
                        ) -> tuple[tuple[Any, Any, Any], backward_plans.BackwardReplay | None]:
    """backward's full path: ((dq, dk, dv), the call's replay, or None when it launched nothing).
    The replay relaunches the same plan on new pointers of arrays with these shapes, strides,
    dtypes and device (backward_plans; cupyflash.jax keeps one per traced backward)."""
    dov, qv, kv, vv = as_view(dout, "dout"), as_view(q, "q"), as_view(k, "k"), as_view(v, "v")
    ov, lv = as_view(out, "out"), as_view(lse, "lse")
    dqv = output_view(dq, "dq") if dq is not None else None
    dkv = output_view(dk, "dk") if dk is not None else None
    dvv = output_view(dv, "dv") if dv is not None else None
    plan = plan_backward(cfg, dov, qv, kv, vv, ov, lv, dqv, dkv, dvv, causal, softmax_scale, deterministic)
    stream_ptr = resolve_stream(stream, qv)
    if dqv is None:
        dqv = allocate_output(qv, tuple(qv.shape))
    if dkv is None:
        dkv = allocate_output(qv, tuple(kv.shape))
    if dvv is None:
        dvv = allocate_output(qv, tuple(vv.shape))
    replay = _launch(plan, (qv, kv, vv, ov, dov, lv, dqv, dkv, dvv), stream_ptr) if plan.launch else None
    return (dq if dq is not None else wrap_output(dqv), dk if dk is not None else wrap_output(dkv),
            dv if dv is not None else wrap_output(dvv)), replay


def plan_backward(cfg: Any, dout: TensorView, q: TensorView, k: TensorView, v: TensorView, out: TensorView,
                  lse: TensorView, dq: TensorView | None, dk: TensorView | None, dv: TensorView | None, causal: Any,
                  softmax_scale: Any, deterministic: Any) -> BackwardPlan:
    """backward's validation and config choice on views (dq/dk/dv None: arrays backward would
    allocate): the plan, or the argument's TypeError/ValueError. Launches nothing."""
    from .api import _check_device, _checked_devices, _ensure_gpu
    from . import api as _api

    if not _api._gpu_ready:
        _ensure_gpu()
    config = resolve_backward_config(cfg)
    if q.device not in _checked_devices:
        _check_device(q.device)
    if config is None and hopper_reason(dout, q, k, v) is None:
        config = _hopper_default(q.dtype, q.shape[3], causal is True, q.shape[1])
    plan = check_backward_args(config, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal,
                               deterministic, select=_select)
    if isinstance(plan.cfg, HopperBackwardKernelConfig):
        from .families.backward_sm90.launch import check_sm90_problem

        check_sm90_problem(plan, q, k, v, dout, _api._compute_capability(plan.device))
    return plan


def prepared_replay(plan: BackwardPlan, q: TensorView, k: TensorView, v: TensorView,
                    dout: TensorView) -> backward_plans.BackwardReplay | None:
    """The replay of `plan` for arrays of these views' layouts with its kernels compiled and
    loaded now, so that its runs only pack and launch (cupyflash.jax prepares it while tracing:
    a command buffer may record those runs); None when the plan launches nothing."""
    if not plan.launch:
        return None
    replay = backward_plans.BackwardReplay(plan, q, k, v, dout)
    replay.prepare()
    return replay


def _launch(plan: BackwardPlan, views: tuple[TensorView, ...], stream_ptr: int) -> backward_plans.BackwardReplay:
    """Launch the planned call on `views` (q, k, v, out, dout, lse, dq, dk, dv) with its own
    workspace block (backward_plans.workspace_layout), through the replay a later call of this
    signature makes; returns that replay."""
    q, k, v, _, dout = views[:5]
    replay = backward_plans.BackwardReplay(plan, q, k, v, dout)
    ws, ws_ptr = _workspace(q, (replay.ws_floats,), stream_ptr)
    ptrs = tuple(view.ptr for view in views)
    if isinstance(plan.cfg, HopperBackwardKernelConfig) or _cupy.cuda.runtime.getDevice() != plan.device:
        with _cupy.cuda.Device(plan.device):
            replay.run(stream_ptr, ptrs, ws_ptr)
    else:
        replay.run(stream_ptr, ptrs, ws_ptr)
    # The workspace is released here; both allocators order its reuse on the launch stream.
    del ws
    return replay
