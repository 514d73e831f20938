"""Argument checks for `forward_kvcache`, as pure functions over TensorViews and plain numbers.

Nothing here touches CUDA, so every rule is testable without a GPU. The result is a `KVCachePlan`:
everything the launches need except the config's geometry, the split count and the pointers.
Errors are TypeError (wrong kind: not an array, wrong dtype) or ValueError (wrong value: shape,
layout, limits), and every message starts with the name of the argument at fault.

Index values (`cache_seqlens`, `block_table`) live on the GPU and are NOT checked per call:
reading them would synchronise with the device and break CUDA-graph capture. `check_index_values`
checks host copies of them; forward_kvcache calls it only on request (check_indices=True or
CUPYFLASH_CHECK_INDICES=1).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .config import DType
from .families.decode.config import DECODE_D_HEADS
from .interop import TensorView
from .validation import (INT32_MAX, MAX_GRID_YZ, _check_layout, _dtype_name, check_flag,
                         check_softmax_scale)

__all__ = ["KVCachePlan", "check_kvcache_args", "check_num_splits", "check_index_values", "MIN_PAGE_SIZE",
           "MAX_PAGE_SIZE", "is_int32"]

MIN_PAGE_SIZE = 16    # vLLM's default page size; a 16-key sub-block never straddles a page
MAX_PAGE_SIZE = 256
MAX_SPLITS = 128      # families.decode.splits.MAX_SPLITS (the combine kernel's weight table)
_STRIDE0 = (0, 0, 0)


class KVCachePlan(NamedTuple):
    """The shapes, strides and flags of one forward_kvcache call (strides in elements)."""

    dtype: DType
    device: int
    batch: int
    seq_q: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    seq_new: int                # rows appended per sequence (0: no k_new/v_new)
    paged: bool
    page_size: int              # 0 for a contiguous cache
    num_pages: int              # paged: pages in the cache; contiguous: 0
    max_keys: int               # upper bound of cache_seqlens + seq_new (capacity of a sequence)
    causal: bool
    softmax_scale: float
    want_lse: bool
    q_strides: tuple[int, int, int]
    k_strides: tuple[int, int, int]   # contiguous: (batch, seq, head); paged: (page, row, head)
    v_strides: tuple[int, int, int]
    knew_strides: tuple[int, int, int]
    vnew_strides: tuple[int, int, int]
    o_strides: tuple[int, int, int]
    block_table_stride: int

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def rows_total(self) -> int:
        """Packed query rows per KV head: group x seq_q."""
        return self.group * self.seq_q

    @property
    def total_rows(self) -> int:
        return self.batch * self.seq_q * self.n_heads

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seq_q, self.n_heads, self.d_head)

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.n_heads, self.seq_q)

    @property
    def page_shift(self) -> int:
        return self.page_size.bit_length() - 1 if self.paged else 0

    @property
    def empty(self) -> bool:
        return not (self.batch and self.seq_q and self.n_heads)


def is_int32(view: TensorView) -> bool:
    raw = view.raw_dtype
    if str(raw) == "torch.int32":
        return True
    try:
        return np.dtype(raw) == np.int32
    except TypeError:
        return False


def _check_dtype(view: TensorView, name: str, dtype: DType | None, like: str = "q") -> None:
    if view.dtype is None:
        raise TypeError(f"{name}: dtype must be float16 or bfloat16, got {_dtype_name(view)}")
    if dtype is not None and view.dtype is not dtype:
        raise TypeError(f"{name}: dtype {_dtype_name(view)} does not match {like}'s dtype {dtype.name.lower()}")


def _check_rank(view: TensorView, name: str, rank: int, dims: str) -> None:
    if len(view.shape) != rank:
        raise ValueError(f"{name}: expected {rank} dimensions {dims}, got shape {tuple(view.shape)}")


def _check_device(view: TensorView, name: str, device: int) -> None:
    if view.device != device:
        raise ValueError(f"{name}: is on CUDA device {view.device} but q is on device {device}; "
                         "all arrays must be on one device")


def _check_index_array(view: TensorView, name: str, shape: tuple[int, ...], what: str) -> None:
    """int32, the expected shape, last dimension contiguous, on q's device (checked by the caller)."""
    if not is_int32(view):
        raise TypeError(f"{name}: expected dtype int32, got {view.raw_dtype}")
    if len(view.shape) != len(shape):
        raise ValueError(f"{name}: expected {len(shape)} dimension(s) {what}, got shape {tuple(view.shape)}")
    for got, want, label in zip(view.shape, shape, ("batch size", "second dimension")):
        if want is not None and got != want:
            raise ValueError(f"{name}: {label} {got} does not match q's batch size {want} "
                             f"(expected shape {what})")
    if view.shape[-1] > 1 and view.strides[-1] != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides "
                         f"{tuple(view.strides)}")
    if view.ptr % 4:
        raise ValueError(f"{name}: data pointer 0x{view.ptr:x} is not 4-byte aligned")


