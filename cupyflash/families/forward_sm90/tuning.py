"""The Hopper forward family's tuning problem: the mma.sync family's (SPEC §6's grid at one
sequence bucket, each config checked against float64 before it is timed), minus its rule that
the length be a multiple of the tile: TMA zero-fills and the masks cut at any length."""
from __future__ import annotations

from ..forward_sm80.tuning import ForwardTuningProblem
from .config import HopperForwardKernelConfig

__all__ = ["HopperForwardTuningProblem"]


class HopperForwardTuningProblem(ForwardTuningProblem):
    def skip_reason(self, cfg: HopperForwardKernelConfig) -> str | None:
        return None
