"""`cupyflash.backward`: FlashAttention-2 backward on CuPy arrays, PyTorch tensors and JAX arrays."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .backward_validation import BackwardPlan, check_backward_args, resolve_backward_config
from .config import DType
from .families.backward_sm80.config_sets import default_config
from .interop import TORCH, TensorView, _cupy, allocate_output, as_view, output_view, resolve_stream, wrap_output

__all__ = ["backward"]


@functools.lru_cache(maxsize=64)
def _default(dtype: DType, d_head: int):
    return default_config(dtype, d_head)


def _select(dtype: DType, d_head: int, seq_len_q: int, seq_len_k: int, device: int, causal: bool):
    """cfg=None: the user's or the shipped tuning table of the backward_sm80 family for this GPU
    (`cupyflash autotune --family backward_sm80` writes one), else the family's default."""
    from .tuning import tuned_config

    cfg = tuned_config(dtype, d_head, seq_len_q, seq_len_k, device, causal, "backward_sm80")
    return cfg if cfg is not None else _default(dtype, d_head)


def _workspace(like: TensorView, shape: tuple[int, ...], stream_ptr: int) -> tuple[Any, int]:
    """An fp32 scratch array (its owner, its pointer) that is safe to use on `stream_ptr`: from
    torch's caching allocator for torch callers (stream-ordered on their current stream), else
    from CuPy's pool with the launch stream current (CuPy's pool is per stream)."""
    if like.framework == TORCH:
        import torch

        t = torch.empty(shape, dtype=torch.float32, device=like.base.device)
        return t, t.data_ptr()
    with _cupy.cuda.Device(like.device), _external_stream(stream_ptr, like.device):
        a = _cupy.empty(shape, dtype=np.float32)
    return a, a.data.ptr


class _StreamHandle:
    """A raw stream handle behind the CUDA stream protocol (what Stream.from_external reads)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _external_stream(stream_ptr: int, device: int) -> Any:
    """A CuPy stream object for the raw handle `stream_ptr`: Stream.from_external where CuPy has it
    (ExternalStream is deprecated since CuPy 14), else ExternalStream."""
    stream_type = _cupy.cuda.Stream
    if hasattr(stream_type, "from_external"):
        return stream_type.from_external(_StreamHandle(stream_ptr))
    return _cupy.cuda.ExternalStream(stream_ptr, device)


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
        cfg: a BackwardKernelConfig, its short form, or None/'auto' (the library picks).

    Returns:
        (dq, dk, dv) in the framework of q.
    """
    from .api import _check_device, _checked_devices, _ensure_gpu
    from . import api as _api

    if not _api._gpu_ready:
        _ensure_gpu()
    config = resolve_backward_config(cfg)
    dov, qv, kv, vv = as_view(dout, "dout"), as_view(q, "q"), as_view(k, "k"), as_view(v, "v")
    ov, lv = as_view(out, "out"), as_view(lse, "lse")
    dqv = output_view(dq, "dq") if dq is not None else None
    dkv = output_view(dk, "dk") if dk is not None else None
    dvv = output_view(dv, "dv") if dv is not None else None
    if qv.device not in _checked_devices:
        _check_device(qv.device)
    plan = check_backward_args(config, dov, qv, kv, vv, ov, lv, dqv, dkv, dvv, softmax_scale, causal,
                               deterministic, select=_select)
    stream_ptr = resolve_stream(stream, qv)
    if dqv is None:
        dqv = allocate_output(qv, tuple(qv.shape))
    if dkv is None:
        dkv = allocate_output(qv, tuple(kv.shape))
    if dvv is None:
        dvv = allocate_output(qv, tuple(vv.shape))
    if plan.launch:
        _launch(plan, (qv, kv, vv, ov, dov, lv, dqv, dkv, dvv), stream_ptr)
    return (dq if dq is not None else wrap_output(dqv), dk if dk is not None else wrap_output(dkv),
            dv if dv is not None else wrap_output(dvv))


def _launch(plan: BackwardPlan, views: tuple[TensorView, ...], stream_ptr: int) -> None:
    from .families.backward_sm80.kernels import get_launcher

    q = views[0]
    launcher = get_launcher(plan.cfg, plan.device, plan.causal, plan.deterministic)
    lse2, lse2_ptr = _workspace(q, plan.stats_shape, stream_ptr)
    dvec, dvec_ptr = _workspace(q, plan.stats_shape, stream_ptr)
    acc, acc_ptr = (None, 0) if plan.deterministic else _workspace(q, plan.dq_accum_shape, stream_ptr)
    ptrs = tuple(view.ptr for view in views) + (acc_ptr, lse2_ptr, dvec_ptr)
    params = plan.pack(ptrs)
    if _cupy.cuda.runtime.getDevice() == plan.device:
        launcher.launch(params, plan.batch, plan.n_heads, plan.n_kv_heads, plan.seq_len_q, plan.seq_len_k,
                        stream_ptr)
    else:
        with _cupy.cuda.Device(plan.device):
            launcher.launch(params, plan.batch, plan.n_heads, plan.n_kv_heads, plan.seq_len_q, plan.seq_len_k,
                            stream_ptr)
    # The workspaces are released here; both allocators order their reuse on the launch stream.
    del lse2, dvec, acc
