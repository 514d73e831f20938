"""Per-signature replays: the per-call fast path of `backward` with cfg=None.

The first call with a given signature (array type; shapes, strides, dtypes and devices of dout,
q, k, v, out and lse; causal, softmax_scale, deterministic) goes through full validation, the
family choice (`hopper_reason`) and the config choice; its `BackwardPlan` is kept. Later calls
with the same signature read the six pointers, check their alignment, allocate dq/dk/dv and one
fp32 workspace block (`workspace_layout`), store the pointers into parameter blocks packed when
the replay was kept (`BackwardReplay.prepare`) and launch: no views, no validation, no config
lookup, no packing. On a tiny problem that is most of a call's host time (NOTES.md items 83, 268).

Only PyTorch tensors and CuPy arrays take this path (on the caller's current stream, or on a
`stream=` given as an int handle or a CuPy / torch stream of the plan's device: the workspace is
then allocated in that stream's order), without cfg, and with all of dq/dk/dv given (their
layouts then part of the signature) or none; everything else takes the full path.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

from .backward_validation import BackwardPlan
from .families.backward_sm90.config import HopperBackwardKernelConfig
from .interop import stream_scratch_f32
from .launch_plans import _TORCH, PlanTable, _kind, current_stream_reader, given_stream, meta_reader

__all__ = ["BackwardReplay", "WorkspaceLayout", "workspace_layout", "signature", "run", "remember", "clear"]

_ALIGN = 256  # bytes between the workspace's three arrays (lse2, dvec, dq_accum)


class WorkspaceLayout(NamedTuple):
    """Where a plan's fp32 workspaces lie in one block: byte offsets of lse2, dvec and dq_accum
    (with the Hopper family's counters behind it; -1: none, deterministic), 256-byte aligned, and
    the block's size in floats."""

    lse2: int
    dvec: int
    acc: int
    floats: int

    def pointers(self, base: int) -> tuple[int, int, int]:
        """(dq_accum, lse2, dvec) pointers in a block at `base` (dq_accum 0 when there is none)."""
        return (base + self.acc if self.acc >= 0 else 0), base + self.lse2, base + self.dvec


def workspace_layout(plan: BackwardPlan) -> WorkspaceLayout:
    """The plan's workspaces in one block: lse2 and dvec (plan.stats_shape) and, unless
    deterministic, dq_accum (backward_sm90: launch.dq_workspace_shape, its counters included)."""
    align = lambda nbytes: -(-nbytes // _ALIGN) * _ALIGN  # noqa: E731
    stats = align(4 * math.prod(plan.stats_shape))
    if plan.deterministic:
        return WorkspaceLayout(0, stats, -1, 2 * stats // 4)
    if isinstance(plan.cfg, HopperBackwardKernelConfig):
        from .families.backward_sm90.launch import dq_workspace_shape

        acc_shape = dq_workspace_shape(plan)
    else:
        acc_shape = plan.dq_accum_shape
    return WorkspaceLayout(0, stats, 2 * stats, (2 * stats + align(4 * math.prod(acc_shape))) // 4)


class BackwardReplay:
    """One signature's validated plan and what a call needs besides its six pointers."""

    __slots__ = ("plan", "device", "is_torch", "raw_dtype", "q_shape", "kv_shape", "shapes", "strides", "layout", "launch", "packed", "current_stream", "allocate", "allocate_ws", "ws_dtype")

    def __init__(self, plan: BackwardPlan, q: Any, k: Any, v: Any, dout: Any) -> None:
        self.plan = plan
        self.device = plan.device
        self.is_torch = False
        self.raw_dtype = q.raw_dtype  # the framework's dtype object of q (and of dq, dk, dv)
        self.q_shape = tuple(q.shape)
        self.kv_shape = tuple(k.shape)
        # q, k, v, dout as pack_dkdv reads them (the Hopper family's TMA descriptors)
        self.shapes = tuple(tuple(x.shape) for x in (q, k, v, dout))
        self.strides = tuple(tuple(x.strides) for x in (q, k, v, dout))
        self.layout = workspace_layout(plan)
        self.launch = _launcher(plan)
        # the parameter blocks packed once (prepare(); a PackedLaunch), None: pack per call
        self.packed: Any = None
        # set by remember() for replays: the caller's current stream, and the allocators (CuPy:
        # allocate/allocate_ws; torch: q.new_empty with ws_dtype for the workspace)
        self.current_stream: Callable[[], int] | None = None
        self.allocate: Callable[[tuple[int, ...]], Any] | None = None
        self.allocate_ws: Callable[[int], Any] | None = None
        self.ws_dtype: Any = None

    @property
    def ws_floats(self) -> int:
        """Size of the workspace block `run` takes, in floats."""
        return self.layout.floats

    def prepare(self) -> None:
        """Compile and load the plan's kernels and resolve its launches now, so that a run only
        stores pointers and launches: the parameter blocks are packed once here, with the words a
        run stores its pointers into (backward_sm90.launch.packed_launch: both structs, TMA
        descriptors included, where the driver's descriptor format shows the addresses, else each
        run packs them; backward_sm80.kernels.packed_launch: BackwardParams' leading words)."""
        if self.packed is not None:
            return
        if isinstance(self.plan.cfg, HopperBackwardKernelConfig):
            from .families.backward_sm90.launch import packed_launch, plan_launch

            plan_launch(self.plan)
            self.packed = packed_launch(self.plan, self.shapes, self.strides)
        else:
            from .families.backward_sm80.kernels import packed_launch as sm80_packed_launch

            self.packed = sm80_packed_launch(self.plan)

    def run(self, stream: int, ptrs: tuple[int, ...], ws_ptr: int) -> None:
        """Launch with (q, k, v, out, dout, lse, dq, dk, dv) pointers and one workspace of
        ws_floats laid out as lse2, dvec, dq_accum."""
        workspace = self.layout.pointers(ws_ptr)
        if self.packed is not None:
            self.packed.launch(stream, ptrs + workspace)
        else:
            self.launch_on(stream, ptrs, *workspace)

    def launch_on(self, stream: int, ptrs: tuple[int, ...], acc: int, lse2: int, dvec: int) -> None:
        """Pack both parameter structs and launch (the current device is plan.device): every
        backward launch, the full path's included, goes through here."""
        params = self.plan.pack(ptrs + (acc, lse2, dvec))
        self.launch(self, stream, params, ptrs, acc, lse2, dvec)


def _launcher(plan: BackwardPlan) -> Callable[..., None]:
    """(replay, stream, BackwardParams bytes, pointers, acc, lse2, dvec) -> the call's launches."""
    if isinstance(plan.cfg, HopperBackwardKernelConfig):
        from .families.backward_sm90.launch import Operand, launch_backward_sm90, pack_dkdv

        def hopper(replay: BackwardReplay, stream: int, params: bytes, ptrs: tuple[int, ...], acc: int, lse2: int,
                   dvec: int) -> None:
            shapes, strides = replay.shapes, replay.strides
            q, k, v, dout = (Operand(p, s, t) for p, s, t in zip((ptrs[0], ptrs[1], ptrs[2], ptrs[4]), shapes, strides))
            hopper_params = pack_dkdv(plan, q, k, v, dout, ptrs[7], ptrs[8], acc, lse2, dvec)
            launch_backward_sm90(plan, params, hopper_params, stream)

        return hopper
    from .families.backward_sm80.kernels import get_launcher

    launcher = get_launcher(plan.cfg, plan.device, plan.causal, plan.deterministic)
    dims = (plan.batch, plan.n_heads, plan.n_kv_heads, plan.seq_len_q, plan.seq_len_k)

    def mma_sync(replay: BackwardReplay, stream: int, params: bytes, ptrs: tuple[int, ...], acc: int, lse2: int,
                 dvec: int) -> None:
        launcher.launch(params, *dims, stream)

    return mma_sync


def signature(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: Any, softmax_scale: Any,
              deterministic: Any, dq: Any = None, dk: Any = None, dv: Any = None) -> tuple | None:
    """The replay key, or None when these arguments cannot take the fast path (dq, dk, dv: all
    given, whose shapes, strides, dtypes and devices join the key, or none)."""
    if (causal is not True and causal is not False) or (deterministic is not True and deterministic is not False):
        return None
    if not (softmax_scale is None or type(softmax_scale) is float):
        return None
    cls = type(q)
    if not (type(dout) is cls and type(k) is cls and type(v) is cls and type(out) is cls and type(lse) is cls):
        return None
    given = dq is not None
    if given and not (type(dq) is cls and type(dk) is cls and type(dv) is cls):
        return None
    if not given and (dk is not None or dv is not None):
        return None
    meta = meta_reader(cls)
    if meta is None:
        return None
    key = (cls, causal, softmax_scale, deterministic, meta(dout), meta(q), meta(k), meta(v), meta(out), meta(lse))
    return key + (meta(dq), meta(dk), meta(dv)) if given else key




def run(key: tuple | None, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dq: Any = None, dk: Any = None,
        dv: Any = None, stream: Any = None) -> tuple | None:
    """(dq, dk, dv) through the replay for `key` (into the given outputs, when its signature has
    them) on `stream` (None: the caller's current stream), or None (no replay, another current
    device, a stream given_stream cannot read, or a pointer that breaks an alignment rule this
    time: the full path then raises the error)."""
    replay = _PLANS.get(key) if key is not None else None
    if replay is None or _TABLE.get_device() != replay.device:
        return None
    if stream is not None:
        stream = given_stream(stream, replay.device)
        if stream is None:
            return None
    if replay.is_torch:
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(), lse.data_ptr())
    else:
        ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr, lse.data.ptr)
    if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15 or ptrs[5] & 3:
        return None
    if replay.is_torch:
        if dq is None:
            dq, dk, dv = q.new_empty(replay.q_shape), k.new_empty(replay.kv_shape), v.new_empty(replay.kv_shape)
        out_ptrs = (dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
        if stream is None:
            ws = q.new_empty((replay.ws_floats,), dtype=replay.ws_dtype)
            ws_ptr = ws.data_ptr()
    else:
        if dq is None:
            dq, dk, dv = (replay.allocate(replay.q_shape), replay.allocate(replay.kv_shape),
                          replay.allocate(replay.kv_shape))
        out_ptrs = (dq.data.ptr, dk.data.ptr, dv.data.ptr)
        if stream is None:
            ws = replay.allocate_ws(replay.ws_floats)
            ws_ptr = ws.data.ptr
    if (out_ptrs[0] | out_ptrs[1] | out_ptrs[2]) & 15:
        return None  # (only given outputs can be misaligned)
    if stream is None:
        stream = replay.current_stream()
    else:  # the workspace in the given stream's order
        ws, ws_ptr = stream_scratch_f32(replay.is_torch, replay.device, (replay.ws_floats,), stream)
    replay.run(stream, ptrs + out_ptrs, ws_ptr)
    # the workspace is released here: both allocators order its reuse on the launch stream
    return dq, dk, dv


def remember(key: tuple | None, replay: BackwardReplay) -> None:
    """Keep `replay` (built and launched once by the full path) under `key`, with the allocators
    and the current-stream reader of the key's array type."""
    if key is None or not replay.plan.launch:
        return
    device = replay.device
    is_torch = _kind(key[0]) == _TORCH
    replay.current_stream = current_stream_reader(is_torch, device)
    if is_torch:
        import torch

        replay.ws_dtype = torch.float32
    else:
        import cupy
        import numpy as np

        replay.allocate = functools.partial(cupy.empty, dtype=replay.raw_dtype)
        replay.allocate_ws = functools.partial(cupy.empty, dtype=np.float32)
    replay.prepare()  # the full path launched it: its kernels are loaded, this packs the blocks
    _TABLE.remember(key, replay)


_TABLE = PlanTable()  # backward()'s replays
_PLANS = _TABLE.plans  # the same dict for the life of the process (clear() empties it in place)
clear = _TABLE.clear
