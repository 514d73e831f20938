"""Programmatic dependent launches of the Hopper backward family's kernels (`pdl` configs).

The dK/dV kernel and the convert kernel of a pdl config are launched with the
programmatic-stream-serialization attribute (cuLaunchKernelEx through kvcache_pdl.PDLLaunch), so
each may start while the kernel before it on the stream still runs; the kernels order their
reads themselves (griddepcontrol.wait, or dq_early's per-block counters; kernels_cu/backward_sm90).
Where PDL is off (CUPYFLASH_PDL=0, a driver without cuLaunchKernelEx) the launch is the ordinary
one and the griddepcontrol instructions are no-ops.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Callable

from ...launch_plans import argv_launcher
from ...registry import LoadedKernel

__all__ = ["pdl_launcher"]


class _Launcher:
    """One (kernel, geometry)'s PDL launch with its own parameter buffer (cuLaunchKernelEx copies
    the arguments during the call, so the buffer is reusable once it returns)."""

    __slots__ = ("pdl", "buf", "argv", "argv_ptr", "size", "lock")

    def __init__(self, kernel: LoadedKernel, grid: tuple[int, int, int], block: int, smem: int) -> None:
        self.size = kernel.params_size
        self.buf = ctypes.create_string_buffer(self.size)
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.buf))
        self.argv_ptr = ctypes.addressof(self.argv)
        self.lock = threading.Lock()
        self.pdl = argv_launcher(kernel, grid, block, smem, True)


_lock = threading.Lock()
_launchers: dict[tuple, _Launcher] = {}
_MAX_LAUNCHERS = 4096  # one per (kernel, grid): a process cycling through more shapes rebuilds them


def _launcher(kernel: LoadedKernel, grid: tuple[int, int, int], block: int, smem: int) -> _Launcher:
    key = (kernel.func_ptr, grid, block, smem)
    launcher = _launchers.get(key)
    if launcher is None:
        with _lock:
            if len(_launchers) >= _MAX_LAUNCHERS:
                _launchers.clear()
            launcher = _launchers.setdefault(key, _Launcher(kernel, grid, block, smem))
    return launcher


def pdl_launcher(kernel: LoadedKernel, grid: tuple[int, int, int], block: int,
                 smem: int) -> Callable[[int, bytes], None]:
    """(stream_ptr, params) -> `kernel` launched as a programmatic dependent of the previous kernel
    on the stream, with its launcher looked up once (a plan keeps the function)."""
    launcher = _launcher(kernel, grid, block, smem)
    size = kernel.params_size

    def launch(stream_ptr: int, params: bytes) -> None:
        if len(params) != size:
            raise ValueError(f"params: expected {size} bytes of the packed parameter struct, got {len(params)}")
        with launcher.lock:
            ctypes.memmove(launcher.buf, params, size)
            launcher.pdl(stream_ptr, launcher.argv_ptr)

    return launch

