"""The mma.sync backward family (sm_80 and newer): FlashAttention-2's backward with mma.m16n8k16,
ldmatrix and cp.async. Four kernels per config: preprocess (D = rowsum(dO * O), lse in base 2),
dK/dV (one CTA per key block, dQ through fp32 atomics), dQ (deterministic mode: one CTA per query
block, no atomics) and convert (dQ fp32 -> input precision)."""
from .config import BackwardKernelConfig
from .config_sets import default_config, get_kernel_configs

__all__ = ["BackwardKernelConfig", "default_config", "get_kernel_configs"]
