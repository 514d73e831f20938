"""The Hopper forward kernel's parameter struct, `HopperForwardParams`, passed by value as a
`const __grid_constant__` argument.

The three TMA descriptors (128 bytes each, CUtensorMap) come first, at 64-byte aligned offsets
(0, 128, 256), as the driver requires for descriptors read from parameter space. The C++ struct
is rendered from `PARAM_FIELDS` and the rendered source static_asserts its size and the offsets,
so this packing and the kernel cannot drift.
"""
from __future__ import annotations

import struct

__all__ = ["PARAM_FIELDS", "PARAMS_STRUCT", "PARAMS_SIZE", "TMA_DESCRIPTOR_BYTES", "DESCRIPTOR_OFFSETS",
           "pack_params", "param_names"]

TMA_DESCRIPTOR_BYTES = 128
_ALIGN = 64  # alignof(TmaDescriptor): sizeof(HopperForwardParams) is a multiple of it

# (name, C++ type, struct format). The descriptors, then pointers and 64-bit strides, then ints.
PARAM_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("tma_q", "TmaDescriptor", f"{TMA_DESCRIPTOR_BYTES}s"),
    ("tma_k", "TmaDescriptor", f"{TMA_DESCRIPTOR_BYTES}s"),
    ("tma_v", "TmaDescriptor", f"{TMA_DESCRIPTOR_BYTES}s"),
    ("o", "void*", "Q"),
    ("lse", "float*", "Q"),  # per-(batch, head, row) log-sum-exp; 0 = not written
    ("o_batch_stride", "long long", "q"),
    ("o_seq_stride", "long long", "q"),
    ("o_head_stride", "long long", "q"),
    ("seq_len_q", "int", "i"),
    ("seq_len_k", "int", "i"),
    ("n_heads", "int", "i"),
    ("n_kv_heads", "int", "i"),
    ("softmax_scale", "float", "f"),
    ("softmax_scale_log2", "float", "f"),
    ("kv_group_size", "int", "i"),  # n_heads / n_kv_heads
    ("batch", "int", "i"),          # persistent CTAs decode tile indices with it
)

_fields_format = "<" + "".join(f for _, _, f in PARAM_FIELDS)
_unpadded = struct.calcsize(_fields_format)
PARAMS_SIZE = -(-_unpadded // _ALIGN) * _ALIGN
# Tail padding up to sizeof(HopperForwardParams): the driver copies that many bytes.
PARAMS_STRUCT = struct.Struct(_fields_format + f"{PARAMS_SIZE - _unpadded}x")
DESCRIPTOR_OFFSETS = {"tma_q": 0, "tma_k": 128, "tma_v": 256}


def param_names() -> tuple[str, ...]:
    return tuple(name for name, _, _ in PARAM_FIELDS)


def pack_params(*values) -> bytes:
    """The kernel's parameter bytes from values in `PARAM_FIELDS` order."""
    return PARAMS_STRUCT.pack(*values)
