"""The decode family's config sets (tune, prog, all) and its default picks."""
from __future__ import annotations

import functools
import itertools

from ...config import DType
from .config import (B_C_VALUES, DECODE_D_HEADS, HEADS_VALUES, N_WARPS_VALUES, ROWS_VALUES, STAGES_VALUES,
                     TILE_REGISTER_BUDGET, DecodeKernelConfig)

__all__ = ["KERNEL_SET_KEYS", "all_configs", "autotune_configs", "progression_configs", "default_config",
           "fit_to_rows", "rows_for", "get_kernel_configs", "should_autotune"]

KERNEL_SET_KEYS = ("all", "tune", "prog")

# The heuristic defaults, (B_c, n_warps, stages, evict_first) per d_head (rows is picked per
# problem by rows_for), from the H100 probes in NOTES.md, for four kinds of problem: contiguous or
# paged cache, and narrow (fewer than one CTA per SM without splits: batch x KV heads x row tiles
# < SM count, so splits fill the GPU) or wide (at least one CTA per SM without splits).
# - narrow contiguous: eight warps with one step ahead each stream faster than four with three
#   (d128, batch 1: 8k keys 20.1 vs 20.7 us, 131k keys 182.6 vs 190.7 at the same 64 CTAs);
# - wide contiguous: 2 CTAs per SM (four warps, 3 stages, 100 KB), so one CTA's prologue and merge
#   overlap the other's streaming (d128 batch 64 x 8k: 697 vs 705 us with 1 CTA per SM; batch
#   32 x 4k 179.1 vs 180.6); d64 since 2026-11-23 two heads per CTA (below);
# - paged (a page-table read and a new page every 16 keys): a CTA streams about half as fast as
#   on a contiguous cache, and more warps help more than deeper rings (d128 batch 1 x 131k at 64
#   CTAs: 8 warps x 2 stages 225 us, 4 x 4 387): narrow takes 8 warps x 2 stages with the split
#   rule aiming at one CTA per SM (131k: 189 us vs 194 with 8 x 1; 8k: 22.1 vs 24.3), wide the
#   2-CTA shape (batch 64 x 8k: 723 vs 730 us with 8 x 1; batch 32 x 4k: 189 vs 193). Paged loads
#   carry the L2 evict-first hint, so the page tables stay in L2 while K and V stream past.
# d256 keeps its shapes (8 warps x 2 stages of 16 d256 keys do not fit in shared memory).
# Probe of 2026-11-23 (scripts/decode_probe.py, bf16, page 16 shuffled, NOTES.md item 63): d64 wide
# paged took 8 single-slot warps without the hint (batch 64 x 8k: 371 us vs 385 with 4 x 3,
# contiguous 361; since item 69 two heads per CTA, below); d256 narrow paged takes 4 warps x 2 stages (batch 8 x 32k: 716 us vs 729 with
# 8 x 1; batch 1 x 8k: 37.3 vs 37.8).
_DEFAULTS: dict[int, tuple[int, int, int, bool]] = {      # narrow contiguous
    64: (32, 4, 4, False),
    128: (16, 8, 2, False),
    256: (16, 4, 2, False),
}
# Wide contiguous d_head 64 serves two KV heads per CTA with 8 warps x 2 stages (each CTA reads
# both heads' 128-byte rows of a key range together): batch 64 x 8k 356.0 us vs 363.2 for 4 x 3
# (SDPA cuDNN 355.4-356.2 in the same runs; NOTES.md item 64).
_WIDE_DEFAULTS: dict[int, tuple[int, int, int, bool]] = {  # wide contiguous
    64: (32, 8, 2, False),
    128: (16, 4, 3, False),
    256: (16, 4, 2, False),
}
_WIDE_HEADS = {64: 2, 128: 1, 256: 1}  # KV heads per CTA of the wide defaults, contiguous and paged
# Wide contiguous d_head 128, one query tile: where the (batch, KV head) items, taken H at a time,
# make one wave of 0.9-1.0 CTAs per SM, a CTA reads its H heads' rows of each key together (H x 256
# contiguous bytes a key, where one head per CTA reads 256 bytes in every 2 KB) and every CTA
# streams from start to end with no second wave. Measured on the H100 (NOTES.md item 234, bf16
# and fp16, four fresh allocations of the cache each, ratio to SDPA cuDNN in the same process):
# batch 64 x 8k (512 items, 4 heads a CTA: 128 CTAs) 0.994x against 1.004x for the 2-CTA-per-SM
# shape; batch 32 x 4k (256 items, 2 heads: 128 CTAs) 0.989x against 0.999-1.004x. The same
# configs off that fill lost: 4 heads at batch 32 x 4k (64 CTAs) 1.003-1.013x, 2 heads at batch
# 64 x 8k (256 CTAs) 1.005x.
ONE_WAVE_SHAPES: dict[int, tuple[int, int, int]] = {4: (32, 4, 2), 2: (16, 4, 2)}  # heads -> (B_c, n_warps, stages)
ONE_WAVE_FILL = (0.9, 1.0)  # CTAs per SM of the one-wave shapes
# Narrow paged caches at d_head 64 and 128 also take `interleave` (splits walk the keys
# round-robin, so the first page-table reads go out beside the cache_seqlens read): d64 batch 1 x
# 128k 99.5 vs 102.7 us, 8k 15.1 vs 15.3; d128 batch 1 x 8k 21.8 vs 22.0; d256 8k 37.9 vs 37.3,
# so not there (2026-11-23 probe, NOTES.md item 64).
_PAGED_DEFAULTS: dict[int, tuple[int, int, int, bool]] = {  # narrow paged
    64: (32, 8, 2, True),
    128: (16, 8, 2, True),
    256: (16, 4, 2, True),
}
_PAGED_INTERLEAVE = {64: True, 128: True, 256: False}
# Wide paged d_head 64 takes the wide contiguous shape, two KV heads per CTA, since the paged
# loop's fix (NOTES.md item 69): batch 64 x 8k 364.0 us vs 372.7 for 8 single-slot warps
# (contiguous 352.7; probe of 2026-11-23 evening).
_WIDE_PAGED_DEFAULTS: dict[int, tuple[int, int, int, bool]] = {  # wide paged
    64: (32, 8, 2, False),
    128: (16, 4, 3, True),
    256: (16, 8, 1, True),
}


