"""Named config sets of the Hopper backward family and its default per (dtype, d_head)."""
from __future__ import annotations

import functools
import itertools

from ...config import DType
from ..backward_sm80.config import BackwardKernelConfig
from ..backward_sm80.config_sets import default_config as sm80_default
from .config import B_C_VALUES, B_R_VALUES, D_HEADS, STAGE_VALUES, HopperBackwardKernelConfig

__all__ = ["KERNEL_SET_KEYS", "LONG_CAUSAL_ROWS", "LONG_NONCAUSAL_ROWS", "all_configs", "tune_configs", "progression_configs",
           "default_config", "default_configs", "default_launches", "varlen_default_config", "varlen_default_launches",
           "get_kernel_configs", "companion_config"]

KERNEL_SET_KEYS = ("all", "defaults", "varlen_defaults", "tune", "prog")

# (B_r, B_c, n_stages, knobs) per d_head: two consumer warpgroups (128 keys, FA3's d128 tile) and a
# double Q/dO ring. d_head 128: dQ by the writer warp's TMA tensor reductions with the dV | dQ, dK
# order (H100, bf16, S 1k-16k, causal and not: 1.18-1.32x the red.global.add.v2 kernel; dq_tma
# alone 1.17-1.26x; dq_tma+nomask 0.93-1.05x dq_tma; dq_bulk measured 14-18% slower than
# red.global). d_head 64 until the eighth session: red.global.add.v2 (dq_tma then needed each
# warpgroup's half of dQ to be whole 32-column panels of a d 128 row; see below). The other tiles were checked for correctness on the
# H100, not timed: a `tune` sweep is still to do. Since 2026-11-23 (evening, NOTES.md item 73) d_head
# 128 also launches the dK/dV and convert kernels as programmatic dependents and converts dQ
# blocks during the dK/dV tail (pdl+dq_early): bf16, 5 interleaved rounds beside cuDNN, 0.904-0.990x
# against 0.882-0.930x without them, better on every row (1k-16k, causal and not); lpt and three
# stages won some rows and lost others.
# Since 2026-11-23 (fifth session, NOTES.md item 87) the kernel masks only the causal diagonal
# (the sequence tails need no mask), and d_head 128 takes two stages and rotate (each non-causal
# CTA starts at its own query block) for both masks: bf16 and fp16, 1k-16k, 5 interleaved rounds
# beside cuDNN, 0.992-1.023x (geomean 1.012x) against 1.004x for two stages without rotate and
# 0.990x for three stages with it (the fourth session's non-causal default).
# Since the sixth session (NOTES.md items 94-95) d_head 128 takes persistent CTAs (one per SM
# walking tiles, the next tile's loads under the last one's epilogue) that causal calls claim from
# a counter (dynamic; non-causal tiles are alike and keep the static walk): 7 interleaved rounds
# beside cuDNN, bf16 and fp16 at 1k/4k/16k, 1.008-1.053x (geometric mean 1.028x) against
# 0.980-1.028x (1.005x) for the fifth session's `rotate` default; static striding alone ran
# causal calls at 0.63-0.83x (tiles of unequal length), lpt's order with dynamic 0.96x at causal 1k.
# Since the eighth session (NOTES.md items 111, 114) d_head 64 takes 128 query rows per iteration,
# each consumer warpgroup computing dQ for 64 of them over all 128 keys (added once per CTA, by the
# writer warp's TMA reductions), with dq_mid and persistent CTAs behind a pdl preprocess, causal
# tiles claimed from a counter longest first (dynamic no longer needs dq_early, which needs 64-row
# blocks and at d_head 64 cost 15-20% there): 1.06-1.17x cuDNN and 1.3-1.9x backward_sm80's table
# (H100, bf16 and fp16, 1k-16k, causal and not; 3 interleaved rounds), against 0.6x cuDNN for the
# 64-row tile with red.global. One config for both masks, as at d_head 128.
# Since the thirteenth session (NOTES.md item 158) both d_heads keep dQ in fragment order (dq_frag:
# 8 conflict-free 16-byte shared stores per warpgroup and block, one 1-D bulk reduction, the convert
# kernel undoing the order): H100, bf16, three alternating passes of kernel-level call periods
# against the swizzled panels, d128 +3-5% at 4k and 16k (both masks), +1% causal 1k, level
# non-causal 1k; d64 +2-4% at 1k and 4k.
# Since the twenty-fourth session (NOTES.md item 246) causal calls take `nomask`: each query head's
# walk runs the blocks that cut the CTA's keys in a masked loop and the rest in an unmasked
# one (the d128 loop 517 -> 418 instructions, d64 716 -> 586). H100, 3 rounds, the default and
# its nomask twin in one process beside FA3: d128 bf16 / fp16 causal 2k +1.8% / +3.1%, 4k +4.0% /
# +6.1%, 1k level, 16k +1.3% / -0.6%; d64 bf16 2k +1.4%, 4k-16k level.
# Since the thirty-second session (NOTES.md item 297) d_head 96 runs here too, with 64-byte
# swizzled Q/K/V/dO tiles and d_head 128's tile and knobs (each warpgroup computes all 96 dQ
# columns over its own keys: 96 is no two whole 32-column halves of panels), three stages for every
# causal call and rotate for long non-causal ones (LONG_CAUSAL_ROWS / LONG_NONCAUSAL_ROWS). H200
# at the power cap, 3 rounds, 1k-16k: causal three stages +1-5% over two on all 10 rows; non-causal
# rotate +1.5-4% at 8k-16k, level at 2k-4k; 1.5-1.9x backward_sm80's d96 default.
# Since the thirty-third session (NOTES.md items 302-303) d_head 256 runs here too: two consumer
# warpgroups share 64 keys and split dK/dV's columns (`kv_split`), P^T and dS^T meet in shared
# memory. With dQ by fp32 atomics (two stages) it ran 220-305 TFLOP/s on the H200 at the power cap
# (bf16, 1k-16k), 1.24-1.28x backward_sm80's pds pick; one stage ran level with two, and one stage
# leaves the 64 KiB that dq_tma stages dQ in: dq_tma+pdl+dq_frag 284-452, +35-50% over the atomics
# and 1.14-1.25x cuDNN (persistent+dynamic level, persistent alone 0.66-0.8x causal). `nomask`
# measured -1..-4% on the causal rows (atomic kernel), so d_head 256's causal calls go without it
# (NO_NOMASK_D_HEADS).
# Since the thirty-fourth session (NOTES.md item 308) d_head 96 splits dQ's columns 64 + 32 over
# the two warpgroups (`dq_colsplit`: each over all 128 keys, every dQ element added once per CTA,
# half the fp32 reduction bytes): H200 at the power cap, 3 interleaved rounds, bf16 and fp16, 1k-16k,
# non-causal +20-26% (1.18-1.25x cuDNN, from 0.96-1.00x), causal +16-22% (1.22-1.28x cuDNN).
# Since the thirty-fifth session (NOTES.md item 315) d_head 256 computes its score tiles by role
# (`sdp_roles`: warpgroup 0 S^T over all 64 queries, warpgroup 1 dP^T, P^T handed over in fp32;
# the same bits as the split tiles): H200 at the power cap, two same-process runs of 3 rounds, bf16
# and fp16, 1k-16k: non-causal +2.7% / +3.2% on average (-1.4..+6.5% per row), causal +0.9% / +1.4%
# (-1.5..+4.7%).
# Since the thirty-seventh session (NOTES.md item 330) d_head 256's one stage loads dO (with dvec)
# and Q (with lse2) on barriers of their own (`qdo_split`): dO's slot is refilled once dV is done,
# while dK and dQ still run, and only Q's bytes land after dK's release. H200 at the power cap, one
# same-process run of 3 rounds, bf16 and fp16, 1k-16k: non-causal +3.0% on average (+1.4..+5.0%
# per row), causal +1.6% (-1.3..+4.2%); the same bits.
CAUSAL_KNOBS = {"nomask": True}
NO_NOMASK_D_HEADS = (256,)
_DEFAULTS = {64: (128, 128, 2, {"dq_tma": True, "dq_mid": True, "lpt": True, "pdl": True, "persistent": True,
                                "dynamic": True, "dq_frag": True}),
             96: (64, 128, 2, {"dq_tma": True, "dq_mid": True, "pdl": True, "dq_early": True, "persistent": True,
                               "dynamic": True, "dq_frag": True, "dq_colsplit": True}),
             128: (64, 128, 2, {"dq_tma": True, "dq_mid": True, "pdl": True, "dq_early": True, "persistent": True,
                                "dynamic": True, "dq_frag": True}),
             256: (64, 64, 1, {"dq_tma": True, "pdl": True, "dq_frag": True, "sdp_roles": True, "qdo_split": True})}

