"""Per-signature launch plans: the per-call fast path of `forward`.

The first call with a given signature (framework, shapes, strides, dtypes and devices of q, k, v
and out, the cfg argument, softmax_scale, causal, return_lse) goes through full validation. Its
result is kept as a `FastLaunch`: the kernel, grid and a parameter buffer with every field but the
pointers already packed. Later calls with the same signature read the four pointers, check their
16-byte alignment, allocate the output (and lse) and launch: no views, no validation, no config
lookup.

Only PyTorch tensors and CuPy arrays take this path, on the caller's current stream or on a
`stream=` given as an int handle or a CuPy / torch stream of the plan's device; anything else
(JAX arrays, lse=, a `causal` or `return_lse` that is not a plain bool) goes through the full
path every time.
"""
from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Callable

from .families.forward_sm80.config import FlashForwardKernelConfig
from .families.forward_sm90.config import HopperForwardKernelConfig

__all__ = ["ParamBlock", "PlanTable", "FastLaunch", "PackedLaunch", "argv_launcher", "meta_reader", "current_stream_reader", "given_stream",
           "lse_allocator", "signature", "lookup", "remember", "clear"]

_CONFIG_TYPES = (FlashForwardKernelConfig, HopperForwardKernelConfig)
_MAX_PLANS = 4096  # a process that cycles through more shapes than this just rebuilds them


class ParamBlock:
    """A launch's packed kernel parameters, replayed with new pointers: the bytes, the
    kernelParams array cuLaunchKernel reads them through, and the lock a pack and its launch hold
    (the block is shared by every thread replaying the plan; cuLaunchKernel copies the parameters
    before it returns, so the lock only has to cover the pack and the launch). `is_torch` says
    which pointer accessor the plan's array type takes (set by PlanTable.remember)."""

    __slots__ = ("buf", "_argv", "argv_ptr", "lock", "is_torch")

    def __init__(self, params: bytes, size: int | None = None) -> None:
        self.buf = ctypes.create_string_buffer(params, len(params) if size is None else size)
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.buf))
        self.argv_ptr = ctypes.addressof(self._argv)
        self.lock = threading.Lock()
        self.is_torch = False


class PlanTable:
    """One fast path's plans by signature key, and the driver calls its hot path launches
    through: bound when the first plan is remembered, so importing a fast path costs nothing.
    The hot paths read `plans` and `get_device` inline (a call frame is a visible share of the
    per-call cost) and use a plan only on the device it was made on."""

    __slots__ = ("plans", "launch_kernel", "get_device", "max_plans")

    def __init__(self, max_plans: int = _MAX_PLANS) -> None:
        self.plans: dict[tuple, Any] = {}
        self.launch_kernel: Callable[..., None] | None = None  # cuLaunchKernel as CuPy binds it
        self.get_device: Callable[[], int] | None = None       # the current device
        self.max_plans = max_plans

    def remember(self, key: tuple | None, plan: Any, is_torch: bool | None = None) -> None:
        """Keep `plan` under `key` (None: the arguments cannot take the fast path), marking which
        pointer accessor its array type takes (`is_torch`, else read off the key's first item, the
        array type); a table that reached max_plans starts over (a process cycling through more
        shapes than that just rebuilds them), emptied in place so that the hot paths' references
        to `plans` stay valid."""
        if key is None:
            return
        if self.launch_kernel is None or self.get_device is None:
            launch_kernel, get_device = driver_calls()
            self.launch_kernel = self.launch_kernel or launch_kernel
            self.get_device = self.get_device or get_device
        if len(self.plans) >= self.max_plans:
            self.plans.clear()
        plan.is_torch = _kind(key[0]) == _TORCH if is_torch is None else is_torch
        self.plans[key] = plan

    def clear(self) -> None:
        """Forget every plan (tests; or after the tuning table changed)."""
        self.plans.clear()


class FastLaunch(ParamBlock):
    """One validated launch, replayable with new pointers (see `lookup`)."""

    __slots__ = ("launch_head", "device", "out_shape", "allocate", "current_stream", "size", "write_pointers",
                 "lse_shape", "allocate_lse")

    def __init__(self, func_ptr: int, grid: tuple[int, int, int], block: int, smem_bytes: int, device: int,
                 params: bytes, out_shape: tuple[int, ...], allocate: Callable[[], Any] | None,
                 current_stream: Callable[[], int], lse_shape: tuple[int, ...] | None = None,
                 allocate_lse: Callable[[], Any] | None = None) -> None:
        super().__init__(params)
        # cuLaunchKernel's arguments up to the stream, as one tuple: fewer attribute reads per call
        self.launch_head = (func_ptr, *grid, block, 1, 1, smem_bytes)
        self.device = device
        self.out_shape = out_shape            # torch outputs: q.new_empty(out_shape)
        self.allocate = allocate              # () -> a new output array (CuPy; None for torch)
        self.current_stream = current_stream  # () -> the caller's current stream handle
        self.lse_shape = lse_shape            # return_lse=True plans: each call's new lse
        self.allocate_lse = allocate_lse      # () -> a new lse array (torch and CuPy)
        self.size = len(params)
        # write_pointers(q, k, v, o, lse): one call's pointers into `buf`, set by whoever builds
        # the plan (op_launch's writers: the leading ForwardParams fields, the TMA descriptors'
        # address words, or a re-pack of the whole block); hold `lock` around it and the launch

    def store_pointers(self, q: int, k: int, v: int, o: int) -> None:
        """Put a call's four pointers into the parameter buffer, as `lookup` does (for tools that
        launch the buffer themselves: the bench scripts' bare-launch figures)."""
        with self.lock:
            self.write_pointers(q, k, v, o, 0)


