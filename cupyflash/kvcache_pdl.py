"""Programmatic dependent launch (PDL) of forward_kvcache's combine kernel (sm_90+).

A decode step with several splits is two short kernels in a row (attention, combine); at batch
1 each runs a few microseconds, so the gap between the end of one grid and the start of the next
is a visible part of the step. Launched with the programmatic-stream-serialization attribute, a
kernel's grid may start while its predecessor still runs: the predecessor's CTAs execute
`griddepcontrol.launch_dependents` at their start, the dependent's CTAs execute
`griddepcontrol.wait` before touching memory, which returns once the predecessor has completed
and its writes are visible (kernels_cu/decode/decode_common.cuh). Launched without the attribute
(sm_80, or PDL unavailable) both instructions are no-ops, so the kernels are the same either way.

cuLaunchKernelEx is called through ctypes (CuPy exposes only cuLaunchKernel). If the driver
lacks it or rejects the first launch, PDL is turned off for the process and the launch is made
the ordinary way.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable

__all__ = ["PDLLaunch", "available", "disable"]

_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: an int id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_lock = threading.Lock()
_state: dict[str, object] = {}  # "fn": cuLaunchKernelEx, or "off": the reason PDL is off


def _launch_ex():
    """cuLaunchKernelEx, or None when PDL is off (CUPYFLASH_PDL=0, no such driver entry point)."""
    fn = _state.get("fn")
    if fn is not None or "off" in _state:
        return fn
    with _lock:
        if "fn" in _state or "off" in _state:
            return _state.get("fn")
        if os.environ.get("CUPYFLASH_PDL", "1") == "0":
            _state["off"] = "CUPYFLASH_PDL=0"
            return None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernelEx
        except (OSError, AttributeError) as exc:
            _state["off"] = f"no cuLaunchKernelEx: {exc}"
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _state["fn"] = fn
        return fn


def available() -> bool:
    return _launch_ex() is not None


def disable(reason: str) -> None:
    with _lock:
        _state.pop("fn", None)
        _state["off"] = reason


class PDLLaunch:
    """One kernel launched as a programmatic dependent of the kernel before it on the stream.

    Called like cupy_backends' launchKernel minus the leading launch geometry: (stream,
    kernel_params_address, extra=0). `fallback(stream, argv, extra)` makes the ordinary launch
    when PDL is off."""

    __slots__ = ("func", "config", "config_ptr", "attr", "fallback", "stream")

    def __init__(self, func: int, grid: tuple[int, int, int], block: int, smem: int,
                 fallback: Callable[[int, int], None]) -> None:
        self.func = func
        self.attr = _LaunchAttribute(_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, b"", 1)
        self.config = _LaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, smem, None,
                                    ctypes.pointer(self.attr), 1)
        self.config_ptr = ctypes.pointer(self.config)  # made once: ctypes passes it without converting
        self.stream = None                             # the stream config.hStream holds now
        self.fallback = fallback

    def __call__(self, stream: int, argv: int, extra: int = 0) -> None:
        fn = _state.get("fn") or _launch_ex()
        if fn is not None:
            if stream != self.stream:
                self.config.hStream = stream or None
                self.stream = stream
            rc = fn(self.config_ptr, self.func, argv, None)
            if rc == 0:
                return
            # the launch was rejected before anything was enqueued: launch it the ordinary way
            disable(f"cuLaunchKernelEx returned CUresult {rc}")
        self.fallback(stream, argv, extra)
