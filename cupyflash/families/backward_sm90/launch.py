"""Launching the Hopper backward family on a validated `BackwardPlan` (backward_validation).

`check_sm90_problem` adds this family's rules to the shared validation (d_head, TMA-readable
layouts, compute capability 9.0), `pack_dkdv` builds `HopperBackwardParams` (four cached TMA
descriptors, then the outputs and workspaces), `launch_sequence` lists the kernels of one call
in order with their grids and parameter structs, and `launch_backward_sm90` runs them (resolved
once per plan: `plan_launch`). Only an explicit `cfg` of this family reaches it (`cupyflash.backward(..., cfg=...)`).
"""
from __future__ import annotations

import functools
import threading
from typing import Callable, NamedTuple

from ...backward_validation import BackwardPlan
from ...launch_plans import PackedLaunch, argv_launcher
from ...validation import LOG2_E
from ..forward_sm90 import tma
from . import BACKWARD_SM90, roles_for
from .config import D_HEADS, DQ_TMA_COLS, HopperBackwardKernelConfig
from .params import PARAMS_SIZE, pack_params
from .pdl_launch import pdl_launcher

__all__ = ["check_sm90_problem", "pack_dkdv", "dq_tma_spec", "dq_descriptor", "LaunchStep", "launch_sequence", "dq_workspace_shape",
           "launch_backward_sm90", "plan_launch", "get_kernels", "Operand", "packed_launch"]


def check_sm90_problem(plan: BackwardPlan, q, k, v, dout, compute_capability: int | None) -> None:
    """ValueError (naming the argument) when this family cannot run the validated problem.
    `compute_capability` None skips the device check (CPU planning in tests)."""
    cfg = plan.cfg
    if not isinstance(cfg, HopperBackwardKernelConfig):
        raise TypeError(f"cfg: expected a HopperBackwardKernelConfig, got {type(cfg).__name__}")
    if compute_capability is not None and not BACKWARD_SM90.supports(compute_capability):
        raise ValueError(f"cfg: {cfg.short_form()} is a backward_sm90 config (wgmma/TMA, sm_90a): it runs on "
                         f"compute capability 9.0 only, device {plan.device} has "
                         f"{compute_capability // 10}.{compute_capability % 10}; pass cfg=None or a "
                         "backward_sm80 config")
    if plan.d_head not in D_HEADS:
        raise ValueError(f"q: d_head {plan.d_head} is not supported by backward_sm90 (supported: {D_HEADS})")
    for view, name in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout")):
        problem = tma.tma_layout_problem(name, tuple(view.shape), tuple(view.strides))
        if problem:
            raise ValueError(problem)


def pack_dkdv(plan: BackwardPlan, q, k, v, dout, dk_ptr: int, dv_ptr: int, dq_accum_ptr: int, lse2_ptr: int,
              dvec_ptr: int, cu_seqlens: tuple[int, int] = (0, 0)) -> bytes:
    """HopperBackwardParams of one call: Q/dO boxes of B_r rows, K/V boxes of B_c rows, and the
    dq_accum map of dq_tma configs; `cu_seqlens` the varlen calls' offsets (q, k ... then as
    (1, total_tokens, heads, d) views of the packed arrays)."""
    cfg = plan.cfg
    dtype = cfg.dtype
    descs = [tma.descriptor(view.ptr, dtype, tuple(view.shape), tuple(view.strides), rows)
             for view, rows in ((q, cfg.B_r), (k, cfg.B_c), (v, cfg.B_c), (dout, cfg.B_r))]
    descs.append(dq_descriptor(cfg, plan, dq_accum_ptr))
    dk_strides, dv_strides = plan.strides[6], plan.strides[7]
    totals = (q.shape[1], k.shape[1]) if plan.varlen else (0, 0)  # the packed arrays' tokens
    return pack_params(*descs, dk_ptr, dv_ptr, dq_accum_ptr, lse2_ptr, dvec_ptr, *cu_seqlens, *dk_strides, *dv_strides,
                       plan.seq_len_q, plan.seq_len_k, plan.seq_len_q_pad, plan.n_heads, plan.n_kv_heads,
                       plan.n_heads // plan.n_kv_heads, plan.batch, plan.softmax_scale, plan.softmax_scale * LOG2_E,
                       *totals)