def _valid(**fields) -> DecodeKernelConfig | None:
    try:
        return DecodeKernelConfig(**fields)
    except ValueError:
        return None


@functools.cache
def all_configs() -> tuple[DecodeKernelConfig, ...]:
    """Every valid combination of the field values."""
    out = []
    for dtype, d, rows, bc, w, st, ev, h, il in itertools.product(DType, DECODE_D_HEADS, ROWS_VALUES, B_C_VALUES,
                                                                   N_WARPS_VALUES, STAGES_VALUES, (False, True),
                                                                   HEADS_VALUES, (False, True)):
        cfg = _valid(dtype=dtype, d_head=d, rows=rows, B_c=bc, n_warps=w, stages=st, evict_first=ev, heads=h,
                     interleave=il)
        if cfg is not None:
            out.append(cfg)
    return tuple(sorted(out))


def should_autotune(cfg: DecodeKernelConfig) -> bool:
    """The tuning set: 16-row tiles (a GQA group of up to 16 rows, the serving case), steps of
    16 or 32 keys, no evict-first hint (it moved no row by more than 1%, NOTES.md), contiguous
    split ranges (`interleave` serves paged caches, which the table does not), and either
    - one head per CTA with 4 or 8 warps and 2-4 stages holding at least 16 KB in flight per CTA
      ((stages - 1) * n_warps slots; less cannot cover HBM latency), or 8 single-slot warps; or
    and no more than 224 KB of shared memory (one CTA per SM at most). Several KV heads per CTA
    (heads > 1) are left out: on the H100 they lost at batch 1, 8k keys, at every split count
    (d128: 25-57 us against 21.4; d64: 19-50 against 16.0; NOTES.md)."""
    if cfg.rows != 16 or cfg.B_c > 32 or cfg.evict_first or cfg.interleave:
        return False
    if cfg.heads == 1:
        in_flight = (cfg.stages - 1) * cfg.n_warps * cfg.stage_bytes()
        many_warps = cfg.stages == 1 and cfg.n_warps == 8  # the paged caches' shape (see _PAGED_DEFAULTS)
        shape_ok = cfg.n_warps >= 4 and (cfg.stages >= 2 and in_flight >= 16 * 1024 or many_warps)
    else:
        shape_ok = False
    return shape_ok and cfg.smem_bytes() <= 224 * 1024


def autotune_configs(dtypes=tuple(DType), d_heads=DECODE_D_HEADS) -> list[DecodeKernelConfig]:
    return [c for c in all_configs() if c.dtype in dtypes and c.d_head in d_heads and should_autotune(c)]


def progression_configs(dtype: DType = DType.BF16, d_head: int = 128) -> list[DecodeKernelConfig]:
    """The optimisation steps, in order: one warp without prefetch; four warps; a 2-stage ring;
    a 4-stage ring; the L2 evict-first hint."""
    steps = [(16, 1, 1, False), (16, 4, 1, False), (16, 4, 2, False), (16, 4, 4, False), (16, 4, 4, True)]
    return [DecodeKernelConfig(dtype, d_head, 16, bc, w, st, ev) for bc, w, st, ev in steps]


