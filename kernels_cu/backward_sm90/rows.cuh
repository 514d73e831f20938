// The Hopper family's own row kernels around the dK/dV kernel, for pdl configs (the others use
// backward_sm80's kernels). Both are backward_sm80's bodies (preprocess_block, convert_block in
// kernels_cu/backward_sm80/backward_rows.cuh): the preprocess with a launch trigger and a dQ
// counter reset, the convert behind a wait for its dQ block, reading dq_accum from L2.
// Both take BackwardParams; 64 rows (one query block) per CTA, 4 threads per row; grid
// (seq_len_q_pad / 64, n_heads, batch).
//
// preprocess: dvec = rowsum(dO * O), lse2 = lse * log2(e) (+inf for rows that saw no key and
//   padding rows), dq_accum rows zeroed, with dq_early the block's counter reset, and with
//   dynamic the dK/dV kernel's tile counter (VARLEN with new outputs: the rows past the last
//   sequence of dq, dk, dv zeroed, zero_varlen_tail). It lets the
//   dK/dV kernel's grid launch at once (griddepcontrol.launch_dependents); that kernel waits for
//   this one's writes before reading them.
// convert: dq = dq_accum * softmax_scale in the input precision (dq_frag: from the fragment
//   order). pdl: waits for the dK/dV grid
//   (griddepcontrol.wait) before reading. dq_early: waits only for its own block's counter to
//   reach the number of key blocks that add to it (the dK/dV writer warps count them), so blocks
//   finished early are converted while the dK/dV kernel's last wave still runs (after ~1 s of
//   spinning it waits for the whole grid instead); CTA (0, 0, 0) waits for the whole dK/dV grid
//   before it exits, so the call ends after that grid.
#pragma once

// VARLEN (backward_varlen): each CTA works on its sequence's rows (backward_sm80's
// sequence_params: whole B_r blocks from the sequence's first workspace row), the grid covering
// the longest sequence; the counters are those of one workspace batch entry.
template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN = false>
__global__ void __launch_bounds__(Cfg::ROW_KERNEL_THREADS)
    backward_sm90_preprocess_kernel(const __grid_constant__ BackwardParams p) {
    if constexpr (Cfg::PDL) pdl_launch_dependents();
    const int batches = ws_batches<VARLEN>(gridDim.z);
    if constexpr (Cfg::DYNAMIC && !DETERMINISTIC) {
        if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
            *bwd_tile_counter<Cfg>(p.dq_accum, batches, p.n_heads, p.seq_len_q_pad) = 0u;
    }
    int batch = blockIdx.z, block = blockIdx.x;
    if constexpr (VARLEN) {
        zero_varlen_tail<Cfg>(p);
        const BackwardParams s = sequence_params<Cfg>(p, blockIdx.z);
        if ((int)blockIdx.x * Cfg::ROW_KERNEL_ROWS >= (s.seq_len_q + Cfg::BR - 1) / Cfg::BR * Cfg::BR) return;
        preprocess_block<Cfg, DETERMINISTIC>(s, 0);
        batch = 0;
        block += (int)(varlen_ws_row0<Cfg::BR>(p.cu_seqlens_q[blockIdx.z], blockIdx.z) / Cfg::BR);
    } else {
        preprocess_block<Cfg, DETERMINISTIC>(p, blockIdx.z);
    }
    if constexpr (Cfg::DQ_EARLY && !DETERMINISTIC) {
        if (threadIdx.x == 0)
            *dq_block_counter<Cfg::D, Cfg::BR>(p.dq_accum, batches, p.n_heads, p.seq_len_q_pad, batch, blockIdx.y,
                                               block) = 0u;
    }
}