_FLOAT32 = 7  # CU_TENSOR_MAP_DATA_TYPE_FLOAT32
_NO_DESCRIPTOR = bytes(128)


def dq_tma_spec(cfg: HopperBackwardKernelConfig, plan: BackwardPlan, dq_accum_ptr: int) -> tma.TensorMapSpec:
    """The tensor map of the fp32 dq_accum workspace (batch, n_heads, seq_len_q_pad, d_head),
    contiguous, that dq_tma's writer warp reduces into: boxes of 32 columns (128 bytes, the
    128B swizzle span of the staged panels) x a consumer warpgroup's dQ rows (64)."""
    d, rows = plan.d_head, plan.seq_len_q_pad
    return tma.TensorMapSpec(_FLOAT32, dq_accum_ptr, (d, rows, plan.n_heads, plan.ws_batch),
                             (d * 4, rows * d * 4, plan.n_heads * rows * d * 4), (DQ_TMA_COLS, cfg.dq_rows, 1, 1))


def dq_descriptor(cfg: HopperBackwardKernelConfig, plan: BackwardPlan, dq_accum_ptr: int) -> bytes:
    """tma_dq's bytes: the workspace map for dq_tma configs with a workspace (dq_frag's bulk
    reductions need none), zeros otherwise (the kernel does not read it)."""
    if not cfg.dq_tma or cfg.dq_frag or plan.deterministic or not dq_accum_ptr:
        return _NO_DESCRIPTOR
    return tma.encode_cached(dq_tma_spec(cfg, plan, dq_accum_ptr))


class LaunchStep(NamedTuple):
    role: str
    grid: tuple[int, int, int]
    block: int
    smem: int
    hopper_params: bool  # HopperBackwardParams (dkdv) or BackwardParams (the reused kernels)
    pdl: bool = False  # launched as a programmatic dependent of the step before it


# pdl configs: the roles whose kernels wait for their predecessor themselves (griddepcontrol.wait
# or dq_early's counters); backward_sm80's deterministic dQ pass does not, so it is launched plainly.
_PDL_ROLES = ("dkdv", "convert")


def launch_sequence(plan: BackwardPlan) -> list[LaunchStep]:
    """The kernels of one call in launch order (empty grids left out)."""
    cfg = plan.cfg
    out = []
    for role in roles_for(plan.deterministic):
        grid = BACKWARD_SM90.grid(cfg, role, plan.batch, plan.n_heads, plan.n_kv_heads, plan.seq_len_q,
                                  plan.seq_len_k, sm_count(plan.device) if cfg.persistent else 0)
        if grid[0]:
            out.append(LaunchStep(role, grid, BACKWARD_SM90.block_threads(cfg, role),
                                  BACKWARD_SM90.smem_bytes(cfg, role), role == "dkdv",
                                  cfg.pdl and bool(out) and role in _PDL_ROLES))
    return out


def dq_workspace_shape(plan: BackwardPlan) -> tuple[int, ...]:
    """Shape of the fp32 dQ workspace: plan.dq_accum_shape, or with counters one flat array with
    them behind those elements (the kernels find them at dq_accum + batch * n_heads *
    seq_len_q_pad * d_head): for dq_early a 32-bit counter per query block of every (batch, head),
    then for dynamic one more, the dK/dV kernel's tile counter."""
    cfg = plan.cfg
    if not (cfg.dq_early or cfg.dynamic) or plan.deterministic:
        return plan.dq_accum_shape
    elements = plan.ws_batch * plan.n_heads * plan.seq_len_q_pad * plan.d_head
    blocks = plan.ws_batch * plan.n_heads * (plan.seq_len_q_pad // cfg.B_r) if cfg.dq_early else 0
    counters = blocks + int(cfg.dynamic)
    return (elements + counters,)


@functools.lru_cache(maxsize=None)
def sm_count(device: int) -> int:
    """Streaming multiprocessors of `device` (persistent: one dK/dV CTA each)."""
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])


_lock = threading.Lock()
_kernels: dict[tuple, dict] = {}


