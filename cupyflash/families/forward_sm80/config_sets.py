"""Named sets of the mma.sync forward family's configs: autotuning, progression, all, and B_r,B_c selections."""
from __future__ import annotations

import functools
import itertools
import os
from typing import Iterable

from ...config import SUPPORTED_D_HEADS, DType
from .config import B_C_VALUES, B_R_VALUES, N_WARPS_VALUES, FlashForwardKernelConfig

__all__ = ["default_config", "should_autotune", "autotune_configs", "progression_configs", "all_configs",
           "get_kernel_configs", "KERNEL_SET_KEYS"]

KERNEL_SET_KEYS = ("all", "tune", "prog", "prog_all")
_FRAGMENT_VALUES = (0, 1, 2, 4)
_BOOLS = (False, True)


def _candidates(dtypes: Iterable[DType], d_heads: Iterable[int]) -> Iterable[FlashForwardKernelConfig]:
    """Every valid config over the value lists of SPEC §2 (invalid combinations are skipped)."""
    for dtype, d, br, bc, w, a, e, s, q, k, v, buf, opt in itertools.product(
        dtypes, d_heads, B_R_VALUES, B_C_VALUES, N_WARPS_VALUES, _BOOLS, _BOOLS, _BOOLS,
        _FRAGMENT_VALUES, _FRAGMENT_VALUES, _FRAGMENT_VALUES, _BOOLS, _BOOLS,
    ):
        try:
            yield FlashForwardKernelConfig(dtype, d, br, bc, w, a, e, s, q, k, v, buf, opt)
        except ValueError:
            continue


# Fragment registers one thread holds across the key loop: O and S accumulators (4 fp32 per
# 16x8 tile) and, when Q stays in registers, its A fragments (4 per 16x16 tile), per 16-row m-tile.
# Measured with --ptxas-options=-v for sm_80 and sm_90: up to 160 nothing spills; at 192 (32 rows
# per warp) ptxas spills 36 bytes (9 words, reloaded from L1 a few times per key block), and
# those configs are still the fastest at d_head 128 on the H100; above 192 spills reach
# hundreds of bytes.
ACCUMULATOR_REGISTER_BUDGET = 192


def accumulator_registers(cfg: FlashForwardKernelConfig) -> int:
    """Registers per thread held by the O and S accumulators (and Q if kept in registers)."""
    m_tiles = cfg.rows_per_warp // 16
    per_m_tile = cfg.d_head // 8 * 4 + cfg.B_c // 8 * 4
    if cfg.Q_mma_load_K_fragments == 0:
        per_m_tile += cfg.d_head // 16 * 4
    return m_tiles * per_m_tile


def should_autotune(cfg: FlashForwardKernelConfig) -> bool:
    """The autotuning rule: which valid configs are worth benchmarking.

    - async copies, eager K/V prefetch, swizzling and the optimized softmax are always on: each
      is a strict improvement in the progression benchmark, so tuning them wastes time;
    - B_c in {64, 128}: B_c = 32 doubles the barriers per key and never won on the H100;
    - K and V loaded 1 or 2 k-fragments at a time (whole tiles cost registers for nothing); Q
      either kept in registers (0) or loaded in step with K (the same count);
    - accumulator_registers(cfg) <= ACCUMULATOR_REGISTER_BUDGET: this admits 32 query rows per
      warp (the H100 winner at d_head 128) only with Q loaded from shared memory and, at
      d_head 128, B_c = 64;
    - 32 query rows per warp only at d_head 64 and 128, and B_c = 64 at d_head 256: the other
      shapes inside the budget still spill (d_head 96: ~110 bytes, 256 with B_c 128: 60-670);
    nothing in the set spills more than 128 bytes (tested for sm_80 and sm_90; measured at most
    64 for sm_90 and 96 for sm_80).
    """
    if not (cfg.async_copy and cfg.eager_load_blocks and cfg.swizzled and cfg.optimized_softmax):
        return False
    if cfg.B_c == 32:
        return False
    if cfg.K_mma_load_K_fragments not in (1, 2) or cfg.V_mma_load_K_fragments not in (1, 2):
        return False
    if cfg.Q_mma_load_K_fragments not in (0, cfg.K_mma_load_K_fragments):
        return False
    if cfg.rows_per_warp == 32 and cfg.d_head not in (64, 128):
        return False
    if cfg.d_head == 256 and cfg.B_c != 64:
        return False
    return accumulator_registers(cfg) <= ACCUMULATOR_REGISTER_BUDGET


@functools.cache
def _autotune_configs(dtypes: tuple[DType, ...], d_heads: tuple[int, ...]) -> tuple[FlashForwardKernelConfig, ...]:
    # Enumerating the candidate space takes about a second; every caller gets the same answer.
    return tuple(sorted(c for c in _candidates(dtypes, d_heads) if should_autotune(c)))