def rows_for(d_head: int, packed_rows: int) -> int:
    """Smallest tile height holding `packed_rows` (group x seq_q) rows, within the register budget."""
    allowed = [r for r in ROWS_VALUES if r * d_head // 32 <= 128]
    for r in allowed:
        if r >= packed_rows:
            return r
    return allowed[-1]


def fit_to_rows(cfg: DecodeKernelConfig, packed_rows: int) -> DecodeKernelConfig | None:
    """`cfg` (a tuned 16-row config) with the tile height for `packed_rows` rows: fewer keys per
    step where taller tiles exceed the register budget, a shorter ring where the merge area
    outgrows shared memory; None if nothing valid remains."""
    rows = rows_for(cfg.d_head, packed_rows)
    bc, st = cfg.B_c, cfg.stages
    while rows * (cfg.d_head + bc) // 32 > TILE_REGISTER_BUDGET and bc > min(B_C_VALUES):
        bc //= 2
    while st >= 1:
        fitted = _valid(dtype=cfg.dtype, d_head=cfg.d_head, rows=rows, B_c=bc, n_warps=cfg.n_warps, stages=st,
                        evict_first=cfg.evict_first, heads=cfg.heads)
        if fitted is not None:
            return fitted
        st -= 1
    return None


def one_wave_heads(d_head: int, packed_rows: int, paged: bool, batch: int, n_kv_heads: int,
                   num_sms: int) -> int | None:
    """KV heads per CTA of a one-wave shape (ONE_WAVE_SHAPES) for this problem, or None: d_head
    128, a contiguous cache, one 16-row query tile, and batch x n_kv_heads / H CTAs within
    ONE_WAVE_FILL of one per SM for an H dividing n_kv_heads."""
    if d_head != 128 or paged or packed_rows > 16:
        return None
    low, high = ONE_WAVE_FILL
    for heads in ONE_WAVE_SHAPES:
        ctas = batch * n_kv_heads / heads
        if n_kv_heads % heads == 0 and low * num_sms <= ctas <= high * num_sms:
            return heads
    return None


def default_config(dtype: DType, d_head: int, packed_rows: int = 1, paged: bool = False,
                   wide: bool = False, wave_heads: int | None = None) -> DecodeKernelConfig:
    """The heuristic choice for (dtype, d_head), a group of `packed_rows` query rows, the cache
    kind and the problem's width (`wide`: batch x KV heads x row tiles >= the SM count);
    `wave_heads`: the one-wave shape with that many KV heads per CTA (see one_wave_heads)."""
    if d_head not in _DEFAULTS:
        raise ValueError(f"q: d_head {d_head} is not supported by forward_kvcache; expected one of {DECODE_D_HEADS}")
    if wave_heads is not None:
        bc, w, st = ONE_WAVE_SHAPES[wave_heads]
        return DecodeKernelConfig(dtype, d_head, rows_for(d_head, packed_rows), bc, w, st, False, heads=wave_heads)
    table = ((_WIDE_PAGED_DEFAULTS if wide else _PAGED_DEFAULTS) if paged
             else (_WIDE_DEFAULTS if wide else _DEFAULTS))
    bc, w, st, ev = table[d_head]
    il = paged and not wide and _PAGED_INTERLEAVE[d_head]
    h = _WIDE_HEADS[d_head] if wide else 1
    rows = rows_for(d_head, packed_rows)
    while rows * (d_head + bc) // 32 > TILE_REGISTER_BUDGET:  # taller tiles: fewer keys per step
        bc //= 2
    cfg = _valid(dtype=dtype, d_head=d_head, rows=rows, B_c=bc, n_warps=w, stages=st, evict_first=ev, interleave=il,
                 heads=h)
    while cfg is None and st > 1:  # taller tiles enlarge the merge area: shorten the ring until it fits
        st -= 1
        cfg = _valid(dtype=dtype, d_head=d_head, rows=rows, B_c=bc, n_warps=w, stages=st, evict_first=ev,
                     interleave=il, heads=h)
    if cfg is None:  # not reached for the supported head dims and tile heights (tests/test_decode.py)
        raise ValueError(f"q: no decode config fits d_head {d_head} with {packed_rows} packed query rows")
    return cfg


def get_kernel_configs(key: str | None = None) -> list[DecodeKernelConfig]:
    """The named set: 'all', 'tune', 'prog' (bf16 and fp16, d_head 128)."""
    key = (key or "tune").strip()
    if key == "all":
        return list(all_configs())
    if key == "tune":
        return autotune_configs()
    if key == "prog":
        return sorted(set(progression_configs(DType.BF16) + progression_configs(DType.FP16)))
    raise ValueError(f"KERNELS: unknown decode config set {key!r}; expected one of {KERNEL_SET_KEYS}")
