"""The decode family's configuration: split-KV (flash-decoding) attention over a KV cache.

`DecodeKernelConfig` is the one source of truth for the C++ struct of the same name, the NVRTC
name expressions, the short form and the cache key. Short form:

    decode (BF16, 128, 16, 16, 4): stages_3+evict_first
    decode (BF16, 128, 16, 16, 8): stages_2+heads_8
    decode (BF16, 128, 16, 16, 8): stages_2+evict_first+interleave
    decode (dtype, d_head, rows, B_c, n_warps): stages_N[+evict_first][+interleave][+heads_H]   (no suffix: heads 1)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from ...config import DType, KernelConfig

__all__ = ["DecodeKernelConfig", "DECODE_D_HEADS", "ROWS_VALUES", "B_C_VALUES", "N_WARPS_VALUES",
           "STAGES_VALUES", "HEADS_VALUES", "MAX_SMEM_BYTES", "OUTPUT_REGISTER_BUDGET", "TILE_REGISTER_BUDGET"]

# d_head / 8 sixteen-byte chunks per row must divide a warp's 32 lanes (a warp copies whole rows).
DECODE_D_HEADS = (64, 128, 256)
ROWS_VALUES = (16, 32, 64)
B_C_VALUES = (16, 32, 64)
N_WARPS_VALUES = (1, 2, 4, 8)
STAGES_VALUES = (1, 2, 3, 4)
HEADS_VALUES = (1, 2, 4, 8)
# The largest dynamic shared memory a CTA may ask for (sm_90: 227 KB; sm_80 GPUs allow less, and
# the launch picks only configs that fit the device: see cupyflash.kvcache).
MAX_SMEM_BYTES = 227 * 1024
# Each lane holds rows * d_head / 32 fp32 output values and rows * B_c / 32 scores; past these
# budgets ptxas spills (measured: rows 64, d_head 64, B_c 32 spilled 4 bytes in the causal paged
# variant at 255 registers).
OUTPUT_REGISTER_BUDGET = 128
TILE_REGISTER_BUDGET = 160

_SHORT_RE = re.compile(
    r"^\s*decode\s*\(\s*(?P<dtype>\w+)\s*,\s*(?P<d>\d+)\s*,\s*(?P<rows>\d+)\s*,\s*(?P<bc>\d+)\s*,"
    r"\s*(?P<w>\d+)\s*\)\s*:\s*stages_(?P<stages>\d+)(?P<features>(\+\w+)*?)(\+heads_(?P<heads>\d+))?\s*$"
)
_FEATURES = ("evict_first", "interleave")


@dataclass(frozen=True, order=True)
class DecodeKernelConfig(KernelConfig):
    """Static configuration of the decode kernels (attention, combine and append).

    Fields, in order (the total order of configs and the C++ struct's member order):
      dtype: FP16 or BF16 (Q, K, V, O); softmax and accumulation are fp32.
      d_head: 64, 128 or 256.
      rows: packed query rows per CTA tile (GQA group size x seq_q rows share one K/V read);
        groups with more rows take several tiles.
      B_c: keys per warp step (one cp.async ring slot holds B_c keys of K and of V).
      n_warps: warps per CTA; they take the split's steps round-robin, each with its own ring
        and online softmax, and merge once at the end.
      stages: ring slots per warp; stages - 1 steps are in flight while one is computed
        (1 = load, wait, compute: no overlap).
      evict_first: K/V copies carry an L2 evict-first policy (they are read exactly once).
      heads: KV heads per CTA (1, 2, 4 or 8; n_warps a multiple of it): warp w serves head
        w % heads, so the CTA reads every head's rows of a key range together (a whole page of a
        paged cache: one address translation and one DRAM page for all its heads' bytes).
      interleave: the splits take the sequence's warp steps round-robin (split s: steps s,
        s + num_splits, ...) instead of one contiguous range each. A CTA's first keys then do
        not depend on the sequence's length, so a paged cache's first page-table reads are issued
        together with the cache_seqlens read instead of after it (one dependent memory latency
        fewer before the first K/V copies).
    """

    FAMILY: ClassVar[str] = "decode"

    dtype: DType
    d_head: int
    rows: int
    B_c: int
    n_warps: int
    stages: int
    evict_first: bool
    heads: int = 1
    interleave: bool = False

    # ------------------------------------------------------------------ rules
    def _rules(self):
        yield f"d_head in {DECODE_D_HEADS}", self.d_head in DECODE_D_HEADS
        yield f"rows in {ROWS_VALUES}", self.rows in ROWS_VALUES
        yield f"B_c in {B_C_VALUES}", self.B_c in B_C_VALUES
        yield f"n_warps in {N_WARPS_VALUES}", self.n_warps in N_WARPS_VALUES
        yield f"stages in {STAGES_VALUES}", self.stages in STAGES_VALUES
        yield f"heads in {HEADS_VALUES}", self.heads in HEADS_VALUES
        yield "n_warps a multiple of heads", self.n_warps % self.heads == 0
        yield (f"rows * d_head / 32 output registers per lane <= {OUTPUT_REGISTER_BUDGET}",
               self.rows * self.d_head // 32 <= OUTPUT_REGISTER_BUDGET)
        yield (f"rows * (d_head + B_c) / 32 output and score registers per lane <= {TILE_REGISTER_BUDGET}",
               self.rows * (self.d_head + self.B_c) // 32 <= TILE_REGISTER_BUDGET)
        yield f"shared memory <= {MAX_SMEM_BYTES} bytes", self.smem_bytes() <= MAX_SMEM_BYTES

    # ------------------------------------------------------------------ derived figures
    @property
    def n_threads(self) -> int:
        return 32 * self.n_warps

    @property
    def team(self) -> int:
        """Warps per KV head."""
        return self.n_warps // self.heads

    def stage_bytes(self) -> int:
        """One ring slot: B_c keys of K and of V."""
        return 2 * self.B_c * self.d_head * 2

    def smem_bytes(self) -> int:
        """Dynamic shared memory of the attention kernel (same formula as
        StaticDecodeKernelConfig::SMEM_BYTES): one Q tile per head, then the warps' rings, which
        the end-of-CTA merge area (row statistics and each warp's fp32 output rows) reuses."""
        q = self.heads * self.rows * self.d_head * 2
        kv = self.n_warps * self.stages * self.stage_bytes()
        merge = ((2 * self.n_warps * self.rows + 2 * self.heads * self.rows) * 4
                 + self.n_warps * self.rows * (self.d_head + 8) * 4)
        return q + max(kv, merge)

    def ctas_per_sm(self, smem_per_sm: int = 228 * 1024, reserved_per_cta: int = 1024) -> int:
        """Resident CTAs per SM allowed by shared memory and threads (2048 per SM)."""
        by_smem = smem_per_sm // (self.smem_bytes() + reserved_per_cta)
        return max(0, min(by_smem, 2048 // self.n_threads, 32))

    # ------------------------------------------------------------------ short form
    def short_form(self) -> str:
        features = "".join(f"+{name}" for name in _FEATURES if getattr(self, name))
        if self.heads != 1:
            features += f"+heads_{self.heads}"
        return (f"decode ({self.dtype.name}, {self.d_head}, {self.rows}, {self.B_c}, {self.n_warps}): "
                f"stages_{self.stages}{features}")

    @classmethod
    def parse(cls, text: str) -> "DecodeKernelConfig":
        """Inverse of short_form(); ValueError naming what is wrong."""
        if not isinstance(text, str):
            raise TypeError(f"short form must be a str, got {type(text).__name__}")
        m = _SHORT_RE.match(text)
        if not m:
            raise ValueError(f"not a decode short form: {text!r}; expected e.g. "
                             "'decode (BF16, 128, 16, 16, 4): stages_3+evict_first'")
        names = [f for f in m.group("features").split("+") if f]
        unknown = [f for f in names if f not in _FEATURES]
        if unknown:
            raise ValueError(f"unknown decode feature(s) {unknown} in {text!r}; known: {list(_FEATURES)}")
        if len(set(names)) != len(names):
            raise ValueError(f"repeated feature in {text!r}")
        heads = int(m.group("heads")) if m.group("heads") else 1
        return cls(DType.parse(m.group("dtype")), int(m.group("d")), int(m.group("rows")), int(m.group("bc")),
                   int(m.group("w")), int(m.group("stages")), "evict_first" in names, heads, "interleave" in names)
