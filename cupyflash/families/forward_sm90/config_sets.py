"""Named config sets of the Hopper forward family: default, tune, progression."""
from __future__ import annotations

import dataclasses
import functools
import itertools

from ...config import DType
from .config import D_HEADS, HopperForwardKernelConfig

__all__ = ["default_config", "varlen_default_config", "should_autotune", "autotune_configs", "knob_twins", "progression_configs", "get_kernel_configs",
           "KERNEL_SET_KEYS"]

KERNEL_SET_KEYS = ("tune", "prog", "prog_all", "defaults", "varlen_defaults")

# Key-tile columns of the progression: the largest B_c in {64, 128} whose S, P and O
# accumulators fit the 240 consumer registers with the two-stage ring in shared memory.
_DEFAULT_B_C = {64: 128, 96: 128, 128: 128, 256: 64}

# The defaults, (d_head, causal) -> (B_r, B_c, n_stages, knobs), one CTA per tile, all with the producer
# warpgroup, ping-pong and intra-warpgroup overlap. Measured on the H100 (scripts/bench_hopper.py,
# 2026-11-23, batch*seq 16k): d128 B_c 176 beats 128 by 0-5% without masking at S >= 2k (FA3's
# tile too); causal keeps 128 (176 lost 5-15%: more masked work on the diagonal). d256: B_c 80
# beats 64 by 3-10%; its causal build spills 8 bytes, so causal keeps 64. d64: three consumer
# warpgroups (B_r 192) beat two by 0-10% (causal: -10% at 1k, +0-12% from 2k). Persistent CTAs
# are level without masking; causal, the snake schedule is level at S <= 2k but loses 25% at 16k
# (128 query blocks per head against 132 CTAs: the snake's pairing drifts), so none are default.
# d64, d96 and d256 rescale lazily (`lazy`, NOTES.md item 71): +4-9% at every d256 row and +0-11% on
# d64 192x128 tiles in two probe runs; d128 keeps exact rescaling (-1..-4% with it). forward_varlen's
# GPU tests passed on the lazy table picks at d64/d256.
_LAZY = {"lazy_rescale": True}
# d_head 96 (64-byte swizzled tiles, 2026-11-28 on an H200 at the power cap, bench.py beside SDPA
# cuDNN and flash, 2 rounds, 1k-16k, NOTES.md item 291): three consumer warpgroups with P through
# shared memory, 192 x 128 (P V's m64n96k16 reads 5 KiB per 48 tensor clocks, inside the SM's
# shared-memory bandwidth, unlike d64's), lazy; causal with per-warpgroup blocks. 1.18-1.29x
# cuDNN at S >= 2k non-causal (192 x 80 1.15-1.24x, 128 x 176 1.11-1.24x), causal 1.15-1.28x; at
# 1k 1.02-1.03x, where the 128 x 128 persistent qbuf2 tile reached 1.07-1.08x.
_D96 = {**_LAZY, "p_smem": True}
_DEFAULTS = {
    (64, False): (192, 128, 2, _LAZY), (64, True): (192, 128, 2, _LAZY),
    (96, False): (192, 128, 2, _D96), (96, True): (192, 128, 2, {**_D96, "wg_blocks": True}),
    (128, False): (128, 176, 2, {}), (128, True): (128, 128, 2, {}),
    (256, False): (128, 80, 2, _LAZY), (256, True): (128, 64, 2, _LAZY),
}


@functools.lru_cache(maxsize=64)  # per-call path of forward_sm90: building a config costs ~10 us
def default_config(dtype: DType, d_head: int, causal: bool = False) -> HopperForwardKernelConfig:
    """The family's pick for (dtype, d_head, causal) without a tuning table (see _DEFAULTS)."""
    b_r, b_c, stages, knobs = _DEFAULTS[(d_head, bool(causal))]
    return HopperForwardKernelConfig(dtype, d_head, b_r, b_c, stages, True, True, True, False, **knobs)