class PackedLaunch:
    """A multi-kernel launch (the backward families') whose parameter blocks are packed once for
    arrays of fixed layouts, relaunched by `launch(stream, pointers)`: each call stores its
    pointers into the words of the blocks that hold them (`slots`: (word index, pointer index)
    pairs) and launches every step from its block, with no re-pack and no copy. The blocks lie in
    one buffer at `block_offsets`; the steps' launchers are this object's own (a PDL launcher keeps
    its stream), so one lock covers the stores and the launches (the driver copies the parameters
    before a launch returns)."""

    __slots__ = ("buf", "words", "slots", "steps", "lock", "_argvs")

    def __init__(self, template: bytes, block_offsets: tuple[int, ...], slots: tuple[tuple[int, int], ...],
                 steps: list[tuple[Callable[..., None], int]]) -> None:
        self.buf = ctypes.create_string_buffer(template, len(template))
        self.words = memoryview(self.buf).cast("B").cast("Q")
        self.slots = slots
        base = ctypes.addressof(self.buf)
        self._argvs = [(ctypes.c_void_p * 1)(base + offset) for offset in block_offsets]
        argvs = [ctypes.addressof(argv) for argv in self._argvs]
        self.steps = tuple((go, argvs[block]) for go, block in steps)  # (launcher, its block's argv)
        self.lock = threading.Lock()

    def launch(self, stream: int, ptrs: tuple[int, ...]) -> None:
        words = self.words
        with self.lock:
            for at, i in self.slots:
                words[at] = ptrs[i]
            for go, argv in self.steps:
                go(stream, argv)


def argv_launcher(kernel: Any, grid: tuple[int, int, int], block: int, smem: int, pdl: bool) -> Callable[..., None]:
    """(stream, argv_ptr) -> `kernel` (a registry.LoadedKernel) launched from the parameter block
    argv_ptr's array points at (no copy): as a programmatic dependent of the previous kernel on
    the stream when `pdl` (kvcache_pdl.PDLLaunch, which keeps its stream: each caller owns its own
    and serialises its calls), else plainly."""
    launch_kernel = driver_calls()[0]
    func, (gx, gy, gz) = kernel.func_ptr, grid

    def plain(stream: int, argv: int, extra: int = 0) -> None:
        launch_kernel(func, gx, gy, gz, block, 1, 1, smem, stream, argv, extra)

    if not pdl:
        return plain
    from .kvcache_pdl import PDLLaunch

    return PDLLaunch(func, grid, block, smem, plain)


_TORCH, _CUPY = 1, 2
_kinds: dict[type, int] = {}  # array type -> _TORCH / _CUPY / 0, so the module test runs once per type


def _kind(cls: type) -> int:
    """_TORCH, _CUPY or 0 for an array type (cached per type; kvcache_plans shares it)."""
    kind = _kinds.get(cls)
    if kind is None:
        package = cls.__module__.partition(".")[0]  # 'cupy', not 'cupyflash' (whose views take the full path)
        kind = _TORCH if package == "torch" else _CUPY if package == "cupy" else 0
        _kinds[cls] = kind
    return kind


def torch_meta(x: Any) -> tuple:
    """What a plan key holds of a torch tensor: shape, strides, dtype, device."""
    return (x.shape, x.stride(), x.dtype, x.get_device())


def cupy_meta(x: Any) -> tuple:
    """What a plan key holds of a CuPy array: shape, strides, dtype, device."""
    return (x.shape, x.strides, x.dtype, x.data.device_id)


def meta_reader(cls: type) -> Callable[[Any], tuple] | None:
    """What a plan key holds of an array of type `cls` (torch_meta, cupy_meta), or None: that
    array type takes the full path."""
    kind = _kinds.get(cls) or _kind(cls)
    return torch_meta if kind == _TORCH else cupy_meta if kind == _CUPY else None


def current_stream_reader(is_torch: bool, device: int) -> Callable[[], int]:
    """() -> the caller's current stream handle on `device`, for a plan's replays: torch's raw
    accessor (what Triton reads; ~10x faster than torch.cuda.current_stream) for torch tensors,
    CuPy's current stream otherwise (the fast paths replay only on the plan's device)."""
    if is_torch:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return functools.partial(raw, device)
        from .interop import _torch_current_stream

        return functools.partial(_torch_current_stream, device)
    import cupy

    current = cupy.cuda.get_current_stream
    return lambda: current(device).ptr  # noqa: E731


