"""The backward family's tuning problem: SPEC §6's grid at one sequence bucket, timing
`cupyflash.backward` (atomic dQ) of each candidate on buffers of its own."""
from __future__ import annotations

from typing import Any, Callable

from ...benchmarking import REL_L2_TOLERANCE, attention_flops, grid_shape, poison, random_inputs, rotation_sets
from ...config import DType
from .config import BackwardKernelConfig

__all__ = ["BackwardTuningProblem", "BACKWARD_FLOP_FACTOR"]

BACKWARD_FLOP_FACTOR = 2.5  # backward FLOPs = 2.5 x forward (FlashAttention papers)


def _rel_l2(a: Any, b: Any) -> float:
    import cupy

    a32, b32 = a.astype(cupy.float32), b.astype(cupy.float32)
    norm = float(cupy.linalg.norm(b32))
    return float(cupy.linalg.norm(a32 - b32)) / norm if norm > 0 else float(cupy.linalg.norm(a32))


class BackwardTuningProblem:
    """batch*seq = 16384, heads*d_head = 2048, seq_q = seq_k = `seq`; rotating sets of (dout, q, k,
    v, out, lse) with their own gradient buffers. Each candidate is checked once against the
    family default's deterministic gradients (the path the GPU tests hold to SPEC §5 against a
    float64 reference) before it is timed."""

    def __init__(self, dtype: DType, d_head: int, seq: int, causal: bool, l2_bytes: int) -> None:
        import cupy

        from ...api import forward
        from ...families.forward_sm80.config_sets import default_config as forward_default

        self.dtype, self.seq, self.causal, self.d_head = dtype, seq, causal, d_head
        shape = grid_shape(seq, d_head)
        self.n_sets = rotation_sets(10 * 2 * shape.batch * shape.seq * shape.heads * d_head, l2_bytes)
        self.sets = []
        for i in range(self.n_sets):
            q, k, v, do = (random_inputs(shape.shape, dtype, seed=2000 * seq + 4 * i + j) for j in range(4))
            out, lse = forward(forward_default(dtype, d_head), q, k, v, causal=causal, return_lse=True)
            grads = tuple(cupy.empty_like(x) for x in (q, k, v))
            self.sets.append(((do, q, k, v, out, lse), grads))
        self.flops = BACKWARD_FLOP_FACTOR * attention_flops(shape.batch, shape.heads, seq, seq, d_head, causal)
        self.label = f"{dtype.name} d{d_head} S={seq}{' causal' if causal else ''} backward"
        self.info: dict[str, Any] = {"batch": shape.batch, "heads": shape.heads}
        self._reference: tuple[Any, ...] | None = None

    def skip_reason(self, cfg: BackwardKernelConfig) -> str | None:
        """Every config handles any length (tails are masked); the one exclusion is a register
        budget: mbarrier with 64-row S/dP warp tiles (d_head 64, B_r 128) spills 60-100 bytes
        in its causal atomic kernel (NVRTC 12.9/13.0), and at d_head 256 (8 warps over 64 keys)
        16 bytes in its causal deterministic one, so both are tuned for non-causal rows only."""
        if self.causal and cfg.mbarrier and (cfg.pds_s_rows == 64 or cfg.d_head == 256):
            return "mbarrier spills under causal masking with 64-row S/dP tiles and at d_head 256"
        return None

    def _run(self, cfg: BackwardKernelConfig, i: int, deterministic: bool = False) -> tuple[Any, ...]:
        from ...backward_api import backward

        inputs, (dq, dk, dv) = self.sets[i]
        return backward(*inputs, causal=self.causal, dq=dq, dk=dk, dv=dv, deterministic=deterministic, cfg=cfg)

    def check(self, cfg: BackwardKernelConfig) -> str | None:
        """None if `cfg`'s gradients agree with the reference path's, else what is wrong."""
        from . import default_config

        if self._reference is None:
            self._reference = tuple(g.copy() for g in self._run(default_config(self.dtype, self.d_head), 0, True))
        for g in self.sets[0][1]:
            poison(g, self.dtype)
        tol = REL_L2_TOLERANCE[self.dtype]
        for name, got, ref in zip(("dq", "dk", "dv"), self._run(cfg, 0), self._reference):
            rel = _rel_l2(got, ref)
            if not rel <= tol:  # also catches NaN (unwritten elements)
                return f"wrong result: {name} relative L2 difference {rel:.3g} > {tol:g}"
        return None

    def timed_call(self, cfg: BackwardKernelConfig) -> Callable[[int], Any]:
        return lambda i, c=cfg: self._run(c, i)

    def close(self) -> None:
        import cupy

        self.sets.clear()
        self._reference = None
        cupy.get_default_memory_pool().free_all_blocks()
