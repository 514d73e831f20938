"""The decode kernels' launch ABI: one `DecodeParams` struct, passed by value to all three
kernels (attention, combine, append), rendered to C++ and packed from the same field list."""
from __future__ import annotations

from ..base import ParamStruct, stride_fields

__all__ = ["DECODE_PARAMS", "DECODE_PARAM_FIELDS"]

# (name, C++ type, struct format char): pointers and 64-bit strides first, so no padding.
DECODE_PARAM_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("q", "const void*", "Q"),
    ("k_cache", "void*", "Q"),        # written by the append kernel
    ("v_cache", "void*", "Q"),
    ("k_new", "const void*", "Q"),    # 0 without k_new/v_new
    ("v_new", "const void*", "Q"),
    ("o", "void*", "Q"),
    ("lse", "float*", "Q"),           # (batch, n_heads, seq_q) fp32, 0 = not written
    ("ws_o", "float*", "Q"),          # (num_splits, total_rows, d_head) fp32 partial outputs
    ("ws_lse", "float*", "Q"),        # (num_splits, total_rows) fp32 partial log-sum-exp
    ("cache_seqlens", "const int*", "Q"),
    ("block_table", "const int*", "Q"),  # 0 for a contiguous cache
    # k/v, contiguous cache: (batch, seq, head) strides; paged: (page, row in page, head) strides
) + stride_fields("q", "k", "v", "knew", "vnew", "o") + (
    ("block_table_stride", "int", "i"),  # elements between block_table rows
    ("page_shift", "int", "i"),          # log2(page size); 0 for a contiguous cache
    ("max_keys", "int", "i"),            # rows a sequence can hold (block_table width x page size)
    ("batch", "int", "i"),
    ("seq_q", "int", "i"),
    ("n_heads", "int", "i"),
    ("n_kv_heads", "int", "i"),
    ("group", "int", "i"),               # n_heads / n_kv_heads
    ("rows_total", "int", "i"),          # group * seq_q packed rows per KV head
    ("row_tiles", "int", "i"),           # ceil(rows_total / cfg.rows)
    ("total_rows", "int", "i"),          # batch * seq_q * n_heads output rows
    ("seq_new", "int", "i"),             # rows appended per sequence (0 without k_new)
    ("num_splits", "int", "i"),
    ("softmax_scale", "float", "f"),
    ("softmax_scale_log2", "float", "f"),
)

DECODE_PARAMS = ParamStruct("DecodeParams", DECODE_PARAM_FIELDS)
