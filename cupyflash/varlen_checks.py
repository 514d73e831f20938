"""Argument checks for `forward_varlen`, as pure functions over TensorViews and plain numbers.

Packed ragged batches: q and out are (total_q, n_heads, d_head), k and v (total_k, n_kv_heads,
d_head); sequence b holds the tokens cu_seqlens[b] .. cu_seqlens[b + 1] - 1 of each. Nothing here
touches CUDA; the index values themselves live on the GPU and are checked only on request
(`check_index_values`, which takes host copies).
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from .config import SUPPORTED_D_HEADS, DType
from .interop import TensorView
from .kvcache_checks import is_int32
from .validation import (ALIGN_BYTES, INT32_MAX, LOG2_E, MAX_GRID_YZ, _dtype_name, _raise_dtype_error,
                         check_flag, check_softmax_scale)

__all__ = ["VarlenProblem", "check_varlen_args", "check_index_values", "check_max_seqlen"]

_ALIGN_ELEMS = ALIGN_BYTES // 2


class VarlenProblem(NamedTuple):
    """A validated forward_varlen call, minus the config and the pointers."""

    dtype: DType
    d_head: int
    total_q: int
    total_k: int
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    n_heads: int
    n_kv_heads: int
    # (token, head) strides in elements; o_strides: out's, or those of the output forward_varlen allocates
    q_strides: tuple[int, int]
    k_strides: tuple[int, int]
    v_strides: tuple[int, int]
    o_strides: tuple[int, int]
    softmax_scale: float
    softmax_scale_log2: float
    causal: bool
    device: int

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return (self.total_q, self.n_heads, self.d_head)

    @property
    def lse_shape(self) -> tuple[int, int]:
        """(n_heads, total_q), FlashAttention's varlen layout."""
        return (self.n_heads, self.total_q)

    @property
    def kv_group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def empty(self) -> bool:
        """Nothing to compute: no query token, no head or no sequence."""
        return not (self.total_q and self.n_heads and self.batch and self.max_seqlen_q)


def check_max_seqlen(value, name: str) -> int:
    """A Python int (not a bool) in [0, INT32_MAX]: it sizes the grid, so it is read on the host."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if value < 0 or value > INT32_MAX:
        raise ValueError(f"{name}: {value} is outside [0, {INT32_MAX}]")
    return value


def _check_packed(view: TensorView, name: str) -> tuple[int, int]:
    """3-D (tokens, heads, d_head), last dimension contiguous, rows 16-byte aligned; returns the
    (token, head) strides in elements."""
    if len(view.shape) != 3:
        raise ValueError(f"{name}: expected 3 dimensions (total_tokens, heads, d_head), got shape {tuple(view.shape)}")
    strides, shape = view.strides, view.shape
    if not (shape[0] and shape[1] and shape[2]):
        return strides[0], strides[1]  # no elements: nothing is read or written (CuPy reports zero strides)
    if strides[2] != 1 and shape[2] > 1:
        raise ValueError(f"{name}: the last dimension (d_head) must be contiguous (stride 1), got strides "
                         f"{tuple(strides)} (in elements)")
    if view.ptr % ALIGN_BYTES:
        raise ValueError(f"{name}: data pointer 0x{view.ptr:x} is not {ALIGN_BYTES}-byte aligned")
    for dim, label in ((0, "token"), (1, "head")):
        if shape[dim] > 1 and strides[dim] % _ALIGN_ELEMS:
            raise ValueError(f"{name}: the {label} stride {strides[dim]} (elements) is not a multiple of "
                             f"{_ALIGN_ELEMS}; every row must start {ALIGN_BYTES}-byte aligned")
    return strides[0], strides[1]


def _check_cu_seqlens(view: TensorView, name: str, device: int) -> int:
    """int32, 1-D, contiguous, on q's device, at least one entry; returns the batch size."""
    if not is_int32(view):
        raise TypeError(f"{name}: expected dtype int32, got {view.raw_dtype}")
    if len(view.shape) != 1 or view.shape[0] < 1:
        raise ValueError(f"{name}: expected a 1-D array of batch + 1 offsets, got shape {tuple(view.shape)}")
    if view.shape[0] > 1 and view.strides[0] != 1:
        raise ValueError(f"{name}: must be contiguous (stride 1), got stride {view.strides[0]}")
    if view.ptr % 4:
        raise ValueError(f"{name}: data pointer 0x{view.ptr:x} is not 4-byte aligned")
    if view.device != device:
        raise ValueError(f"{name}: is on CUDA device {view.device} but q is on device {device}")
    return view.shape[0] - 1


