"""The Hopper forward family (sm_90a): wgmma GEMMs, TMA loads into an mbarrier-guarded K/V ring,
a warp-specialised producer warpgroup with setmaxnreg, ping-pong of two consumer warpgroups and
intra-warpgroup overlap of softmax with the GEMMs (FlashAttention-3's design).

`forward_sm90` runs it on CuPy / PyTorch / DLPack arrays with `cupyflash.forward`'s arguments;
`plan_sm90` + `launch_sm90` are the pieces `forward(cfg=None)` uses on Hopper.
"""
from __future__ import annotations

from .config import HopperForwardKernelConfig
from .launch import forward_sm90, launch_sm90, plan_sm90, unsupported_reason

__all__ = ["HopperForwardKernelConfig", "forward_sm90", "plan_sm90", "launch_sm90", "unsupported_reason"]
