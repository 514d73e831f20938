"""The mma.sync backward family's configuration: `BackwardKernelConfig`.

Its fields are the one source of truth for the C++ struct of the same name, the NVRTC name
expressions, the short form and the cache key. Short form (it names its family, so it can never
be mistaken for another family's):

    backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf
                  (dtype, d_head, B_r, B_c, n_warps): dsplit_N always, then features
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ...config import SUPPORTED_D_HEADS, DType, KernelConfig

__all__ = ["BackwardKernelConfig", "B_R_VALUES", "B_C_VALUES", "N_WARPS_VALUES", "D_SPLIT_VALUES",
           "MAX_ACCUMULATOR_REGISTERS", "MAX_SMEM_BYTES", "FAMILY_NAME"]

FAMILY_NAME = "backward_sm80"
B_R_VALUES = (64, 128)
B_C_VALUES = (32, 64, 128)
N_WARPS_VALUES = (4, 8)
D_SPLIT_VALUES = (1, 2)
# fp32 accumulators a thread may hold at once (dK + dV, plus S^T and dP^T of one query block);
# above this ptxas spills (measured with NVRTC 12.9 on sm_80/sm_90, see the compile tests).
MAX_ACCUMULATOR_REGISTERS = 192
MAX_SMEM_BYTES = 227 * 1024  # the largest opt-in dynamic shared memory of sm_80..sm_90 (H100)
ROW_KERNEL_ROWS = 64  # rows per CTA of the preprocess and convert kernels

_SHORT_RE = re.compile(
    r"^\s*backward_sm80\s*\(\s*(?P<dtype>\w+)\s*,\s*(?P<d>\d+)\s*,\s*(?P<br>\d+)\s*,\s*(?P<bc>\d+)\s*,"
    r"\s*(?P<w>\d+)\s*\)\s*:\s*(?P<features>[\w+]*)\s*$"
)
_DSPLIT_RE = re.compile(r"^dsplit_(\d+)$")
# Short-form feature names of the boolean fields, in short-form order (dsplit_N comes first).
_FLAGS = (("swizzled", "swizzled"), ("dbuf", "double_buffer"), ("pds", "pds_smem"), ("kvreg", "kv_regs"),
          ("pipe", "pipelined"), ("mbar", "mbarrier"), ("dqf", "dq_first"), ("ldmid", "load_mid"),
          ("dqs", "dq_spread"), ("dql", "dq_late"), ("dqv", "dq_v4"))


@dataclass(frozen=True, order=True)
class BackwardKernelConfig(KernelConfig):
    """Static configuration of one backward kernel set (preprocess, dK/dV, dQ, convert).

    dtype: element type of every tensor (fp32 accumulation and softmax).
    d_head: head dimension.
    B_r: query rows per inner iteration of the dK/dV kernel (and per CTA of the dQ kernel).
    B_c: key rows per CTA of the dK/dV kernel (and per inner iteration of the dQ kernel).
    n_warps: warps of the dK/dV kernel.
    d_split: 1, or 2 to split dK/dV's columns over two warps that share key rows (halves the
        accumulator registers; S^T and dP^T are computed by both). Needed for d_head 256.
    swizzled: XOR-swizzled shared tiles (conflict-free cp.async writes and ldmatrix reads).
    double_buffer: two Q/dO buffers in the dK/dV kernel: the next query block is copied during the
        whole current iteration instead of only during its dQ step (+2 * B_r * d_head * 2 bytes).
    pds_smem: P and dS exchanged through shared memory, with FlashAttention-2's 2-D warp tiling per
        product (S/dP tiles of 32 keys by B_r * (B_c/32) / n_warps queries: 32, or 64 for its d_head 64
        layout (128, 128, 8); 32 keys per warp for dK/dV, 32 queries per warp for dQ)
        instead of every warp owning 16 key rows of all products: fewer shared-memory reads per
        mma, two more [B_r][B_c] tiles. Needs double_buffer and d_split 1.
    kv_regs: pds_smem only: each warp keeps the B fragments of its 32 keys of K and V (d_head
        registers per thread) for the whole CTA instead of re-reading them from shared memory for
        every query block (FlashAttention-2's Is_V_in_regs, for both K and V): half the shared
        reads of S and dP. Fits the register budget at d_head 64 only.
    pipelined: pds_smem only: three Q/dO buffers and two P/dS buffers, so an iteration needs one
        barrier instead of two (the next-but-one block is copied right after it; warps finishing
        their dK/dV/dQ products go on to the next block's S/dP without waiting for the others).
    mbarrier: pipelined only: two Q/dO buffers instead of three; each thread signals its copies of
        a block on the buffer's mbarrier (cp.async.mbarrier.arrive), and phase A waits on it, so the
        loop keeps its single barrier with 2 * B_r * d_head * 2 fewer bytes (d_head 64's 128 x 128
        tiles fit: 226 KB; there the causal atomic kernel spills 60-100 bytes, so the H100 table uses
        it for non-causal rows only).
    dq_first: pds_smem only: dQ (phase C, with its atomics) before dK/dV (phase B), as
        FlashAttention-2 orders them: the fp32 reductions drain while phase B's mma run instead of
        queueing in front of the next iteration's shared-memory loads.
    dq_spread: dq_first only: phase C's fp32 reductions are issued a few per k-step of phase B
        instead of in one burst at the end of phase C, where they fill the load/store queue
        (Nsight Compute at d_head 64: the burst's reductions held 9% of the warps' stall samples,
        half of them queue-full stalls) and hold up phase B's transposed fragment loads behind
        them; phase C's dQ tile stays in registers through phase B.
    dq_late: pipelined only (not with dq_spread): phase C's dQ tile stays in registers and is
        reduced during the next query block's phase A, a few reductions after each row group's
        exponentials, where the load/store queue is idle (the last block's after the loop).
    dq_v4: pds_smem only, not with dq_spread or dq_late: phase C's reductions are 4-column
        red.global.add.v4.f32 (sm_90; scalar pairs on sm_80), each lane pair swapping one fp32
        pair per n-tile pair to hold 4 consecutive columns: half the reduction instructions.
    load_mid: pds_smem only: the next query block's copies (their address arithmetic) are issued
        after the first k-step of the phase that follows the barrier, beside mma work already in
        flight, instead of between the barrier and the first fragment load.
    """

    FAMILY: ClassVar[str] = FAMILY_NAME

    dtype: DType
    d_head: int
    B_r: int
    B_c: int
    n_warps: int
    d_split: int
    swizzled: bool
    double_buffer: bool
    pds_smem: bool
    kv_regs: bool = False
    pipelined: bool = False
    mbarrier: bool = False
    dq_first: bool = False
    load_mid: bool = False
    dq_spread: bool = False
    dq_late: bool = False
    dq_v4: bool = False

    # ------------------------------------------------------------------ derived figures
    @property
    def n_threads(self) -> int:
        return 32 * self.n_warps

    @property
    def key_rows_per_warp(self) -> int:
        return self.B_c * self.d_split // self.n_warps

    @property
    def dq_threads(self) -> int:
        """Threads of the deterministic dQ kernel: one warp per 16 query rows."""
        return 2 * self.B_r

    def accumulator_registers(self) -> int:
        """fp32 registers per thread for dK, dV, S^T and dP^T (S, dP) in the dK/dV kernel."""
        if self.pds_smem:  # 32 keys x d_head / (n_warps / (B_c/32)) of dK and dV, S/dP tiles of 32 keys
            return 2 * self.d_head * (self.B_c // 32) // self.n_warps + 2 * self.pds_s_rows
        mk = self.key_rows_per_warp // 16
        return mk * self.d_head // self.d_split + mk * self.B_r

    @property
    def pds_s_rows(self) -> int:
        """pds_smem: query rows of one warp's S/dP tile (32 keys wide): the B_c/32 key columns of
        warps share the n_warps warps, the rest split the B_r rows."""
        key_warps = max(1, self.B_c // 32)
        return self.B_r * key_warps // self.n_warps

    def dq_accumulator_registers(self) -> int:
        """fp32 registers per thread for dQ, S and dP in the deterministic dQ kernel."""
        return self.d_head // 2 + self.B_c

    def smem_bytes(self) -> int:
        """Dynamic shared memory of the dK/dV kernel: K, V, Q, dO tiles, dS^T, row statistics."""
        buffers = (2 if self.mbarrier else 3) if self.pipelined else 2 if self.double_buffer else 1
        exchange = (4 if self.pipelined else 2) if self.pds_smem else 1  # dS^T, or P and dS (x2 pipelined)
        return (2 * self.B_c * self.d_head * 2 + buffers * (2 * self.B_r * self.d_head * 2 + 8 * self.B_r)
                + exchange * self.B_c * self.B_r * 2 + (16 if self.mbarrier else 0))  # + two mbarriers

    def dq_smem_bytes(self) -> int:
        """Dynamic shared memory of the deterministic dQ kernel: Q, dO, K, V tiles."""
        return 2 * self.B_r * self.d_head * 2 + 2 * self.B_c * self.d_head * 2

    # ------------------------------------------------------------------ rules
    def _rules(self) -> Iterator[tuple[str, bool]]:
        d, br, bc, w, ds = self.d_head, self.B_r, self.B_c, self.n_warps, self.d_split
        yield f"d_head in {SUPPORTED_D_HEADS}", d in SUPPORTED_D_HEADS
        yield f"B_r in {B_R_VALUES}", br in B_R_VALUES
        yield f"B_c in {B_C_VALUES}", bc in B_C_VALUES
        yield f"n_warps in {N_WARPS_VALUES}", w in N_WARPS_VALUES
        yield f"d_split in {D_SPLIT_VALUES}", ds in D_SPLIT_VALUES
        if not (d in SUPPORTED_D_HEADS and br in B_R_VALUES and bc in B_C_VALUES and w in N_WARPS_VALUES
                and ds in D_SPLIT_VALUES):
            return
        rows = bc * ds // w
        if not self.pds_smem:  # the 1-D layout's warps own whole 16-key m-tiles (pds_smem: 2-D grids below)
            yield ("B_c * d_split / n_warps key rows per warp is a positive multiple of 16",
                   rows >= 16 and rows % 16 == 0)
        yield "d_head / d_split is a multiple of 16 (pairs of n-tiles per warp)", (d // ds) % 16 == 0
        q_mtiles = br // 16
        if w > q_mtiles:
            yield "dQ columns per warp (d_head / (n_warps / (B_r/16))) a multiple of 16", (d * q_mtiles // w) % 16 == 0
        yield ("the Q/dO and K/V tiles' 16-byte chunks spread evenly over the threads of both kernels",
               (br * d // 8) % (32 * w) == 0 and (bc * d // 8) % (32 * w) == 0 and (bc * d // 8) % (2 * br) == 0)
        if self.pds_smem:
            yield "pds_smem needs double_buffer and d_split 1", self.double_buffer and ds == 1
            yield "pds_smem needs B_c >= 64 (P/dS tile rows of at least eight 16-byte chunks)", bc >= 64
            wq, wk = br // 32, bc // 32
            rows = self.pds_s_rows
            grids = (bc % 32 == 0 and w % wq == 0 and w % wk == 0 and (br * wk) % w == 0
                     and rows in (16, 32, 64))
            yield ("pds_smem warp grids: S/dP tiles of 16, 32 or 64 query rows x 32 keys (B_c/32 warps across "
                   "the keys), B_c/32 key rows and B_r/32 query rows of warps, each with a column slice of "
                   "whole n-tile pairs",
                   grids and (d * wk // w) % 16 == 0 and (d * wq // w) % 16 == 0)
            if not grids:
                return
        if self.pds_smem or (rows >= 16 and rows % 16 == 0):
            yield (f"dK/dV + S^T/dP^T accumulators <= {MAX_ACCUMULATOR_REGISTERS} registers per thread",
                   self.accumulator_registers() <= MAX_ACCUMULATOR_REGISTERS)
        if self.pipelined:
            yield "pipelined needs pds_smem", self.pds_smem
        if self.mbarrier:
            yield "mbarrier needs pipelined", self.pipelined
        if self.dq_first:
            yield "dq_first needs pds_smem", self.pds_smem
        if self.load_mid:
            yield "load_mid needs pds_smem", self.pds_smem
        if self.dq_spread:
            yield "dq_spread needs dq_first", self.dq_first
        if self.dq_late:
            yield "dq_late needs pipelined and not dq_spread", self.pipelined and not self.dq_spread
        if self.dq_v4:
            yield "dq_v4 needs pds_smem, not dq_spread or dq_late", self.pds_smem and not (self.dq_spread or
                                                                                          self.dq_late)
        if self.kv_regs:
            yield "kv_regs needs pds_smem", self.pds_smem
            yield (f"kv_regs: accumulators + K/V fragments (d_head) <= {MAX_ACCUMULATOR_REGISTERS} registers per "
                   "thread", self.accumulator_registers() + d <= MAX_ACCUMULATOR_REGISTERS)
        yield (f"dQ-kernel accumulators (d_head/2 + B_c) <= {MAX_ACCUMULATOR_REGISTERS} registers per thread",
               self.dq_accumulator_registers() <= MAX_ACCUMULATOR_REGISTERS)
        yield (f"shared memory of each kernel <= {MAX_SMEM_BYTES} bytes",
               max(self.smem_bytes(), self.dq_smem_bytes()) <= MAX_SMEM_BYTES)

    # ------------------------------------------------------------------ names
    def features(self) -> list[str]:
        return [f"dsplit_{self.d_split}"] + [name for name, field in _FLAGS if getattr(self, field)]

    def short_form(self) -> str:
        return (f"{FAMILY_NAME} ({self.dtype.name}, {self.d_head}, {self.B_r}, {self.B_c}, {self.n_warps}): "
                + "+".join(self.features()))

    @classmethod
    def parse(cls, text: str) -> "BackwardKernelConfig":
        """The config of a short form (exact inverse of short_form); ValueError naming the problem."""
        if not isinstance(text, str):
            raise TypeError(f"short form must be a str, got {type(text).__name__}")
        m = _SHORT_RE.match(text)
        if not m:
            raise ValueError(f"not a {FAMILY_NAME} short form: {text!r}; expected e.g. "
                             f"'{FAMILY_NAME} (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf'")
        features = [f for f in m.group("features").split("+") if f]
        d_split = None
        flags = dict.fromkeys((name for name, _ in _FLAGS), False)
        for feat in features:
            dm = _DSPLIT_RE.match(feat)
            if dm and d_split is None:
                d_split = int(dm.group(1))
            elif feat in flags and not flags[feat]:
                flags[feat] = True
            else:
                raise ValueError(f"short form {text!r}: unknown or repeated feature {feat!r} "
                                 f"(known: dsplit_N once, {', '.join(flags)})")
        if d_split is None:
            raise ValueError(f"short form {text!r}: dsplit_N is required")
        return cls(DType.parse(m.group("dtype")), int(m.group("d")), int(m.group("br")), int(m.group("bc")),
                   int(m.group("w")), d_split, **{field: flags[name] for name, field in _FLAGS})
