// The two row-wise kernels around the main backward kernel.
//
// preprocess: dvec = rowsum(dO * O) in fp32, lse2 = lse * log2(e) (+inf where the forward saw no
//   key, and on padding rows), and, unless DETERMINISTIC, zeroes the dq_accum rows of its block;
//   VARLEN with new outputs: also the dq, dk, dv rows past the last sequence (zero_varlen_tail).
// convert: dq = dq_accum * softmax_scale in the input precision (not used when DETERMINISTIC:
//   the dQ kernel then writes dq itself).
// Both: 64 rows per CTA, 4 threads per row; grid (seq_len_q_pad / 64, n_heads, batch), or with
// VARLEN (the longest sequence's rows rounded up to B_r, / 64, n_heads, batch).
#pragma once

// The preprocess body, shared with the Hopper family's own preprocess kernel
// (kernels_cu/backward_sm90/rows.cuh), which wraps it in a launch trigger and a dQ counter reset.
template <class Cfg, bool DETERMINISTIC>
CF_DEVICE void preprocess_block(const BackwardParams& p, int batch) {
    constexpr int CHUNKS = Cfg::D / 8;
    const int tid = threadIdx.x, part = tid & 3;
    const int row = blockIdx.x * Cfg::ROW_KERNEL_ROWS + (tid >> 2);
    const int head = blockIdx.y;
    float acc = 0.f;
    if (row < p.seq_len_q) {
        const u16* o = static_cast<const u16*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride +
                       (long long)row * p.o_seq_stride;
        const u16* d = static_cast<const u16*>(p.dout) + batch * p.do_batch_stride + head * p.do_head_stride +
                       (long long)row * p.do_seq_stride;
#pragma unroll
        for (int c = part; c < CHUNKS; c += 4) {
            const uint4 a = ld_global_16(o + 8 * c);
            const uint4 b = ld_global_16(d + 8 * c);
            const u32 av[4] = {a.x, a.y, a.z, a.w};
            const u32 bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 x = unpack_pair<Cfg::dtype>(av[j]);
                const float2 y = unpack_pair<Cfg::dtype>(bv[j]);
                acc = fmaf(x.x, y.x, acc);
                acc = fmaf(x.y, y.y, acc);
            }
        }
    }
    acc = quad_sum(acc);
    const long long stat = ((long long)batch * p.n_heads + head) * p.seq_len_q_pad + row;
    if (part == 0) {
        float lse = CF_NEG_INF;
        if (row < p.seq_len_q)
            lse = ld_global_f32(p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride +
                                (long long)row * p.lse_seq_stride);
        p.dvec[stat] = acc;
        p.lse2[stat] = lse == CF_NEG_INF ? CF_POS_INF : lse * CF_LOG2E;
    }
    if constexpr (!DETERMINISTIC) {
        float4* acc_rows = reinterpret_cast<float4*>(
            p.dq_accum + (((long long)batch * p.n_heads + head) * p.seq_len_q_pad +
                          (long long)blockIdx.x * Cfg::ROW_KERNEL_ROWS) * Cfg::D);
        constexpr int VECS = Cfg::ROW_KERNEL_ROWS * Cfg::D / 4;
#pragma unroll
        for (int i = tid; i < VECS; i += Cfg::ROW_KERNEL_THREADS) acc_rows[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN = false>
__global__ void __launch_bounds__(Cfg::ROW_KERNEL_THREADS)
    backward_preprocess_kernel(const __grid_constant__ BackwardParams p) {
    if constexpr (VARLEN) {
        zero_varlen_tail<Cfg>(p);
        // Only the sequence's own whole B_r blocks: the rows past them belong to the next one.
        const BackwardParams s = sequence_params<Cfg>(p, blockIdx.z);
        if ((int)blockIdx.x * Cfg::ROW_KERNEL_ROWS < (s.seq_len_q + Cfg::BR - 1) / Cfg::BR * Cfg::BR)
            preprocess_block<Cfg, DETERMINISTIC>(s, 0);
    } else {
        preprocess_block<Cfg, DETERMINISTIC>(p, blockIdx.z);
    }
}

// The convert body, shared with the Hopper family's own convert kernel (rows.cuh there), which
// waits for its dQ block first. FROM_L2: read dq_accum with ld.global.cg (L2 only), for a kernel
// that may run while other CTAs' reductions into it land in L2.
template <class Cfg, bool FROM_L2>
CF_DEVICE void convert_block(const BackwardParams& p, int batch) {
    constexpr int CHUNKS = Cfg::D / 8;
    constexpr int TOTAL = Cfg::ROW_KERNEL_ROWS * CHUNKS;
    const int head = blockIdx.y;
    const int row0 = blockIdx.x * Cfg::ROW_KERNEL_ROWS;
    const float* src = p.dq_accum + (((long long)batch * p.n_heads + head) * p.seq_len_q_pad + row0) * Cfg::D;
    u16* dst = static_cast<u16*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride +
               (long long)row0 * p.dq_seq_stride;
#pragma unroll
    for (int idx = threadIdx.x; idx < TOTAL; idx += Cfg::ROW_KERNEL_THREADS) {
        const int row = idx / CHUNKS, chunk = idx % CHUNKS;
        if (row0 + row >= p.seq_len_q) continue;
        const float* from = src + row * Cfg::D + chunk * 8;
        float4 a, b;
        if constexpr (FROM_L2) {
            a = ld_global_cg_f32x4(from);
            b = ld_global_cg_f32x4(from + 4);
        } else {
            a = *reinterpret_cast<const float4*>(from);
            b = *reinterpret_cast<const float4*>(from + 4);
        }
        const float s = p.softmax_scale;
        uint4 out;
        out.x = pack_pair<Cfg::dtype>(a.x * s, a.y * s);
        out.y = pack_pair<Cfg::dtype>(a.z * s, a.w * s);
        out.z = pack_pair<Cfg::dtype>(b.x * s, b.y * s);
        out.w = pack_pair<Cfg::dtype>(b.z * s, b.w * s);
        st_global_16(dst + row * p.dq_seq_stride + chunk * 8, out);
    }
}

template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN = false>
__global__ void __launch_bounds__(Cfg::ROW_KERNEL_THREADS)
    backward_convert_dq_kernel(const __grid_constant__ BackwardParams p) {
    if constexpr (VARLEN) {
        const BackwardParams s = sequence_params<Cfg>(p, blockIdx.z);
        if ((int)blockIdx.x * Cfg::ROW_KERNEL_ROWS < s.seq_len_q) convert_block<Cfg, false>(s, 0);
    } else {
        convert_block<Cfg, false>(p, blockIdx.z);
    }
}
