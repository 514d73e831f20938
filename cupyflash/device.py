"""GPU presence and per-device compile target: the one place that asks CUDA what hardware exists.

Importing CuPy works without a driver; only runtime calls fail (CUDARuntimeError, e.g.
cudaErrorInsufficientDriver or cudaErrorNoDevice). These helpers turn that into a bool or a
clear error, so callers never see a raw CUDA error for "there is no GPU here".
"""
from __future__ import annotations

import functools
import threading
import warnings

from .compiler import BinaryKind, nvrtc_version, supported_archs

__all__ = ["device_count", "has_gpu", "require_gpu", "compute_capability", "device_arch", "MIN_COMPUTE_CAPABILITY"]

# mma.sync m16n8k16 with bf16, cp.async and ldmatrix all need Ampere (8.0) or newer.
MIN_COMPUTE_CAPABILITY = 80


def device_count() -> int:
    """Number of visible CUDA devices; 0 when there is no driver or no device."""
    import cupy
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except CUDARuntimeError:
        return 0


def has_gpu() -> bool:
    """True when at least one CUDA device can be used."""
    return device_count() > 0


def require_gpu() -> None:
    """Raise RuntimeError with a clear message when no CUDA device is usable."""
    if not has_gpu():
        raise RuntimeError(
            "cupyflash needs an NVIDIA GPU (compute capability 8.0 or newer) with a working driver, "
            "and none was found (cupy.cuda.runtime.getDeviceCount() failed or returned 0). "
            "Compiling and prewarming kernels works without a GPU: `python -m cupyflash prewarm`."
        )


def compute_capability(device_id: int) -> int:
    """Compute capability of `device_id` as an int, e.g. 90 for an H100."""
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


_warn_lock = threading.Lock()
_warned_ptx: set[int] = set()


def device_arch(device_id: int) -> tuple[str, BinaryKind]:
    """The compile target for `device_id`: ('sm_XY', 'cubin') when NVRTC knows the device's arch,
    else ('compute_XY', 'ptx') for the highest supported arch below it, which the driver JITs
    (warned once per compute capability, since the PTX path costs a driver compile and may be slower).
    """
    return _arch_for_capability(compute_capability(device_id))


@functools.cache
def _arch_for_capability(cc: int) -> tuple[str, BinaryKind]:
    archs = supported_archs()
    if cc in archs:
        return f"sm_{cc}", "cubin"
    below = [a for a in archs if a <= cc]
    if not below:
        raise RuntimeError(
            f"NVRTC {'.'.join(map(str, nvrtc_version()))} cannot target compute capability {cc // 10}.{cc % 10} "
            f"(supported: {', '.join(f'sm_{a}' for a in archs)})"
        )
    fallback = max(below)
    with _warn_lock:
        if cc not in _warned_ptx:
            _warned_ptx.add(cc)
            warnings.warn(
                f"NVRTC {'.'.join(map(str, nvrtc_version()))} does not support sm_{cc}; compiling PTX for "
                f"compute_{fallback} and letting the driver JIT it. Install a newer NVRTC for native code.",
                RuntimeWarning, stacklevel=3,
            )
    return f"compute_{fallback}", "ptx"
