// Deterministic dQ: one CTA per (query block, head, batch), one warp per 16 query rows, the
// forward kernel's shape. The CTA walks the key blocks its rows see and recomputes, per block,
// S = Q K^T, P = exp2(S * scale * log2 e - lse2), dP = dO V^T, dS = P * (dP - dvec) and
// accumulates dQ += dS K in registers, in key order: no atomics, so the result has the same bits
// on every run. Costs two extra mma products per (query, key) block over the atomic path
// (S and dP are computed twice: here and in the dK/dV kernel). Writes dq * scale directly.
#pragma once

template <class Cfg, bool CAUSAL, bool VARLEN = false>
struct BackwardDQCTA {
    static constexpr int KEY_N_TILES = Cfg::BC / 8;   // n-tiles of S over keys
    static constexpr int D_N_TILES = Cfg::D / 8;
    using KVTile = typename Cfg::KVTile;
    using QTile = typename Cfg::QTile;

    const BackwardParams& p;
    const int tid, lane, warp_row0;
    QTile q_tile, do_tile;
    KVTile k_tile, v_tile;
    typename QTile::Cursor q_a, do_a;
    typename KVTile::Cursor k_b, v_b, k_bt;
    float dq[D_N_TILES][4];
    float lse2[2], dvec[2];  // this lane's two rows