# forward_varlen's picks where they differ from _DEFAULTS. d_head 128, both masks: three consumer
# warpgroups with P through shared memory (192 x 128, lazy, wgblocks), measured on an H200
# (2026-11-28, `.out/s28/ab_varlen.py`: bench.py --mode varlen's batch, lengths 1..8k, 32k
# tokens, 16 heads, 5 interleaved rounds at the power cap; NOTES.md item 280) at x1.050 / x1.055
# (bf16 / fp16) non-causal and x1.112 / x1.100 causal over the earlier 128 x 176 pick; its
# persistent forms lost (x0.92-0.99). (The 128 x 176 pick had beaten the dense causal default,
# B_c 128, on the H100, 2026-11-23: packed sequences mostly end mid-tile, where a wider tile's
# masked-diagonal cost matters less than its fewer key-block iterations.)
_VARLEN_D128 = dict(B_r=192, B_c=128, lazy_rescale=True, wg_blocks=True, p_smem=True)
_VARLEN_PICKS = {(128, causal): _VARLEN_D128 for causal in (False, True)}


@functools.lru_cache(maxsize=64)
def varlen_default_config(dtype: DType, d_head: int, causal: bool = False) -> HopperForwardKernelConfig:
    """The family's pick for forward_varlen: `default_config` with the _VARLEN_PICKS changes."""
    cfg = default_config(dtype, d_head, causal)
    changes = _VARLEN_PICKS.get((d_head, bool(causal)))
    return dataclasses.replace(cfg, **changes) if changes else cfg


def progression_configs(dtype: DType = DType.BF16, d_head: int = 128) -> list[HopperForwardKernelConfig]:
    """The optimisation history, one feature added per step (FA3's ablation order): wgmma alone
    (every consumer thread loads with cp.async) -> + TMA ring loaded by a consumer thread ->
    + warp specialisation (producer warpgroup, setmaxnreg) -> + ping-pong of the two consumer
    warpgroups -> + intra-warpgroup overlap -> + persistent CTAs."""
    b_c = _DEFAULT_B_C[d_head]
    return [
        HopperForwardKernelConfig(dtype, d_head, 128, b_c, 2, False, False, False, False, cp_async=True),
        HopperForwardKernelConfig(dtype, d_head, 128, b_c, 2, False, False, False, False),
        HopperForwardKernelConfig(dtype, d_head, 128, b_c, 2, True, False, False, False),
        HopperForwardKernelConfig(dtype, d_head, 128, b_c, 2, True, True, False, False),
        HopperForwardKernelConfig(dtype, d_head, 128, b_c, 2, True, True, True, False),
        HopperForwardKernelConfig(dtype, d_head, 128, b_c, 2, True, True, True, True),
    ]


# The tune set, per d_head: (B_r, B_c) tiles, ring stages, and the knobs worth timing there.
# Every candidate has the producer warpgroup, intra-warpgroup overlap and (but at d256)
# ping-pong: each progression step that removed one of these lost. Narrow key tiles (B_c <= 80)
# only at d256, where shared memory allows nothing wider with two stages: Q K^T with N <= 80
# reads more shared memory per FLOP than the 128 B/clock an SM delivers at full wgmma rate.
# Schedules: one CTA per tile ('plain'), persistent, persistent with two Q tiles (qbuf2; at d64
# only that one: it was level or better than plain persistent at d128). The FMA-unit exp2
# (exp_emulation) stays out: on the H100 (2026-11-23, docs/autotune_sm90_candidates_h100.jsonl)
# a quarter of the scores on the FMA units lost a median 6% (0.83-1.04x over 192 d64 pairs,
# 0.88-1.06x over 24 d128 ones), causal or not: the softmax is bound by issue, not by MUFU.
_TUNE_TILES = {64: ((192, 128), (128, 128), (128, 176)), 96: ((192, 80), (128, 128), (128, 176)),
               128: ((128, 128), (128, 176)), 256: ((128, 64), (128, 80))}