# Causal calls at d_head 128 with at least this many query rows take a three-stage Q/dO ring (the
# ninth session, NOTES.md item 121): with persistent CTAs claiming causal tiles from a counter, the
# deeper ring carries the producer further into the next tile while the consumers finish the last
# one (causal tiles are short and many). H100, bf16/fp16, 3 interleaved rounds, two runs: 4k
# +5-8%, 8k +6-8%, 16k +2-3% over two stages; 2k level; 1k -2% (so shorter calls keep two stages;
# non-causal calls -2% at 1k and level at 4k/16k, so they keep two as well). d_head 96: every causal
# call (item 297).
LONG_CAUSAL_ROWS = {96: 0, 128: 4096}
# Non-causal calls at d_head 128 with at least this many query rows start each CTA's walk over the
# query blocks at its own block (`rotate`, on the persistent static walk; `dynamic` only orders
# causal tiles, so the config leaves it out): the CTAs of a head then add into different dQ rows.
# Two runs of 5 interleaved rounds (NOTES.md item 127): 8k +1.9-2.6% in both dtypes (cuDNN's level
# there, which the plain walk missed by 1-2%), 16k +1.5% on average (-0.8 to +4.5%), 4k -1.7%,
# 2k -2%. d_head 96 alike (item 297: 8k +1.5-2%, 16k +4%, 2k-4k level).
LONG_NONCAUSAL_ROWS = {96: 8192, 128: 8192}

