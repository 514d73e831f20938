// The rows of packed varlen arrays that belong to no sequence: tokens cu_seqlens[batch] ..
// total - 1. Where the caller asks (XLA's output buffers in cupyflash.jax; backward_varlen's new
// outputs) the kernels zero them, so that no full-array memset precedes the launch (zeroing whole
// arrays cost 2-4% of a backward call). The grid's threads share those rows, 16 bytes per thread
// and step; usually there are none, and each thread only reads the last offset.
#pragma once

// Whether a sequence's partial last block, whose sequence ends before packed row `seq_end`, reads
// rows past that end: the arrays (`total` rows) hold some (TMA zero-fills only past the arrays).
// They are the next sequence's tokens or rows past the last sequence, which no sequence owns and
// may hold anything (a padded buffer never written: NaN, inf). The masks give them P = 0, but a
// GEMM still adds 0 * NaN, so the Hopper kernels zero them in shared memory first: no value of one
// sequence reaches another's results, and the rows past the last reach none (as the mma.sync
// families' predicated loads, which zero-fill past each sequence).
CF_DEVICE bool reads_rows_past_sequence_end(int seq_end, int total) { return seq_end < total; }

// This thread's index among all threads of the grid, and their count (the stride of zero_rows).
CF_DEVICE long long grid_thread_index() {
    const long long cta = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    return cta * blockDim.x + threadIdx.x;
}
CF_DEVICE long long grid_thread_count() { return (long long)gridDim.x * gridDim.y * gridDim.z * blockDim.x; }

// Rows row0 .. rows_end - 1 of a (rows, heads, D) 16-bit array; this thread stores chunks
// first, first + step, ... of 8 elements.
template <int D>
CF_DEVICE void zero_rows(void* base, long long seq_stride, long long head_stride, int heads, int row0, int rows_end,
                         long long first, long long step) {
    constexpr int CHUNKS = D / 8;
    const long long count = (long long)max(0, rows_end - row0) * heads * CHUNKS;
    for (long long i = first; i < count; i += step) {
        const long long rh = i / CHUNKS;
        const long long row = row0 + rh / heads;
        st_global_16(static_cast<u16*>(base) + row * seq_stride + (rh % heads) * head_stride + (i % CHUNKS) * 8,
                     make_uint4(0u, 0u, 0u, 0u));
    }
}

// Columns col0 .. cols_end - 1 of each of the `heads` rows of a float (heads, row_stride) array
// (the varlen log-sum-exp, (n_heads, total_q)).
CF_DEVICE void zero_columns(float* base, long long row_stride, int heads, int col0, int cols_end, long long first,
                            long long step) {
    const long long cols = max(0, cols_end - col0);
    for (long long i = first; i < cols * heads; i += step) base[(i / cols) * row_stride + col0 + i % cols] = 0.f;
}

// The forward's tail: o's rows and lse's columns past the last sequence, when `total_q` (the
// packed arrays' token count) is non-zero. Every CTA of the grid takes part: call it before any
// early exit.
template <int D>
CF_DEVICE void zero_forward_tail(void* o, long long o_seq_stride, long long o_head_stride, float* lse,
                                 long long lse_head_stride, int heads, const int* cu_seqlens_q, int batch, int total_q) {
    if (total_q == 0) return;
    const int row0 = cu_seqlens_q[batch];
    const long long first = grid_thread_index(), step = grid_thread_count();
    zero_rows<D>(o, o_seq_stride, o_head_stride, heads, row0, total_q, first, step);
    if (lse != nullptr) zero_columns(lse, lse_head_stride, heads, row0, total_q, first, step);
}