_TUNE_STAGES = {64: (2, 3), 96: (2, 3), 128: (2, 3), 256: (2,)}
_TUNE_PINGPONG = {64: (True,), 96: (True,), 128: (True,), 256: (False, True)}
# Lazy rescaling (threshold 2^8), measured on the H100 (2026-11-23, scripts/probe_sm90_d64_256.py,
# two runs beside cuDNN): d256 +4-9% at every S from 1k to 16k, causal or not; d64 +0-11% on the
# three-consumer 192x128 tile but -4..-10% on the two-consumer 128x176 one; so both time both (the
# defaults keep exact rescaling: forward_varlen has not run lazy configs on a GPU yet); d128 (two
# consumers) -1..-4%, so d128 keeps exact rescaling here. (Causal d128 differs: the shipped table's
# bf16 causal 512-4k rows took `lazy` from same-run twins at the power cap, +1-3.7% in two runs,
# NOTES.md item 167.)
# d64's 128x128 tile: causal S <= 2k (no ragged 192-row last block, a smaller diagonal),
# +16-27% over 192x128 at 512/1k.
_TUNE_LAZY = {64: (False, True), 96: (False, True), 128: (False,), 256: (False, True)}
# Tiles whose P only fits with `psmem` (P V reads P from shared memory): d128 with three consumer
# warpgroups, 192 x 128 (64 + 64 accumulator registers at 160 per consumer thread). Measured on an
# H200 (2026-11-28, bench.py beside the table's picks, NOTES.md item 276): +3-5% over the
# two-consumer picks at S >= 4k, causal +0.4-4% at 8k-16k, -5-10% at 1k; with lazy rescaling
# (+5% there, unlike d128's two-consumer tiles), so both are timed. At d64, psmem lost 3-9% to
# the register P on every tile tried (192 x 128, 192 x 192): P V's m64n64k16 from shared memory
# reads 4 KiB per 32 tensor clocks, the SM's whole shared-memory bandwidth.
_PSMEM_TILES = {96: ((192, 128),), 128: ((192, 128),)}
_PSMEM_LAZY = (False, True)
# `cluster2` (K/V multicast to CTA pairs) is in no set: on an H200 (2026-11-28, NOTES.md item 281)
# the d128 192 x 128 pick lost 1.7% with it, 128 x 176 and d256's 128 x 80 moved by -2..+2%
# (noise-sized): the pair's lockstep costs what the halved L2 traffic saves.
_SCHEDULES = ((False, False), (True, False), (True, True))  # (persistent, double_q)


def should_autotune(cfg: HopperForwardKernelConfig) -> bool:
    """Worth timing (see _TUNE_TILES): warp-specialised with intra-warpgroup overlap, the tiles,
    stages, ping-pong and lazy rescaling listed for its d_head (P in shared memory only on the
    tiles that need it, _PSMEM_TILES), at d64 persistent CTAs only with
    two Q tiles, every exponential on MUFU.EX2, loads through TMA (cp_async is the progression's
    first step), O staged through shared memory (`oreg` is tried as a same-run twin of the picks
    instead, scripts/probe_sm90_d64_256.py --twins oreg: with its 16-byte stores it won the d64 and
    d256 rows at S <= 1k, which the table carries, and lost up to 3.6% at d256 16k, NOTES.md item
    157)."""
    d = cfg.d_head
    tiles, lazy = (_PSMEM_TILES.get(d, ()), _PSMEM_LAZY) if cfg.p_smem else (_TUNE_TILES.get(d, ()), _TUNE_LAZY[d])
    return (cfg.warp_specialized and cfg.intra_wg_overlap
            and (cfg.B_r, cfg.B_c) in tiles
            and cfg.n_stages in _TUNE_STAGES[d] and cfg.pingpong in _TUNE_PINGPONG[d]
            and not (d == 64 and cfg.persistent and not cfg.double_q)
            and cfg.exp_emulation == 0 and not cfg.cp_async
            and cfg.lazy_rescale in lazy and not cfg.o_direct)


def autotune_configs(dtypes=tuple(DType), d_heads=D_HEADS) -> list[HopperForwardKernelConfig]:
    out = []
    for dtype, d in itertools.product(dtypes, d_heads):
        for p_smem, tiles, lazies in ((False, _TUNE_TILES[d], _TUNE_LAZY[d]),
                                      (True, _PSMEM_TILES.get(d, ()), _PSMEM_LAZY)):
            for (b_r, b_c), stages, pingpong, (persistent, double_q), lazy in itertools.product(
                    tiles, _TUNE_STAGES[d], _TUNE_PINGPONG[d], _SCHEDULES, lazies):
                try:
                    cfg = HopperForwardKernelConfig(dtype, d, b_r, b_c, stages, True, pingpong, True, persistent,
                                                    double_q, lazy_rescale=lazy, p_smem=p_smem)
                except ValueError:
                    continue  # over the register or shared-memory budget
                if should_autotune(cfg):
                    out.append(cfg)
    return sorted(out)


