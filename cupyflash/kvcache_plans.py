"""Per-signature launch plans: the per-call fast path of `forward_kvcache`.

The first call with a given signature (array type; shapes, strides, dtypes and devices of every
array argument; cfg, num_splits, softmax_scale, causal) goes through full validation; its launches
are kept with every parameter but the pointers already packed. Later calls with the same
signature read the pointers, check their alignment, allocate the output (and the split
workspace) and launch: no views, no validation, no config lookup, no split heuristic.

Only PyTorch tensors and CuPy arrays take this path (on the caller's current stream, or on a
`stream=` given as an int handle or a CuPy / torch stream of the plan's device), and only without
workspace= or the index check; everything else takes the full path.
"""
from __future__ import annotations

import functools
import struct
from typing import Any, Callable

from .families.decode.config import DecodeKernelConfig
from .launch_plans import (_CUPY, _TORCH, ParamBlock, PlanTable, _kind, _kinds, cupy_meta,  # shared by every fast path
                           driver_calls, given_stream, torch_meta)
from .families.decode.params import DECODE_PARAMS

__all__ = ["KVCacheLaunch", "build_launches", "run", "remember", "clear"]

# q, k_cache, v_cache, k_new, v_new, o, lse, ws_o, ws_lse, cache_seqlens, block_table: the first
# eleven DecodeParams fields
_POINTERS = struct.Struct("<11Q")

def build_launches(heads: list[tuple], pdl: bool) -> list[Callable[[int, int, int], None]]:
    """One callable (stream, kernel_params_address, 0) per kernel from cuLaunchKernel's leading
    arguments (function, grid, block, shared memory). With `pdl`, every kernel after the first
    is launched as a programmatic dependent of the one before it (cupyflash.kvcache_pdl)."""
    from .kvcache_pdl import PDLLaunch

    launch_kernel, _ = driver_calls()
    out: list[Callable[[int, int, int], None]] = []
    for i, head in enumerate(heads):
        plain = functools.partial(launch_kernel, *head)
        if pdl and i > 0:
            func, gx, gy, gz, bx, _, _, smem = head
            out.append(PDLLaunch(func, (gx, gy, gz), bx, smem, plain))
        else:
            out.append(plain)
    return out


class KVCacheLaunch(ParamBlock):
    """The validated launches of one signature, replayable with new pointers."""

    __slots__ = ("launches", "device", "out_shape", "lse_shape", "ws_bytes", "ws_lse_offset", "allocate",
                 "ws_alloc", "ws_free", "allocate_lse", "current_stream")

    def __init__(self, launches: list[Callable[[int, int, int], None]], device: int, params: bytes,
                 out_shape: tuple[int, ...], ws_bytes: int, ws_lse_offset: int, allocate: Callable[[], Any] | None,
                 ws_alloc: Callable[[int, int], Any] | None, ws_free: Callable[[Any], None] | None,
                 current_stream: Callable[[], int], lse_shape: tuple[int, ...] | None = None,
                 allocate_lse: Callable[[], Any] | None = None) -> None:
        super().__init__(params, DECODE_PARAMS.size)
        self.launches = launches            # per kernel: (stream, argv address, 0) -> launch (build_launches)
        self.device = device
        self.out_shape = out_shape
        self.lse_shape = lse_shape          # (batch, n_heads, seq_q) with return_lse, else None
        self.allocate_lse = allocate_lse    # () -> a new lse array (with return_lse)
        self.ws_bytes = ws_bytes            # split workspace bytes (0: one split)
        self.ws_lse_offset = ws_lse_offset  # bytes from ws_o to ws_lse
        self.allocate = allocate            # CuPy: () -> output; torch: None (q.new_empty)
        # split workspace: ws_alloc(nbytes, stream) -> handle, an int pointer (torch: the caching
        # allocator's raw blocks, no tensor object) or an object with .ptr (CuPy's pool), ordered
        # on `stream`; ws_free(handle) after the launches are enqueued (both allocators reuse a
        # block in stream order)
        self.ws_alloc = ws_alloc
        self.ws_free = ws_free
        self.current_stream = current_stream

    def run(self, stream: int) -> None:
        """Launch every kernel on `stream` with the parameters as packed now."""
        with self.lock:
            for launch in self.launches:
                launch(stream, self.argv_ptr, 0)


