"""TMA descriptors (CUtensorMap) for the Hopper forward kernel, encoded on the host.

CuPy exposes no cuTensorMapEncodeTiled, so it is called through ctypes on the driver library
(libcuda.so.1 / nvcuda.dll), which every machine that runs a kernel has: no extra dependency.

Q, K, V of shape (batch, seq, heads, d_head) with strides in elements become 4-D tensor maps
(d_head, seq, heads, batch) - innermost first - with byte strides, boxes of 64 x rows x 1 x 1
(64 16-bit elements = one 128-byte swizzled row; d_head 96: 32 x rows x 1 x 1, 64-byte swizzled
rows, see col_block) and zero fill out of bounds, so the rows past a sequence end read as zeros.
Encoded descriptors are cached by everything they encode (pointer, dtype, shape, strides, box),
so a repeated call costs a dict lookup.
"""
from __future__ import annotations

import ctypes
import sys
import threading
from typing import NamedTuple

from ...config import DType

__all__ = ["TensorMapSpec", "tensor_map_spec", "encode", "encode_cached", "descriptor", "clear_cache",
           "tma_layout_problem", "COL_BLOCK", "col_block"]

COL_BLOCK = 64  # elements per box row: 128 bytes, the 128B swizzle span


def col_block(d_head: int) -> int:
    """16-bit elements per box row for a head dimension: 64 (128-byte rows, 128B swizzle) where
    d_head is a multiple of 64, else 32 (64-byte rows, 64B swizzle: d_head 96's three blocks).
    Must match SwizzledTiles<D>::COL_BLOCK (kernels_cu/common/ptx_sm90.cuh)."""
    return COL_BLOCK if d_head % COL_BLOCK == 0 else COL_BLOCK // 2


# CUtensorMapDataType / Interleave / Swizzle / L2promotion / FloatOOBfill enumerators (cuda.h)
_DATA_TYPE = {DType.FP16: 6, DType.BF16: 9}
_INTERLEAVE_NONE = 0
_SWIZZLE_64B = 2
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read as zero
_MAX_STRIDE = 1 << 40
_MAX_CACHED = 4096


class TensorMapSpec(NamedTuple):
    """The arguments of cuTensorMapEncodeTiled for one (batch, seq, heads, d) array."""

    data_type: int
    address: int
    dims: tuple[int, int, int, int]        # (d_head, seq, heads, batch), innermost first
    byte_strides: tuple[int, int, int]     # of dims 1..3 (dim 0 is contiguous)
    box: tuple[int, int, int, int]         # (64, rows, 1, 1)
    swizzle: int = _SWIZZLE_128B           # CUtensorMapSwizzle: its span is box[0]'s bytes


def tensor_map_spec(ptr: int, dtype: DType, shape: tuple[int, ...], strides: tuple[int, ...],
                    box_rows: int) -> TensorMapSpec:
    """The tensor map of a (batch, seq, heads, d_head) array with element `strides`.

    Dimensions of extent 1 get a valid placeholder stride (the hardware still checks it is a
    multiple of 16 bytes), so single-batch or single-head views with odd strides still encode."""
    batch, seq, heads, d = shape
    item = dtype.itemsize
    contiguous = (seq * heads * d, heads * d, d)
    byte_strides = []
    for extent, stride, fallback in zip((batch, seq, heads), strides[:3], contiguous):
        byte_strides.append((stride if extent > 1 else fallback) * item)
    # innermost first: (d, seq, heads, batch) -> strides of seq, heads, batch
    cols = col_block(d)
    return TensorMapSpec(_DATA_TYPE[dtype], ptr, (d, seq, heads, batch),
                         (byte_strides[1], byte_strides[2], byte_strides[0]), (cols, box_rows, 1, 1),
                         _SWIZZLE_128B if cols == COL_BLOCK else _SWIZZLE_64B)


def tma_layout_problem(name: str, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int = 2) -> str | None:
    """Why a validated (16-byte aligned) array cannot be read by TMA, or None. The rules beyond
    validation's: no zero (broadcast) strides and strides below 2**40 bytes."""
    for extent, stride, label in zip(shape[:3], strides[:3], ("batch", "seq", "head")):
        if extent > 1 and stride <= 0:
            return f"{name}: the {label} stride is {stride}; TMA needs positive strides"
        if extent > 1 and stride * itemsize >= _MAX_STRIDE:
            return f"{name}: the {label} stride {stride} exceeds TMA's 2**40-byte limit"
    return None


# ------------------------------------------------------------------------------ driver call
_encode_fn = None
_encode_lock = threading.Lock()


def _driver_function():
    global _encode_fn
    if _encode_fn is None:
        with _encode_lock:
            if _encode_fn is None:
                name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
                lib = ctypes.CDLL(name)
                fn = lib.cuTensorMapEncodeTiled
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                               ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                               ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
                _encode_fn = fn
    return _encode_fn


def encode(spec: TensorMapSpec) -> bytes:
    """The 128 descriptor bytes for `spec`; RuntimeError with the driver's code on failure."""
    fn = _driver_function()
    out = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 4)(*spec.dims)
    strides = (ctypes.c_uint64 * 3)(*spec.byte_strides)
    box = (ctypes.c_uint32 * 4)(*spec.box)
    elem = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    rc = fn(ctypes.addressof(out), spec.data_type, 4, ctypes.c_void_p(spec.address), dims, strides, box, elem,
            _INTERLEAVE_NONE, spec.swizzle, _L2_PROMOTION_256B, _OOB_FILL_ZEROS)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc} for {spec}")
    return bytes(out)


_cache: dict[tuple, bytes] = {}


def encode_cached(spec: TensorMapSpec) -> bytes:
    """`encode` through a cache keyed by the whole spec (pointer, shape, strides, box)."""
    desc = _cache.get(spec)
    if desc is None:
        desc = encode(spec)
        if len(_cache) >= _MAX_CACHED:
            _cache.clear()
        _cache[spec] = desc
    return desc


def descriptor(ptr: int, dtype: DType, shape: tuple[int, ...], strides: tuple[int, ...], box_rows: int) -> bytes:
    """The encoded descriptor of an array, cached by exactly what it encodes: the per-call path
    (one flat-tuple lookup; the spec is only built on a miss)."""
    key = (ptr, dtype, tuple(shape), tuple(strides), box_rows)
    desc = _cache.get(key)
    if desc is None:
        desc = encode_cached(tensor_map_spec(ptr, dtype, shape, strides, box_rows))
        if len(_cache) >= _MAX_CACHED:
            _cache.clear()
        _cache[key] = desc
    return desc


def clear_cache() -> None:
    _cache.clear()
