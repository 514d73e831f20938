"""The decode family (sm_80 and newer): split-KV attention of a few query rows against a long,
contiguous or paged KV cache, for `cupyflash.forward_kvcache`.

Two kernels per config and variant (causal, paged): `attention` (one CTA per split x KV head x
row tile x sequence; it also writes k_new / v_new into the cache in place) and `combine` (merges
the splits by their log-sum-exp). See kernels_cu/decode/.
"""
from __future__ import annotations

from ...config import DType
from ..base import KernelFamily, KernelRole
from . import config_sets
from .config import DecodeKernelConfig
from .params import DECODE_PARAMS

__all__ = ["DecodeFamily", "DECODE", "DecodeKernelConfig", "COMBINE_THREADS"]

COMBINE_THREADS = 128  # 4 warps, one output row each (decode_combine_kernel)


class DecodeFamily(KernelFamily):
    name = "decode"
    kind = "decode"
    description = "split-KV decode attention with GQA packing and paged KV caches (sm_80+)"
    config_type = DecodeKernelConfig
    template = "decode.cu.j2"
    headers = ("common/ptx.cuh", "common/score_mask.cuh", "common/tile_primitives.cuh", "common/online_softmax.cuh",
               "decode/decode_common.cuh", "decode/decode_attention.cuh", "decode/decode_combine.cuh")
    static_wrapper = "StaticDecodeKernelConfig"
    roles = (KernelRole("attention", "decode_attention_kernel", DECODE_PARAMS),
             KernelRole("combine", "decode_combine_kernel", DECODE_PARAMS))
    variant_flags = ("causal", "paged")
    min_compute_capability = 80
    set_keys = config_sets.KERNEL_SET_KEYS

    def parse(self, text: str) -> DecodeKernelConfig:
        return DecodeKernelConfig.parse(text)

    def config_set(self, key: str) -> list[DecodeKernelConfig]:
        return config_sets.get_kernel_configs(key)

    def block_threads(self, cfg: DecodeKernelConfig, role: str | None = None) -> int:
        if role in (None, "attention"):
            return cfg.n_threads
        return COMBINE_THREADS

    def smem_bytes(self, cfg: DecodeKernelConfig, role: str | None = None) -> int:
        return cfg.smem_bytes() if role in (None, "attention") else 0

    def default_config(self, dtype: DType, d_head: int) -> DecodeKernelConfig:
        return config_sets.default_config(dtype, d_head)

    def tune_candidates(self, dtype: DType, d_head: int) -> list[DecodeKernelConfig]:
        return config_sets.autotune_configs([dtype], [d_head])

    def progression_configs(self, dtype: DType, d_head: int) -> list[DecodeKernelConfig]:
        return config_sets.progression_configs(dtype, d_head)

    def tuning_problem(self, dtype: DType, d_head: int, seq: int, causal: bool, l2_bytes: int):
        """One decode step at `seq` keys per sequence, contiguous plus paged (see tuning.py)."""
        from .tuning import DecodeTuningProblem

        return DecodeTuningProblem(dtype, d_head, seq, causal, l2_bytes)


DECODE = DecodeFamily()
