"""Argument checks for `backward`, pure functions over TensorViews (no CUDA), like validation.py.

Every message starts with the name of the argument at fault. The result is a `BackwardPlan`:
everything the launch needs except the device pointers and the workspaces.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

from .config import SUPPORTED_D_HEADS, DType
from .families.backward_sm80.config import BackwardKernelConfig
from .families.backward_sm80.params import pack_params
from .families.backward_sm90.config import HopperBackwardKernelConfig
from .interop import TensorView, contiguous_strides
from .validation import (INT32_MAX, LOG2_E, MAX_GRID_YZ, _check_layout, _dtype_name, _is_float32,
                         check_flag, check_softmax_scale)

__all__ = ["BackwardPlan", "check_backward_args", "resolve_backward_config"]

# (dtype, d_head, seq_len_q, seq_len_k, device, causal) -> config, for cfg=None
Selector = Callable[[DType, int, int, int, int, bool], BackwardKernelConfig]


class BackwardPlan(NamedTuple):
    cfg: BackwardKernelConfig
    batch: int
    seq_len_q: int
    seq_len_k: int
    seq_len_q_pad: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    # (batch, seq, head) element strides of q, k, v, out, dout, dq, dk, dv (outputs: given or
    # the contiguous strides of the arrays backward() allocates), and lse's (batch, head, seq).
    strides: tuple[tuple[int, int, int], ...]
    lse_strides: tuple[int, int, int]
    softmax_scale: float
    causal: bool
    deterministic: bool
    device: int
    launch: bool  # False when there is nothing to compute (an empty batch or no heads)
    # backward_varlen: batch counts the packed sequences, seq_len_q/k are the longest ones, and the
    # workspaces are one (n_heads, seq_len_q_pad) batch entry (backward_varlen.workspace_rows)
    varlen: bool = False

    @property
    def ws_batch(self) -> int:
        """Batch entries of the fp32 workspaces (lse2, dvec, dq_accum)."""
        return 1 if self.varlen else self.batch

    @property
    def stats_shape(self) -> tuple[int, int, int]:
        return (self.ws_batch, self.n_heads, self.seq_len_q_pad)

    @property
    def dq_accum_shape(self) -> tuple[int, int, int, int]:
        return (self.ws_batch, self.n_heads, self.seq_len_q_pad, self.d_head)

    def pack(self, ptrs: tuple[int, ...], cu_seqlens: tuple[int, int] = (0, 0), tail: tuple[int, int] = (0, 0)) -> bytes:
        """BackwardParams bytes; `ptrs` in params.POINTER_FIELDS order up to dvec, then the varlen
        calls' cu_seqlens_q/k pointers (0 for dense calls) and, for varlen calls with new outputs,
        (total_q, total_k): the preprocess zeroes dq's and dk/dv's rows past the last sequence."""
        flat = [s for triple in self.strides for s in triple]
        return pack_params(*ptrs, *cu_seqlens, *flat, *self.lse_strides, self.seq_len_q, self.seq_len_k, self.seq_len_q_pad,
                           self.n_heads, self.n_kv_heads, self.n_heads // self.n_kv_heads,
                           self.softmax_scale, self.softmax_scale * LOG2_E, *tail)


def resolve_backward_config(cfg: Any) -> BackwardKernelConfig | HopperBackwardKernelConfig | None:
    """A config for `cfg` (object or short-form str of either backward family), None for None/'auto'."""
    if cfg is None or isinstance(cfg, (BackwardKernelConfig, HopperBackwardKernelConfig)):
        return cfg
    if isinstance(cfg, str):
        if cfg.strip().lower() == "auto":
            return None
        parse = (HopperBackwardKernelConfig.parse if cfg.strip().startswith(HopperBackwardKernelConfig.FAMILY)
                 else BackwardKernelConfig.parse)
        try:
            return parse(cfg)
        except ValueError as exc:
            raise ValueError(f"cfg: {exc}") from None
    raise TypeError(f"cfg: expected a BackwardKernelConfig or HopperBackwardKernelConfig, a short-form str, "
                    f"'auto' or None, got {type(cfg).__name__}")


def _check_same(view: TensorView, name: str, shape: tuple, dtype: DType, device: int, like: str) -> None:
    if len(view.shape) != 4:
        raise ValueError(f"{name}: expected 4 dimensions (batch, seq, heads, d_head), got shape {tuple(view.shape)}")
    if tuple(view.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} ({like}'s shape), got {tuple(view.shape)}")
    if view.dtype is not dtype:
        raise TypeError(f"{name}: dtype {_dtype_name(view)} does not match q's dtype {dtype.name.lower()}")
    if view.device != device:
        raise ValueError(f"{name}: is on CUDA device {view.device} but q is on device {device}; "
                         "all arrays must be on one device")


def _check_output(view: TensorView, name: str, shape: tuple, dtype: DType, device: int, like: str
                  ) -> tuple[int, int, int]:
    _check_same(view, name, shape, dtype, device, like)
    strides = _check_layout(view, name)
    for dim in range(3):
        if shape[dim] > 1 and strides[dim] == 0:
            raise ValueError(f"{name}: has a zero stride in dimension {dim} (a broadcast view); expected a "
                             "writable array whose elements do not overlap")
    return strides


def check_backward_args(cfg: BackwardKernelConfig | None, dout: TensorView, q: TensorView, k: TensorView,
                        v: TensorView, out: TensorView, lse: TensorView, dq: TensorView | None = None,
                        dk: TensorView | None = None, dv: TensorView | None = None, softmax_scale: Any = None,
                        causal: Any = False, deterministic: Any = False, *, select: Selector) -> BackwardPlan:
    """Check every rule that needs no GPU and return the plan (TypeError/ValueError naming the argument)."""
    causal = check_flag(causal, "causal")
    deterministic = check_flag(deterministic, "deterministic")
    dtype = q.dtype
    if dtype is None:
        raise TypeError(f"q: dtype must be float16 or bfloat16, got {_dtype_name(q)}")
    if len(q.shape) != 4:
        raise ValueError(f"q: expected 4 dimensions (batch, seq, heads, d_head), got shape {tuple(q.shape)}")
    batch, seq_len_q, n_heads, d_head = q.shape
    device = q.device
    for view, name in ((k, "k"), (v, "v")):
        if len(view.shape) != 4:
            raise ValueError(f"{name}: expected 4 dimensions (batch, seq, heads, d_head), got shape {tuple(view.shape)}")
        if view.dtype is not dtype:
            raise TypeError(f"{name}: dtype {_dtype_name(view)} does not match q's dtype {_dtype_name(q)}")
        if view.device != device:
            raise ValueError(f"{name}: is on CUDA device {view.device} but q is on device {device}; "
                             "all arrays must be on one device")
    kb, seq_len_k, n_kv_heads, kd = k.shape
    if kb != batch:
        raise ValueError(f"k: batch size {kb} does not match q's {batch}")
    if kd != d_head:
        raise ValueError(f"k: d_head {kd} does not match q's {d_head}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: shape {tuple(v.shape)} does not match k's shape {tuple(k.shape)}")
    if n_kv_heads != n_heads and (not n_kv_heads or n_heads % n_kv_heads):
        raise ValueError(f"k: k and v have {n_kv_heads} heads but q has {n_heads}; q's head count must be a "
                         "multiple of k/v's (grouped-query attention)")
    if d_head not in SUPPORTED_D_HEADS:
        raise ValueError(f"q: d_head {d_head} is not supported; expected one of {SUPPORTED_D_HEADS}")
    q_shape = (batch, seq_len_q, n_heads, d_head)
    k_shape = (batch, seq_len_k, n_kv_heads, d_head)
    _check_same(out, "out", q_shape, dtype, device, "q")
    _check_same(dout, "dout", q_shape, dtype, device, "q")

    # lse: the forward's fp32 (batch, n_heads, seq_len_q), any strides
    if len(lse.shape) != 3 or tuple(lse.shape) != (batch, n_heads, seq_len_q):
        raise ValueError(f"lse: expected shape {(batch, n_heads, seq_len_q)} (batch, n_heads, seq_len_q), "
                         f"got {tuple(lse.shape)}")
    if not _is_float32(lse):
        raise TypeError(f"lse: expected dtype float32 (forward(..., return_lse=True) gives it), got {lse.raw_dtype}")
    if lse.device != device:
        raise ValueError(f"lse: is on CUDA device {lse.device} but q is on device {device}")
    if lse.ptr % 4:
        raise ValueError(f"lse: data pointer 0x{lse.ptr:x} is not 4-byte aligned")

    if cfg is None:
        cfg = select(dtype, d_head, seq_len_q, seq_len_k, device, causal)
    if cfg.dtype is not dtype:
        raise ValueError(f"cfg: config dtype {cfg.dtype.name} does not match the inputs' dtype {dtype.name}")
    if cfg.d_head != d_head:
        raise ValueError(f"cfg: config d_head {cfg.d_head} does not match the inputs' d_head {d_head}")

    if seq_len_q > INT32_MAX // 2 or seq_len_k > INT32_MAX:
        name = "q" if seq_len_q > INT32_MAX // 2 else "k"
        raise ValueError(f"{name}: sequence length exceeds the int32 limit of the kernels")
    if n_heads > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        raise ValueError(f"q: {n_heads} heads x batch {batch} exceed the CUDA grid limit {MAX_GRID_YZ}")
    empty = not (batch and n_heads)
    if not seq_len_k and seq_len_q and not empty:
        raise ValueError(f"k: seq_len_k is 0 but q has {seq_len_q} query rows; attention over no keys is undefined")
    scale = check_softmax_scale(softmax_scale, d_head)

    strides = [_check_layout(q, "q"), _check_layout(k, "k"), _check_layout(v, "v"), _check_layout(out, "out"),
               _check_layout(dout, "dout")]
    for view, name, shape, like in ((dq, "dq", q_shape, "q"), (dk, "dk", k_shape, "k"), (dv, "dv", k_shape, "v")):
        if view is None:
            strides.append(contiguous_strides(shape)[:3])
        else:
            strides.append(_check_output(view, name, shape, dtype, device, like))
    pad = -(-seq_len_q // cfg.B_r) * cfg.B_r
    return BackwardPlan(cfg, batch, seq_len_q, seq_len_k, pad, n_heads, n_kv_heads, d_head, tuple(strides),
                        tuple(lse.strides), scale, causal, deterministic, device,
                        not empty and seq_len_k > 0)
