"""The Hopper forward family's configuration (sm_90a): `HopperForwardKernelConfig`.

A frozen, ordered dataclass like the mma.sync family's: its fields become the C++ struct of the
same name (rendered by cupyflash.render from templates/forward_sm90.cu.j2), the NVRTC name
expression and
the short form, which names the family:

    forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent
    forward_sm90(BF16, 128, 128, 128, 2): cpasync
    forward_sm90(dtype, d_head, B_r, B_c, n_stages): features

The features start with how Q/K/V reach shared memory: `tma` (TMA copies) or `cpasync` (16-byte
cp.async copies issued by every consumer thread: the progression's first step, wgmma alone);
`ws`, `pingpong`, `overlap`, `persistent`, `qbuf2` (two Q tiles), `oreg` (O stored from
registers, 16 bytes per lane after a lane-quad transpose, Q released early), `lazy` (threshold
rescaling), `ring` (the ping-pong turn ring runs on across a persistent CTA's tiles), `xtile` (a
tile's last P V issued behind the next tile's first Q K^T), `wgblocks` (each consumer
warpgroup stops at its own last needed key block: none past the sequence's end, causal its own
diagonal), `psmem` (P V reads P from shared memory, not registers), `cluster2` (CTAs in clusters
of two that share each K/V tile's loads by TMA multicast), `lptN` (causal grids start the longest
tiles of chunks of heads whose K and V fit N MiB first), `qreg` (Q K^T reads Q's fragments from
registers), `halflast` (a warpgroup's last key block, when no row of it sees the block's second
half, runs its softmax and P V on the first half) and `emuN` (exp2 of N quarters of the
scores on the FMA units)
are the optional features. Invalid combinations raise
ValueError naming the rule.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ...config import DType, KernelConfig

__all__ = ["HopperForwardKernelConfig", "D_HEADS", "B_R_VALUES", "B_C_VALUES", "STAGE_VALUES", "EXP_EMULATION_VALUES",
           "LPT_MIB_VALUES",
           "MAX_SMEM_PER_BLOCK", "FAMILY"]

FAMILY = "forward_sm90"
D_HEADS = (64, 96, 128, 256)  # multiples of 64: 128-byte swizzled rows; 96: three 64-byte ones
B_R_VALUES = (64, 128, 192)   # 64 query rows per consumer warpgroup (one wgmma m64 tile)
# key-tile columns: the N of S = Q K^T (FA3 uses 176 at d128, 80 at d256, 192 at d64)
B_C_VALUES = (64, 80, 128, 176, 192)
STAGE_VALUES = (1, 2, 3, 4)   # K/V ring slots
EXP_EMULATION_VALUES = (0, 1, 2)  # quarters of each row's score columns whose exp2 runs on the FMA units
LPT_MIB_VALUES = (0, 4, 8, 16, 32, 64)  # lpt's K/V bytes per chunk of heads (0: each head's tiles in turn)
MAX_SMEM_PER_BLOCK = 227 * 1024  # sm_90 opt-in dynamic shared memory per CTA
WG_ROWS = 64
_LOADS = {"tma": False, "cpasync": True}  # first feature of the short form -> cp_async
# fp32 registers of the S and O accumulators a consumer thread holds (BC/2 + d/2), plus P
# (BC/4) unless P is staged in shared memory, plus Q's fragments (d/4) with q_regs, by consumer
# warpgroups: above these the consumers (setmaxnreg 256 / 240 / 160 registers) spill.
ACCUMULATOR_BUDGET = {1: 200, 2: 200, 3: 128}


@dataclass(frozen=True, order=True)
class HopperForwardKernelConfig(KernelConfig):
    """Static configuration of one Hopper forward kernel instantiation (field order = C++ order).
    KernelConfig.__post_init__ checks field kinds and the rules of `_rules`."""

    FAMILY: ClassVar[str] = FAMILY

    dtype: DType
    d_head: int
    B_r: int
    B_c: int
    n_stages: int
    warp_specialized: bool   # a producer warpgroup issues TMA; consumers get its registers (setmaxnreg)
    pingpong: bool           # two consumer warpgroups take turns on the tensor cores (named barriers)
    intra_wg_overlap: bool   # QK^T of block j issued with P V of block j-1; softmax overlaps P V
    persistent: bool         # ~one CTA per SM loops over tiles; loads run ahead across tile boundaries
    # Two Q tiles (persistent only): the next tile's Q loads while this tile's epilogue stages O
    # in its own Q tile, so a short tile's prologue no longer waits for the previous epilogue.
    double_q: bool = False
    # exp2 of `exp_emulation` quarters of the score columns by a polynomial on the FMA units,
    # the rest by MUFU.EX2: at d_head 64 the 16 ex2/clock/SM take as long as the GEMMs.
    exp_emulation: int = 0
    # Q/K/V loaded by the consumer threads with 16-byte cp.async (zero-filled past the sequence
    # ends) into the same swizzled tiles, instead of TMA: wgmma without the copy engine.
    cp_async: bool = False
    # O written to global memory straight from the accumulator registers (4-byte stores) instead
    # of staged through the Q tile; persistent CTAs then release their Q tile as soon as the
    # tile's last Q K^T has completed, so the next tile's Q loads during the last P V and the
    # epilogue (at d256 no second Q tile fits in shared memory).
    o_direct: bool = False
    # Lazy rescaling: a row's running max (and O, and its sum) are only moved when a block's max
    # exceeds it by more than 2^8 in exp2 units; otherwise the stale max stays (probabilities up
    # to 256, exact in fp32 and representable in fp16/bf16) and the O rescale (d_head/2 FMULs
    # per thread per key block) is skipped by the whole warp.
    lazy_rescale: bool = False
    # Ping-pong turns across tiles (persistent): the last consumer warpgroup hands the tensor cores
    # to warpgroup 0 right after its last GEMM of a tile, so warpgroup 0 starts the next tile's
    # Q K^T during the others' epilogues; without it every tile starts the ring anew, after the
    # last warpgroup's epilogue. Short tiles gain (H100: d_head 64 at S 512-1k +2-4%, causal
    # d_head 128 at 512-1k +1-2.5%), d_head 128 non-causal at 1k-2k lost 1-3% (NOTES.md item 133).
    turn_ring: bool = False
    # Cross-tile overlap (persistent, two Q tiles, turn ring, intra-warpgroup overlap): a tile's
    # last P V is issued behind the next tile's first Q K^T, whose masking and softmax statistics
    # run while P V completes; the epilogue follows, and the next tile starts at its second key
    # block. Meant for short tiles (S 512-1k: 4-8 key blocks), where the per-tile prologue weighs.
    cross_tile: bool = False
    # Each consumer warpgroup stops at the last key block its own 64 rows need, instead of at the
    # tile's: one whose rows all lie past the end of the sequence computes nothing (the last tile
    # of a length that is not a multiple of B_r: d_head 64's 192-row tiles at S = 512-4k), and,
    # causal, a lower warpgroup of a tile skips up to two key blocks its mask would empty. It
    # takes its ping-pong turns without GEMMs and releases their K/V stages. The wasted work is
    # large on short causal tiles of three warpgroups (192x128: 10% of the warpgroup-blocks
    # computed at causal 2k, 25% at 1k) and on 192-row tiles whose sequence ends a warpgroup
    # or two into the last tile (non-causal d_head 64: 1/33 of the work at 2k, 1/9 at 1k),
    # smaller under B_c < 128 (d_head 256's 128x64 / 128x80) and absent from 128-row tiles with
    # B_c = 128 when seq_q = seq_k is a multiple of 128. Measured per row: it costs some long
    # causal rows 1-4% (NOTES.md items 184-185), so the table takes it row by row.
    wg_blocks: bool = False
    # P staged in shared memory: each consumer warpgroup stores its 16-bit probabilities to its
    # own 128B-swizzled P tile (stmatrix) and P V reads both operands from shared memory. That
    # frees the B_c/4 registers P held across the softmax, so d_head 128 fits three consumer
    # warpgroups (192 x 128: 64 + 64 accumulator registers of 160), at the cost of B_c x 128
    # bytes of shared memory per warpgroup and a store per block. Measured on an H200 (NOTES.md
    # item 276): d_head 128 192 x 128 +3-5% over the two-warpgroup picks at S >= 4k (the table's
    # long rows); d_head 64 lost 3-9% on every tile (192 x 128, 192 x 192), where P V's
    # m64n64k16 from shared memory takes the SM's whole shared-memory bandwidth.
    p_smem: bool = False
    # CTAs in clusters of two, the query blocks 2i and 2i + 1 of one head (the grid padded to an
    # even count): on non-causal dense calls each CTA's producer loads every other 64-column block
    # of a K or V tile and multicasts it into both CTAs, so each K/V tile leaves L2 once per pair
    # (FlashAttention-3 clusters its non-causal d_head >= 128 forward so). Causal and varlen calls,
    # whose paired tiles may visit different key blocks, run the two CTAs independently.
    cluster: bool = False
    # Causal, one CTA per tile: the grid's CTAs start with the longest tiles of every (head, batch)
    # of a chunk (query block nqb-1 of each, then nqb-2, ...) instead of each head's tiles in turn,
    # so the last CTAs to start are the short ones. The hardware starts CTAs in linear block order;
    # with each head's tiles in turn the last head's long tiles start late and run alone (a list-
    # scheduling model puts that at 6-10% of the makespan at 2k-16k, 132 SMs; on an H200 at its
    # power cap, where a tail's idle SMs let the busy ones clock higher, it measured +0.4-2% at
    # 8k-16k and up to -7% at 2k: NOTES.md item 321). A chunk holds the heads whose K and V fit in
    # `lpt_mib` MiB: the tiles of a head no longer run together (each K/V block is read again a
    # tile's time later), so the chunk bounds what L2 must hold. Persistent CTAs balance by pairs
    # of tiles already; non-causal tiles are equal. 0: off.
    lpt_mib: int = 0
    # Q's fragments in registers: each consumer warp loads its 16 rows of the tile's Q once
    # (ldmatrix, d_head / 4 registers per thread) and Q K^T reads A from registers, B (K) from
    # shared memory. Each Q K^T k-step then reads 4 KiB of shared memory instead of 6 (m64n128k16):
    # at d_head 64 the GEMMs read 96 (Q K^T) and 64 (P V) bytes per tensor-core clock of the
    # 128 an SM's shared memory serves, besides the K/V stores. With o_direct on a persistent CTA
    # the Q tile is released after the tile's first Q K^T instead of its last.
    q_regs: bool = False
    # A consumer warpgroup's last key block whose second half no row of the warpgroup sees (causal:
    # its last row's diagonal lies in the first half, which with B_c 128 is every other
    # warpgroup's last block; or the keys end there) has its mask, softmax, P conversion and P V
    # cut to the first B_c / 2 columns: half of that block's exponentials and of its P V. Q K^T
    # keeps its one width (a second wgmma shape serialises the kernel's wgmmas, NOTES.md item 233).
    half_last: bool = False

    # ------------------------------------------------------------------ rules
    def _rules(self) -> Iterator[tuple[str, bool]]:
        yield f"d_head in {D_HEADS}", self.d_head in D_HEADS
        yield f"B_r in {B_R_VALUES}", self.B_r in B_R_VALUES
        yield f"B_c in {B_C_VALUES}", self.B_c in B_C_VALUES
        yield f"n_stages in {STAGE_VALUES}", self.n_stages in STAGE_VALUES
        yield ("pingpong needs two or three consumer warpgroups (B_r >= 128) and warp_specialized",
               not self.pingpong or (self.B_r >= 128 and self.warp_specialized))
        yield "B_r == 192 (three consumer warpgroups) needs warp_specialized (setmaxnreg)", \
            self.B_r != 192 or self.warp_specialized
        yield "persistent needs warp_specialized (the producer runs ahead across tiles)", \
            not self.persistent or self.warp_specialized
        yield "double_q needs persistent (only a CTA with a next tile can load its Q early)", \
            not self.double_q or self.persistent
        yield "turn_ring needs persistent and pingpong (it carries the ping-pong turns across tiles)", \
            not self.turn_ring or (self.persistent and self.pingpong)
        yield ("cross_tile needs turn_ring, double_q and intra_wg_overlap (the next tile's first Q K^T is "
               "issued with this tile's last P V, from the other Q tile, in the same ping-pong turn)",
               not self.cross_tile or (self.turn_ring and self.double_q and self.intra_wg_overlap))
        yield f"exp_emulation in {EXP_EMULATION_VALUES}", self.exp_emulation in EXP_EMULATION_VALUES
        yield ("cp_async loads need the plain mainloop (no ws, pingpong, overlap, persistent, qbuf2): "
               "every consumer thread copies between its own GEMMs",
               not self.cp_async or not (self.warp_specialized or self.pingpong or self.intra_wg_overlap
                                         or self.persistent or self.double_q))
        yield ("wg_blocks needs warp_specialized and no cross_tile (the producer loads every block of the tile; "
               "the carried first block of xtile assumes every warpgroup visits all of them)",
               not self.wg_blocks or (self.warp_specialized and not self.cross_tile))
        yield ("cluster needs warp_specialized (the producer's TMA multicast), no persistent (one tile per CTA, "
               "paired with its neighbour's) and d_head a multiple of 128 (a CTA loads every other 64-column block)",
               not self.cluster or (self.warp_specialized and not self.persistent and self.d_head % 128 == 0))
        yield f"lpt_mib in {LPT_MIB_VALUES}", self.lpt_mib in LPT_MIB_VALUES
        yield ("lpt needs one CTA per tile (no persistent: its pairs of tiles balance already; no cluster: "
               "a cluster's CTAs are query blocks 2i and 2i + 1 of one head)",
               not self.lpt_mib or not (self.persistent or self.cluster))
        yield ("q_regs needs TMA loads and no cross_tile (the next tile's first Q K^T would read the other "
               "Q tile's fragments) and d_head <= 128 (d_head / 4 registers per consumer thread)",
               not self.q_regs or (not self.cp_async and not self.cross_tile and self.d_head <= 128))
        yield ("half_last needs intra_wg_overlap, no cross_tile (it cuts the overlapped mainloop's last block; "
               "xtile issues that block's P V elsewhere) and B_c a multiple of 32 (whole P V k-steps per half)",
               not self.half_last or (self.intra_wg_overlap and not self.cross_tile and self.B_c % 32 == 0))
        yield ("half_last at d_head 128 on three consumer warpgroups needs one CTA per tile (the persistent build's "
               "second copy of the last loop step spills 76-108 bytes at 160 registers)",
               not (self.half_last and self.d_head >= 128 and self.consumer_warpgroups == 3 and self.persistent))
        yield ("intra_wg_overlap needs n_stages >= 2 (K of block j and V of block j-1 are in use together)",
               not self.intra_wg_overlap or self.n_stages >= 2)
        budget = ACCUMULATOR_BUDGET.get(self.consumer_warpgroups, 0)
        yield (f"accumulator registers B_c/2 + d_head/2 (+ B_c/4 without psmem, + d_head/4 with qreg) <= {budget} "
               f"per consumer thread ({self.consumer_warpgroups} consumer warpgroups)",
               self.accumulator_registers() <= budget)
        yield (f"shared memory (Q tile(s) + n_stages K and V tiles + psmem's P tiles + 1 KiB) <= "
               f"{MAX_SMEM_PER_BLOCK} bytes",
               self.smem_bytes() <= MAX_SMEM_PER_BLOCK)

    # ------------------------------------------------------------- resources
    @property
    def consumer_warpgroups(self) -> int:
        return self.B_r // WG_ROWS

    @property
    def n_threads(self) -> int:
        return 128 * (self.consumer_warpgroups + (1 if self.warp_specialized else 0))

    @property
    def q_buffers(self) -> int:
        return 2 if self.double_q else 1

    def accumulator_registers(self) -> int:
        return (self.B_c // 2 + self.d_head // 2 + (0 if self.p_smem else self.B_c // 4)
                + (self.d_head // 4 if self.q_regs else 0))

    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA; must equal StaticHopperForwardConfig::SMEM_BYTES."""
        itemsize = 2
        tiles = (self.q_buffers * self.B_r + 2 * self.n_stages * self.B_c) * self.d_head * itemsize
        if self.p_smem:  # per consumer warpgroup, ceil(B_c / 64) column blocks of 64 rows x 128 bytes
            tiles += self.consumer_warpgroups * -(-self.B_c // 64) * WG_ROWS * 128
        # per Q tile full/empty; per stage k/v full and empty; tail_cleared
        barriers = 8 * (2 * self.q_buffers + 4 * self.n_stages + 1)
        return tiles + barriers + 1024

    # ------------------------------------------------------------ short form
    _FLAGS: ClassVar[dict[str, str]] = {"ws": "warp_specialized", "pingpong": "pingpong",
                                        "overlap": "intra_wg_overlap", "persistent": "persistent",
                                        "qbuf2": "double_q", "oreg": "o_direct", "lazy": "lazy_rescale",
                                        "ring": "turn_ring", "xtile": "cross_tile", "wgblocks": "wg_blocks",
                                        "psmem": "p_smem", "cluster2": "cluster", "qreg": "q_regs",
                                        "halflast": "half_last"}
    _LATE_FLAGS: ClassVar[tuple[str, ...]] = ("oreg", "lazy", "ring", "xtile", "wgblocks", "psmem", "cluster2",
                                              "qreg", "halflast")  # after emuN
    _NUMBERED: ClassVar[dict[str, re.Pattern]] = {"emu": re.compile(r"^emu(?P<n>\d)$"),  # exp_emulation
                                                  "lpt": re.compile(r"^lpt(?P<n>\d+)$")}  # lpt_mib

    def short_form(self) -> str:
        on = [name for name, attr in self._FLAGS.items() if getattr(self, attr)]
        emu = [f"emu{self.exp_emulation}"] if self.exp_emulation else []
        # emuN stays right after the older flags, so every earlier short form reads as before
        features = ([self.loads] + [f for f in on if f not in self._LATE_FLAGS] + emu
                    + [f for f in on if f in self._LATE_FLAGS] + ([f"lpt{self.lpt_mib}"] if self.lpt_mib else []))
        dtype = self.dtype.name if isinstance(self.dtype, DType) else str(self.dtype)
        return (f"{FAMILY}({dtype}, {self.d_head}, {self.B_r}, {self.B_c}, {self.n_stages}): "
                + "+".join(features))

    def __str__(self) -> str:
        return self.short_form()

    @property
    def loads(self) -> str:
        """The short form's first feature: how Q/K/V reach shared memory."""
        return "cpasync" if self.cp_async else "tma"

    _SHORT_RE: ClassVar[re.Pattern] = re.compile(
        r"^forward_sm90\(\s*(?P<dtype>\w+)\s*,\s*(?P<d>\d+)\s*,\s*(?P<br>\d+)\s*,\s*(?P<bc>\d+)\s*,"
        r"\s*(?P<st>\d+)\s*\)\s*:\s*(?P<feat>\S+)\s*$")

    @classmethod
    def parse(cls, text: str) -> "HopperForwardKernelConfig":
        """Inverse of `short_form()`; ValueError on anything else."""
        m = cls._match_short_form(text, cls._SHORT_RE,
                                  "'forward_sm90(DTYPE, d_head, B_r, B_c, n_stages): tma+feature+...'")
        feats = m.group("feat").split("+")
        if feats[0] not in _LOADS:
            raise ValueError(f"cannot parse kernel config {text!r}: features start with 'tma' or 'cpasync'")
        flags = dict.fromkeys(cls._FLAGS.values(), False)
        numbers: dict[str, int] = {}  # numbered features: emuN, lptN
        for feat in feats[1:]:
            matches = {name: pattern.match(feat) for name, pattern in cls._NUMBERED.items()}
            name, match = next(((n, m) for n, m in matches.items() if m), (None, None))
            if match:
                if name in numbers:
                    raise ValueError(f"cannot parse kernel config {text!r}: feature '{name}N' given twice")
                numbers[name] = int(match.group("n"))
                if numbers[name] == 0:
                    raise ValueError(f"cannot parse kernel config {text!r}: '{name}0' is written as no feature")
                continue
            if feat not in cls._FLAGS:
                raise ValueError(f"cannot parse kernel config {text!r}: unknown feature {feat!r}")
            if flags[cls._FLAGS[feat]]:
                raise ValueError(f"cannot parse kernel config {text!r}: feature {feat!r} given twice")
            flags[cls._FLAGS[feat]] = True
        return cls(DType.parse(m.group("dtype")), int(m.group("d")), int(m.group("br")), int(m.group("bc")),
                   int(m.group("st")), flags["warp_specialized"], flags["pingpong"], flags["intra_wg_overlap"],
                   flags["persistent"], flags["double_q"], numbers.get("emu", 0), _LOADS[feats[0]],
                   o_direct=flags["o_direct"], lazy_rescale=flags["lazy_rescale"], turn_ring=flags["turn_ring"],
                   cross_tile=flags["cross_tile"], wg_blocks=flags["wg_blocks"],
                   p_smem=flags["p_smem"], cluster=flags["cluster"], lpt_mib=numbers.get("lpt", 0),
                   q_regs=flags["q_regs"], half_last=flags["half_last"])
