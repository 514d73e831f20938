"""The mma.sync backward family (sm_80 and newer): FlashAttention-2's backward with mma.m16n8k16,
ldmatrix and cp.async. Four kernels (roles) per config, one module per variant:

- preprocess: dvec = rowsum(dO * O), lse2 = lse * log2(e), dq_accum zeroed;
- dkdv: one CTA per (key block, k/v head), dK and dV in registers over every query block (and
  every query head of a GQA group), dQ added to an fp32 workspace with atomics;
- dq (deterministic variant): one CTA per query block, dQ in registers in key order, no atomics;
- convert (atomic variant): dQ fp32 -> the input precision, scaled.

Variants are the template flags (causal, deterministic, varlen). A variant's module holds only the
roles it launches: preprocess, dkdv, then dq or convert. varlen kernels (`backward_varlen`) take
packed (total_tokens, heads, d_head) operands with cu_seqlens offsets: each CTA moves the
parameters to its sequence (backward_common.cuh's sequence_params) and runs the dense code. The Hopper backward family is meant to be the next
member of this kind ("backward"): same config-family interface, roles and parameter struct shape.
"""
from __future__ import annotations

from ...config import DType
from ..base import KernelFamily, KernelRole, Variant
from . import config_sets
from .config import ROW_KERNEL_ROWS, BackwardKernelConfig
from .params import BACKWARD_PARAMS

__all__ = ["BackwardSm80Family", "BACKWARD_SM80", "BackwardKernelConfig", "default_config",
           "get_kernel_configs", "roles_for", "ROW_KERNEL_THREADS"]

ROW_KERNEL_THREADS = 256  # preprocess / convert: ROW_KERNEL_ROWS rows per CTA, 4 threads per row

default_config = config_sets.default_config
get_kernel_configs = config_sets.get_kernel_configs


def roles_for(deterministic: bool) -> tuple[str, ...]:
    """The kernels one backward call launches, in launch order."""
    return ("preprocess", "dkdv", "dq") if deterministic else ("preprocess", "dkdv", "convert")


class BackwardSm80Family(KernelFamily):
    name = "backward_sm80"
    kind = "backward"
    description = "FlashAttention-2 backward with mma.sync, ldmatrix and cp.async (sm_80+)"
    config_type = BackwardKernelConfig
    template = "backward_sm80.cu.j2"
    # the shared primitives (one copy in kernels_cu/common), then the family's own headers
    headers = ("common/ptx.cuh", "common/varlen_tail.cuh", "common/score_mask.cuh", "common/tile_primitives.cuh",
               "backward_sm80/backward_common.cuh",
               "backward_sm80/backward_rows.cuh", "backward_sm80/backward_dkdv.cuh", "backward_sm80/backward_dkdv_2d.cuh",
               "backward_sm80/backward_dq.cuh")
    static_wrapper = "StaticBackwardKernelConfig"
    roles = (  # the main kernel first: it is what registry.get(cfg) and prewarm summaries report
        KernelRole("dkdv", "backward_dkdv_kernel", BACKWARD_PARAMS),
        KernelRole("preprocess", "backward_preprocess_kernel", BACKWARD_PARAMS),
        KernelRole("dq", "backward_dq_kernel", BACKWARD_PARAMS),
        KernelRole("convert", "backward_convert_dq_kernel", BACKWARD_PARAMS),
    )
    variant_flags = ("causal", "deterministic", "varlen")
    min_compute_capability = 80
    set_keys = config_sets.KERNEL_SET_KEYS

    def parse(self, text: str) -> BackwardKernelConfig:
        return BackwardKernelConfig.parse(text)

    def config_set(self, key: str) -> list[BackwardKernelConfig]:
        return config_sets.get_kernel_configs(key)

    def name_expressions(self, cfg: BackwardKernelConfig, variant: Variant | None = None) -> dict[str, str]:
        """Only the roles this variant launches: the atomic variants never run the dQ pass and
        the deterministic ones never convert, so their modules do not carry those kernels."""
        variant = self.default_variant() if variant is None else self.check_variant(variant)
        every = super().name_expressions(cfg, variant)
        return {role.role: every[role.role] for role in self.roles if role.role in roles_for(variant[1])}

    def block_threads(self, cfg: BackwardKernelConfig, role: str | None = None) -> int:
        role = role or "dkdv"
        if role == "dkdv":
            return cfg.n_threads
        if role == "dq":
            return cfg.dq_threads
        self.role(role)  # ValueError for an unknown role
        return ROW_KERNEL_THREADS

    def smem_bytes(self, cfg: BackwardKernelConfig, role: str | None = None) -> int:
        role = role or "dkdv"
        if role == "dkdv":
            return cfg.smem_bytes()
        if role == "dq":
            return cfg.dq_smem_bytes()
        self.role(role)
        return 0

    def grid(self, cfg: BackwardKernelConfig, role: str, batch: int, n_heads: int, n_kv_heads: int,
             seq_len_q: int, seq_len_k: int) -> tuple[int, int, int]:
        """Launch grid of `role` for one problem (x may be 0: nothing to launch). For varlen calls
        seq_len_q/k are the longest sequence's lengths (max_seqlen_q/k)."""
        if role == "dkdv":
            return (-(-seq_len_k // cfg.B_c), n_kv_heads, batch)
        if role == "dq":
            return (-(-seq_len_q // cfg.B_r), n_heads, batch)
        padded = -(-seq_len_q // cfg.B_r) * cfg.B_r
        return (padded // ROW_KERNEL_ROWS, n_heads, batch)

    def default_config(self, dtype: DType, d_head: int) -> BackwardKernelConfig:
        return config_sets.default_config(dtype, d_head)

    def progression_configs(self, dtype: DType, d_head: int) -> list[BackwardKernelConfig]:
        return config_sets.progression_configs(dtype, d_head)

    def tuning_problem(self, dtype: DType, d_head: int, seq: int, causal: bool, l2_bytes: int):
        from .tuning import BackwardTuningProblem

        return BackwardTuningProblem(dtype, d_head, seq, causal, l2_bytes)


BACKWARD_SM80 = BackwardSm80Family()
