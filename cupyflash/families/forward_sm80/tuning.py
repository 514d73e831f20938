"""The mma.sync forward family's tuning problem: SPEC §6's grid at one sequence bucket."""
from __future__ import annotations

from typing import Any, Callable

from ...benchmarking import (REL_L2_TOLERANCE, attention_flops, grid_shape, poison, random_inputs, rotation_sets,
                             spot_check_rel_l2)
from ...config import DType
from .config import FlashForwardKernelConfig

__all__ = ["ForwardTuningProblem"]


class ForwardTuningProblem:
    """batch*seq = 16384, heads*d_head = 2048, seq_q = seq_k = `seq`, in buffers of its own
    (enough rotating sets to defeat L2). Each config is checked once against a float64
    reference on a poisoned output before it is timed."""

    def __init__(self, dtype: DType, d_head: int, seq: int, causal: bool, l2_bytes: int) -> None:
        import cupy

        self.dtype, self.seq, self.causal = dtype, seq, causal
        shape = grid_shape(seq, d_head)
        self.n_sets = rotation_sets(4 * 2 * shape.batch * shape.seq * shape.heads * d_head, l2_bytes)
        self.sets = []
        for i in range(self.n_sets):
            q, k, v = (random_inputs(shape.shape, dtype, seed=1000 * seq + 3 * i + j) for j in range(3))
            self.sets.append((q, k, v, cupy.empty_like(q)))
        self.flops = attention_flops(shape.batch, shape.heads, seq, seq, d_head, causal)
        self.label = f"{dtype.name} d{d_head} S={seq}{' causal' if causal else ''}"
        self.info: dict[str, Any] = {"batch": shape.batch, "heads": shape.heads}

    def skip_reason(self, cfg: FlashForwardKernelConfig) -> str | None:
        if self.seq % cfg.B_r or self.seq % cfg.B_c:
            return f"seq {self.seq} is not a multiple of B_r={cfg.B_r} / B_c={cfg.B_c}"
        return None

    def check(self, cfg: FlashForwardKernelConfig) -> str | None:
        """None if `cfg` computes the right result, else what is wrong."""
        from ...api import forward  # looked up per call so tests can stand in for it

        q, k, v, o = self.sets[0]
        poison(o, self.dtype)
        forward(cfg, q, k, v, out=o, causal=self.causal)
        rel = spot_check_rel_l2(q, k, v, o, self.dtype, causal=self.causal)
        tol = REL_L2_TOLERANCE[self.dtype]
        return None if rel <= tol else f"wrong result: relative L2 error {rel:.3g} > {tol:g}"

    def timed_call(self, cfg: FlashForwardKernelConfig) -> Callable[[int], Any]:
        """`run(set_index)` for time_cupy: one forward of `cfg` into the set's own output buffer."""
        from ...api import forward

        sets, causal = self.sets, self.causal
        return lambda i, c=cfg: forward(c, *sets[i][:3], out=sets[i][3], causal=causal)

    def close(self) -> None:
        import cupy

        self.sets.clear()  # drop the buffers before the next bucket allocates its own
        cupy.get_default_memory_pool().free_all_blocks()