// dq_frag: dq = dq_accum * softmax_scale read from the fragment order (config.cuh). Thread i takes
// warpgroup thread t = i % 128 and the n-tile groups 4 g .. 4 g + 3 with g = i / 128, i / 128 + 2,
// ... of the block (32 columns a group): four coalesced 16-byte loads a group, then
// quad_transpose gives each lane 8 consecutive columns of its rows r and r + 8, stored 16 bytes
// at a time.
template <class Cfg>
CF_DEVICE void convert_fragments_block(const BackwardParams& p, int batch) {
    static_assert(Cfg::ROW_KERNEL_ROWS == Cfg::DQ_PART_ROWS && Cfg::ROW_KERNEL_THREADS == 256,
                  "dq_frag: one 64-row block per convert CTA, 128 threads per 4 n-tiles");
    constexpr int GROUPS = Cfg::D / 32;  // of 4 n-tiles
    const int head = blockIdx.y;
    const int row0 = blockIdx.x * Cfg::DQ_PART_ROWS;
    const float* src = p.dq_accum + (((long long)batch * p.n_heads + head) * p.seq_len_q_pad + row0) * Cfg::D;
    u16* dst = static_cast<u16*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride +
               (long long)row0 * p.dq_seq_stride;
    const int t = threadIdx.x % 128, g0 = threadIdx.x / 128, lane = threadIdx.x & 31;
    const int r = 16 * (t / 32) + (t % 32) / 4;
    const bool ok0 = row0 + r < p.seq_len_q, ok1 = row0 + r + 8 < p.seq_len_q;  // (every lane shuffles)
    const float s = p.softmax_scale;
#pragma unroll
    for (int pass = 0; pass < (GROUPS + 1) / 2; ++pass) {
        const int g = g0 + 2 * pass;
        if (GROUPS % 2 != 0 && g >= GROUPS) continue;  // (uniform per warp: the shuffles below need every lane)
        u32 w0[4], w1[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 v = ld_global_cg_f32x4(src + ((4 * g + i) * 128 + t) * 4);
            w0[i] = pack_pair<Cfg::dtype>(v.x * s, v.y * s);
            w1[i] = pack_pair<Cfg::dtype>(v.z * s, v.w * s);
        }
        quad_transpose(w0, lane);
        quad_transpose(w1, lane);
        const int col = 32 * g + 8 * (lane & 3);
        if (ok0) st_global_16(dst + (long long)r * p.dq_seq_stride + col, make_uint4(w0[0], w0[1], w0[2], w0[3]));
        if (ok1) st_global_16(dst + (long long)(r + 8) * p.dq_seq_stride + col, make_uint4(w1[0], w1[1], w1[2], w1[3]));
    }
}

// dq_early: wait until the writers have counted `expected` additions to this block (spinning on
// the counter for up to ~1 s, then for the whole dK/dV grid instead, so the counters only ever
// make the wait shorter: a block whose CTAs run longer than that is still read complete).
CF_DEVICE void wait_for_dq_block(const unsigned* counter, int expected) {
    if (expected == 0) {
        pdl_wait_for_predecessor();  // no key block adds to these rows: the preprocess's zeros, once written
        return;
    }
    constexpr int MAX_SPINS = 1 << 22;
    __shared__ int counted;
    if (threadIdx.x == 0) {
        int spin = 0;
        while (spin < MAX_SPINS && ld_acquire_gpu(counter) < (unsigned)expected) {
            __nanosleep(256);
            ++spin;
        }
        counted = spin < MAX_SPINS;
    }
    __syncthreads();
    if (!counted) pdl_wait_for_predecessor();
}

template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN = false>
__global__ void __launch_bounds__(Cfg::ROW_KERNEL_THREADS)
    backward_sm90_convert_kernel(const __grid_constant__ BackwardParams p) {
    const int head = blockIdx.y;
    // VARLEN: the CTA's sequence (backward_sm80's sequence_params); blocks past its rows convert
    // nothing but still reach the final wait below
    const BackwardParams s = VARLEN ? sequence_params<Cfg>(p, blockIdx.z) : p;
    const int batch = VARLEN ? 0 : (int)blockIdx.z;
    const int block = VARLEN ? (int)blockIdx.x + (int)(varlen_ws_row0<Cfg::BR>(p.cu_seqlens_q[blockIdx.z], blockIdx.z) /
                                                       Cfg::BR)
                             : (int)blockIdx.x;
    if (!VARLEN || (int)blockIdx.x * Cfg::ROW_KERNEL_ROWS < s.seq_len_q) {
        if constexpr (Cfg::DQ_EARLY) {
            const int expected = dq_block_contributors<Cfg::BR, Cfg::BC, CAUSAL>(blockIdx.x, s.seq_len_q, s.seq_len_k);
            wait_for_dq_block(dq_block_counter<Cfg::D, Cfg::BR>(p.dq_accum, ws_batches<VARLEN>(gridDim.z), p.n_heads,
                                                                 p.seq_len_q_pad, batch, head, block),
                              expected);
        } else if constexpr (Cfg::PDL) {
            pdl_wait_for_predecessor();
        }
        if constexpr (Cfg::DQ_FRAG)
            convert_fragments_block<Cfg>(s, batch);
        else
            convert_block<Cfg, true>(s, batch);
    }
    if constexpr (Cfg::DQ_EARLY) {
        // The grid may not complete before the dK/dV grid (its epilogues still store dK and dV):
        // one thread of one CTA holds it until then.
        if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) pdl_wait_for_predecessor();
    }
}