# Launch knob combinations in the `all` set (on the dq_tma+dq_mid tile, two stages).
LAUNCH_KNOB_SETS = ({"lpt": True}, {"pdl": True}, {"pdl": True, "dq_early": True},
                    {"lpt": True, "pdl": True, "dq_early": True},
                    {"lpt": True, "pdl": True, "dq_early": True, "persistent": True},
                    {"lpt": True, "pdl": True, "dq_early": True, "persistent": True, "dynamic": True})
# B_r 128 (d_head 64; dq_early, and with it dynamic, need B_r 64): on the dq_tma+dq_mid tile,
# besides LAUNCH_KNOB_SETS' lpt and pdl.
B_R128_KNOB_SETS = ({"rotate": True}, {"pdl": True, "persistent": True}, {"pdl": True, "persistent": True, "dynamic": True},
                    {"lpt": True, "pdl": True, "persistent": True, "dynamic": True})
# On the defaults' launch knobs (pdl+dq_early), two and three stages: the block order knob.
ORDER_KNOB_SETS = ({"rotate": True}, {"rotate": True, "persistent": True}, {"persistent": True},
                   {"persistent": True, "dynamic": True})


def _with(cfg: HopperBackwardKernelConfig, **knobs) -> list[HopperBackwardKernelConfig]:
    """[cfg with `knobs`], or [] where that breaks a rule (dq_early needs B_r 64)."""
    try:
        return [cfg.replace(**knobs)]
    except ValueError:
        return []