def check_num_splits(num_splits: Any) -> int | None:
    """None (the library picks) or an int in 1..MAX_SPLITS."""
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits: expected None or an int, got {type(num_splits).__name__}")
    if not 1 <= int(num_splits) <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected 1..{MAX_SPLITS} (or None to let the library pick), got {num_splits}")
    return int(num_splits)


def check_kvcache_args(q: TensorView, k_cache: TensorView, v_cache: TensorView, cache_seqlens: TensorView,
                       block_table: TensorView | None = None, k_new: TensorView | None = None,
                       v_new: TensorView | None = None, out: TensorView | None = None, causal: Any = True,
                       softmax_scale: Any = None, return_lse: Any = False) -> KVCachePlan:
    """Every rule of forward_kvcache that needs no GPU; returns the plan."""
    causal = check_flag(causal, "causal")
    want_lse = check_flag(return_lse, "return_lse")

    # dtypes and ranks
    _check_dtype(q, "q", None)
    _check_rank(q, "q", 4, "(batch, seq_q, n_heads, d_head)")
    dtype = q.dtype
    paged = block_table is not None
    cache_dims = "(num_pages, page_size, n_kv_heads, d_head)" if paged else "(batch, capacity, n_kv_heads, d_head)"
    for view, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        _check_dtype(view, name, dtype)
        _check_rank(view, name, 4, cache_dims)
    batch, seq_q, n_heads, d_head = q.shape
    n_pages_or_batch, cache_rows, n_kv_heads, kd = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} does not match k_cache's {tuple(k_cache.shape)}")
    if kd != d_head:
        raise ValueError(f"k_cache: d_head {kd} does not match q's {d_head}")
    if d_head not in DECODE_D_HEADS:
        raise ValueError(f"q: d_head {d_head} is not supported by forward_kvcache; expected one of {DECODE_D_HEADS}")
    if not n_kv_heads or n_heads % n_kv_heads:
        raise ValueError(f"k_cache: has {n_kv_heads} heads but q has {n_heads}; q's head count must be a multiple "
                         "of the cache's (grouped-query attention)")

    # devices
    device = q.device
    for view, name in ((k_cache, "k_cache"), (v_cache, "v_cache"), (cache_seqlens, "cache_seqlens"),
                       (block_table, "block_table"), (k_new, "k_new"), (v_new, "v_new"), (out, "out")):
        if view is not None:
            _check_device(view, name, device)

    # cache geometry
    if paged:
        _check_index_array(block_table, "block_table", (batch, None), "(batch, max_pages)")
        page_size = cache_rows
        if page_size & (page_size - 1) or not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"k_cache: page size {page_size} (its second dimension) must be a power of two from "
                             f"{MIN_PAGE_SIZE} to {MAX_PAGE_SIZE}")
        num_pages = n_pages_or_batch
        max_keys = block_table.shape[1] * page_size
        bt_stride = block_table.strides[0] if block_table.shape[0] > 1 else 0
    else:
        if n_pages_or_batch != batch:
            raise ValueError(f"k_cache: batch size {n_pages_or_batch} does not match q's {batch} (a contiguous "
                             "cache is (batch, capacity, n_kv_heads, d_head); pass block_table for a paged one)")
        page_size = num_pages = bt_stride = 0
        max_keys = cache_rows
    _check_index_array(cache_seqlens, "cache_seqlens", (batch,), "(batch,)")

    # appended keys
    seq_new = 0
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{'v_new' if k_new is not None else 'k_new'}: k_new and v_new must be given together")
    if k_new is not None:
        for view, name in ((k_new, "k_new"), (v_new, "v_new")):
            _check_dtype(view, name, dtype)
            _check_rank(view, name, 4, "(batch, seq_new, n_kv_heads, d_head)")
        if tuple(v_new.shape) != tuple(k_new.shape):
            raise ValueError(f"v_new: shape {tuple(v_new.shape)} does not match k_new's {tuple(k_new.shape)}")
        nb, seq_new, nh, nd = k_new.shape
        if nb != batch or nh != n_kv_heads or nd != d_head:
            raise ValueError(f"k_new: expected shape ({batch}, seq_new, {n_kv_heads}, {d_head}) (q's batch, the "
                             f"cache's heads and d_head), got {tuple(k_new.shape)}")
        if seq_new > max_keys:
            raise ValueError(f"k_new: {seq_new} new rows exceed the cache capacity of {max_keys} rows per sequence")

    # out
    out_shape = (batch, seq_q, n_heads, d_head)
    if out is not None:
        if tuple(out.shape) != out_shape:
            raise ValueError(f"out: expected shape {out_shape} (q's shape), got {tuple(out.shape)}")
        if out.dtype is not dtype:
            raise TypeError(f"out: expected dtype {dtype.name.lower()} (q's dtype), got {_dtype_name(out)}")

    # sizes and launch limits
    if max_keys > INT32_MAX // 2:
        raise ValueError(f"k_cache: {max_keys} rows per sequence exceed the int32 range the kernel indexes in")
    if batch > MAX_GRID_YZ:
        raise ValueError(f"q: batch size {batch} exceeds the CUDA grid limit gridDim.z <= {MAX_GRID_YZ}")
    if n_heads * seq_q > INT32_MAX // max(1, batch):
        raise ValueError("q: batch x seq_q x n_heads exceeds the int32 range")
    scale = check_softmax_scale(softmax_scale, d_head)

    # layouts (after shapes, so that shape messages come first)
    q_strides = _check_layout(q, "q")
    k_strides = _check_layout(k_cache, "k_cache")
    v_strides = _check_layout(v_cache, "v_cache")
    knew_strides = _check_layout(k_new, "k_new") if k_new is not None else _STRIDE0
    vnew_strides = _check_layout(v_new, "v_new") if v_new is not None else _STRIDE0
    if out is not None:
        o_strides = _check_layout(out, "out")
        if any(out.shape[d] > 1 and o_strides[d] == 0 for d in range(3)):
            raise ValueError("out: has a zero stride (a broadcast view); expected a writable array whose "
                             "elements do not overlap")
    else:
        o_strides = (seq_q * n_heads * d_head, n_heads * d_head, d_head)

    return KVCachePlan(dtype, device, batch, seq_q, n_heads, n_kv_heads, d_head, seq_new, paged, page_size,
                       num_pages, max_keys, causal, scale, want_lse, q_strides, k_strides, v_strides, knew_strides,
                       vnew_strides, o_strides, bt_stride)


