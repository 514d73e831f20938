"""Compile, cache and load the backward family's kernels; launch one backward call.

One (config, causal, deterministic) variant compiles into one module holding the kernels that
variant launches (preprocess, dK/dV, then dQ or convert), through the shared kernel cache, so the
registry and a GPU-less prewarm produce the same cache entry. Loaded modules are kept per device
in a thread-safe lazy map.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

from ...cache import CacheLookup, KernelCache, default_cache
from ...compiler import KernelResources
from .config import ROW_KERNEL_ROWS, BackwardKernelConfig
from .params import PARAMS_STRUCT
from .render import name_expressions, render_source, roles_for

__all__ = ["compile_variant", "BackwardKernels", "get_backward_kernels", "clear"]

_DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def variant_label(causal: bool, deterministic: bool) -> str:
    on = [name for name, flag in (("causal", causal), ("deterministic", deterministic)) if flag]
    return f" [{','.join(on)}]" if on else ""


def compile_variant(cfg: BackwardKernelConfig, arch: str, causal: bool = False, deterministic: bool = False,
                    cache: KernelCache | None = None) -> CacheLookup:
    """Compile (or fetch from the cache) the module of one variant of `cfg` for `arch`."""
    cache = cache if cache is not None else default_cache()
    names = name_expressions(cfg, causal, deterministic)
    return cache.lookup_or_compile(render_source(), list(names.values()), arch,
                                   short_forms=[cfg.short_form() + variant_label(causal, deterministic)])


@dataclass(eq=False)
class BackwardKernels:
    """The loaded kernels of one variant on one device, with their launch geometry."""

    cfg: BackwardKernelConfig
    causal: bool
    deterministic: bool
    device_id: int
    functions: dict[str, Any]        # role -> cupy Function (keeps its module alive)
    resources: dict[str, KernelResources | None]

    def __post_init__(self) -> None:
        self._buf = ctypes.create_string_buffer(PARAMS_STRUCT.size)
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._buf))
        self._argv_ptr = ctypes.addressof(self._argv)
        self._lock = threading.Lock()
        self._ptrs = {role: int(f.ptr) for role, f in self.functions.items()}

    def launch_all(self, params: bytes, batch: int, n_heads: int, n_kv_heads: int, seq_len_q_pad: int,
                   seq_len_k: int, seq_len_q: int, stream: int) -> None:
        """Launch the variant's kernels in order on `stream` with one parameter struct."""
        from cupy_backends.cuda.api.driver import launchKernel

        cfg = self.cfg
        row_grid = (seq_len_q_pad // ROW_KERNEL_ROWS, n_heads, batch)
        launches = [("preprocess", row_grid, 256, 0),
                    ("dkdv", (-(-seq_len_k // cfg.B_c), n_kv_heads, batch), cfg.n_threads, cfg.smem_bytes())]
        if self.deterministic:
            launches.append(("dq", (-(-seq_len_q // cfg.B_r), n_heads, batch), cfg.dq_threads, cfg.dq_smem_bytes()))
        else:
            launches.append(("convert", row_grid, 256, 0))
        with self._lock:  # the driver copies the parameters during each call
            ctypes.memmove(self._buf, params, PARAMS_STRUCT.size)
            for role, (gx, gy, gz), block, smem in launches:
                if not gx:  # no query rows: only the dK/dV kernel runs (and writes zeros)
                    continue
                launchKernel(self._ptrs[role], gx, gy, gz, block, 1, 1, smem, stream, self._argv_ptr, 0)


_lock = threading.Lock()
_loaded: dict[tuple, BackwardKernels] = {}
_key_locks: dict[tuple, threading.Lock] = {}


def get_backward_kernels(cfg: BackwardKernelConfig, device_id: int, causal: bool, deterministic: bool,
                         cache: KernelCache | None = None) -> BackwardKernels:
    """The loaded kernels of a variant on `device_id`, compiling/loading on first use."""
    key = (device_id, cfg, causal, deterministic)
    kernels = _loaded.get(key)
    if kernels is not None:
        return kernels
    with _lock:
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:
        kernels = _loaded.get(key)
        if kernels is None:
            kernels = _load(cfg, device_id, causal, deterministic, cache)
            with _lock:
                _loaded[key] = kernels
    return kernels


def _load(cfg: BackwardKernelConfig, device_id: int, causal: bool, deterministic: bool,
          cache: KernelCache | None) -> BackwardKernels:
    import cupy
    from cupy_backends.cuda.api import driver

    from ...device import device_arch

    arch, _ = device_arch(device_id)
    module = compile_variant(cfg, arch, causal, deterministic, cache).module
    names = name_expressions(cfg, causal, deterministic)
    image = module.binary
    if module.binary_kind == "ptx" and not image.endswith(b"\0"):
        image += b"\0"
    smem = {"dkdv": cfg.smem_bytes(), "dq": cfg.dq_smem_bytes()}
    functions: dict[str, Any] = {}
    with cupy.cuda.Device(device_id):
        cuda_module = cupy.cuda.function.Module()
        cuda_module.load(image)
        for role, expr in names.items():
            function = cuda_module.get_function(module.lowered_names[expr])
            need = smem.get(role, 0)
            if need > _DEFAULT_DYNAMIC_SMEM_LIMIT:
                limit = cupy.cuda.Device(device_id).attributes.get("MaxSharedMemoryPerBlockOptin", 0)
                if limit and need > limit:
                    raise ValueError(f"cfg: {cfg.short_form()} needs {need} bytes of shared memory for its "
                                     f"{role} kernel; device {device_id} allows {limit}")
                driver.funcSetAttribute(function.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, need)
            functions[role] = function
    return BackwardKernels(cfg, causal, deterministic, device_id, functions,
                           {role: module.resources.get(expr) for role, expr in names.items()})


def clear() -> None:
    with _lock:
        _loaded.clear()
        _key_locks.clear()
