"""Lazy, thread-safe map (device, config) -> loaded kernel function, filled through the kernel cache.

Each config is compiled as its own module (one name expression), so the cache entry for
(config, arch) is the same whether the prewarm script or a run-time miss produced it.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any

from .cache import CacheLookup, KernelCache, default_cache
from .compiler import CompiledModule, KernelResources
from .config import FlashForwardKernelConfig
from .kernel_abi import PARAMS_STRUCT
from .render import name_expression, render_source

__all__ = ["LoadedKernel", "KernelRegistry", "get_registry", "compile_config", "config_cache_key", "DEFAULT_DYNAMIC_SMEM_LIMIT"]

# Above this, CUDA requires opting in per function (cudaFuncAttributeMaxDynamicSharedMemorySize).
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def compile_config(cfg: FlashForwardKernelConfig, arch: str, cache: KernelCache | None = None,
                   causal: bool = False) -> CacheLookup:
    """Compile (or fetch from `cache`) the single-kernel module for `cfg` (its causal or
    non-causal instantiation) on `arch`.

    The one definition of how a config becomes a cache entry; the registry and the prewarm both
    call it, so their cache keys are identical.
    """
    cache = cache if cache is not None else default_cache()
    return cache.lookup_or_compile(render_source([cfg]), [name_expression(cfg, causal)], arch,
                                   short_forms=[cfg.short_form() + (" [causal]" if causal else "")])


def config_cache_key(cfg: FlashForwardKernelConfig, arch: str, causal: bool = False) -> str:
    """The cache key `compile_config(cfg, arch, causal=causal)` reads and writes."""
    return KernelCache.key(render_source([cfg]), [name_expression(cfg, causal)], arch)


@dataclass(eq=False)
class LoadedKernel:
    """A kernel function loaded on one device, ready to launch with packed `ForwardParams` bytes."""

    cfg: FlashForwardKernelConfig
    device_id: int
    arch: str
    function: Any  # cupy.cuda.function.Function; keeps its Module (and so the code) alive
    resources: KernelResources | None
    lowered_name: str
    # Launch state, preallocated once: cuLaunchKernel takes an array of pointers to arguments;
    # the kernel's single argument is ForwardParams by value, so argv[0] points at a buffer
    # holding the packed struct. The driver copies the arguments during the call, so the buffer
    # may be reused as soon as launchKernel returns; the lock keeps threads from interleaving.
    _func_ptr: int = field(init=False, repr=False)
    _params_buf: Any = field(init=False, repr=False)
    _argv: Any = field(init=False, repr=False)
    _argv_ptr: int = field(init=False, repr=False)
    _launch_lock: threading.Lock = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._func_ptr = int(self.function.ptr)
        self._params_buf = ctypes.create_string_buffer(PARAMS_STRUCT.size)
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._params_buf))
        self._argv_ptr = ctypes.addressof(self._argv)
        self._launch_lock = threading.Lock()

    @property
    def func_ptr(self) -> int:
        """The CUfunction handle (for launch_plans, which keeps its own parameter buffer)."""
        return self._func_ptr

    def launch(self, grid: tuple[int, int, int], block: int, smem_bytes: int, stream_ptr: int,
               params: bytes) -> None:
        """Launch on `stream_ptr` (0 = legacy default stream) with `params` from `kernel_abi.pack_params`."""
        if len(params) != PARAMS_STRUCT.size:
            raise ValueError(f"params: expected {PARAMS_STRUCT.size} bytes of packed ForwardParams, got {len(params)}")
        gx, gy, gz = grid
        with self._launch_lock:
            ctypes.memmove(self._params_buf, params, PARAMS_STRUCT.size)
            _launch_kernel(self._func_ptr, gx, gy, gz, block, 1, 1, smem_bytes, stream_ptr, self._argv_ptr, 0)


def _launch_kernel(*args: int) -> None:
    # Bound on first use so importing this module never touches the CUDA driver bindings.
    global _launch_kernel
    from cupy_backends.cuda.api.driver import launchKernel

    _launch_kernel = launchKernel
    launchKernel(*args)


class KernelRegistry:
    """Thread-safe lazy map (device_id, cfg) -> LoadedKernel.

    A miss renders, compiles through the cache (or reads the cache entry), loads the binary on that
    device and raises its dynamic shared memory limit when needed. Different keys load in parallel;
    threads asking for the same key wait for one load.
    """

    def __init__(self, cache: KernelCache | None = None) -> None:
        self._cache = cache  # None = the process default, resolved at each miss
        self._kernels: dict[tuple[int, FlashForwardKernelConfig], LoadedKernel] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[tuple[int, FlashForwardKernelConfig], threading.Lock] = {}

    @property
    def cache(self) -> KernelCache:
        return self._cache if self._cache is not None else default_cache()

    def get(self, cfg: FlashForwardKernelConfig, device_id: int | None = None, causal: bool = False) -> LoadedKernel:
        """The kernel for `cfg` (causal or not) on `device_id` (default: CuPy's current device),
        loading it on first use."""
        if device_id is None:
            import cupy

            device_id = cupy.cuda.runtime.getDevice()
        key = (device_id, cfg, bool(causal))
        kernel = self._kernels.get(key)  # lock-free fast path: dict reads are atomic under the GIL
        if kernel is not None:
            return kernel
        if not isinstance(cfg, FlashForwardKernelConfig):
            raise TypeError(f"cfg: expected FlashForwardKernelConfig, got {type(cfg).__name__}")
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            kernel = self._kernels.get(key)
            if kernel is None:
                kernel = self._load(cfg, device_id, bool(causal))
                with self._lock:
                    self._kernels[key] = kernel
        return kernel

    def loaded(self) -> list[tuple[int, FlashForwardKernelConfig, bool]]:
        """(device_id, cfg, causal) keys loaded so far."""
        with self._lock:
            return list(self._kernels)

    def clear(self) -> None:
        """Forget loaded kernels (their modules unload once no LoadedKernel references them)."""
        with self._lock:
            self._kernels.clear()
            self._key_locks.clear()

    def _load(self, cfg: FlashForwardKernelConfig, device_id: int, causal: bool) -> LoadedKernel:
        import cupy
        from cupy_backends.cuda.api import driver

        from .device import device_arch

        arch, _ = device_arch(device_id)
        module: CompiledModule = compile_config(cfg, arch, self.cache, causal).module
        expr = name_expression(cfg, causal)
        lowered = module.lowered_names[expr]
        image = module.binary
        if module.binary_kind == "ptx" and not image.endswith(b"\0"):
            image += b"\0"  # cuModuleLoadData reads PTX as a NUL-terminated string
        with cupy.cuda.Device(device_id):
            cuda_module = cupy.cuda.function.Module()
            cuda_module.load(image)
            function = cuda_module.get_function(lowered)
            smem = cfg.smem_bytes()
            if smem > DEFAULT_DYNAMIC_SMEM_LIMIT:
                driver.funcSetAttribute(function.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        return LoadedKernel(cfg=cfg, device_id=device_id, arch=arch, function=function,
                            resources=module.resources.get(expr), lowered_name=lowered)


_registry_lock = threading.Lock()
_registry: KernelRegistry | None = None


def get_registry() -> KernelRegistry:
    """The process-wide registry (uses the default cache)."""
    global _registry
    if _registry is None:
        with _registry_lock:
            if _registry is None:
                _registry = KernelRegistry()
    return _registry