def autotune_configs(dtypes=tuple(DType), d_heads=SUPPORTED_D_HEADS) -> list[FlashForwardKernelConfig]:
    return list(_autotune_configs(tuple(dtypes), tuple(d_heads)))


def progression_configs(dtype: DType = DType.BF16, d_head: int = 128) -> list[FlashForwardKernelConfig]:
    """The seven-step optimisation history, in order, at (B_r, B_c, n_warps) = (64, 64, 4).

    1 plain async copies (whole K/V tiles), 2 +swizzle, 3 +eager K/V prefetch, 4 +fragment loads
    (Q, K and V two k-fragments at a time), 5 +register double buffering, 6 +optimized softmax,
    7 Q kept in registers.
    """
    base = FlashForwardKernelConfig(dtype, d_head, 64, 64, 4, True, False, False, 0, 0, 0, False, False)
    steps = [base]
    steps.append(steps[-1].replace(swizzled=True))
    steps.append(steps[-1].replace(eager_load_blocks=True))
    steps.append(steps[-1].replace(Q_mma_load_K_fragments=2, K_mma_load_K_fragments=2, V_mma_load_K_fragments=2))
    steps.append(steps[-1].replace(mma_double_buffer_loads=True))
    steps.append(steps[-1].replace(optimized_softmax=True))
    steps.append(steps[-1].replace(Q_mma_load_K_fragments=0))
    return steps


# The progression is the optimisation history of the d_head 64/128 kernels; at 96 and 256 its
# early whole-tile steps would only measure register spills.
PROGRESSION_D_HEADS = (64, 128)


def all_configs(dtypes=tuple(DType), d_heads=SUPPORTED_D_HEADS) -> list[FlashForwardKernelConfig]:
    """Autotuning set plus every progression, deduplicated and sorted."""
    out = set(autotune_configs(dtypes, d_heads))
    for dtype in dtypes:
        for d in d_heads:
            if d in PROGRESSION_D_HEADS:
                out.update(progression_configs(dtype, d))
    return sorted(out)


# The heuristic pick when no tuning table has an entry: per d_head, the fastest config that
# compiles without any spill, in the H100 sweep of every tuning candidate at S=4096 (NOTES.md);
# for d_head 96 and 256, not yet swept, a spill-free shape with 16 rows per warp.
_DEFAULT_SHAPES = {
    64: "(BF16, 64, 128, 64, 4): async+eager+swizzled+load_0_1_1_tiles+opt_softmax",
    96: "(BF16, 96, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+opt_softmax",
    128: "(BF16, 128, 128, 128, 8): async+eager+swizzled+load_0_2_1_tiles+opt_softmax",
    256: "(BF16, 256, 64, 64, 4): async+eager+swizzled+load_1_1_1_tiles+opt_softmax",
}


def default_config(dtype: DType, d_head: int) -> FlashForwardKernelConfig:
    """The config `forward(cfg=None)` falls back to without a tuning-table entry. Every default
    is in the tuning set and compiles without spills for sm_80 and sm_90 (tested)."""
    if d_head not in _DEFAULT_SHAPES:
        raise ValueError(f"d_head {d_head} is not supported; expected one of {tuple(_DEFAULT_SHAPES)}")
    return FlashForwardKernelConfig.parse(_DEFAULT_SHAPES[d_head]).replace(dtype=DType(dtype))


def get_kernel_configs(key: str | None = None) -> list[FlashForwardKernelConfig]:
    """Config set for `key`: 'all', 'tune', 'prog' (bf16, d_head 128), 'prog_all' (every dtype, d_head
    64 and 128), or 'B_r,B_c' (the tuning configs with that block shape). None reads $KERNELS,
    defaulting to 'tune'."""
    if key is None:
        key = os.environ.get("KERNELS", "tune")
    key = key.strip()
    if key == "all":
        return all_configs()
    if key == "tune":
        return autotune_configs()
    if key == "prog":
        return progression_configs()
    if key == "prog_all":
        return sorted({c for dt in DType for d in PROGRESSION_D_HEADS for c in progression_configs(dt, d)})
    parts = key.split(",")
    if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
        br, bc = (int(p) for p in parts)
        picked = [c for c in all_configs() if (c.B_r, c.B_c) == (br, bc)]
        if not picked:
            raise ValueError(f"KERNELS key {key!r}: no configs with B_r={br}, B_c={bc}")
        return picked
    raise ValueError(f"unknown KERNELS key {key!r}: expected one of {KERNEL_SET_KEYS} or 'B_r,B_c'")