def given_stream(stream: Any, device: int) -> int | None:
    """The handle a replay on `device` launches on for a `stream=` argument: an int handle, or a
    CuPy / torch stream object of that device; None for anything else (the full path then
    resolves it, and raises where it is wrong)."""
    if type(stream) is int:
        return stream if stream >= 0 else None
    handle = getattr(stream, "ptr", None)  # cupy.cuda.Stream / ExternalStream
    if type(handle) is int:
        owner = getattr(stream, "device_id", None)
        return handle if type(owner) is not int or owner < 0 or owner == device else None
    handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream / ExternalStream
    if type(handle) is int:
        owner = getattr(getattr(stream, "device", None), "index", None)
        return handle if type(owner) is not int or owner == device else None
    return None


def lse_allocator(is_torch: bool, device: int, shape: tuple[int, ...]) -> Callable[[], Any]:
    """() -> a new float32 array of `shape` on `device` (torch or CuPy), for return_lse plans."""
    if is_torch:
        import torch

        # new_empty of a float32 template: no dtype keyword to parse on every call
        template = torch.empty((0,), dtype=torch.float32, device=f"cuda:{device}")
        return functools.partial(template.new_empty, shape)
    import cupy

    return functools.partial(cupy.empty, shape, dtype=cupy.float32)


def signature(cfg: Any, q: Any, k: Any, v: Any, out: Any, softmax_scale: Any,
              causal: Any = False, return_lse: Any = False) -> tuple | None:
    """The plan key for these arguments, or None when they cannot take the fast path.

    One flat tuple (hashing nested tuples costs more): per array its shape, strides, dtype and
    device, as the framework reports them without building any view."""
    if not (cfg is None or type(cfg) is str or type(cfg) in _CONFIG_TYPES):
        return None
    if not (softmax_scale is None or type(softmax_scale) is float or type(softmax_scale) is int):
        return None
    if causal is not False and causal is not True:  # 0/1 would hash like False/True: validate it
        return None
    if return_lse is not False and return_lse is not True:
        return None
    cls = type(q)
    if type(k) is not cls or type(v) is not cls or (out is not None and type(out) is not cls):
        return None
    kind = _kinds.get(cls) or _kind(cls)
    if kind == _TORCH:
        key = (cls, cfg, softmax_scale, causal, return_lse,
               q.shape, q.stride(), q.dtype, q.get_device(),
               k.shape, k.stride(), k.dtype, k.get_device(),
               v.shape, v.stride(), v.dtype, v.get_device())
        if out is None:
            return key
        return key + (out.shape, out.stride(), out.dtype, out.get_device())
    if kind == _CUPY:
        key = (cls, cfg, softmax_scale, causal, return_lse,
               q.shape, q.strides, q.dtype, q.data.device_id,
               k.shape, k.strides, k.dtype, k.data.device_id,
               v.shape, v.strides, v.dtype, v.data.device_id)
        if out is None:
            return key
        return key + (out.shape, out.strides, out.dtype, out.data.device_id)
    return None


def lookup(key: tuple | None, q: Any, k: Any, v: Any, out: Any, stream: Any = None) -> Any:
    """Launch through the plan for `key` on `stream` (None: the caller's current stream) and
    return the output (a return_lse plan: (out, lse)), or None if there is no usable plan (then
    the caller takes the full path, which also reports any error)."""
    plan = _PLANS.get(key) if key is not None else None
    if plan is None or _TABLE.get_device() != plan.device:
        return None
    if stream is not None:
        stream = given_stream(stream, plan.device)
        if stream is None:
            return None
    is_torch = plan.is_torch
    if is_torch:
        q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
    else:
        q_ptr, k_ptr, v_ptr = q.data.ptr, k.data.ptr, v.data.ptr
    if out is not None:
        result = out
    elif is_torch:
        result = q.new_empty(plan.out_shape)  # q's dtype and device; cheaper than torch.empty(...)
    else:
        result = plan.allocate()
    o_ptr = result.data_ptr() if is_torch else result.data.ptr
    if (q_ptr | k_ptr | v_ptr | o_ptr) & 15:
        return None  # misaligned this time: the full path raises the proper error
    lse = None
    lse_ptr = 0
    if plan.lse_shape is not None:
        lse = plan.allocate_lse()
        lse_ptr = lse.data_ptr() if is_torch else lse.data.ptr
    if stream is None:
        stream = plan.current_stream()
    # Inline rather than a method: on this path every Python call frame is a visible share of
    # the per-call cost.
    with plan.lock:
        plan.write_pointers(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr)
        _TABLE.launch_kernel(*plan.launch_head, stream, plan.argv_ptr, 0)
    return result if lse is None else (result, lse)


def driver_calls() -> tuple[Callable[..., None], Callable[[], int]]:
    """(cuLaunchKernel, current device) as CuPy binds them: imported on the first remembered plan,
    so that importing a fast-path module costs nothing (every fast path shares this)."""
    from cupy_backends.cuda.api.driver import launchKernel
    from cupy.cuda.runtime import getDevice

    return launchKernel, getDevice


_TABLE = PlanTable()  # forward()'s plans
_PLANS = _TABLE.plans  # the same dict for the life of the process (clear() empties it in place)
remember = _TABLE.remember
clear = _TABLE.clear
