"""The Hopper backward family (sm_90a): FlashAttention-2/3's backward with wgmma GEMMs, TMA loads
into an mbarrier ring and a warp-specialised producer warpgroup (kernels_cu/backward_sm90/).

The next member of the "backward" kind after backward_sm80, not a fork: the same roles, variant
flags (causal, deterministic) and launch sequence (preprocess, dkdv, then dq or convert), the
same fp32 workspaces and `BackwardParams` for the three kernels it reuses from backward_sm80
(preprocess, convert, the deterministic dQ pass, instantiated with `companion_config(cfg)`);
only the dK/dV kernel is new, with its own `HopperBackwardParams` (TMA descriptors first).

`backward(cfg=None)` runs it where `pick_family("backward", cc)` prefers it (priority 1, compute
capability 9.0) and the call suits it (d_head 64/96/128/256, TMA-readable layouts):
`backward_api.hopper_reason` says why not otherwise, and backward_sm80 runs the call.
"""
from __future__ import annotations

from ...config import DType
from ..backward_sm80 import BACKWARD_SM80, ROW_KERNEL_THREADS, roles_for
from ..backward_sm80.config import BackwardKernelConfig
from ..backward_sm80.params import BACKWARD_PARAMS
from ..base import KernelFamily, KernelRole, Variant
from . import config_sets
from .config import HopperBackwardKernelConfig
from .params import HOPPER_BACKWARD_PARAMS

__all__ = ["BackwardSm90Family", "BACKWARD_SM90", "HopperBackwardKernelConfig", "roles_for"]


# pdl configs: roles served by this family's own row kernels (same BackwardParams, same grid).
OWN_ROW_KERNELS = {"preprocess": "backward_sm90_preprocess_kernel", "convert": "backward_sm90_convert_kernel"}


class BackwardSm90Family(KernelFamily):
    name = "backward_sm90"
    kind = "backward"
    description = ("FlashAttention-3-style backward with wgmma, TMA, an mbarrier Q/dO ring and a "
                   "warp-specialised producer (sm_90a)")
    config_type = HopperBackwardKernelConfig
    extra_config_types = (BackwardKernelConfig,)
    template = "backward_sm90.cu.j2"
    # backward_sm80's headers first (its row and dQ kernels are reused), then the Hopper ones.
    headers = BACKWARD_SM80.headers + (
        "common/ptx_sm90.cuh", "common/launch_order.cuh", "common/wgmma_sm90.cuh", "backward_sm90/wgmma_tt.cuh",
        "backward_sm90/config.cuh",
        "backward_sm90/producer.cuh", "backward_sm90/dq_writer.cuh", "backward_sm90/tail_zeroer.cuh",
        "backward_sm90/mainloop.cuh", "backward_sm90/epilogue.cuh",
        "backward_sm90/kernel.cuh", "backward_sm90/rows.cuh")
    static_wrapper = "StaticHopperBackwardConfig"
    roles = (
        KernelRole("dkdv", "backward_sm90_dkdv_kernel", HOPPER_BACKWARD_PARAMS),
        KernelRole("preprocess", "backward_preprocess_kernel", BACKWARD_PARAMS),
        KernelRole("dq", "backward_dq_kernel", BACKWARD_PARAMS),
        KernelRole("convert", "backward_convert_dq_kernel", BACKWARD_PARAMS),
    )
    variant_flags = ("causal", "deterministic", "varlen")
    min_compute_capability = 90
    arch_suffix = "a"
    exact_compute_capability = 90
    set_keys = config_sets.KERNEL_SET_KEYS
    # Above backward_sm80's 0: backward(cfg=None) runs this family on Hopper where it applies.
    priority = 1

    def parse(self, text: str) -> HopperBackwardKernelConfig:
        return HopperBackwardKernelConfig.parse(text)

    def config_set(self, key: str) -> list[HopperBackwardKernelConfig]:
        return config_sets.get_kernel_configs(key)

    def name_expressions(self, cfg: HopperBackwardKernelConfig, variant: Variant | None = None) -> dict[str, str]:
        """The dK/dV kernel on this config; the reused roles on its backward_sm80 companion (pdl
        configs: preprocess and convert are this family's own, kernels_cu/backward_sm90/rows.cuh);
        only the roles the variant launches."""
        variant = self.default_variant() if variant is None else self.check_variant(variant)
        flags = "".join(", true" if flag else ", false" for flag in variant)
        own = f"{self.static_wrapper}<{self.config_literal(cfg)}>"
        companion = f"{BACKWARD_SM80.static_wrapper}<{self.config_literal(config_sets.companion_config(cfg))}>"
        out = {}
        for role in self.roles:
            if role.role not in roles_for(variant[1]):
                continue
            if role.role == "dkdv":
                out[role.role] = f"{role.template}<{own}{flags}>"
            elif cfg.pdl and role.role in OWN_ROW_KERNELS:
                out[role.role] = f"{OWN_ROW_KERNELS[role.role]}<{own}{flags}>"
            else:
                out[role.role] = f"{role.template}<{companion}{flags}>"
        return out

    def block_threads(self, cfg: HopperBackwardKernelConfig, role: str | None = None) -> int:
        role = role or "dkdv"
        if role == "dkdv":
            return cfg.n_threads
        if role == "dq":
            return config_sets.companion_config(cfg).dq_threads
        self.role(role)
        return ROW_KERNEL_THREADS

    def smem_bytes(self, cfg: HopperBackwardKernelConfig, role: str | None = None) -> int:
        role = role or "dkdv"
        if role == "dkdv":
            return cfg.smem_bytes()
        if role == "dq":
            return config_sets.companion_config(cfg).dq_smem_bytes()
        self.role(role)
        return 0

    def grid(self, cfg: HopperBackwardKernelConfig, role: str, batch: int, n_heads: int, n_kv_heads: int,
             seq_len_q: int, seq_len_k: int, sm_count: int = 0) -> tuple[int, int, int]:
        """Launch grid of `role` (x may be 0: nothing to launch). dkdv: one CTA per (key block,
        kv head, batch), or with `persistent` one per SM (`sm_count`), at most one per tile; the
        others as backward_sm80 launches them for the companion config."""
        if role == "dkdv":
            tiles = (-(-seq_len_k // cfg.B_c), n_kv_heads, batch)
            if cfg.persistent:
                if sm_count <= 0:
                    raise ValueError("sm_count: a persistent dK/dV grid needs the GPU's SM count")
                return (min(tiles[0] * tiles[1] * tiles[2], sm_count), 1, 1)
            return tiles
        return BACKWARD_SM80.grid(config_sets.companion_config(cfg), role, batch, n_heads, n_kv_heads,
                                  seq_len_q, seq_len_k)

    def default_config(self, dtype: DType, d_head: int) -> HopperBackwardKernelConfig:
        return config_sets.default_config(dtype, d_head)

    def progression_configs(self, dtype: DType, d_head: int) -> list[HopperBackwardKernelConfig]:
        return config_sets.progression_configs(dtype, d_head)


BACKWARD_SM90 = BackwardSm90Family()