# Launch knobs the tune set leaves out: each helps some rows and costs others a few percent
# (NOTES.md items 133, 157, 184), so autotune tries them on each row's winner instead of
# multiplying the whole set by them. `cross_tile` and `wg_blocks` exclude each other.
_TWIN_KNOBS = ("turn_ring", "o_direct")
# `qreg` (Q K^T's A from registers) at d_head 64 only: there the GEMMs' shared-memory reads bind
# (96 + 64 bytes per tensor clock of 128); on an H200 (2026-11-29, NOTES.md item 372) it gained
# 0.2-4.7% on d_head 64's two-consumer tiles and lost 0.5-2.8% at d_head 128. Its registers
# (d_head / 4) do not fit three overlapped consumer warpgroups without psmem.
_Q_REGS_D_HEADS = (64,)
# `halflast` (a warpgroup's last key block cut to its first half) on causal rows at d_head 64 only:
# on an H200 (2026-11-29, NOTES.md item 379) it gained 2.1-2.7% at 1k-2k in two runs, was level at
# 4k-16k, and at d_head 96 / 256 moved -3.8..+1.5%.
_HALF_LAST_D_HEADS = (64,)
_XTILE = {"turn_ring": True, "cross_tile": True}
_WG_BLOCKS = {"wg_blocks": True}
# lptN on causal rows of one CTA per tile: on an H200 (2026-11-29, NOTES.md item 321) 16 and 32 MiB
# chunks gained 0.5-2% at 8k-16k and lost up to 7% at 2k, so autotune tries them row by row.
_LPT = ({}, {"lpt_mib": 16}, {"lpt_mib": 32})


def knob_twins(cfg: HopperForwardKernelConfig, causal: bool) -> list[HopperForwardKernelConfig]:
    """`cfg` with every combination of `ring` and `oreg` (and at d_head 64 `qreg`, on causal rows
    `halflast` too) added, each also with `xtile` or `wgblocks` (causal rows, and 192-row tiles
    on any row), and on causal rows each of those with `lpt16` or `lpt32`; those the
    family's rules refuse for this config are left out, as is `cfg` itself. Sorted, so the order
    never depends on the caller. Unmasked, `wgblocks` only idles the warpgroups of a last tile
    that lie past the sequence's end, which only a B_r that does not divide a power of two
    leaves at the grid's lengths: with the rotated persistent rounds it gained 1.5-4.5% on d_head
    64's 192-row picks at 512 / 1k / 4k on an H200 (NOTES.md item 394; level at 2k, -1..-2% at
    8k-16k), where the snake's rounds had left it level (item 190). Non-causal grids have no long
    and short tiles for `lpt` to order, so non-causal rows do not spend autotune time on it."""
    out = set()
    exclusive = [{}, _XTILE] + ([_WG_BLOCKS] if causal or cfg.B_r % 128 else [])
    names = (_TWIN_KNOBS + (("q_regs",) if cfg.d_head in _Q_REGS_D_HEADS else ())
             + (("half_last",) if causal and cfg.d_head in _HALF_LAST_D_HEADS else ()))
    for n in range(len(names) + 1):
        for knobs in itertools.combinations(names, n):
            for extra, order in itertools.product(exclusive, _LPT if causal else ({},)):
                try:
                    twin = dataclasses.replace(cfg, **{**{k: True for k in knobs}, **extra, **order})
                except ValueError:
                    continue  # a rule refuses the combination for this config
                if twin != cfg:
                    out.add(twin)
    return sorted(out)


def get_kernel_configs(key: str) -> list[HopperForwardKernelConfig]:
    """'tune', 'prog' (bf16 d128), 'prog_all' (every dtype and d_head), 'defaults' or
    'varlen_defaults' (forward_varlen's cfg=None on Hopper, which prewarm_offdevice builds too)."""
    if key == "tune":
        return autotune_configs()
    if key == "prog":
        return progression_configs()
    if key == "prog_all":
        return sorted({c for dt in DType for d in D_HEADS for c in progression_configs(dt, d)})
    if key == "defaults":
        return sorted({default_config(dt, d, c) for dt in DType for d in D_HEADS for c in (False, True)})
    if key == "varlen_defaults":
        return sorted({varlen_default_config(dt, d, c) for dt in DType for d in D_HEADS for c in (False, True)})
    raise ValueError(f"key: expected one of {KERNEL_SET_KEYS}, got {key!r}")
