"""The Hopper backward family's configuration (sm_90a): `HopperBackwardKernelConfig`.

Its fields become the C++ struct of the same name (templates/backward_sm90.cu.j2), the NVRTC
name expression and the short form, which names the family:

    backward_sm90(BF16, 128, 64, 128, 2)
    backward_sm90(BF16, 128, 64, 128, 2): dq_bulk
    backward_sm90(BF16, 128, 64, 128, 2): dq_tma
    backward_sm90(BF16, 128, 64, 128, 2): dq_tma+nomask
    backward_sm90(BF16, 128, 64, 128, 2): dq_tma+dq_mid+lpt+pdl+dq_early
    backward_sm90(BF16, 128, 64, 128, 3): dq_tma+dq_mid+pdl+dq_early+rotate
    backward_sm90(BF16, 64, 128, 128, 2): dq_tma+dq_mid
    backward_sm90(dtype, d_head, B_r, B_c, n_stages)[: KNOB+KNOB...]  (KNOBS, in that order)

B_c keys per CTA (64 per consumer warpgroup: the wgmma m64 rows of S^T, dP^T, dK, dV are keys;
at d_head 256 two warpgroups share 64 keys, see `kv_split`),
B_r query rows per iteration (the N of S^T = K Q^T), n_stages Q/dO/lse2/dvec ring slots. dQ = dS K
is one wgmma m64 tile (64 query rows) per consumer warpgroup: with two warpgroups and B_r 128
(d_head 64 only: the accumulator budget) each takes 64 of the rows over all B_c keys; with B_r 64
at d_head 128 each takes half of the columns over all keys, at d_head 96 with `dq_colsplit` 64 or 32
of them (96 splits into no two whole 32-column halves); otherwise each computes all of dQ over its
own 64 keys (each element added twice per CTA). Q, K, V and dO tiles are 128-byte swizzled, at d_head 96 (no multiple of 64
columns) 64-byte swizzled in three 32-column blocks, as the forward family's. How dQ is accumulated is the variant,
not the config: fp32 atomics (red.global.add.v2.f32) into a workspace, or with `deterministic`
backward_sm80's separate dQ pass. `dq_bulk` (two consumer warpgroups at d_head 128 and B_r 64
only) stages each block's fp32 dQ in shared memory and adds it to the workspace with bulk
reductions (cp.reduce.async.bulk, one per row) from one consumer warp, instead of
red.global.add.v2 from every consumer thread. `dq_tma` (two consumer warpgroups) has each
consumer warpgroup stage its share of the block's dQ in two 128B-swizzled fp32 panels of 64 rows
and a writer warp of the producer warpgroup add each panel to the workspace with one TMA tensor
reduction (cp.reduce.async.bulk.tensor, 8 KiB), off the consumers' critical path.
Schedule knobs: `dq_mid` issues dV before the dS^T barrier and dQ then dK after it (dQ is
finished, and its result handed on, while dK still runs; the default queues dV and dK before
the barrier and dQ last); `nomask` splits a causal call's walk over each query head's blocks
into two loops: the blocks that cut the CTA's keys with the diagonal compare, the rest (every
(key, query) pair visible) without it (the causal defaults' since the twenty-fourth session). No call
masks the sequence tails: the preprocess's lse2 = +inf on padding rows and TMA's zero fill past
seq_len_k make those terms vanish or land only in rows that are never stored.
Launch knobs: `lpt` orders causal CTAs longest first (key block 0 of every (kv head, batch) of
a chunk of heads whose Q/dO fit in L2, then key block 1, ...), so the last CTAs to start are the
short ones; non-causal calls keep the plain order. `pdl` launches the dK/dV kernel and the
convert kernel as programmatic dependents (griddepcontrol) of the kernel before each, with the
family's own preprocess and convert kernels (kernels_cu/backward_sm90/rows.cuh): a kernel's
prologue overlaps its predecessor's tail. `dq_early` (needs pdl, dq_tma and B_r 64) converts each query
block's dQ as soon as every key block that adds to it is done: the writer warp counts finished
blocks in per-(batch, head, query block) counters behind the dq_accum workspace, and the convert
kernel's CTAs, started while the dK/dV kernel's last wave still runs, wait on their counter
instead of on the whole dK/dV grid (at d_head 64 it cost 15-20%, NOTES.md item 111).
`rotate` starts each non-causal CTA's walk over the query blocks at its own block (key block n of
N starts at query block n * M / N and wraps), so the CTAs of one head do not add into the same
dQ rows at the same time (causal CTAs already start at their diagonal).
`persistent` (needs dq_tma) launches one CTA per SM that walks tiles (key block, kv head, batch)
t, t + grid, ... in the launch order (with lpt the causal longest-first order): the producer
loads the next tile's K and V as soon as the consumers' last GEMMs of a tile have read them, and
its first Q/dO stages while they still compute, so the epilogue (dK and dV from registers) and
the next tile's loads overlap instead of every CTA paying its launch, K/V load and dQ drain.
`dynamic` (needs persistent and pdl) hands the tiles out from a counter instead: the
producer claims the CTA's next tile with an atomic add once it has issued the current one's
loads and passes it to the consumers and the writer warp through shared memory (the family's
preprocess resets the counter); causal tiles, of unequal length, then balance over the CTAs.
Non-causal calls (tiles all alike) and the deterministic variant (no dQ workspace) keep the
static walk.
`dq_frag` (needs dq_tma and pdl) keeps dQ in the order wgmma leaves it in registers: each
consumer warpgroup stages its 64 x 64 share (64 x 96 at d_head 96) with one conflict-free 16-byte
shared store per n-tile (8, against the swizzled panels' 16 8-byte stores), the writer warp adds
it with one 1-D bulk reduction (16 KiB; 24 KiB) to a dq_accum that holds each 64-row block in that order
(kernels_cu/backward_sm90/config.cuh), and the family's convert kernel undoes the order (no TMA
map of the workspace).
`dq_colsplit` (d_head 96, two consumer warpgroups, B_r 64) splits dQ's columns 64 + 32 over the two
warpgroups, each over all B_c keys (both read every warpgroup's dS^T behind one barrier), as
d_head 128 and 256 always do with halves: each dQ element is added once per CTA instead of twice
(half the reduction traffic to L2), at the price of uneven dQ GEMMs (N = 64 and N = 32).
`sdp_roles` (d_head 256) gives the two warpgroups, which share the CTA's 64 keys, one score tile each
over all 64 queries: warpgroup 0 computes S^T and P^T and hands P^T (fp32) to warpgroup 1 through
shared memory, warpgroup 1 computes dP^T and dS^T = P^T (dP^T - dvec); both take dV's A operand
(P^T) from registers. Without it each computes both tiles for half of the queries (wgmma N = 32),
which reads the K and V tiles once per 32 queries: 192 bytes of shared memory per tensor clock
against the SM's 128.
`qdo_split` (needs sdp_roles) gives each stage's dO (with dvec) a full and an empty barrier of its
own beside Q's (with lse2): warpgroup 0 starts S^T once Q has landed, warpgroup 1 dP^T once dO
has, and dO's slot is released as soon as dV (its last reader) completes, before dK and dQ, so
the producer loads the next block's dO while they run and only Q's bytes land after dK's
release. It is meant for d_head 256's one stage (the staged dQ takes the second's shared memory),
where the whole stage otherwise landed after the block's last Q/dO read.
`park` (the varlen instances only; the dense ones are unchanged): each consumer warp keeps the
tile's sequence values (lengths, token offsets, its walk and mask offset, all read from
cu_seqlens) in a 40-byte shared-memory slot and loads them where they are used (broadcast from
lane 0, so loop bounds stay provably warp-uniform), instead of holding them in registers across
the loop. Those registers tipped the d_head 128 causal consumers with dq_frag into serialised
wgmma (ptxas C7512); parked, they compile without it, and backward_varlen's d_head 128 causal
default takes dq_frag again (+4-7% on the H200, NOTES.md item 340). Non-causal, every block then
clamps the exponent as the dense kernel's last key block does, on the K/V rows past a sequence's
end that the tail zeroer (warps 2-3 of the producer warpgroup, in every varlen build) zeroed: one
instance of the loop, not a second one for the sequence's last key block, which had tipped the
consumers with dq_mid into C7512; so the d_head 128 non-causal default takes dq_mid back (NOTES.md
items 347 and 368).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ...config import DType, KernelConfig

__all__ = ["HopperBackwardKernelConfig", "FAMILY", "KNOBS", "D_HEADS", "B_R_VALUES", "B_C_VALUES", "STAGE_VALUES",
           "MAX_SMEM_PER_BLOCK", "ACCUMULATOR_BUDGET", "WG_KEYS", "DQ_TMA_COLS"]

FAMILY = "backward_sm90"
KNOBS = ("dq_bulk", "dq_tma", "dq_mid", "nomask", "lpt", "pdl", "dq_early", "rotate", "persistent", "dynamic",
         "dq_frag", "dq_colsplit", "sdp_roles", "qdo_split", "park")  # the boolean fields after n_stages, short-form order
D_HEADS = (64, 96, 128, 256)  # dK and dV stay in registers (d_head 256: half of the columns per warpgroup)
B_R_VALUES = (64, 128)       # query rows per iteration: dQ is one wgmma m64 tile per warpgroup (128: two, rows split)
B_C_VALUES = (64, 128)       # one or two consumer warpgroups of 64 keys
STAGE_VALUES = (1, 2, 3)
WG_KEYS = 64
MAX_SMEM_PER_BLOCK = 227 * 1024
# fp32 accumulator registers a consumer thread holds at its peak (dK + dV = d_head, plus the
# larger of S^T + dP^T = B_r and dQ = d_head / 2); the consumers get 240 registers (setmaxnreg)
# with two warpgroups, so more than this leaves too few for addresses and fragments.
ACCUMULATOR_BUDGET = 200
_ROW_KERNEL_ROWS = 64  # backward_sm80's preprocess/convert rows per CTA (the padding unit)
DQ_TMA_COLS = 32  # fp32 columns of one dq_tma panel: 128 bytes, the 128B swizzle span
PARK_SLOT_BYTES = 40  # park: a consumer warp's varlen tile values (ten 32-bit words; config.cuh)
DQ_ROW_PAD = 8  # fp32 padding of each staged dQ row (dq_bulk): 8 banks between rows, conflict-free stores


@dataclass(frozen=True, order=True)
class HopperBackwardKernelConfig(KernelConfig):
    """Static configuration of one Hopper backward kernel set (field order = C++ order)."""

    FAMILY: ClassVar[str] = FAMILY

    dtype: DType
    d_head: int
    B_r: int
    B_c: int
    n_stages: int
    dq_bulk: bool = False
    dq_tma: bool = False
    dq_mid: bool = False
    nomask: bool = False
    lpt: bool = False
    pdl: bool = False
    dq_early: bool = False
    rotate: bool = False
    persistent: bool = False
    dynamic: bool = False
    dq_frag: bool = False
    dq_colsplit: bool = False
    sdp_roles: bool = False
    qdo_split: bool = False
    park: bool = False

    # ------------------------------------------------------------------ rules
    def _rules(self) -> Iterator[tuple[str, bool]]:
        yield f"d_head in {D_HEADS}", self.d_head in D_HEADS
        yield f"B_r in {B_R_VALUES}", self.B_r in B_R_VALUES
        yield f"B_c in {B_C_VALUES}", self.B_c in B_C_VALUES
        yield f"n_stages in {STAGE_VALUES}", self.n_stages in STAGE_VALUES
        yield ("B_r 128 needs two consumer warpgroups (each computes dQ for 64 of the block's query rows)",
               self.B_r == 64 or self.B_c == 2 * WG_KEYS)
        yield ("dq_bulk needs two consumer warpgroups, d_head 128 and B_r 64 (each adds half of dQ's columns)",
               not self.dq_bulk or (self.B_c == 2 * WG_KEYS and self.d_head == 128 and self.B_r == 64))
        yield ("dq_tma needs two consumer warpgroups (each stages its share of dQ: half of the rows with B_r 128, "
               "else half of the columns at d_head 128 and 256 or 64 + 32 with dq_colsplit, else all of dQ over "
               "its own keys)",
               not self.dq_tma or self.consumer_warpgroups == 2)
        yield "dq_bulk and dq_tma exclude each other", not (self.dq_bulk and self.dq_tma)
        yield ("d_head 256 splits dK/dV's columns over two warpgroups that share 64 keys: B_r 64, B_c 64, dQ by fp32 "
               "atomics or dq_tma (two 128-column halves), not dq_bulk or dq_mid",
               self.d_head != 256 or (self.B_r == 64 and self.B_c == WG_KEYS and not (self.dq_bulk or self.dq_mid)))
        yield "dq_mid needs dq_tma (the order is measured and tested there)", not self.dq_mid or self.dq_tma
        yield ("pdl needs dq_tma (the consumers then touch no workspace the preprocess writes)",
               not self.pdl or self.dq_tma)
        yield ("dq_early needs pdl, dq_tma and B_r 64 (the writer warp counts finished blocks, one counter per "
               "64-row convert block)", not self.dq_early or (self.pdl and self.dq_tma and self.B_r == 64))
        yield "persistent needs dq_tma (the writer warp's panel hand-over runs on across tiles)", \
            not self.persistent or self.dq_tma
        yield "dynamic needs persistent and pdl (the family's preprocess resets the tile counter)", \
            not self.dynamic or (self.persistent and self.pdl)
        yield ("dq_frag needs dq_tma and pdl (the family's own convert kernel reads the fragment order)",
               not self.dq_frag or (self.dq_tma and self.pdl))
        yield ("dq_colsplit needs d_head 96, B_r 64 and two consumer warpgroups (dQ's columns 64 + 32, each over "
               "all keys)", not self.dq_colsplit or (self.d_head == 96 and self.B_r == 64
                                                     and self.consumer_warpgroups == 2))
        yield ("sdp_roles needs d_head 256 (its two warpgroups share 64 keys; one computes S^T, the other dP^T)",
               not self.sdp_roles or self.kv_split)
        yield ("qdo_split needs sdp_roles (S^T reads only Q, dP^T only dO, on different warpgroups; dV, the last "
               "GEMM reading dO, completes before dK)", not self.qdo_split or self.sdp_roles)
        yield (f"accumulator registers d_head + max(B_r, d_head / 2) <= {ACCUMULATOR_BUDGET} per consumer thread",
               self.accumulator_registers() <= ACCUMULATOR_BUDGET)
        yield (f"shared memory (K, V, n_stages Q/dO/lse2/dvec stages, two dS^T per warpgroup, dQ staging, 1 KiB) <= "
               f"{MAX_SMEM_PER_BLOCK} bytes", self.smem_bytes() <= MAX_SMEM_PER_BLOCK)

    # ------------------------------------------------------------- resources
    @property
    def kv_split(self) -> bool:
        """d_head 256: two consumer warpgroups share the CTA's 64 keys and take half of dK/dV's
        columns each (64 keys x 256 columns of dK and dV are 256 registers per thread of one
        warpgroup); each computes S^T and dP^T for half of the query block, and P^T and dS^T meet
        in shared memory."""
        return self.d_head == 256

    @property
    def consumer_warpgroups(self) -> int:
        return 2 if self.kv_split else self.B_c // WG_KEYS

    @property
    def n_threads(self) -> int:
        return 128 * (self.consumer_warpgroups + 1)  # + the producer warpgroup

    @property
    def dq_rows(self) -> int:
        """dQ rows of one consumer warpgroup (one wgmma m64 tile): with B_r 128 the two warpgroups
        take 64 each (over all B_c keys)."""
        return self.B_r // 2 if self.consumer_warpgroups == 2 and self.B_r == 2 * WG_KEYS else self.B_r

    @property
    def dq_split(self) -> bool:
        """dQ's columns split over two warpgroups, each over all B_c keys: halves at d_head 128 and
        256 with B_r 64 (whole 64-column swizzle blocks of K), 64 + 32 at d_head 96 with
        `dq_colsplit` (whole 32-column blocks)."""
        two = self.consumer_warpgroups == 2 and self.dq_rows == self.B_r
        return two and (self.d_head >= 128 or self.dq_colsplit)

    def dq_columns(self, warpgroup: int) -> int:
        """dQ columns of consumer warpgroup `warpgroup` (config.cuh's dq_cols): its part of the
        split, else all of them (with B_r 128 for its 64 rows, with B_r 64 over its own keys)."""
        if not self.dq_split:
            return self.d_head
        if self.d_head == 96:
            return 64 if warpgroup == 0 else 32
        return self.d_head // 2

    def accumulator_registers(self) -> int:
        if self.kv_split:  # half of dK and dV, S^T and dP^T of half of the queries (sdp_roles: S^T or dP^T of
            # all of them), half of dQ's columns
            return self.d_head // 2 + max(self.B_r if self.sdp_roles else self.B_r // 2, self.d_head // 4)
        return self.d_head + max(self.B_r, self.d_head // 2)

    def smem_bytes(self) -> int:
        """Dynamic shared memory of the dK/dV kernel; must equal StaticHopperBackwardConfig::SMEM_BYTES."""
        kv = 2 * self.B_c * self.d_head * 2
        stage = 2 * self.B_r * self.d_head * 2  # Q and dO tiles (a multiple of 1024 bytes)
        stats = self.n_stages * 2 * self.B_r * 4  # lse2 and dvec rows of every stage, their own ring
        # two alternating buffers of a dS^T tile per warpgroup (kv_split: one P^T and one dS^T tile)
        ds = 2 * self.consumer_warpgroups * WG_KEYS * self.B_r * 2
        dq = self.B_r * (self.d_head + DQ_ROW_PAD) * 4 if self.dq_bulk else 0  # fp32 dQ rows, padded
        if self.dq_tma:  # each warpgroup's share of the block's fp32 dQ, unpadded swizzled panels
            dq = self.dq_rows * sum(self.dq_columns(w) for w in range(self.consumer_warpgroups)) * 4
        barriers = 8 * (2 + 2 * self.n_stages)  # kv_full, kv_empty, q_full and q_empty per stage
        if self.dynamic:
            barriers += 8 * 4 + 8  # tile_full and tile_empty per slot, two slots of a tile index
        if self.qdo_split:
            barriers += 8 * 2 * self.n_stages  # do_full and do_empty per stage
        barriers += 8 * (2 + self.n_stages)  # varlen's tail zeroer: kv_ready, zero_done, q_tail per stage
        parked = 4 * self.consumer_warpgroups * PARK_SLOT_BYTES if self.park else 0  # a slot per consumer warp
        return kv + self.n_stages * stage + ds + dq + stats + barriers + parked + 1024

    @property
    def pad_rows(self) -> int:
        """Query rows are padded to a multiple of this in the fp32 workspaces (lse2, dvec,
        dq_accum): the query block and the row kernels' 64 rows."""
        return max(self.B_r, _ROW_KERNEL_ROWS)

    # ------------------------------------------------------------ short form
    def short_form(self) -> str:
        dtype = self.dtype.name if isinstance(self.dtype, DType) else str(self.dtype)
        knobs = "+".join(k for k in KNOBS if getattr(self, k))
        tail = f": {knobs}" if knobs else ""
        return f"{FAMILY}({dtype}, {self.d_head}, {self.B_r}, {self.B_c}, {self.n_stages}){tail}"

    def __str__(self) -> str:
        return self.short_form()

    _SHORT_RE: ClassVar[re.Pattern] = re.compile(
        r"^backward_sm90\(\s*(?P<dtype>\w+)\s*,\s*(?P<d>\d+)\s*,\s*(?P<br>\d+)\s*,\s*(?P<bc>\d+)\s*,"
        r"\s*(?P<st>\d+)\s*\)\s*(?::\s*(?P<knobs>\w+(?:\s*\+\s*\w+)*)\s*)?$")

    @classmethod
    def parse(cls, text: str) -> "HopperBackwardKernelConfig":
        """Inverse of `short_form()`; ValueError on anything else."""
        expected = f"'backward_sm90(DTYPE, d_head, B_r, B_c, n_stages)' or with ': KNOB+...' (knobs {KNOBS})"
        m = cls._match_short_form(text, cls._SHORT_RE, expected)
        knobs = [k.strip() for k in m.group("knobs").split("+")] if m.group("knobs") else []
        if any(k not in KNOBS for k in knobs) or len(set(knobs)) != len(knobs):
            raise ValueError(f"cannot parse kernel config {text!r}: expected {expected}")
        return cls(DType.parse(m.group("dtype")), int(m.group("d")), int(m.group("br")), int(m.group("bc")),
                   int(m.group("st")), **{k: True for k in knobs})