def check_index_values(plan: KVCachePlan, cache_seqlens: np.ndarray, block_table: np.ndarray | None) -> None:
    """The opt-in check of index values (host copies): every sequence fits its cache, and every
    page it uses exists. ValueError naming the argument and the first bad sequence."""
    lens = np.asarray(cache_seqlens, dtype=np.int64).reshape(-1)
    total = lens + plan.seq_new
    bad = np.nonzero(lens < 0)[0]
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"cache_seqlens: sequence {b} has negative length {int(lens[b])}")
    bad = np.nonzero(total > plan.max_keys)[0]
    if bad.size:
        b = int(bad[0])
        where = "block_table pages x page_size" if plan.paged else "k_cache capacity"
        raise ValueError(f"cache_seqlens: sequence {b} needs {int(total[b])} rows (cache_seqlens + seq_new) but the "
                         f"{where} holds {plan.max_keys}")
    if plan.paged:
        table = np.asarray(block_table)
        for b in range(plan.batch):
            used = table[b, :math.ceil(int(total[b]) / plan.page_size)]
            wrong = np.nonzero((used < 0) | (used >= plan.num_pages))[0]
            if wrong.size:
                j = int(wrong[0])
                raise ValueError(f"block_table: entry [{b}, {j}] = {int(used[j])} is not a page of k_cache "
                                 f"(0..{plan.num_pages - 1})")