def check_varlen_args(q: TensorView, k: TensorView, v: TensorView, cu_q: TensorView, cu_k: TensorView,
                      max_seqlen_q, max_seqlen_k, out: TensorView | None = None, softmax_scale=None,
                      causal=False) -> VarlenProblem:
    """Every rule of forward_varlen that needs no GPU; TypeError/ValueError naming the argument."""
    causal = check_flag(causal, "causal")
    dtype = q.dtype
    if dtype is None or k.dtype is not dtype or v.dtype is not dtype:
        _raise_dtype_error(q, k, v)
    q_strides = _check_packed(q, "q")
    k_strides = _check_packed(k, "k")
    v_strides = _check_packed(v, "v")
    total_q, n_heads, d_head = q.shape
    total_k, n_kv_heads, kd = k.shape
    if kd != d_head:
        raise ValueError(f"k: d_head {kd} does not match q's {d_head}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: shape {tuple(v.shape)} does not match k's shape {tuple(k.shape)}")
    if d_head not in SUPPORTED_D_HEADS:
        raise ValueError(f"q: d_head {d_head} is not supported; expected one of {SUPPORTED_D_HEADS}")
    if n_kv_heads != n_heads and (not n_kv_heads or n_heads % n_kv_heads):
        raise ValueError(f"k: k and v have {n_kv_heads} heads but q has {n_heads}; q's head count must be a "
                         "multiple of k/v's (grouped-query attention)")
    if n_heads > MAX_GRID_YZ:
        raise ValueError(f"q: {n_heads} heads exceed the CUDA grid limit gridDim.y <= {MAX_GRID_YZ}")
    if total_q > INT32_MAX or total_k > INT32_MAX:
        name, n = ("q", total_q) if total_q > INT32_MAX else ("k", total_k)
        raise ValueError(f"{name}: {n} tokens exceed the int32 limit {INT32_MAX}")
    device = q.device
    for view, name in ((k, "k"), (v, "v")):
        if view.device != device:
            raise ValueError(f"{name}: is on CUDA device {view.device} but q is on device {device}; "
                             "all arrays must be on one device")
    batch = _check_cu_seqlens(cu_q, "cu_seqlens_q", device)
    batch_k = _check_cu_seqlens(cu_k, "cu_seqlens_k", device)
    if batch_k != batch:
        raise ValueError(f"cu_seqlens_k: has {batch_k + 1} entries but cu_seqlens_q has {batch + 1}; "
                         "both hold batch + 1 offsets")
    if batch > MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_q: batch size {batch} exceeds the CUDA grid limit gridDim.z <= {MAX_GRID_YZ}")
    max_q = check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_k = check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    scale = check_softmax_scale(softmax_scale, d_head)
    if out is not None:
        if tuple(out.shape) != (total_q, n_heads, d_head):
            raise ValueError(f"out: expected shape {(total_q, n_heads, d_head)} (q's shape), got {tuple(out.shape)}")
        if out.dtype is not dtype:
            raise TypeError(f"out: expected dtype {_dtype_name(q)} (q's dtype), got {_dtype_name(out)}")
        if out.device != device:
            raise ValueError(f"out: is on CUDA device {out.device} but q is on device {device}")
        o_strides = _check_packed(out, "out")
        if (total_q > 1 and o_strides[0] == 0) or (n_heads > 1 and o_strides[1] == 0):
            raise ValueError("out: has a zero stride (a broadcast view); expected a writable array whose "
                             "elements do not overlap")
    else:
        o_strides = (n_heads * d_head, d_head)
    return VarlenProblem(dtype, d_head, total_q, total_k, batch, max_q, max_k, n_heads, n_kv_heads,
                         q_strides, k_strides, v_strides, o_strides, scale, scale * LOG2_E, causal, device)


def check_index_values(problem: VarlenProblem, cu_q: np.ndarray, cu_k: np.ndarray) -> None:
    """Host copies of cu_seqlens_q/k against the arrays and max_seqlen_q/k (the opt-in check):
    ValueError naming the argument instead of an out-of-bounds read or rows left unwritten."""
    for cu, name, total, longest, max_name in ((cu_q, "cu_seqlens_q", problem.total_q, problem.max_seqlen_q,
                                                "max_seqlen_q"),
                                               (cu_k, "cu_seqlens_k", problem.total_k, problem.max_seqlen_k,
                                                "max_seqlen_k")):
        cu = np.asarray(cu, dtype=np.int64).reshape(-1)
        if cu[0] != 0:
            raise ValueError(f"{name}: must start at 0, got {int(cu[0])}")
        lengths = np.diff(cu)
        if lengths.size and lengths.min() < 0:
            b = int(np.argmin(lengths))
            raise ValueError(f"{name}: offsets must not decrease; entry {b + 1} ({int(cu[b + 1])}) < entry {b} "
                             f"({int(cu[b])})")
        if cu[-1] > total:
            raise ValueError(f"{name}: the last offset {int(cu[-1])} exceeds the {total} packed tokens")
        if lengths.size and lengths.max() > longest:
            b = int(np.argmax(lengths))
            raise ValueError(f"{max_name}: {longest} is less than sequence {b}'s length {int(lengths[b])}")
