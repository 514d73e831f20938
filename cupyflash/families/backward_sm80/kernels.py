"""Launch one backward call: the variant's kernels from the registry, one parameter struct.

The registry compiles (or reads from the cache) one module per (config, variant) holding the roles
the variant launches, loads it per device and raises each kernel's shared-memory limit; this
module adds the launch sequence: preprocess, dK/dV, then dQ (deterministic) or convert.
"""
from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING

from ...launch_plans import PackedLaunch, argv_launcher
from . import BACKWARD_SM80, roles_for
from .config import BackwardKernelConfig
from .params import PARAMS_STRUCT, POINTER_FIELDS

if TYPE_CHECKING:
    from ...backward_validation import BackwardPlan

__all__ = ["BackwardLauncher", "get_launcher", "packed_launch", "clear"]


class BackwardLauncher:
    """The loaded kernels of one (config, causal, deterministic, varlen) on one device."""

    def __init__(self, cfg: BackwardKernelConfig, device_id: int, causal: bool, deterministic: bool,
                 varlen: bool = False) -> None:
        from ...registry import get_registry

        self.cfg = cfg
        self.device_id = device_id
        self.variant = BACKWARD_SM80.variant(causal=causal, deterministic=deterministic, varlen=varlen)
        kernels = get_registry().get_all(cfg, device_id, variant=self.variant)
        self.kernels = kernels  # role -> LoadedKernel (keeps the module alive)
        self._steps = [(role, kernels[role].func_ptr, BACKWARD_SM80.block_threads(cfg, role),
                        BACKWARD_SM80.smem_bytes(cfg, role)) for role in roles_for(deterministic)]
        self._buf = ctypes.create_string_buffer(PARAMS_STRUCT.size)
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._buf))
        self._argv_ptr = ctypes.addressof(self._argv)
        self._lock = threading.Lock()

    def launch(self, params: bytes, batch: int, n_heads: int, n_kv_heads: int, seq_len_q: int, seq_len_k: int,
               stream: int) -> None:
        """Launch the variant's kernels in order on `stream` (skipping empty grids). varlen:
        seq_len_q/k are max_seqlen_q/k, which size the grids."""
        from cupy_backends.cuda.api.driver import launchKernel

        if len(params) != PARAMS_STRUCT.size:
            raise ValueError(f"params: expected {PARAMS_STRUCT.size} bytes of BackwardParams, got {len(params)}")
        with self._lock:  # the driver copies the parameters during each call
            ctypes.memmove(self._buf, params, PARAMS_STRUCT.size)
            for role, func, block, smem in self._steps:
                gx, gy, gz = BACKWARD_SM80.grid(self.cfg, role, batch, n_heads, n_kv_heads, seq_len_q, seq_len_k)
                if gx:  # no query rows: only the dK/dV kernel runs (and writes zeros)
                    launchKernel(func, gx, gy, gz, block, 1, 1, smem, stream, self._argv_ptr, 0)


def packed_launch(plan: "BackwardPlan", tail: tuple[int, int] = (0, 0)) -> PackedLaunch:
    """The plan's launches (its kernels loaded now, its grids sized once) with BackwardParams packed
    once: a call stores its pointers (q, k, v, out, dout, lse, dq, dk, dv, dq_accum, lse2, dvec and
    a varlen plan's cu_seqlens_q/k) into the struct's leading words (params.POINTER_FIELDS); `tail`
    a varlen plan's (total_q, total_k) when the preprocess zeroes the outputs past the last
    sequence."""
    launcher = get_launcher(plan.cfg, plan.device, plan.causal, plan.deterministic, plan.varlen)
    count = len(POINTER_FIELDS) if plan.varlen else len(POINTER_FIELDS) - 2
    steps = []
    for role, _, block, smem in launcher._steps:
        grid = BACKWARD_SM80.grid(plan.cfg, role, plan.batch, plan.n_heads, plan.n_kv_heads, plan.seq_len_q,
                                  plan.seq_len_k)
        if grid[0]:  # as launch(): no query rows, only the dK/dV kernel
            steps.append((argv_launcher(launcher.kernels[role], grid, block, smem, False), 0))
    return PackedLaunch(plan.pack((0,) * 12, (0, 0), tail), (0,), tuple((i, i) for i in range(count)), steps)


_lock = threading.Lock()
_launchers: dict[tuple, BackwardLauncher] = {}


def get_launcher(cfg: BackwardKernelConfig, device_id: int, causal: bool, deterministic: bool,
                 varlen: bool = False) -> BackwardLauncher:
    key = (device_id, cfg, causal, deterministic, varlen)
    launcher = _launchers.get(key)
    if launcher is None:
        _check_smem(cfg, device_id)
        launcher = BackwardLauncher(cfg, device_id, causal, deterministic, varlen)  # the registry serialises loads
        with _lock:
            _launchers[key] = launcher
    return launcher


def _check_smem(cfg: BackwardKernelConfig, device_id: int) -> None:
    import cupy

    limit = cupy.cuda.Device(device_id).attributes.get("MaxSharedMemoryPerBlockOptin", 0)
    need = max(cfg.smem_bytes(), cfg.dq_smem_bytes())
    if limit and need > limit:
        raise ValueError(f"cfg: {cfg.short_form()} needs {need} bytes of shared memory per CTA; device "
                         f"{device_id} allows {limit}")


def clear() -> None:
    with _lock:
        _launchers.clear()