def all_configs() -> list[HopperBackwardKernelConfig]:
    out = []
    # dQ modes (dq_bulk, dq_tma): fp32 atomics, bulk row reductions, TMA tensor reductions
    for dtype, d, br, bc, st, (bulk, tma) in itertools.product(DType, D_HEADS, B_R_VALUES, B_C_VALUES, STAGE_VALUES,
                                                               ((False, False), (True, False), (False, True))):
        try:
            cfg = HopperBackwardKernelConfig(dtype, d, br, bc, st, bulk, tma)
        except ValueError:
            continue
        out.append(cfg)
        if cfg.kv_split:  # d_head 256: the causal walk's split; with dq_tma (one stage) the launch knobs
            out += _with(cfg, nomask=True)
            if tma:
                out += [c for knobs in KV_SPLIT_KNOB_SETS for c in _with(cfg, **knobs)]
        if tma:  # the schedule knobs, on the dq_tma tile only (the set stays small)
            out += _with(cfg, dq_mid=True) + _with(cfg, nomask=True)
            if st == 2:  # the launch knobs on the dq_tma+dq_mid tile
                out += [c for knobs in LAUNCH_KNOB_SETS for c in _with(cfg, dq_mid=True, **knobs)]
            elif st == 3:  # three stages (lse2/dvec in their own ring): pdl+dq_early, and all three
                out += [c for knobs in LAUNCH_KNOB_SETS[-2:] for c in _with(cfg, dq_mid=True, **knobs)]
            if st >= 2:  # the block order knobs on pdl+dq_early
                out += [c for knobs in ORDER_KNOB_SETS for c in _with(cfg, dq_mid=True, pdl=True, dq_early=True, **knobs)]
            if cfg.B_r == 128 and st == 2:  # dq_early needs B_r 64: the launch and order knobs without it
                out += [c for knobs in B_R128_KNOB_SETS for c in _with(cfg, dq_mid=True, **knobs)]
    # (dq_frag: in no other set; their swizzled-panel twins, most above, the causal ones' here)
    out += default_configs() + [c.replace(dq_frag=False) for c in default_configs()]
    out += [c.replace(dq_frag=False) for c in out if c.kv_split and c.dq_frag]
    # d_head 96: every two-warpgroup 64-row config with and without dQ's columns split 64 + 32
    out += [c.replace(dq_colsplit=not c.dq_colsplit) for c in out
            if c.d_head == 96 and c.B_r == 64 and c.consumer_warpgroups == 2]
    # d_head 256: every config with and without the score tiles by role (sdp_roles)
    out += [c.replace(sdp_roles=not c.sdp_roles, qdo_split=False) for c in out if c.kv_split]
    # ... and those by role with Q and dO on barriers of their own (qdo_split)
    out += [c.replace(qdo_split=True) for c in out if c.sdp_roles]
    return sorted(set(out))


def default_config(dtype: DType, d_head: int, causal: bool = True, seq_len_q: int = 0) -> HopperBackwardKernelConfig:
    """The config cfg=None runs for (dtype, d_head), with or without the causal mask, for calls of
    `seq_len_q` query rows (0: a short call). One tile and knob set for both masks (`dynamic` and
    `lpt` order only causal calls' tiles), causal calls with CAUSAL_KNOBS; at d_head 128 long
    causal calls take three stages (LONG_CAUSAL_ROWS) and long non-causal ones `rotate`
    (LONG_NONCAUSAL_ROWS)."""
    if d_head not in _DEFAULTS:
        raise ValueError(f"q: d_head {d_head} is not supported by backward_sm90 (supported: {D_HEADS})")
    br, bc, stages, knobs = _DEFAULTS[d_head]
    if causal and seq_len_q >= LONG_CAUSAL_ROWS.get(d_head, 1 << 62):
        stages = 3
    if not causal and seq_len_q >= LONG_NONCAUSAL_ROWS.get(d_head, 1 << 62):
        knobs = {**knobs, "rotate": True, "dynamic": False}
    if causal and d_head not in NO_NOMASK_D_HEADS:
        knobs = {**knobs, **CAUSAL_KNOBS}
    return HopperBackwardKernelConfig(dtype, d_head, br, bc, stages, **knobs)


