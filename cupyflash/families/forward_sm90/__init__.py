"""The Hopper forward family (sm_90a): wgmma GEMMs, TMA loads into an mbarrier-guarded K/V ring,
a warp-specialised producer warpgroup with setmaxnreg, ping-pong of two consumer warpgroups,
intra-warpgroup overlap of softmax with the GEMMs and persistent CTAs (FlashAttention-3's design).

`forward_sm90` runs it on CuPy / PyTorch / DLPack arrays with `cupyflash.forward`'s arguments;
`plan_sm90` + `launch_sm90` are the pieces `forward(cfg=None)` needs to launch it on Hopper.
"""
from __future__ import annotations

from ...config import DType
from ..base import KernelFamily, KernelRole
from . import config_sets
from .config import HopperForwardKernelConfig
from .params import HOPPER_FORWARD_PARAMS

__all__ = ["ForwardSm90Family", "FORWARD_SM90", "HopperForwardKernelConfig", "forward_sm90", "plan_sm90",
           "launch_sm90", "unsupported_reason"]


class ForwardSm90Family(KernelFamily):
    name = "forward_sm90"
    kind = "forward"
    description = ("FlashAttention-3-style forward with wgmma, TMA, mbarrier pipelines and warp "
                   "specialisation (sm_90a)")
    config_type = HopperForwardKernelConfig
    template = "forward_sm90.cu.j2"
    headers = ("common/ptx.cuh", "common/varlen_tail.cuh", "common/score_mask.cuh", "common/online_softmax.cuh",
               "common/ptx_sm90.cuh", "common/launch_order.cuh", "common/wgmma_sm90.cuh",
               "forward_sm90/config.cuh", "forward_sm90/tile_scheduler.cuh", "forward_sm90/producer.cuh",
               "forward_sm90/softmax.cuh", "forward_sm90/mainloop.cuh", "forward_sm90/cp_async_loads.cuh",
               "forward_sm90/epilogue.cuh",
               "forward_sm90/kernel.cuh")
    static_wrapper = "StaticHopperForwardConfig"
    roles = (KernelRole("forward", "flash_forward_sm90_kernel", HOPPER_FORWARD_PARAMS),)
    variant_flags = ("causal", "varlen")  # varlen: packed ragged batches (forward_varlen)
    min_compute_capability = 90
    arch_suffix = "a"                # wgmma, setmaxnreg: sm_90a only
    exact_compute_capability = 90
    set_keys = config_sets.KERNEL_SET_KEYS
    # Above forward_sm80's 0: forward(cfg=None) runs this family on Hopper wherever the layout
    # suits TMA (1.5-1.9x the mma.sync kernel on the H100), and forward_sm80 elsewhere.
    priority = 1

    def parse(self, text: str) -> HopperForwardKernelConfig:
        return HopperForwardKernelConfig.parse(text)

    def config_set(self, key: str) -> list[HopperForwardKernelConfig]:
        return config_sets.get_kernel_configs(key)

    def block_threads(self, cfg: HopperForwardKernelConfig, role: str | None = None) -> int:
        return cfg.n_threads

    def smem_bytes(self, cfg: HopperForwardKernelConfig, role: str | None = None) -> int:
        return cfg.smem_bytes()

    def default_config(self, dtype: DType, d_head: int, causal: bool = False) -> HopperForwardKernelConfig:
        return config_sets.default_config(dtype, d_head, causal)

    def tune_candidates(self, dtype: DType, d_head: int) -> list[HopperForwardKernelConfig]:
        return config_sets.autotune_configs([dtype], [d_head])

    def knob_twins(self, cfg: HopperForwardKernelConfig, causal: bool) -> list[HopperForwardKernelConfig]:
        return config_sets.knob_twins(cfg, causal)

    def progression_configs(self, dtype: DType, d_head: int) -> list[HopperForwardKernelConfig]:
        return config_sets.progression_configs(dtype, d_head)

    def tuning_problem(self, dtype: DType, d_head: int, seq: int, causal: bool, l2_bytes: int):
        from .tuning import HopperForwardTuningProblem

        return HopperForwardTuningProblem(dtype, d_head, seq, causal, l2_bytes)


FORWARD_SM90 = ForwardSm90Family()

_LAUNCH_NAMES = ("forward_sm90", "launch_sm90", "plan_sm90", "unsupported_reason")


def __getattr__(name: str):
    # The launch module imports validation/interop, which import the family tables: bound lazily.
    if name in _LAUNCH_NAMES:
        from . import launch

        return getattr(launch, name)
    raise AttributeError(name)
