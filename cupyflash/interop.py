"""Framework interop: read array metadata, allocate outputs and find streams, zero-copy.

Every input becomes a `TensorView` (pointer, shape, strides in elements, dtype, device, framework),
which is all the validation and the launch need. Three sources:

- CuPy arrays (fp16 and `ml_dtypes.bfloat16`), read directly;
- PyTorch CUDA tensors, read directly through `data_ptr()`/`stride()` (a DLPack round trip costs
  several microseconds per tensor, and per-call overhead matters). torch is never imported here
  unless the caller passed a torch object, so it stays an optional dependency;
- any other DLPack producer on a CUDA device (JAX arrays, ...), wrapped zero-copy with
  `cupy.from_dlpack`, which also orders the producer's pending work before CuPy's current stream.

Outputs are allocated in the caller's framework (torch.empty for torch, cupy.empty otherwise) and
handed back in it (JAX gets its array through `jax.dlpack.from_dlpack`, zero-copy).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .config import DType

try:  # CuPy comes with the cuda12/cuda13 extra; importing cupyflash without it must still work.
    import cupy as _cupy
except ImportError:  # pragma: no cover - exercised only without the CUDA extra
    _cupy = None

__all__ = [
    "CUPY", "TORCH", "JAX", "DLPACK", "TensorView", "as_view", "output_view", "allocate_output",
    "allocate_lse", "wrap_output", "resolve_stream", "contiguous_strides", "external_stream", "scratch_f32",
    "stream_scratch_f32",
]

# Framework tags: the framework the caller gets its output back in.
CUPY = "cupy"
TORCH = "torch"
JAX = "jax"
DLPACK = "dlpack"  # another DLPack producer: output is a CuPy array (we cannot build its type)

# DLPack device types whose memory a CUDA kernel can address (kDLCUDA, kDLCUDAManaged).
_DLPACK_CUDA_DEVICES = (2, 13)

_NUMPY_DTYPES: dict[Any, DType] = {np.dtype(np.float16): DType.FP16}
try:
    import ml_dtypes as _ml_dtypes

    _NUMPY_DTYPES[np.dtype(_ml_dtypes.bfloat16)] = DType.BF16
except ImportError:  # pragma: no cover - ml_dtypes is a hard dependency
    pass

_torch_dtypes: dict[Any, DType] | None = None  # filled the first time a torch tensor is seen


class TensorView(NamedTuple):
    """What the launch needs to know about one (batch, seq, heads, d_head) array.

    A NamedTuple because it is built several times per call: cheaper than a dataclass, and still
    immutable and easy to fake in tests.
    """

    ptr: int                      # device address of element [0, 0, 0, 0]
    shape: tuple[int, ...]
    strides: tuple[int, ...]      # in elements, not bytes
    dtype: DType | None           # None: not fp16/bf16 (validation reports `raw_dtype`)
    raw_dtype: Any                # the framework's dtype object, only for error messages
    device: int                   # CUDA device ordinal
    framework: str                # CUPY, TORCH, JAX or DLPACK
    base: Any = None              # array owning the memory: keeps it alive, gives its type/device


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides in elements."""
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _type_name(x: Any) -> str:
    cls = type(x)
    return f"{cls.__module__}.{cls.__qualname__}"


def _require_cupy(name: str) -> None:
    if _cupy is None:
        raise RuntimeError(
            f"{name}: CuPy is not installed; install cupyflash with a CUDA extra, "
            "e.g. pip install 'cupyflash[cuda12]'"
        )


