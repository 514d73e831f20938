"""The Hopper backward dK/dV kernel's parameter struct, `HopperBackwardParams`, passed by value as
a `const __grid_constant__` argument (the reused backward_sm80 kernels take `BackwardParams`).

The five TMA descriptors (CUtensorMap: 128 bytes, 64-byte aligned) come first, at offsets 0, 128,
256, 384 (Q, K, V, dO, as for forward_sm90) and 512 (the dq_tma workspace map); a tail pad
makes the packed size sizeof(HopperBackwardParams), a multiple of 64.
"""
from __future__ import annotations

import struct

from ..base import ParamStruct

__all__ = ["HOPPER_BACKWARD_PARAMS", "PARAM_FIELDS", "PARAMS_SIZE", "DESCRIPTOR_OFFSETS", "pack_params"]

_TMA = 128
_ALIGN = 64

_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("tma_q", "TmaDescriptor", f"{_TMA}s"),
    ("tma_k", "TmaDescriptor", f"{_TMA}s"),
    ("tma_v", "TmaDescriptor", f"{_TMA}s"),
    ("tma_do", "TmaDescriptor", f"{_TMA}s"),
    # dq_tma: fp32 dq_accum as (d_head, seq_len_q_pad, n_heads, batch), boxes of 32 x 64 (a consumer warpgroup's dQ rows); zeros otherwise
    ("tma_dq", "TmaDescriptor", f"{_TMA}s"),
    ("dk", "void*", "Q"),
    ("dv", "void*", "Q"),
    ("dq_accum", "float*", "Q"),  # fp32 (batch, n_heads, seq_len_q_pad, d_head); 0 if deterministic
    ("lse2", "const float*", "Q"),  # fp32 (batch, n_heads, seq_len_q_pad): lse * log2(e), +inf for no key
    ("dvec", "const float*", "Q"),  # fp32 (batch, n_heads, seq_len_q_pad): rowsum(dO * O)
    # varlen only (0 otherwise): int32 (batch + 1) token offsets of the packed sequences (the
    # workspaces are then (n_heads, seq_len_q_pad), config.cuh's BwdSeq)
    ("cu_seqlens_q", "const int*", "Q"),
    ("cu_seqlens_k", "const int*", "Q"),
    ("dk_batch_stride", "long long", "q"),
    ("dk_seq_stride", "long long", "q"),
    ("dk_head_stride", "long long", "q"),
    ("dv_batch_stride", "long long", "q"),
    ("dv_seq_stride", "long long", "q"),
    ("dv_head_stride", "long long", "q"),
    ("seq_len_q", "int", "i"),
    ("seq_len_k", "int", "i"),
    ("seq_len_q_pad", "int", "i"),
    ("n_heads", "int", "i"),
    ("n_kv_heads", "int", "i"),
    ("kv_group_size", "int", "i"),
    ("batch", "int", "i"),  # persistent: the tile grid is (key blocks, n_kv_heads, batch)
    ("softmax_scale", "float", "f"),
    ("softmax_scale_log2", "float", "f"),
    # varlen: the packed arrays' token counts (a sequence's last blocks read rows past its end, the
    # next sequences' or rows no sequence owns, when they exist: the tail zeroer zeroes them); 0 otherwise
    ("total_q", "int", "i"),
    ("total_k", "int", "i"),
)
_unpadded = struct.calcsize("<" + "".join(f for _, _, f in _FIELDS))
_pad = -_unpadded % _ALIGN
PARAM_FIELDS = _FIELDS + ((f"tail_padding[{_pad}]", "char", f"{_pad}x"),) if _pad else _FIELDS
HOPPER_BACKWARD_PARAMS = ParamStruct("HopperBackwardParams", PARAM_FIELDS)
PARAMS_SIZE = HOPPER_BACKWARD_PARAMS.size
DESCRIPTOR_OFFSETS = {"tma_q": 0, "tma_k": 128, "tma_v": 256, "tma_do": 384, "tma_dq": 512}


def pack_params(*values) -> bytes:
    """The kernel's parameter bytes from values in field order (the padding takes none)."""
    return HOPPER_BACKWARD_PARAMS.pack(*values)
