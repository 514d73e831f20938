"""Named config sets of the Hopper forward family: default, tune, progression."""
from __future__ import annotations

import itertools

from ...config import DType
from .config import B_C_VALUES, D_HEADS, HopperForwardKernelConfig

__all__ = ["default_config", "should_autotune", "autotune_configs", "progression_configs", "get_kernel_configs",
           "KERNEL_SET_KEYS"]

KERNEL_SET_KEYS = ("tune", "prog", "prog_all", "defaults")

# Key-tile columns per head dimension for the defaults: the largest B_c whose S, P and O
# accumulators fit the 240 consumer registers with the two-stage ring in shared memory.
_DEFAULT_B_C = {64: 128, 128: 128, 256: 64}


def default_config(dtype: DType, d_head: int) -> HopperForwardKernelConfig:
    """The family's untuned pick: 2 consumer warpgroups, producer warpgroup, ping-pong and
    intra-warpgroup overlap, a two-stage K/V ring, persistent CTAs."""
    return HopperForwardKernelConfig(dtype, d_head, 128, _DEFAULT_B_C[d_head], 2, True, True, True, True)


def progression_configs(dtype: DType = DType.BF16, d_head: int = 128) -> list[HopperForwardKernelConfig]:
    """The optimisation history, one feature added per step (FA3's ablation order):
    wgmma + TMA ring loaded by a consumer thread -> + warp specialisation (producer warpgroup,
    setmaxnreg) -> + ping-pong of the two consumer warpgroups -> + intra-warpgroup overlap ->
    + persistent CTAs."""
    b_c = _DEFAULT_B_C[d_head]
    return [
        HopperForwardKernelConfig(dtype, d_head, 128, b_c, 2, False, False, False, False),
        HopperForwardKernelConfig(dtype, d_head, 128, b_c, 2, True, False, False, False),
        HopperForwardKernelConfig(dtype, d_head, 128, b_c, 2, True, True, False, False),
        HopperForwardKernelConfig(dtype, d_head, 128, b_c, 2, True, True, True, False),
        HopperForwardKernelConfig(dtype, d_head, 128, b_c, 2, True, True, True, True),
    ]


def should_autotune(cfg: HopperForwardKernelConfig) -> bool:
    """Worth timing: warp-specialised with both consumer warpgroups (every progression step
    that removed one lost), intra-warpgroup overlap on; B_c, stages, ping-pong and persistence
    are tuned."""
    return cfg.warp_specialized and cfg.B_r == 128 and cfg.intra_wg_overlap


def autotune_configs(dtypes=tuple(DType), d_heads=D_HEADS) -> list[HopperForwardKernelConfig]:
    out = []
    for dtype, d, b_c, stages, pingpong, persistent in itertools.product(
            dtypes, d_heads, B_C_VALUES, (2, 3), (False, True), (False, True)):
        try:
            cfg = HopperForwardKernelConfig(dtype, d, 128, b_c, stages, True, pingpong, True, persistent)
        except ValueError:
            continue  # over the register or shared-memory budget
        if should_autotune(cfg):
            out.append(cfg)
    return sorted(out)


def get_kernel_configs(key: str) -> list[HopperForwardKernelConfig]:
    """'tune', 'prog' (bf16 d128), 'prog_all' (every dtype and d_head) or 'defaults'."""
    if key == "tune":
        return autotune_configs()
    if key == "prog":
        return progression_configs()
    if key == "prog_all":
        return sorted({c for dt in DType for d in D_HEADS for c in progression_configs(dt, d)})
    if key == "defaults":
        return [default_config(dt, d) for dt in DType for d in D_HEADS]
    raise ValueError(f"key: expected one of {KERNEL_SET_KEYS}, got {key!r}")
