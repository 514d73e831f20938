"""The backward family's launch ABI: one `BackwardParams` struct, passed by value to all four
kernels (preprocess, dK/dV, dQ, convert). The template renders the C++ struct from
`BACKWARD_PARAMS` and `pack_params` packs the same list, so the two cannot drift."""
from __future__ import annotations

from ..base import ParamStruct, stride_fields

__all__ = ["BACKWARD_PARAMS", "PARAM_FIELDS", "PARAMS_STRUCT", "pack_params", "param_names", "POINTER_FIELDS"]

POINTER_FIELDS = ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "dq_accum", "lse2", "dvec", "cu_seqlens_q",
                  "cu_seqlens_k")

# (name, C++ type, struct format char): pointers and 64-bit strides first, then 32-bit values
# (an even count, so the struct has no padding).
PARAM_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("q", "const void*", "Q"),
    ("k", "const void*", "Q"),
    ("v", "const void*", "Q"),
    ("o", "const void*", "Q"),
    ("dout", "const void*", "Q"),
    ("lse", "const float*", "Q"),   # the forward's natural-log LSE, (batch, n_heads, seq_len_q)
    ("dq", "void*", "Q"),
    ("dk", "void*", "Q"),
    ("dv", "void*", "Q"),
    ("dq_accum", "float*", "Q"),    # fp32 workspace (batch, n_heads, seq_len_q_pad, d_head); 0 if deterministic
    ("lse2", "float*", "Q"),        # fp32 workspace (batch, n_heads, seq_len_q_pad)
    ("dvec", "float*", "Q"),        # fp32 workspace (batch, n_heads, seq_len_q_pad)
    # varlen only (0 otherwise): int32 (batch + 1) token offsets of the packed sequences; then the
    # workspaces are (n_heads, seq_len_q_pad) with sequence b's rows from a B_r multiple (see
    # backward_common.cuh's sequence_params) and the lse (n_heads, total_q)
    ("cu_seqlens_q", "const int*", "Q"),
    ("cu_seqlens_k", "const int*", "Q"),
) + stride_fields("q", "k", "v", "o", "do", "dq", "dk", "dv") + (
    ("lse_batch_stride", "long long", "q"),
    ("lse_head_stride", "long long", "q"),
    ("lse_seq_stride", "long long", "q"),
    ("seq_len_q", "int", "i"),
    ("seq_len_k", "int", "i"),
    ("seq_len_q_pad", "int", "i"),  # seq_len_q rounded up to a multiple of B_r
    ("n_heads", "int", "i"),
    ("n_kv_heads", "int", "i"),
    ("kv_group_size", "int", "i"),  # n_heads / n_kv_heads
    ("softmax_scale", "float", "f"),
    ("softmax_scale_log2", "float", "f"),
    # varlen with new dq/dk/dv: the packed arrays' token counts; the preprocess zeroes the rows
    # past the last sequence (cu_seqlens[batch] .. total - 1). 0: nothing to zero
    ("tail_total_q", "int", "i"),
    ("tail_total_k", "int", "i"),
)

BACKWARD_PARAMS = ParamStruct("BackwardParams", PARAM_FIELDS)
PARAMS_STRUCT = BACKWARD_PARAMS.layout


def param_names() -> tuple[str, ...]:
    return BACKWARD_PARAMS.names()


def pack_params(*values) -> bytes:
    """Pack positional values in PARAM_FIELDS order."""
    return BACKWARD_PARAMS.pack(*values)
