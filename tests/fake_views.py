"""TensorViews of made-up device arrays, for the CPU tests of argument checks (no GPU needed)."""
from __future__ import annotations

import struct

import numpy as np

from cupyflash.config import DType
from cupyflash.interop import CUPY, TensorView, contiguous_strides

_PTR = [1 << 20]


def view(shape, dtype: DType | None = DType.BF16, raw=None, strides=None, device=0, ptr=None) -> TensorView:
    """A CuPy-like view; each call gets its own 1 MiB-aligned fake address unless `ptr` is given."""
    if ptr is None:
        _PTR[0] += 1 << 20
        ptr = _PTR[0]
    raw = raw if raw is not None else (dtype.numpy_dtype if dtype is not None else np.dtype(np.int32))
    return TensorView(ptr, tuple(shape), tuple(strides or contiguous_strides(tuple(shape))), dtype, raw,
                      device, CUPY, None)


def ints(shape, raw=np.dtype(np.int32), **kw) -> TensorView:
    """An index array (int32 unless `raw` says otherwise)."""
    return view(shape, dtype=None, raw=raw, **kw)


def stand_in_encoder(address_word):
    """A stand-in for cuTensorMapEncodeTiled (monkeypatched over tma.encode): the spec's fields
    in fixed words, and the address as `address_word(address)` at word 3."""

    def encode(spec):
        words = [0] * 16
        words[0], words[1] = spec.data_type, spec.dims[0] | spec.dims[1] << 32
        words[2] = spec.dims[2] | spec.dims[3] << 32
        words[4:7] = spec.byte_strides
        words[7] = spec.box[0] | spec.box[1] << 16
        words[3], extra = address_word(spec.address)
        words[8] = extra
        return struct.pack("<16Q", *words)

    return encode