def _cupy_view(x: Any, name: str, framework: str) -> TensorView:
    itemsize = x.itemsize
    byte_strides = x.strides
    if itemsize == 2 and len(byte_strides) == 4:  # the supported case, without a generator
        b, s, h, d = byte_strides
        strides = (b >> 1, s >> 1, h >> 1, d >> 1)
        misaligned = (b | s | h | d) & 1
    else:
        strides = tuple(st // itemsize for st in byte_strides)
        misaligned = any(st % itemsize for st in byte_strides)
    if misaligned:
        # Only possible for hand-built views; the kernel indexes in whole elements.
        raise ValueError(
            f"{name}: strides {byte_strides} bytes are not multiples of the element size "
            f"{itemsize}; expected 16-byte aligned strides"
        )
    memptr = x.data
    return TensorView(memptr.ptr, x.shape, strides, _NUMPY_DTYPES.get(x.dtype), x.dtype,
                      memptr.device_id, framework, x)


def _torch_dtype_map() -> dict[Any, DType]:
    global _torch_dtypes
    if _torch_dtypes is None:
        import torch  # already imported by the caller: it handed us a torch tensor

        _torch_dtypes = {torch.float16: DType.FP16, torch.bfloat16: DType.BF16}
    return _torch_dtypes


def _torch_view(x: Any, name: str) -> TensorView:
    if not x.is_cuda:
        raise TypeError(f"{name}: expected a CUDA tensor, got a torch tensor on {x.device}")
    dtypes = _torch_dtypes if _torch_dtypes is not None else _torch_dtype_map()
    # torch.Size is a tuple subclass and stride() returns element strides: no conversion needed.
    return TensorView(x.data_ptr(), x.shape, x.stride(), dtypes.get(x.dtype), x.dtype,
                      x.get_device(), TORCH, x)


def _dlpack_view(x: Any, name: str) -> TensorView:
    try:
        dev_type, dev_id = x.__dlpack_device__()
    except Exception as exc:  # a producer that cannot say where its memory is
        raise TypeError(f"{name}: __dlpack_device__() failed on {_type_name(x)}: {exc}") from exc
    if int(dev_type) not in _DLPACK_CUDA_DEVICES:
        raise TypeError(
            f"{name}: expected an array on a CUDA device, got {_type_name(x)} on DLPack device "
            f"type {int(dev_type)} (host memory?); move it to the GPU first"
        )
    _require_cupy(name)
    # from_dlpack makes the array safe to use on CuPy's current stream of the current device, so
    # make the array's own device current while importing.
    with _cupy.cuda.Device(int(dev_id)):
        arr = _cupy.from_dlpack(x)
    framework = JAX if type(x).__module__.startswith("jax") else DLPACK
    return _cupy_view(arr, name, framework)


def as_view(x: Any, name: str) -> TensorView:
    """TensorView of a CuPy array, a PyTorch CUDA tensor or a CUDA DLPack producer (zero-copy).

    Raises TypeError naming `name` for anything else (host arrays included).
    """
    cls = type(x)
    if _cupy is not None and cls is _cupy.ndarray:  # the common case first: one identity test
        return _cupy_view(x, name, CUPY)
    module = cls.__module__
    if module.startswith("torch") and hasattr(x, "data_ptr"):
        return _torch_view(x, name)
    if _cupy is not None and isinstance(x, _cupy.ndarray):  # subclasses
        return _cupy_view(x, name, CUPY)
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a CUDA array, got a host numpy.ndarray; use cupy.asarray() first")
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return _dlpack_view(x, name)
    raise TypeError(
        f"{name}: expected a CuPy array, a PyTorch CUDA tensor or a DLPack producer on a CUDA device "
        f"(e.g. a JAX array), got {_type_name(x)}"
    )


def output_view(x: Any, name: str = "out") -> TensorView:
    """TensorView of a caller-provided output array (`out=`, `lse=`), refusing JAX arrays
    (immutable buffers)."""
    if type(x).__module__.startswith("jax"):  # checked before the DLPack import would sync on it
        raise TypeError(f"{name}: JAX arrays are immutable and cannot be written in place; omit {name}= "
                        "to get a new JAX array")
    return as_view(x, name)


def host_copy(view: TensorView) -> np.ndarray:
    """A NumPy copy of a device array (a synchronising read: only for opt-in checks)."""
    base = view.base
    if view.framework == TORCH:
        return base.detach().cpu().numpy()
    return np.asarray(_cupy.asnumpy(base))


def allocate_output(like: TensorView, shape: tuple[int, ...]) -> TensorView:
    """A new contiguous array of `shape` with `like`'s dtype, device and framework."""
    if like.framework == TORCH:
        import torch  # imported already: `like` is a torch tensor

        base = like.base
        out = torch.empty(shape, dtype=base.dtype, device=base.device)
        return TensorView(out.data_ptr(), out.shape, out.stride(), like.dtype, like.raw_dtype,
                          like.device, TORCH, out)
    _require_cupy("out")
    # cupy.empty allocates on the current device; switching costs a little, so only when needed.
    if _cupy.cuda.runtime.getDevice() == like.device:
        out = _cupy.empty(shape, dtype=like.raw_dtype)
    else:
        with _cupy.cuda.Device(like.device):
            out = _cupy.empty(shape, dtype=like.raw_dtype)
    return TensorView(out.data.ptr, shape, contiguous_strides(shape), like.dtype, like.raw_dtype,
                      like.device, like.framework, out)


def allocate_lse(like: TensorView, shape: tuple[int, ...]) -> TensorView:
    """A new contiguous float32 array of `shape` (the log-sum-exp) on `like`'s device, in its
    framework (torch for torch; CuPy otherwise, handed to JAX callers by `wrap_output`)."""
    if like.framework == TORCH:
        import torch  # imported already: `like` is a torch tensor

        lse = torch.empty(shape, dtype=torch.float32, device=like.base.device)
        return TensorView(lse.data_ptr(), lse.shape, lse.stride(), None, lse.dtype, like.device, TORCH, lse)
    _require_cupy("lse")
    with _cupy.cuda.Device(like.device):
        lse = _cupy.empty(shape, dtype=np.float32)
    return TensorView(lse.data.ptr, shape, contiguous_strides(shape), None, lse.dtype, like.device,
                      like.framework, lse)


def wrap_output(view: TensorView) -> Any:
    """The array to return to the caller, in its framework (JAX: zero-copy through DLPack)."""
    if view.framework == JAX:
        import jax.dlpack  # imported already: the inputs were JAX arrays

        try:
            return jax.dlpack.from_dlpack(view.base)  # JAX >= 0.4.x takes any __dlpack__ object
        except TypeError:  # older JAX only takes a capsule
            return jax.dlpack.from_dlpack(view.base.toDlpack())
    return view.base


# ----------------------------------------------------------------------------------- streams
def _torch_current_stream(device: int) -> int:
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:  # ~10x faster than torch.cuda.current_stream(); what Triton uses too
        return raw(device)
    return torch.cuda.current_stream(device).cuda_stream


def _stream_device(stream: Any) -> int | None:
    """Device of a stream object when it says so (CuPy: device_id, torch: device.index)."""
    dev = getattr(stream, "device_id", None)
    if isinstance(dev, int) and dev >= 0:
        return dev
    dev = getattr(stream, "device", None)
    index = getattr(dev, "index", None)
    return index if isinstance(index, int) else None


def resolve_stream(stream: Any, like: TensorView) -> int:
    """The CUDA stream handle to launch on.

    None: the caller's current stream (PyTorch's for torch tensors, CuPy's otherwise: JAX and
    other DLPack inputs were imported onto CuPy's current stream). Otherwise a cupy.cuda.Stream
    (or ExternalStream), a torch.cuda.Stream, or an int handle.
    """
    if stream is None:
        if like.framework == TORCH:
            return _torch_current_stream(like.device)
        return _cupy.cuda.get_current_stream(like.device).ptr
    if isinstance(stream, bool):
        raise TypeError("stream: expected None, a CUDA stream object or an int handle, got a bool")
    if isinstance(stream, (int, np.integer)):
        if stream < 0:
            raise ValueError(f"stream: expected a non-negative CUDA stream handle, got {stream}")
        return int(stream)
    handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream / torch ExternalStream
    if handle is None:
        handle = getattr(stream, "ptr", None)  # cupy.cuda.Stream / cupy ExternalStream
    if not isinstance(handle, int):
        raise TypeError(
            "stream: expected None, a cupy.cuda.Stream, a torch.cuda.Stream or an int CUDA stream "
            f"handle, got {_type_name(stream)}"
        )
    dev = _stream_device(stream)
    if dev is not None and dev != like.device:
        raise ValueError(f"stream: belongs to device {dev} but the inputs are on device {like.device}")
    return handle


class _StreamHandle:
    """A raw stream handle behind the CUDA stream protocol (what Stream.from_external reads)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def external_stream(stream_ptr: int, device: int) -> Any:
    """A CuPy stream object for the raw handle `stream_ptr`: Stream.from_external where CuPy has it
    (ExternalStream is deprecated since CuPy 14), else ExternalStream."""
    stream_type = _cupy.cuda.Stream
    if hasattr(stream_type, "from_external"):
        return stream_type.from_external(_StreamHandle(stream_ptr))
    return _cupy.cuda.ExternalStream(stream_ptr, device)


def scratch_f32(like: TensorView, shape: tuple[int, ...], stream_ptr: int) -> tuple[Any, int]:
    """An fp32 scratch array (its owner, its pointer) in the caller's framework allocator whose
    memory is stream-ordered on `stream_ptr`, the launch stream: dropped right after the launch,
    its block is reused only behind the kernels that read it (stream_scratch_f32)."""
    return stream_scratch_f32(like.framework == TORCH, like.device, shape, stream_ptr)


def stream_scratch_f32(is_torch: bool, device: int, shape: tuple[int, ...], stream_ptr: int) -> tuple[Any, int]:
    """scratch_f32 by framework and device. Both allocators tie a block to the stream current when
    it was allocated, so the allocation runs with the launch stream current (for torch only when
    it is not torch's current stream already)."""
    if is_torch:
        import torch

        where = torch.device("cuda", device)
        if stream_ptr == _torch_current_stream(device):
            t = torch.empty(shape, dtype=torch.float32, device=where)
        else:
            with torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr, device=where)):
                t = torch.empty(shape, dtype=torch.float32, device=where)
        return t, t.data_ptr()
    with _cupy.cuda.Device(device), external_stream(stream_ptr, device):
        a = _cupy.empty(shape, dtype=np.float32)
    return a, a.data.ptr
