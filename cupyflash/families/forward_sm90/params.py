"""The Hopper forward kernel's parameter struct, `HopperForwardParams`, passed by value as a
`const __grid_constant__` argument.

The three TMA descriptors (CUtensorMap: 128 bytes, 64-byte aligned) come first, at offsets 0,
128 and 256, as the driver requires for descriptors read from parameter space. Configs that load
with cp.async (cp_async) read no descriptor: their slots hold `global_tensor_record`s instead. The struct is
rendered from `HOPPER_FORWARD_PARAMS` (templates/base.cu.j2) and packed from the same list; an
explicit tail pad makes the packed size sizeof(HopperForwardParams), a multiple of 64, since the
driver copies that many bytes from the argument buffer.
"""
from __future__ import annotations

import struct

from ..base import ParamStruct, stride_fields

__all__ = ["HOPPER_FORWARD_PARAMS", "PARAM_FIELDS", "PARAMS_SIZE", "TMA_DESCRIPTOR_BYTES", "DESCRIPTOR_OFFSETS",
           "pack_params", "global_tensor_record", "operand_encoder"]

TMA_DESCRIPTOR_BYTES = 128
_ALIGN = 64  # alignof(TmaDescriptor)

# (name, C++ type, struct format). The descriptors, then pointers and 64-bit strides, then ints.
_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("tma_q", "TmaDescriptor", f"{TMA_DESCRIPTOR_BYTES}s"),
    ("tma_k", "TmaDescriptor", f"{TMA_DESCRIPTOR_BYTES}s"),
    ("tma_v", "TmaDescriptor", f"{TMA_DESCRIPTOR_BYTES}s"),
    ("o", "void*", "Q"),
    ("lse", "float*", "Q"),  # per-(batch, head, row) log-sum-exp; 0 = not written
    # forward_varlen (the varlen variant; 0 otherwise): (batch + 1,) token offsets per sequence
    ("cu_seqlens_q", "const int*", "Q"),
    ("cu_seqlens_k", "const int*", "Q"),
) + stride_fields("o") + (
    ("seq_len_q", "int", "i"),
    ("seq_len_k", "int", "i"),
    ("n_heads", "int", "i"),
    ("n_kv_heads", "int", "i"),
    ("softmax_scale", "float", "f"),
    ("softmax_scale_log2", "float", "f"),
    ("kv_group_size", "int", "i"),  # n_heads / n_kv_heads
    ("batch", "int", "i"),          # persistent CTAs decode tile indices with it
    ("lse_head_stride", "int", "i"),  # varlen: lse is (n_heads, total_q); 0 otherwise
    # varlen: the packed arrays' token count when o's rows (and lse's columns) past the last
    # sequence are to be zeroed by the kernel (cupyflash.jax's output buffers); 0: left as they are
    ("tail_total_q", "int", "i"),
    # varlen: the packed k/v arrays' token count (a sequence's last block reads rows past its end,
    # the next sequences' or rows no sequence owns, when they exist: the kernel zeroes them); 0 otherwise
    ("total_k", "int", "i"),
)
_unpadded = struct.calcsize("<" + "".join(f for _, _, f in _FIELDS))
_pad = -_unpadded % _ALIGN
PARAM_FIELDS = _FIELDS + ((f"tail_padding[{_pad}]", "char", f"{_pad}x"),) if _pad else _FIELDS
HOPPER_FORWARD_PARAMS = ParamStruct("HopperForwardParams", PARAM_FIELDS)
PARAMS_SIZE = HOPPER_FORWARD_PARAMS.size
DESCRIPTOR_OFFSETS = {"tma_q": 0, "tma_k": 128, "tma_v": 256}


def pack_params(*values) -> bytes:
    """The kernel's parameter bytes from values in field order (the padding takes none)."""
    return HOPPER_FORWARD_PARAMS.pack(*values)


_RECORD = struct.Struct("<Qqqq")


def global_tensor_record(ptr: int, dtype=None, shape=None, strides: tuple[int, ...] = (0, 0, 0, 1),
                         box_rows: int = 0) -> bytes:
    """A descriptor slot's bytes for a cp_async config: the pointer, then the batch, seq and head
    strides in elements (kernels_cu/forward_sm90/cp_async_loads.cuh reads them), zero padded.
    Takes tma.descriptor's arguments so either can encode a slot; dtype, shape and box_rows are
    not needed (the kernel bounds rows by the sequence lengths)."""
    return _RECORD.pack(ptr, *strides[:3]).ljust(TMA_DESCRIPTOR_BYTES, b"\0")


def operand_encoder(cfg):
    """How `cfg`'s descriptor slots are encoded: `(ptr, dtype, shape, strides, box_rows) -> bytes`,
    tma.descriptor (cached tensor maps) or global_tensor_record for cp_async configs."""
    if cfg.cp_async:
        return global_tensor_record
    from .tma import descriptor

    return descriptor