    CF_DEVICE BackwardDQCTA(const BackwardParams& params, unsigned char* smem)
        : p(params), tid(threadIdx.x), lane(threadIdx.x & 31), warp_row0((threadIdx.x >> 5) * 16) {
        q_tile.base = shared_address(smem);
        do_tile.base = q_tile.base + QTile::BYTES;
        k_tile.base = do_tile.base + QTile::BYTES;
        v_tile.base = k_tile.base + KVTile::BYTES;
        q_a = a_fragment_cursor(q_tile, warp_row0, lane);
        do_a = a_fragment_cursor(do_tile, warp_row0, lane);
        k_b = b_fragment_cursor(k_tile, lane);
        v_b = b_fragment_cursor(v_tile, lane);
        k_bt = b_transposed_fragment_cursor(k_tile, lane);
#pragma unroll
        for (int n = 0; n < D_N_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq[n][e] = 0.f;
    }

    // (VARLEN: 0, since `p` then points at the CTA's sequence; see sequence_params)
    CF_DEVICE static int batch_index() { return VARLEN ? 0 : (int)blockIdx.z; }
    // Later query blocks see more keys under causal masking: start them first.
    CF_DEVICE static int q_block() { return CAUSAL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x; }
    CF_DEVICE int offset() const { return p.seq_len_k - p.seq_len_q; }

    CF_DEVICE int kv_blocks() const {
        const int all = (p.seq_len_k + Cfg::BC - 1) / Cfg::BC;
        if constexpr (!CAUSAL) return all;
        const int last_row = min(p.seq_len_q, (q_block() + 1) * Cfg::BR) - 1;
        const int last_key = last_row + offset();
        return last_key < 0 ? 0 : min(all, last_key / Cfg::BC + 1);
    }

    // S (or dP) = A B^T over d_head for this warp's 16 rows and all keys of the block.
    template <class BTile>
    CF_DEVICE void row_by_key_product(float (&acc)[KEY_N_TILES][4], const QTile& a_tile,
                                      const typename QTile::Cursor& a_cur, const BTile& b_tile,
                                      const typename BTile::Cursor& b_cur) {
#pragma unroll
        for (int n = 0; n < KEY_N_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < Cfg::D_K_STEPS; ++ks) {
            u32 a[4];
            load_a_fragment(a, a_tile, a_cur, 0, ks);
#pragma unroll
            for (int n = 0; n < KEY_N_TILES; n += 2) {
                u32 b0[2], b1[2];
                load_b_fragments(b0, b1, b_tile, b_cur, 8 * n, ks);
                mma_m16n8k16<Cfg::dtype>(acc[n], a, b0[0], b0[1]);
                mma_m16n8k16<Cfg::dtype>(acc[n + 1], a, b1[0], b1[1]);
            }
        }
    }

    CF_DEVICE void process_kv_block(int kb) {
        const int batch = batch_index(), kv_head = blockIdx.y / p.kv_group_size;
        const int key0 = kb * Cfg::BC;
        const u16* k_src = static_cast<const u16*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride +
                           (long long)key0 * p.k_seq_stride;
        const u16* v_src = static_cast<const u16*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride +
                           (long long)key0 * p.v_seq_stride;
        copy_tile_global_to_shared<Cfg::DQK_THREADS, true>(k_tile, k_src, p.k_seq_stride, p.seq_len_k - key0, tid);
        copy_tile_global_to_shared<Cfg::DQK_THREADS, true>(v_tile, v_src, p.v_seq_stride, p.seq_len_k - key0, tid);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        float s[KEY_N_TILES][4];
        row_by_key_product(s, q_tile, q_a, k_tile, k_b);
        const int keys_valid = p.seq_len_k - key0;
        const int row0 = q_block() * Cfg::BR + warp_row0 + (lane >> 2);
        bool need_mask = keys_valid < Cfg::BC;
        if constexpr (CAUSAL) need_mask = need_mask || key0 + Cfg::BC - 1 > row0 - (lane >> 2) + offset();
        if (need_mask) {
            mask_fragments(s, lane, [&](int, int h, int key) {
                bool masked = key >= keys_valid;
                if constexpr (CAUSAL) masked |= key0 + key > row0 + 8 * h + offset();
                return masked;
            });
        }
#pragma unroll
        for (int n = 0; n < KEY_N_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = fast_exp2(fmaf(s[n][e], p.softmax_scale_log2, -lse2[e >> 1]));

        float dp[KEY_N_TILES][4];
        row_by_key_product(dp, do_tile, do_a, v_tile, v_b);
        u32 dsa[Cfg::KEY_K_STEPS][4];
#pragma unroll
        for (int n = 0; n < KEY_N_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - dvec[e >> 1]);
#pragma unroll
        for (int k = 0; k < Cfg::KEY_K_STEPS; ++k) pack_a_fragment<Cfg::dtype>(dsa[k], dp[2 * k], dp[2 * k + 1]);

#pragma unroll
        for (int ks = 0; ks < Cfg::KEY_K_STEPS; ++ks)
#pragma unroll
            for (int n = 0; n < D_N_TILES; n += 2) {
                u32 b0[2], b1[2];
                load_b_fragments_transposed(b0, b1, k_tile, k_bt, 8 * n, ks);
                mma_m16n8k16<Cfg::dtype>(dq[n], dsa[ks], b0[0], b0[1]);
                mma_m16n8k16<Cfg::dtype>(dq[n + 1], dsa[ks], b1[0], b1[1]);
            }
        __syncthreads();  // every warp is done with this K and V before the next copies
    }

    CF_DEVICE void run() {
        const int head = blockIdx.y, batch = batch_index();
        const int q0 = q_block() * Cfg::BR;
        const int rows_valid = p.seq_len_q - q0;
        const u16* q_src = static_cast<const u16*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride +
                           (long long)q0 * p.q_seq_stride;
        const u16* do_src = static_cast<const u16*>(p.dout) + batch * p.do_batch_stride +
                            head * p.do_head_stride + (long long)q0 * p.do_seq_stride;
        copy_tile_global_to_shared<Cfg::DQK_THREADS, true>(q_tile, q_src, p.q_seq_stride, rows_valid, tid);
        copy_tile_global_to_shared<Cfg::DQK_THREADS, true>(do_tile, do_src, p.do_seq_stride, rows_valid, tid);
        cp_async_commit();
        const long long stat = ((long long)batch * p.n_heads + head) * p.seq_len_q_pad + q0 + warp_row0 + (lane >> 2);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            lse2[h] = ld_global_f32(p.lse2 + stat + 8 * h);
            dvec[h] = ld_global_f32(p.dvec + stat + 8 * h);
        }
        const int n_blocks = kv_blocks();
        for (int kb = 0; kb < n_blocks; ++kb) process_kv_block(kb);

        // Stage dq * scale through this warp's own Q rows (no other warp reads them); every copy
        // into the Q tile must have landed first (a CTA that visits no key block had no wait).
        cp_async_wait<0>();
        __syncthreads();
        const auto cur = accumulator_cursor(q_tile, warp_row0, lane);
        const float scale = p.softmax_scale;
#pragma unroll
        for (int n = 0; n < D_N_TILES; ++n) store_accumulator_tile<Cfg::dtype>(q_tile, cur, dq[n], 0, n, scale, scale);
        __syncwarp();
        u16* dq_dst = static_cast<u16*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride +
                      (long long)q0 * p.dq_seq_stride;
        copy_warp_rows_shared_to_global<16>(q_tile, warp_row0, dq_dst, p.dq_seq_stride, rows_valid, lane);
    }
};

template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN = false>
__global__ void __launch_bounds__(Cfg::DQK_THREADS) backward_dq_kernel(const __grid_constant__ BackwardParams params) {
    extern __shared__ __align__(1024) unsigned char smem[];
    if constexpr (VARLEN) {
        // The grid covers the longest sequence: query blocks past this one's rows have nothing to do.
        const BackwardParams s = sequence_params<Cfg>(params, blockIdx.z);
        if (BackwardDQCTA<Cfg, CAUSAL, true>::q_block() * Cfg::BR < s.seq_len_q) {
            BackwardDQCTA<Cfg, CAUSAL, true> cta(s, smem);
            cta.run();
        }
    } else {
        BackwardDQCTA<Cfg, CAUSAL> cta(params, smem);
        cta.run();
    }
}