def run(cfg: Any, num_splits: Any, softmax_scale: Any, causal: Any, return_lse: Any, q: Any, k_cache: Any,
        v_cache: Any, cache_seqlens: Any, block_table: Any, k_new: Any, v_new: Any, out: Any,
        stream: Any = None) -> tuple:
    """(key, result) of one call: `key` the plan key of these arguments (None when they cannot take
    the fast path); `result` the output (with return_lse: (output, lse)) when a plan for `key`
    launched it on `stream` (None: the caller's current stream), else None (no plan yet, a stream
    given_stream cannot read, or a pointer that breaks an alignment rule this time: the full path
    then raises the proper error, and remembers its launches under `key`).

    Key and launch in one function, the key written out per framework: on a cached call the
    tensor attribute reads, call frames and the key's hash are most of the library's host time."""
    if not (cfg is None or type(cfg) is str or type(cfg) is DecodeKernelConfig):
        return None, None
    if not (num_splits is None or type(num_splits) is int):
        return None, None
    if not (softmax_scale is None or type(softmax_scale) is float):
        return None, None
    if (causal is not True and causal is not False) or (return_lse is not True and return_lse is not False):
        return None, None
    cls = type(q)
    if type(k_cache) is not cls or type(v_cache) is not cls or type(cache_seqlens) is not cls:
        return None, None
    if not ((block_table is None or type(block_table) is cls) and (k_new is None or type(k_new) is cls)
            and (v_new is None or type(v_new) is cls) and (out is None or type(out) is cls)):
        return None, None
    kind = _kinds.get(cls) or _kind(cls)
    if kind == _TORCH:
        key = (cls, cfg, num_splits, softmax_scale, causal, return_lse,
               q.shape, q.stride(), q.dtype, q.get_device(),
               k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.get_device(),
               v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.get_device(),
               cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.get_device(),
               None if block_table is None else torch_meta(block_table),
               None if k_new is None else torch_meta(k_new),
               None if v_new is None else torch_meta(v_new),
               None if out is None else torch_meta(out))
        plan = _PLANS.get(key)
        if plan is None or _TABLE.get_device() != plan.device:
            return key, None
        if stream is not None and given_stream(stream, plan.device) is None:
            return key, None
        q_ptr, k_ptr, v_ptr, s_ptr = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cache_seqlens.data_ptr()
        t_ptr = block_table.data_ptr() if block_table is not None else 0
        kn_ptr = k_new.data_ptr() if k_new is not None else 0
        vn_ptr = v_new.data_ptr() if v_new is not None else 0
        o_ptr = out.data_ptr() if out is not None else 0
        if (q_ptr | k_ptr | v_ptr | kn_ptr | vn_ptr | o_ptr) & 15 or (s_ptr | t_ptr) & 3:
            return key, None
        if out is None:
            out = q.new_empty(plan.out_shape)
            o_ptr = out.data_ptr()
        lse = plan.allocate_lse() if plan.lse_shape is not None else None
        lse_ptr = lse.data_ptr() if lse is not None else 0
    elif kind == _CUPY:
        key = (cls, cfg, num_splits, softmax_scale, causal, return_lse,
               cupy_meta(q), cupy_meta(k_cache), cupy_meta(v_cache), cupy_meta(cache_seqlens),
               None if block_table is None else cupy_meta(block_table),
               None if k_new is None else cupy_meta(k_new),
               None if v_new is None else cupy_meta(v_new),
               None if out is None else cupy_meta(out))
        plan = _PLANS.get(key)
        if plan is None or _TABLE.get_device() != plan.device:
            return key, None
        if stream is not None and given_stream(stream, plan.device) is None:
            return key, None
        q_ptr, k_ptr, v_ptr, s_ptr = q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, cache_seqlens.data.ptr
        t_ptr = block_table.data.ptr if block_table is not None else 0
        kn_ptr = k_new.data.ptr if k_new is not None else 0
        vn_ptr = v_new.data.ptr if v_new is not None else 0
        o_ptr = out.data.ptr if out is not None else 0
        if (q_ptr | k_ptr | v_ptr | kn_ptr | vn_ptr | o_ptr) & 15 or (s_ptr | t_ptr) & 3:
            return key, None
        if out is None:
            out = plan.allocate()
            o_ptr = out.data.ptr
        lse = plan.allocate_lse() if plan.lse_shape is not None else None
        lse_ptr = lse.data.ptr if lse is not None else 0
    else:
        return None, None
    stream = plan.current_stream() if stream is None else given_stream(stream, plan.device)
    if plan.ws_bytes:
        ws = plan.ws_alloc(plan.ws_bytes, stream)
        ws_ptr = ws if type(ws) is int else ws.ptr
        try:
            with plan.lock:
                _POINTERS.pack_into(plan.buf, 0, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, o_ptr, lse_ptr, ws_ptr,
                                    ws_ptr + plan.ws_lse_offset, s_ptr, t_ptr)
                for launch in plan.launches:
                    launch(stream, plan.argv_ptr, 0)
        finally:
            plan.ws_free(ws)
    else:
        with plan.lock:
            _POINTERS.pack_into(plan.buf, 0, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, o_ptr, lse_ptr, 0, 0, s_ptr, t_ptr)
            for launch in plan.launches:
                launch(stream, plan.argv_ptr, 0)
    return key, (out if lse is None else (out, lse))




_TABLE = PlanTable()  # forward_kvcache()'s plans
_PLANS = _TABLE.plans  # the same dict for the life of the process (clear() empties it in place)
remember = _TABLE.remember
clear = _TABLE.clear
