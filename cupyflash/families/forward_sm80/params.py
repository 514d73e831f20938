"""The mma.sync forward kernel's launch ABI: one parameter struct passed by value.

`FORWARD_PARAMS` is the single definition of `ForwardParams`: the template renders the C++ struct
from it and `pack_params` packs the same fields, so the two cannot drift.
"""
from __future__ import annotations

from ..base import ParamStruct, stride_fields

__all__ = ["FORWARD_PARAMS", "PARAM_FIELDS", "PARAMS_STRUCT", "pack_params", "param_names"]

# (name, C++ type, struct format char). Pointers and 64-bit strides first keep the struct
# free of padding on both sides.
PARAM_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("q", "const void*", "Q"),
    ("k", "const void*", "Q"),
    ("v", "const void*", "Q"),
    ("o", "void*", "Q"),
    ("lse", "float*", "Q"),  # optional per-(batch, head, row) log-sum-exp; 0 = not written
    # forward_varlen only (the varlen variant; 0 otherwise): (batch + 1,) token offsets of each
    # sequence in the packed q/o and k/v.
    ("cu_seqlens_q", "const int*", "Q"),
    ("cu_seqlens_k", "const int*", "Q"),
    # varlen: the packed arrays' token count when o's rows (and lse's columns) past the last
    # sequence are to be zeroed by the kernel (cupyflash.jax's output buffers); 0: left as they are
    ("tail_total_q", "long long", "q"),
) + stride_fields("q", "k", "v", "o") + (
    ("seq_len_q", "int", "i"),
    ("seq_len_k", "int", "i"),
    ("n_heads", "int", "i"),
    ("n_kv_heads", "int", "i"),
    ("softmax_scale", "float", "f"),
    ("softmax_scale_log2", "float", "f"),  # softmax_scale * log2(e)
    ("kv_group_size", "int", "i"),  # n_heads / n_kv_heads: q heads sharing one k/v head (GQA/MQA)
    # The varlen variant's lse is (n_heads, total_q): its head stride, total_q. 0 otherwise. Also
    # keeps the packed size equal to sizeof(ForwardParams), a multiple of 8.
    ("lse_head_stride", "int", "i"),
)

FORWARD_PARAMS = ParamStruct("ForwardParams", PARAM_FIELDS)
PARAMS_STRUCT = FORWARD_PARAMS.layout


def param_names() -> tuple[str, ...]:
    return FORWARD_PARAMS.names()


def pack_params(*values) -> bytes:
    """Pack positional values in `PARAM_FIELDS` order into the kernel's parameter bytes."""
    return PARAMS_STRUCT.pack(*values)
