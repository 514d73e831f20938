"""Named sets of kernel configurations: autotuning, progression, all, and B_r,B_c selections."""
from __future__ import annotations

import itertools
import os
from typing import Iterable

from .config import (
    B_C_VALUES, B_R_VALUES, N_WARPS_VALUES, SUPPORTED_D_HEADS, DType, FlashForwardKernelConfig,
)

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


def should_autotune(cfg: FlashForwardKernelConfig) -> bool:
    """The autotuning rule: which valid configs are worth benchmarking.

    - async copies, eager K/V prefetch, swizzling and the optimized softmax are always on: each
      is a strict improvement in the progression benchmark, so tuning them wastes time;
    - 16 query rows per warp (B_r=64 with 4 warps, B_r=128 with 8 warps): 32 rows per warp
      doubles the O accumulator and spills at d_head 128;
    - B_c in {64, 128}: B_c = 32 halves the work per barrier;
    - K loaded 1 or 2 k-fragments at a time (whole K tiles spill); Q either kept in registers
      (0) or loaded in step with K (the same count);
    - V loaded 1 or 2 k-fragments at a time, with or without register double buffering;
    - at d_head 128 only B_c = 64: with B_c = 128 the S accumulators push the kernel past 255
      registers and ptxas spills.
    """
    if not (cfg.async_copy and cfg.eager_load_blocks and cfg.swizzled and cfg.optimized_softmax):
        return False
    if cfg.rows_per_warp != 16 or cfg.B_c == 32:
        return False
    if cfg.K_mma_load_K_fragments not in (1, 2) or cfg.V_mma_load_K_fragments not in (1, 2):
        return False
    if cfg.Q_mma_load_K_fragments not in (0, cfg.K_mma_load_K_fragments):
        return False
    if cfg.d_head == 128 and cfg.B_c == 128:
        return False
    return True


def autotune_configs(dtypes=tuple(DType), d_heads=SUPPORTED_D_HEADS) -> list[FlashForwardKernelConfig]:
    return sorted(c for c in _candidates(dtypes, d_heads) if should_autotune(c))


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


def all_configs(dtypes=tuple(DType), d_heads=SUPPORTED_D_HEADS) -> list[FlashForwardKernelConfig]:
    """Autotuning set plus every progression, deduplicated and sorted."""
    out = set(autotune_configs(dtypes, d_heads))
    for dtype in dtypes:
        for d in d_heads:
            out.update(progression_configs(dtype, d))
    return sorted(out)


def default_config(dtype: DType, d_head: int) -> FlashForwardKernelConfig:
    """The config `forward(cfg=None)` uses when no tuning table has an entry: the last step of the
    progression (all optimisations on, 64 x 64 blocks, 4 warps), which compiles without spills
    for every supported dtype and d_head."""
    return progression_configs(DType(dtype), d_head)[-1]


def get_kernel_configs(key: str | None = None) -> list[FlashForwardKernelConfig]:
    """Config set for `key`: 'all', 'tune', 'prog' (bf16, d_head 128), 'prog_all' (every dtype and
    d_head), or 'B_r,B_c' (the tuning configs with that block shape). None reads $KERNELS,
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
        return sorted({c for dt in DType for d in SUPPORTED_D_HEADS for c in progression_configs(dt, d)})
    parts = key.split(",")
    if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
        br, bc = (int(p) for p in parts)
        picked = [c for c in all_configs() if (c.B_r, c.B_c) == (br, bc)]
        if not picked:
            raise ValueError(f"KERNELS key {key!r}: no configs with B_r={br}, B_c={bc}")
        return picked
    raise ValueError(f"unknown KERNELS key {key!r}: expected one of {KERNEL_SET_KEYS} or 'B_r,B_c'")