def default_launches() -> list[tuple[HopperBackwardKernelConfig, bool]]:
    """(config, causal) of every call cfg=None makes: default_config over both masks, short and
    long calls. (A config is not launched with the other mask: `rotate` orders only non-causal
    walks, and its causal instance, never run, is the one ptxas serialises, C7512.)"""
    return sorted({(default_config(dt, d, causal, rows), causal) for dt in DType for d in _DEFAULTS
                   for causal in (False, True)
                   for rows in (0, LONG_CAUSAL_ROWS.get(d, 0), LONG_NONCAUSAL_ROWS.get(d, 0))})


# d_head 256 with dq_tma (one stage: the staged dQ takes the second stage's 64 KiB): the launch knobs
# and dq_frag, as the other head dims' defaults combine them.
KV_SPLIT_KNOB_SETS = ({"pdl": True}, {"pdl": True, "dq_early": True}, {"pdl": True, "dq_frag": True},
                      {"pdl": True, "dq_early": True, "dq_frag": True},
                      {"pdl": True, "dq_early": True, "persistent": True, "dq_frag": True},
                      {"pdl": True, "dq_early": True, "persistent": True, "dynamic": True, "dq_frag": True})

# backward_varlen's exceptions to default_config (the varlen kernels read each tile's sequence
# from cu_seqlens; their tiles cover the longest sequence for every sequence, so tiles differ in
# work even without the mask, and the varlen kernels claim them from the counter (`dynamic`) in
# both masks). H100, 2026-11-27, the varlen bench's ragged batch (11 sequences, 32768 tokens,
# longest 6969), 3 interleaved rounds (NOTES.md items 205-206):
# - d128 causal: the default's varlen instance, with dq_frag, is one ptxas serialises (C7512);
#   without dq_frag bf16 480.7 TFLOP/s against 402.3 with it and 449.5 without dq_mid instead;
#   fp16 452.0 / 407.6 / 445.8.
# - d128 non-causal: dynamic claims need dq_mid off (with it, C7512): bf16 517.4 against 471.0 for
#   the static walk and 466.7 with rotate; fp16 499.9 / 462.5 / 457.2.
# - d64 non-causal: the default (its `dynamic` now claims non-causal varlen tiles too) 469.5 / 461.6
#   against 431.2 / 421.8 for the static walk.
# - causal: `nomask` as the dense defaults (twenty-fifth session, NOTES.md item 249; the same batch,
#   the default and its twin without nomask in one process, two passes, 0.3 s sustain): d128 bf16
#   493.0 / 493.8 against 457.3 / 470.3 (+5-8%), fp16 475.1 / 486.3 against 449.8 / 453.8 (+6-7%);
#   d64 level (bf16 433.5 / 420.2 against 428.7 / 432.8, fp16 415.4 / 411.2 against 418.8 / 408.6).
# H200, 2026-11-29 (NOTES.md items 336-340): on equal lengths the dense call given these picks ran
# as the varlen call did, 3-9% under the dense picks: the knobs dropped here were the whole gap.
# - d128 causal since then: the dense default plus `park` (the varlen values in shared memory, no
#   C7512 with dq_frag): +4.0..+7.1% over the default without dq_frag, 0.97-1.00x FA3's varlen
#   backward (bench's ragged batch and equal lengths, both dtypes).
# - d128 non-causal since the tail zeroer (NOTES.md item 347): the dense default (dq_mid back)
#   with claims instead of `rotate`, and `park`, whose non-causal builds zero a sequence's K/V
#   rows past its end in two idle producer warps and clamp every block's exponent (one loop
#   instance: no C7512 with dq_mid).
def varlen_default_config(dtype: DType, d_head: int, causal: bool = True, seq_len_q: int = 0) -> HopperBackwardKernelConfig:
    """The config backward_varlen's cfg=None runs (seq_len_q: max_seqlen_q): default_config with
    the varlen exceptions above."""
    cfg = default_config(dtype, d_head, causal, seq_len_q)
    if d_head == 128:
        cfg = cfg.replace(park=True) if causal else cfg.replace(rotate=False, dynamic=True, park=True)
    elif d_head == 96 and not causal:  # varlen tiles differ in work: claimed (d96 keeps dq_mid, no C7512)
        cfg = cfg.replace(rotate=False, dynamic=True)
    return cfg


