"""TensorViews of made-up device arrays, for the CPU tests of argument checks (no GPU needed)."""
from __future__ import annotations

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