def get_kernels(cfg: HopperBackwardKernelConfig, device: int, causal: bool, deterministic: bool,
                varlen: bool = False) -> dict:
    """role -> LoadedKernel of the variant (compiled for sm_90a through the registry and cache)."""
    key = (device, cfg, causal, deterministic, varlen)
    kernels = _kernels.get(key)
    if kernels is None:
        from ...registry import get_registry

        kernels = get_registry().get_all(cfg, device, variant=BACKWARD_SM90.variant(
            causal=causal, deterministic=deterministic, varlen=varlen))
        with _lock:
            _kernels[key] = kernels
    return kernels


Launch = Callable[[bytes, bytes, int], None]
_plan_launches: dict[BackwardPlan, Launch] = {}
_MAX_PLAN_LAUNCHES = 1024  # one per plan (a signature): a process cycling through more rebuilds them


def plan_launch(plan: BackwardPlan) -> Launch:
    """(sm80_params, hopper_params, stream) -> the plan's launches, with its kernels, grids and
    PDL launchers resolved once per plan: on a small problem, resolving them per call (grids,
    block sizes, shared memory from the config) was ~15% of a replayed call's host time."""
    run = _plan_launches.get(plan)
    if run is not None:
        return run
    kernels = get_kernels(plan.cfg, plan.device, plan.causal, plan.deterministic, plan.varlen)
    steps = []
    for step in launch_sequence(plan):
        kernel = kernels[step.role]
        go = (pdl_launcher(kernel, step.grid, step.block, step.smem) if step.pdl
              else functools.partial(kernel.launch, step.grid, step.block, step.smem))
        steps.append((step.hopper_params, go))

    def run(sm80_params: bytes, hopper_params: bytes, stream_ptr: int) -> None:
        for hopper, go in steps:
            go(stream_ptr, hopper_params if hopper else sm80_params)

    with _lock:
        if len(_plan_launches) >= _MAX_PLAN_LAUNCHES:
            _plan_launches.clear()
        _plan_launches[plan] = run
    return run


def launch_backward_sm90(plan: BackwardPlan, sm80_params: bytes, hopper_params: bytes, stream_ptr: int) -> None:
    """Launch the variant's kernels in order on `stream_ptr` (the current device is plan.device):
    `sm80_params` (BackwardParams) for the reused kernels, `hopper_params` for dkdv."""
    plan_launch(plan)(sm80_params, hopper_params, stream_ptr)


class Operand(NamedTuple):
    """What pack_dkdv reads of an input view: its pointer, shape and element strides."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]


def packed_launch(plan: BackwardPlan, shapes: tuple[tuple[int, ...], ...], strides: tuple[tuple[int, ...], ...],
                  tail: tuple[int, int] = (0, 0)) -> PackedLaunch | None:
    """The PackedLaunch of a plan whose q, k, v, dout have these shapes and element strides (a
    varlen plan's as their one-batch 4-D views; `tail` its (total_q, total_k) when the preprocess
    zeroes the outputs past the last sequence), its kernels compiled and loaded now; None when the
    driver's descriptor format hides the addresses (op_launch.pointer_words): such calls keep
    re-packing both blocks."""
    from ...op_launch import pointer_words

    count = 14 if plan.varlen else 12
    hopper_at = -(-len(plan.pack((0,) * 12)) // 64) * 64  # the HopperBackwardParams block's offset

    def repack(*ptrs: int) -> bytes:
        cu_seqlens = ptrs[12:14] if plan.varlen else (0, 0)
        inputs = (Operand(ptr, shape, stride) for ptr, shape, stride in zip(ptrs[:3] + ptrs[4:5], shapes, strides))
        hopper = pack_dkdv(plan, *inputs, *ptrs[7:12], cu_seqlens)
        return plan.pack(ptrs[:12], cu_seqlens, tail).ljust(hopper_at, b"\0") + hopper

    found = pointer_words(repack, hopper_at + PARAMS_SIZE, count)
    if found is None:
        return None
    offsets, template = found
    slots = tuple((off // 8, i) for i, words in enumerate(offsets) for off in words)
    kernels = get_kernels(plan.cfg, plan.device, plan.causal, plan.deterministic, plan.varlen)
    steps = [(argv_launcher(kernels[step.role], step.grid, step.block, step.smem, step.pdl), int(step.hopper_params))
             for step in launch_sequence(plan)]
    return PackedLaunch(template, (0, hopper_at), slots, steps)
