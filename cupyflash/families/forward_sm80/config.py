"""The mma.sync forward family's configuration (sm_80 and newer): SPEC §2's dataclass.

`FlashForwardKernelConfig` defines the fields; the C++ struct, the NVRTC name expression, the
short form and the cache key are all derived from it. Its short form is SPEC §2's and carries no
family prefix: it is the one family whose short form starts with '('.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from ...config import SUPPORTED_D_HEADS, DType, KernelConfig, is_pow2

__all__ = ["FlashForwardKernelConfig", "B_R_VALUES", "B_C_VALUES", "N_WARPS_VALUES"]

B_R_VALUES = (64, 128)
B_C_VALUES = (32, 64, 128)
N_WARPS_VALUES = (4, 8)
ROWS_PER_MMA_TILE = 16
K_FRAGMENT = 16  # reduction-dimension elements per mma.m16n8k16 k-fragment


@dataclass(frozen=True, order=True)
class FlashForwardKernelConfig(KernelConfig):
    """Static configuration of one FlashAttention forward kernel instantiation.

    Field order is the total order of configs and the order of the generated C++ struct.
    """

    FAMILY: ClassVar[str] = "forward_sm80"

    dtype: DType
    d_head: int
    B_r: int
    B_c: int
    n_warps: int
    async_copy: bool
    eager_load_blocks: bool
    swizzled: bool
    Q_mma_load_K_fragments: int
    K_mma_load_K_fragments: int
    V_mma_load_K_fragments: int
    mma_double_buffer_loads: bool
    optimized_softmax: bool

    # ------------------------------------------------------------------ rules
    def _rules(self):
        d, br, bc, w = self.d_head, self.B_r, self.B_c, self.n_warps
        rows = br // w if w else 0
        k_steps_qk = d // K_FRAGMENT
        k_steps_pv = bc // K_FRAGMENT
        q, k, v = self.Q_mma_load_K_fragments, self.K_mma_load_K_fragments, self.V_mma_load_K_fragments
        yield f"d_head in {SUPPORTED_D_HEADS}", d in SUPPORTED_D_HEADS
        yield f"B_r in {B_R_VALUES}", br in B_R_VALUES
        yield f"B_c in {B_C_VALUES}", bc in B_C_VALUES
        yield f"n_warps in {N_WARPS_VALUES}", w in N_WARPS_VALUES
        yield "n_warps == 8 only with B_r == 128", not (w == 8 and br != 128)
        yield "B_r / n_warps rows per warp is a multiple of 16", rows % ROWS_PER_MMA_TILE == 0 and rows > 0
        yield "eager_load_blocks needs async_copy", self.async_copy or not self.eager_load_blocks
        yield (
            "Q_mma_load_K_fragments is 0 or a power of two dividing d_head/16",
            q == 0 or (is_pow2(q) and k_steps_qk % q == 0),
        )
        yield (
            "K_mma_load_K_fragments is 0 (whole tile) or a power of two < d_head/16 dividing it",
            k == 0 or (is_pow2(k) and k < k_steps_qk and k_steps_qk % k == 0),
        )
        yield (
            "V_mma_load_K_fragments is 0 (whole tile) or a power of two < B_c/16",
            v == 0 or (is_pow2(v) and v < k_steps_pv),
        )
        yield (
            "Q_mma_load_K_fragments equals K_mma_load_K_fragments unless Q is 0 (kept in registers)",
            q == 0 or q == (k or k_steps_qk),
        )
        chunks_per_row = d // 8
        yield (
            "the Q and K/V tiles' 16-byte chunks spread evenly over the threads (B_c * d_head / 8 "
            "a multiple of 32 * n_warps)",
            w > 0 and (bc * chunks_per_row) % (32 * w) == 0 and (br * chunks_per_row) % (32 * w) == 0,
        )
        yield (
            "mma_double_buffer_loads needs K or V loaded in fragments (K or V fragments != 0)",
            not self.mma_double_buffer_loads or k != 0 or v != 0,
        )

    # ------------------------------------------------------------- resources
    @property
    def n_threads(self) -> int:
        return self.n_warps * 32

    @property
    def rows_per_warp(self) -> int:
        return self.B_r // self.n_warps

    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA: Q tile plus one K and one V tile."""
        return (self.B_r + 2 * self.B_c) * self.d_head * self.dtype.itemsize

    def num_ctas_per_sm(self, max_smem: int, max_threads_per_sm: int = 2048) -> int:
        """CTAs that fit on one SM given its shared memory (bytes) and thread limit."""
        return max(0, min(max_smem // self.smem_bytes(), max_threads_per_sm // self.n_threads))

    # ------------------------------------------------------------ short form
    def short_form(self) -> str:
        features = []
        if self.async_copy:
            features.append("async")
        if self.eager_load_blocks:
            features.append("eager")
        if self.swizzled:
            features.append("swizzled")
        features.append(
            f"load_{self.Q_mma_load_K_fragments}_{self.K_mma_load_K_fragments}_{self.V_mma_load_K_fragments}_tiles"
        )
        if self.mma_double_buffer_loads:
            features.append("buffer")
        if self.optimized_softmax:
            features.append("opt_softmax")
        dtype = self.dtype.name if isinstance(self.dtype, DType) else str(self.dtype)
        return f"({dtype}, {self.d_head}, {self.B_r}, {self.B_c}, {self.n_warps}): " + "+".join(features)

    _SHORT_RE = re.compile(
        r"^\(\s*(?P<dtype>\w+)\s*,\s*(?P<d>\d+)\s*,\s*(?P<br>\d+)\s*,\s*(?P<bc>\d+)\s*,\s*(?P<w>\d+)\s*\)\s*:\s*(?P<feat>\S+)\s*$"
    )
    _LOAD_RE = re.compile(r"^load_(\d+)_(\d+)_(\d+)_tiles$")
    _FLAGS = {"async": "async_copy", "eager": "eager_load_blocks", "swizzled": "swizzled",
              "buffer": "mma_double_buffer_loads", "opt_softmax": "optimized_softmax"}

    @classmethod
    def parse(cls, text: str) -> "FlashForwardKernelConfig":
        """Inverse of `short_form()`. Raises ValueError on anything it does not understand."""
        if not isinstance(text, str):
            raise TypeError(f"short form must be a str, got {type(text).__name__}")
        m = cls._SHORT_RE.match(text)
        if not m:
            raise ValueError(
                f"cannot parse kernel config {text!r}: expected "
                "'(DTYPE, d_head, B_r, B_c, n_warps): feature+...+load_Q_K_V_tiles+...'"
            )
        flags = {name: False for name in cls._FLAGS.values()}
        loads = None
        for feat in m.group("feat").split("+"):
            lm = cls._LOAD_RE.match(feat)
            if lm:
                if loads is not None:
                    raise ValueError(f"cannot parse kernel config {text!r}: load_Q_K_V_tiles given twice")
                loads = tuple(int(x) for x in lm.groups())
            elif feat in cls._FLAGS:
                if flags[cls._FLAGS[feat]]:
                    raise ValueError(f"cannot parse kernel config {text!r}: feature {feat!r} given twice")
                flags[cls._FLAGS[feat]] = True
            else:
                raise ValueError(f"cannot parse kernel config {text!r}: unknown feature {feat!r}")
        if loads is None:
            raise ValueError(f"cannot parse kernel config {text!r}: missing load_Q_K_V_tiles")
        cfg = cls(
            dtype=DType.parse(m.group("dtype")), d_head=int(m.group("d")), B_r=int(m.group("br")),
            B_c=int(m.group("bc")), n_warps=int(m.group("w")), async_copy=flags["async_copy"],
            eager_load_blocks=flags["eager_load_blocks"], swizzled=flags["swizzled"],
            Q_mma_load_K_fragments=loads[0], K_mma_load_K_fragments=loads[1], V_mma_load_K_fragments=loads[2],
            mma_double_buffer_loads=flags["mma_double_buffer_loads"], optimized_softmax=flags["optimized_softmax"],
        )
        return cfg
