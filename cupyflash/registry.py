"""Lazy, thread-safe map (device, config, variant) -> loaded kernels, filled through the kernel cache.

Works for every kernel family: the config's type names its family (cupyflash.families), which says
how the config renders, which kernels (roles) it instantiates, which archs it compiles for and how
much shared memory a CTA takes. Each (config, variant) is compiled as its own module holding every
role's kernel, so the cache entry for (family, config, variant, arch) is the same whether the
prewarm or a run-time miss produced it.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any

from .cache import CacheLookup, KernelCache, default_cache
from .compiler import CompiledModule, KernelResources
from .config import KernelConfig
from .families import KernelFamily, Variant, family_of
from .render import render_family_source

__all__ = ["LoadedKernel", "KernelRegistry", "get_registry", "compile_config", "config_cache_key",
           "DEFAULT_DYNAMIC_SMEM_LIMIT"]

# Above this, CUDA requires opting in per function (cudaFuncAttributeMaxDynamicSharedMemorySize).
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _variant(family: KernelFamily, variant: Variant | None, causal: bool | None) -> Variant:
    """`variant`, or the family's variant with only `causal` set (the forward families' shorthand)."""
    if variant is not None:
        return family.check_variant(variant)
    return family.variant(causal=True) if causal else family.default_variant()


def _module_request(cfg: KernelConfig, arch: str, variant: Variant) -> tuple[KernelFamily, str, list[str], str]:
    family = family_of(cfg)
    family.check_arch(arch)
    names = list(family.name_expressions(cfg, variant).values())
    label = cfg.short_form() + family.variant_label(variant)
    return family, render_family_source(family.name), names, label


def compile_config(cfg: KernelConfig, arch: str, cache: KernelCache | None = None, causal: bool = False, *,
                   variant: Variant | None = None) -> CacheLookup:
    """Compile (or fetch from `cache`) the module of `cfg` for one variant (default: the family's
    plain one, or its causal one with causal=True) on `arch`.

    The one definition of how a config becomes a cache entry; the registry and the prewarm both
    call it, so their cache keys are identical.
    """
    cache = cache if cache is not None else default_cache()
    family, source, names, label = _module_request(cfg, arch, _variant(family_of(cfg), variant, causal))
    return cache.lookup_or_compile(source, names, arch, short_forms=[label], family=family.name)


def config_cache_key(cfg: KernelConfig, arch: str, causal: bool = False, *, variant: Variant | None = None) -> str:
    """The cache key `compile_config(cfg, arch, ...)` reads and writes."""
    family, source, names, _ = _module_request(cfg, arch, _variant(family_of(cfg), variant, causal))
    return KernelCache.key(source, names, arch, family=family.name)


@dataclass(eq=False)
class LoadedKernel:
    """A kernel function loaded on one device, ready to launch with its packed parameter struct."""

    cfg: KernelConfig
    device_id: int
    arch: str
    function: Any  # cupy.cuda.function.Function; keeps its Module (and so the code) alive
    resources: KernelResources | None
    lowered_name: str
    params_size: int  # bytes of the kernel's parameter struct
    role: str = ""
    # Launch state, preallocated once: cuLaunchKernel takes an array of pointers to arguments;
    # the kernel's single argument is its parameter struct by value, so argv[0] points at a buffer
    # holding the packed struct. The driver copies the arguments during the call, so the buffer
    # may be reused as soon as launchKernel returns; the lock keeps threads from interleaving.
    _func_ptr: int = field(init=False, repr=False)
    _params_buf: Any = field(init=False, repr=False)
    _argv: Any = field(init=False, repr=False)
    _argv_ptr: int = field(init=False, repr=False)
    _launch_lock: threading.Lock = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._func_ptr = int(self.function.ptr)
        self._params_buf = ctypes.create_string_buffer(self.params_size)
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._params_buf))
        self._argv_ptr = ctypes.addressof(self._argv)
        self._launch_lock = threading.Lock()

    @property
    def func_ptr(self) -> int:
        """The CUfunction handle (for launch_plans, which keeps its own parameter buffer)."""
        return self._func_ptr

    def launch(self, grid: tuple[int, int, int], block: int, smem_bytes: int, stream_ptr: int,
               params: bytes) -> None:
        """Launch on `stream_ptr` (0 = legacy default stream) with `params`, the packed parameter
        struct (`ParamStruct.pack`)."""
        if len(params) != self.params_size:
            raise ValueError(f"params: expected {self.params_size} bytes of the packed parameter struct, "
                             f"got {len(params)}")
        gx, gy, gz = grid
        with self._launch_lock:
            ctypes.memmove(self._params_buf, params, self.params_size)
            _launch_kernel(self._func_ptr, gx, gy, gz, block, 1, 1, smem_bytes, stream_ptr, self._argv_ptr, 0)


def _launch_kernel(*args: int) -> None:
    # Bound on first use so importing this module never touches the CUDA driver bindings.
    global _launch_kernel
    from cupy_backends.cuda.api.driver import launchKernel

    _launch_kernel = launchKernel
    launchKernel(*args)


class KernelRegistry:
    """Thread-safe lazy map (device_id, cfg, variant) -> {role: LoadedKernel}.

    A miss renders, compiles through the cache (or reads the cache entry), loads the binary on that
    device and raises each kernel's dynamic shared memory limit when needed. Different keys load in
    parallel; threads asking for the same key wait for one load.
    """

    def __init__(self, cache: KernelCache | None = None) -> None:
        self._cache = cache  # None = the process default, resolved at each miss
        self._kernels: dict[tuple[int, KernelConfig, Variant], dict[str, LoadedKernel]] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[tuple[int, KernelConfig, Variant], threading.Lock] = {}

    @property
    def cache(self) -> KernelCache:
        return self._cache if self._cache is not None else default_cache()

    def get(self, cfg: KernelConfig, device_id: int | None = None, causal: bool = False, *,
            variant: Variant | None = None, role: str | None = None) -> LoadedKernel:
        """The kernel `role` (default: the family's first) of `cfg` for `variant` (default: the
        plain one, or the causal one with causal=True) on `device_id` (default: CuPy's current
        device), loading the module on first use."""
        return self.get_all(cfg, device_id, causal, variant=variant)[role or family_of(cfg).roles[0].role]

    def get_all(self, cfg: KernelConfig, device_id: int | None = None, causal: bool = False, *,
                variant: Variant | None = None) -> dict[str, LoadedKernel]:
        """Every role's kernel of `cfg` for one variant on `device_id`, as {role: LoadedKernel}."""
        if device_id is None:
            import cupy

            device_id = cupy.cuda.runtime.getDevice()
        full_variant = _variant(family_of(cfg), variant, causal)  # TypeError for a non-config
        key = (device_id, cfg, full_variant)
        kernels = self._kernels.get(key)  # lock-free fast path: dict reads are atomic under the GIL
        if kernels is not None:
            return kernels
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            kernels = self._kernels.get(key)
            if kernels is None:
                kernels = self._load(cfg, device_id, full_variant)
                with self._lock:
                    self._kernels[key] = kernels
        return kernels

    def loaded(self) -> list[tuple[int, KernelConfig, Variant]]:
        """(device_id, cfg, variant) keys loaded so far."""
        with self._lock:
            return list(self._kernels)

    def clear(self) -> None:
        """Forget loaded kernels (their modules unload once no LoadedKernel references them)."""
        with self._lock:
            self._kernels.clear()
            self._key_locks.clear()

    def _load(self, cfg: KernelConfig, device_id: int, variant: Variant) -> dict[str, LoadedKernel]:
        import cupy
        from cupy_backends.cuda.api import driver

        family = family_of(cfg)
        arch = family.arch_for_device(device_id)
        module: CompiledModule = compile_config(cfg, arch, self.cache, variant=variant).module
        image = module.binary
        if module.binary_kind == "ptx" and not image.endswith(b"\0"):
            image += b"\0"  # cuModuleLoadData reads PTX as a NUL-terminated string
        out: dict[str, LoadedKernel] = {}
        with cupy.cuda.Device(device_id):
            cuda_module = cupy.cuda.function.Module()
            cuda_module.load(image)
            for role, expr in family.name_expressions(cfg, variant).items():
                lowered = module.lowered_names[expr]
                function = cuda_module.get_function(lowered)
                smem = family.smem_bytes(cfg, role)
                if smem > DEFAULT_DYNAMIC_SMEM_LIMIT:
                    driver.funcSetAttribute(function.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
                out[role] = LoadedKernel(cfg=cfg, device_id=device_id, arch=arch, function=function,
                                         resources=module.resources.get(expr), lowered_name=lowered,
                                         params_size=family.role(role).params.size, role=role)
        return out


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