def varlen_default_launches() -> list[tuple[HopperBackwardKernelConfig, bool]]:
    """(config, causal) of every call backward_varlen's cfg=None makes, as default_launches."""
    return sorted({(varlen_default_config(dt, d, causal, rows), causal) for dt in DType for d in _DEFAULTS
                   for causal in (False, True)
                   for rows in (0, LONG_CAUSAL_ROWS.get(d, 0), LONG_NONCAUSAL_ROWS.get(d, 0))})


def default_configs() -> list[HopperBackwardKernelConfig]:
    """Every config default_config returns (both masks, short and long calls)."""
    return sorted({cfg for cfg, _ in default_launches()})


def tune_configs() -> list[HopperBackwardKernelConfig]:
    """Every valid config with at least two stages (one stage serialises loads and GEMMs)."""
    return [c for c in all_configs() if c.n_stages >= 2]


def progression_configs(dtype: DType = DType.BF16, d_head: int = 128) -> list[HopperBackwardKernelConfig]:
    """The optimisation history at (dtype, d_head), oldest first: at d_head 128 the first kernel
    (dQ by red.global.add.v2), + dq_tma, + dq_mid, + pdl+dq_early+persistent+dynamic, + dq_frag,
    + nomask (the causal default; at d_head 96 + dq_colsplit before it); at d_head 64 the first kernel's 64-row tile, then 128 rows (dQ
    split by rows), + dq_tma, + dq_mid, + lpt+pdl+persistent+dynamic, + dq_frag, + nomask; at d_head
    256 (kv_split) the atomic two-stage kernel, + dq_tma at one stage, + pdl+dq_frag, + sdp_roles,
    + qdo_split."""
    if d_head not in _DEFAULTS:
        return []
    last = default_config(dtype, d_head)
    if last.kv_split:  # d_head 256: the atomic kernel (two stages), + dq_tma (one stage), + pdl+dq_frag, + sdp_roles,
        # + qdo_split
        split = last.replace(sdp_roles=False, qdo_split=False)
        return [split.replace(n_stages=2, dq_tma=False, pdl=False, dq_frag=False),
                split.replace(pdl=False, dq_frag=False), split, split.replace(sdp_roles=True), last]
    if not last.dq_tma:
        return [last]
    first = last.replace(dq_tma=False, dq_mid=False, nomask=False, pdl=False, dq_early=False, lpt=False,
                         rotate=False, persistent=False, dynamic=False, dq_frag=False, dq_colsplit=False)
    plain = last.replace(nomask=False)
    steps = [first, first.replace(dq_tma=True), first.replace(dq_tma=True, dq_mid=True),
             plain.replace(dq_frag=False, dq_colsplit=False), plain.replace(dq_colsplit=False), plain, last]
    if first.B_r != 64:
        steps.insert(0, first.replace(B_r=64))
    return list(dict.fromkeys(steps))


def get_kernel_configs(key: str) -> list[HopperBackwardKernelConfig]:
    k = key.strip().lower()
    if k == "all":
        return all_configs()
    if k == "defaults":
        return default_configs()
    if k == "varlen_defaults":  # backward_varlen's cfg=None (prewarm_offdevice builds both sets)
        return sorted({cfg for cfg, _ in varlen_default_launches()})
    if k == "tune":
        return tune_configs()
    if k == "prog":
        return progression_configs()
    raise ValueError(f"KERNELS: unknown backward_sm90 set {key!r}; expected one of {KERNEL_SET_KEYS}")


@functools.lru_cache(maxsize=256)
def companion_config(cfg: HopperBackwardKernelConfig) -> BackwardKernelConfig:
    """The backward_sm80 config whose row kernels (preprocess, convert) and deterministic dQ
    kernel this family's module instantiates: backward_sm80's default for (dtype, d_head) with
    this config's query block, so both families pad the fp32 workspaces alike. Cached: every
    call's launch sequence asks for it, and building a validated config costs ~25 us."""
    return sm80_default(cfg.dtype, cfg.d_head).replace(B_r=cfg.B_r)
