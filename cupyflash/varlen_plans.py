"""Per-signature launch plans: the per-call fast path of `forward_varlen`.

The first call with a given signature (array type; shapes, strides, dtypes and devices of q, k,
v, cu_seqlens_q/k and out; cfg, max_seqlen_q/k, softmax_scale, causal, return_lse) goes through
full validation and config choice; its launch is kept as a `VarlenLaunch` whose `pack` turns the
call's pointers into the kernel's parameter bytes (the mma.sync family patches the pointers into
a pre-packed struct; the Hopper family stores them into its TMA descriptors' address words).
Later calls read the pointers, check alignment, allocate the output (and lse) and launch.

Only PyTorch tensors and CuPy arrays take this path (on the caller's current stream, or on a
`stream=` given as an int handle or a CuPy / torch stream of the plan's device), and only without
lse= or the index check; everything else takes the full path. cupyflash.jax's
varlen forward makes a VarlenLaunch of its own while tracing (varlen.prepared_launch: no
allocators, no current-stream reader) and relaunches it with `replay` on XLA's buffers and
stream.
"""
from __future__ import annotations

from typing import Any, Callable

from .launch_plans import _TORCH, ParamBlock, PlanTable, _kind, _kinds, driver_calls, given_stream  # shared by every fast path

__all__ = ["VarlenLaunch", "signature", "lookup", "remember", "clear"]

class VarlenLaunch(ParamBlock):
    """One validated launch, replayable with new pointers."""

    __slots__ = ("head", "device", "out_shape", "lse_shape", "allocate", "allocate_lse", "current_stream", "pack")

    def __init__(self, head: tuple, device: int, params: bytes, out_shape: tuple[int, ...],
                 lse_shape: tuple[int, ...] | None, allocate: Callable[[], Any] | None,
                 allocate_lse: Callable[[], Any] | None, current_stream: Callable[[], int],
                 writer: Callable[[Any], Callable[[int, int, int, int, int, int, int], None]]) -> None:
        super().__init__(params)
        self.head = head                      # cuLaunchKernel's arguments up to the stream
        self.device = device
        self.out_shape = out_shape
        self.lse_shape = lse_shape            # None: the call returns no lse
        self.allocate = allocate              # CuPy: () -> output; torch: None (q.new_empty)
        self.allocate_lse = allocate_lse      # () -> a new lse array (with lse_shape)
        self.current_stream = current_stream  # () -> the caller's current stream handle
        self.pack = writer(self.buf)          # pack(q, k, v, o, lse, cu_q, cu_k): the pointers into buf

    def replay(self, stream: int, q: int, k: int, v: int, o: int, lse: int, cu_q: int, cu_k: int) -> None:
        """Launch on `stream` with these pointers (arrays laid out as the first call's; the caller
        checks alignment and holds the plan's device current)."""
        if _TABLE.launch_kernel is None:
            _TABLE.launch_kernel, _TABLE.get_device = driver_calls()
        with self.lock:
            self.pack(q, k, v, o, lse, cu_q, cu_k)
            _TABLE.launch_kernel(*self.head, stream, self.argv_ptr, 0)


def signature(cfg: Any, softmax_scale: Any, causal: Any, return_lse: bool, max_seqlen_q: Any, max_seqlen_k: Any,
              q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, out: Any) -> tuple | None:
    """The plan key, or None when these arguments cannot take the fast path (`return_lse` a bool:
    the caller has checked it)."""
    if not (cfg is None or type(cfg) is str) and not hasattr(cfg, "short_form"):
        return None
    if not (softmax_scale is None or type(softmax_scale) is float):
        return None
    if (causal is not True and causal is not False) or type(max_seqlen_q) is not int or type(max_seqlen_k) is not int:
        return None
    cls = type(q)
    kind = _kinds.get(cls) or _kind(cls)
    if not kind:
        return None
    key: list = [cls, cfg, softmax_scale, causal, return_lse, max_seqlen_q, max_seqlen_k]
    for x in (q, k, v, cu_q, cu_k, out):
        if x is None:
            key.append(None)
        elif type(x) is not cls:
            return None
        elif kind == _TORCH:
            key += (x.shape, x.stride(), x.dtype, x.get_device())
        else:
            key += (x.shape, x.strides, x.dtype, x.data.device_id)
    return tuple(key)


def lookup(key: tuple | None, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, out: Any, stream: Any = None) -> Any:
    """Launch through the plan for `key` on `stream` (None: the caller's current stream) and
    return the output (with its lse: (out, lse)), or None when there is no usable plan (the
    caller then takes the full path, which also reports any error)."""
    plan = _PLANS.get(key) if key is not None else None
    if plan is None or _TABLE.get_device() != plan.device:
        return None
    if stream is not None:
        stream = given_stream(stream, plan.device)
        if stream is None:
            return None
    lse = plan.allocate_lse() if plan.lse_shape is not None else None
    if plan.is_torch:
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        cq, ck = cu_q.data_ptr(), cu_k.data_ptr()
        result = out if out is not None else q.new_empty(plan.out_shape)
        o = result.data_ptr()
        lse_ptr = lse.data_ptr() if lse is not None else 0
    else:
        ptrs = (q.data.ptr, k.data.ptr, v.data.ptr)
        cq, ck = cu_q.data.ptr, cu_k.data.ptr
        result = out if out is not None else plan.allocate()
        o = result.data.ptr
        lse_ptr = lse.data.ptr if lse is not None else 0
    if (ptrs[0] | ptrs[1] | ptrs[2] | o) & 15 or (cq | ck) & 3:
        return None  # misaligned this time: the full path raises the proper error
    if stream is None:
        stream = plan.current_stream()
    with plan.lock:  # cuLaunchKernel copies the parameters before it returns
        plan.pack(*ptrs, o, lse_ptr, cq, ck)
        _TABLE.launch_kernel(*plan.head, stream, plan.argv_ptr, 0)
    return result if lse is None else (result, lse)


_TABLE = PlanTable()  # forward_varlen()'s plans
_PLANS = _TABLE.plans  # the same dict for the life of the process (clear() empties it in place)
remember = _TABLE.remember
clear = _TABLE.clear
