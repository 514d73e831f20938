"""Named config sets of the backward family and the default pick per (dtype, d_head)."""
from __future__ import annotations

import itertools

from ...config import SUPPORTED_D_HEADS, DType
from .config import B_C_VALUES, B_R_VALUES, D_SPLIT_VALUES, N_WARPS_VALUES, BackwardKernelConfig

__all__ = ["KERNEL_SET_KEYS", "all_configs", "should_autotune", "tune_configs", "progression_configs",
           "default_config", "get_kernel_configs"]

KERNEL_SET_KEYS = ("all", "tune", "prog", "prog_all")


def all_configs() -> list[BackwardKernelConfig]:
    """Every valid config (both dtypes, every d_head, swizzled or not, double-buffered or not)."""
    out = []
    for dtype, d, br, bc, w, ds, swz, dbuf, pds, kvr, pipe in itertools.product(
            DType, SUPPORTED_D_HEADS, B_R_VALUES, B_C_VALUES, N_WARPS_VALUES, D_SPLIT_VALUES, (False, True),
            (False, True), (False, True), (False, True), (False, True)):
        # the pds_smem-only flags (mbarrier also needs pipelined) only where they can hold
        for mbar, dqf, mid in itertools.product((False, True) if pipe else (False,),
                                                *([(False, True) if pds else (False,)] * 2)):
            for dqs, dql, dqv in ((False, False, False), (True, False, False), (False, True, False),
                                  (False, False, True)):
                try:
                    out.append(BackwardKernelConfig(dtype, d, br, bc, w, ds, swz, dbuf, pds, kvr, pipe, mbar, dqf, mid,
                                                    dqs, dql, dqv))
                except ValueError:
                    continue
    return sorted(out)


def should_autotune(cfg: BackwardKernelConfig) -> bool:
    """The tuning set's rule: swizzled only (the plain layout exists for the progression).

    d_head 64/128 (measured on the H100, NOTES.md): pds_smem with 128-key blocks only (the ordering
    knobs mbarrier/dq_first/load_mid/dq_spread/dq_late/dq_v4 only at the H100 table's layouts). pds_smem
    won every bucket of the first H100 tuning run (1.02-1.13x the 16-rows-per-warp layout), and
    64-key blocks lost with or without it (0.86-0.92x: twice the Q/dO loads and dQ atomics per
    FLOP); d_split 2 measured 0.66x at d128.
    d_head 96/256: no pipelined or kv_regs; a d_split of 2 only where the unsplit config would not fit (d_head 256) or
    where it lets a CTA hold a larger key block with 8 warps ((B_c * 2 / n_warps) keys per warp
    equal to 16). d_head 256 with pds_smem (Hopper only): with its ordering knobs and mbarrier."""
    if not cfg.swizzled:
        return False
    if cfg.d_head == 256 and cfg.pds_smem:
        # P/dS through shared memory at d_head 256 (64 x 64, 8 warps, 214-230 KB: Hopper's shared
        # memory only): 1.3-1.4x the d_split 2 configs on an H200 (NOTES.md item 301), so its
        # ordering knobs are tuned too, but not the ones that spill there (dq_spread, dq_late) and
        # not kv_regs (no registers left for K/V fragments)
        return not (cfg.kv_regs or cfg.dq_spread or cfg.dq_late)
    if cfg.mbarrier or cfg.dq_first or cfg.load_mid or cfg.dq_spread or cfg.dq_late or cfg.dq_v4:
        # the ordering knobs, measured (H100 sweep, NOTES.md) at the shipped layouts only: d_head 64
        # 128 x 128 (mbarrier: the pipelined loop that fits its shared memory) and d_head 128 64 x 128
        # pipelined (three buffers fit: no mbarrier)
        if cfg.kv_regs or cfg.n_warps != 8 or cfg.B_c != 128 or not cfg.pds_smem:
            return False
        if cfg.d_head == 64:
            return cfg.B_r == 128
        return cfg.d_head == 128 and cfg.B_r == 64 and cfg.pipelined and not cfg.mbarrier
    if cfg.d_head in (64, 128):
        return cfg.pds_smem and cfg.B_c == 128
    if cfg.pipelined or cfg.kv_regs:  # not measured at d_head 96/256 (and pipelined d96 spills ~200 bytes)
        return False
    if cfg.d_split == 2:
        return cfg.d_head == 256 or cfg.key_rows_per_warp == 16
    return True


def tune_configs() -> list[BackwardKernelConfig]:
    return [c for c in all_configs() if should_autotune(c)]


# The optimisation history at bf16, d_head 128 (each step one change; NOTES.md has the figures).
_PROGRESSION = (
    "backward_sm80 (BF16, 128, 64, 64, 4): dsplit_1",            # FA2 algorithm, plain shared tiles
    "backward_sm80 (BF16, 128, 64, 64, 4): dsplit_1+swizzled",   # + conflict-free tiles
    "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled",  # + 128-key blocks, 8 warps
    "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf",  # + Q/dO double buffer
    "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds",  # + P/dS through smem, 2-D warp tiles
)


def progression_configs(dtype: DType | None = DType.BF16, d_head: int | None = 128) -> list[BackwardKernelConfig]:
    out = []
    for text in _PROGRESSION:
        cfg = BackwardKernelConfig.parse(text)
        if d_head is not None and d_head != 128:
            continue
        if dtype is not None:
            cfg = cfg.replace(dtype=dtype)
        out.append(cfg)
    return out


# (B_r, B_c, n_warps, d_split, double_buffer, pds_smem) per d_head. d_head 64/128: FlashAttention-2's
# tilings with P/dS through shared memory, the fastest of the H100 tuning runs that also fit an
# A100's 163 KB of shared memory per block (the H100's shipped table may pick `pipelined` ones,
# 226 KB); 256: no spills. d_head 96: the fastest of its tune set on an H200 at the power cap
# (2026-11-28, bf16 4k / 16k, both masks, NOTES.md item 296): 64 x 64, 4 warps, P/dS through
# shared memory, 211-229 TFLOP/s, 1.60-1.72x the earlier 64 x 64 8-warp d_split 2 pick (89 KB).
_DEFAULTS = {
    64: (128, 128, 8, 1, True, True),
    96: (64, 64, 4, 1, True, True),
    128: (64, 128, 8, 1, True, True),
    256: (64, 64, 8, 2, False, False),
}


def default_config(dtype: DType, d_head: int) -> BackwardKernelConfig:
    """The library's pick for cfg=None (swizzled; the rest per d_head, from the H100 runs in NOTES.md)."""
    if d_head not in _DEFAULTS:
        raise ValueError(f"q: d_head {d_head} is not supported; expected one of {SUPPORTED_D_HEADS}")
    br, bc, w, ds, dbuf, pds = _DEFAULTS[d_head]
    return BackwardKernelConfig(dtype, d_head, br, bc, w, ds, True, dbuf, pds)


def get_kernel_configs(key: str) -> list[BackwardKernelConfig]:
    """A named set: 'all', 'tune', 'prog' (bf16 d_head 128 history) or 'prog_all' (both dtypes)."""
    k = key.strip().lower()
    if k == "all":
        return all_configs()
    if k == "tune":
        return tune_configs()
    if k == "prog":
        return progression_configs()
    if k == "prog_all":
        return sorted(set(progression_configs(DType.BF16) + progression_configs(DType.FP16)))
    raise ValueError(f"KERNELS: unknown backward set {key!r}; expected one of {KERNEL_SET_KEYS}")
