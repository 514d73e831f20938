"""Replayable forward launches for the framework operators (cupyflash.torch, cupyflash.jax).

`forward`'s own fast path (launch_plans) covers calls without a log-sum-exp; the framework
operators also need the lse variant (autograd saves it) and, in JAX, buffers whose pointers only
exist inside XLA's callback. Both build, once per problem signature, a `FastLaunch` whose
parameter block holds everything but five pointers (q, k, v, out, lse), for the kernel that
`forward(cfg=None)` would run: the Hopper family where it applies (its TMA descriptors re-packed
from each call's pointers), else the mma.sync family (five pointers written into the first five
ForwardParams fields).
"""
from __future__ import annotations

import struct
from typing import Any

from . import launch_plans
from .interop import TensorView
from .validation import LaunchPlan

__all__ = ["POINTERS", "hopper_plan", "plan_views", "make_launch"]

POINTERS = struct.Struct("<5Q")  # q, k, v, o, lse: the first five ForwardParams fields


def hopper_plan(q: TensorView, k: TensorView, v: TensorView, causal: bool, softmax_scale: float | None,
                device: int) -> tuple[Any, tuple[TensorView, ...]] | None:
    """(Sm90Plan, views) when forward(cfg=None) would run the Hopper family on this problem
    (sm_90 and a layout TMA takes), else None (the mma.sync plan)."""
    from . import api

    if not api._hopper_default(device):
        return None
    views = (q, k, v)
    if api._hopper_reason(*views) is not None:
        return None
    from .families.forward_sm90.launch import plan_sm90

    return plan_sm90(None, *views, None, softmax_scale, causal), views


def plan_views(q: TensorView, k: TensorView, v: TensorView, causal: bool,
               softmax_scale: float | None) -> tuple[LaunchPlan, Any]:
    """forward(cfg=None)'s plan for validated views: (the mma.sync LaunchPlan, (Sm90Plan, views)
    or None). Raises forward's TypeError/ValueError on bad arguments."""
    from . import api

    plan = api.plan_forward(None, q, k, v, None, softmax_scale, causal)
    return plan, hopper_plan(q, k, v, plan.causal, softmax_scale, plan.device)


def make_launch(plan: LaunchPlan, sm90: Any, device: int) -> launch_plans.FastLaunch:
    """The replayable launch of `plan` (or of the Hopper plan `sm90`) on `device`: kernel handle,
    grid and every parameter but the five pointers packed; `repack` set for the Hopper family."""
    if sm90 is not None:
        from .families.forward_sm90.launch import get_kernel, make_repack
        from .families.forward_sm90.params import PARAMS_SIZE

        hopper, views = sm90
        cfg = hopper.cfg
        kernel = get_kernel(cfg, device, hopper.base.causal)
        return launch_plans.FastLaunch(kernel.func_ptr, hopper.grid, cfg.n_threads, cfg.smem_bytes(), device,
                                       bytes(PARAMS_SIZE), hopper.base.out_shape, None, None,
                                       make_repack(hopper, *views))
    from .registry import get_registry

    kernel = get_registry().get(plan.cfg, device, plan.causal)
    return launch_plans.FastLaunch(kernel.func_ptr, plan.grid, plan.block, plan.smem_bytes, device,
                                   plan.pack(0, 0, 0, 0, 0), plan.out_shape, None, None)
