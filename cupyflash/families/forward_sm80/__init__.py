"""The mma.sync forward family (sm_80 and newer): FlashAttention-2's algorithm with mma.m16n8k16,
ldmatrix and cp.async. The seed design of SPEC §2-4; on sm_80-sm_89 it is the forward kernel,
on Hopper the fallback."""
from __future__ import annotations

from ...config import DType
from ..base import KernelFamily, KernelRole
from . import config_sets
from .config import FlashForwardKernelConfig
from .params import FORWARD_PARAMS

__all__ = ["ForwardSm80Family", "FORWARD_SM80", "FlashForwardKernelConfig"]


class ForwardSm80Family(KernelFamily):
    name = "forward_sm80"
    kind = "forward"
    description = "FlashAttention-2 forward with mma.sync, ldmatrix and cp.async (sm_80+)"
    config_type = FlashForwardKernelConfig
    template = "forward_sm80.cu.j2"
    headers = ("common/ptx.cuh", "common/varlen_tail.cuh", "common/score_mask.cuh", "common/tile_primitives.cuh", "common/online_softmax.cuh",
               "forward_sm80/flash_forward.cuh")
    static_wrapper = "StaticForwardKernelConfig"
    roles = (KernelRole("forward", "flash_forward_kernel", FORWARD_PARAMS),)
    # Template flags: the plain kernel carries no diagonal code, and only the varlen one reads
    # cu_seqlens (forward_varlen).
    variant_flags = ("causal", "varlen")
    min_compute_capability = 80
    set_keys = config_sets.KERNEL_SET_KEYS

    def parse(self, text: str) -> FlashForwardKernelConfig:
        return FlashForwardKernelConfig.parse(text)

    def config_set(self, key: str) -> list[FlashForwardKernelConfig]:
        return config_sets.get_kernel_configs(key)

    def block_threads(self, cfg: FlashForwardKernelConfig, role: str | None = None) -> int:
        return cfg.n_threads

    def smem_bytes(self, cfg: FlashForwardKernelConfig, role: str | None = None) -> int:
        return cfg.smem_bytes()

    def default_config(self, dtype: DType, d_head: int) -> FlashForwardKernelConfig:
        return config_sets.default_config(dtype, d_head)

    def tune_candidates(self, dtype: DType, d_head: int) -> list[FlashForwardKernelConfig]:
        return config_sets.autotune_configs([dtype], [d_head])

    def progression_configs(self, dtype: DType, d_head: int) -> list[FlashForwardKernelConfig]:
        return config_sets.progression_configs(dtype, d_head)

    def tuning_problem(self, dtype: DType, d_head: int, seq: int, causal: bool, l2_bytes: int):
        from .tuning import ForwardTuningProblem

        return ForwardTuningProblem(dtype, d_head, seq, causal, l2_bytes)


FORWARD_SM80 = ForwardSm80Family()
