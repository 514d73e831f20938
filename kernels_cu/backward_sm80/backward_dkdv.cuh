// FlashAttention-2 backward, main kernel: one CTA per (key block, k/v head, batch).
//
// The CTA keeps its B_c keys and values in shared memory and dK, dV in registers (fp32) while it
// walks every query block that sees its keys, for every query head of its k/v head's group
// (GQA/MQA: the group's sum is accumulated in place, in a fixed order). Per query block of B_r
// rows, warp w (key rows warp_key0.., dK/dV columns d0..) computes, all transposed so that keys
// are the rows its registers hold:
//   S^T  = K Q^T                       (A: K rows, B: Q stored [query][d])
//   P^T  = exp2(S^T * scale * log2 e - lse2[query])        (the forward's softmax, recomputed)
//   dP^T = V dO^T                      (A: V rows, B: dO stored [query][d])
//   dS^T = P^T * (dP^T - dvec[query])
//   dV  += P^T dO,  dK += dS^T Q       (A: P^T / dS^T from registers, B: dO / Q transposed)
// and, unless DETERMINISTIC, stores dS^T to shared memory; after a barrier every warp forms a part
// of dQ = dS K (A: dS through the transposing ldmatrix, B: K transposed) and adds it to the fp32
// dq_accum workspace with atomics. The next query block's Q, dO and row statistics are copied
// (cp.async) during that dQ step, or, with double_buffer, into a second buffer during the whole
// iteration. dK is scaled by softmax_scale when stored.
//
// Query blocks are visited starting at a rotation that depends on the key block: the CTAs running
// at once (consecutive key blocks of one head) then add their dQ parts into different rows instead
// of all into the same block's rows, which serialised their atomics in L2.
#pragma once

template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN = false>
struct BackwardKVCTA {
    static constexpr int MK = Cfg::MK;
    using KVTile = typename Cfg::KVTile;
    using QTile = typename Cfg::QTile;
    using DSTile = typename Cfg::DSTile;

    const BackwardParams& p;
    const int tid, lane, warp;
    const int warp_key0;  // first key row of this warp inside the key block
    const int split;      // which D_SPLIT slice of dK/dV columns this warp accumulates
    KVTile k_tile, v_tile;
    QTile q_tile, do_tile;
    DSTile ds_tile;
    u32 stats;  // shared address of lse2[B_r], followed by dvec[B_r] (buffer 0)
    // Per-lane ldmatrix cursors (computed once, displaced by constants in the loops).
    typename KVTile::Cursor k_a, v_a, k_bt;
    typename QTile::Cursor q_b, do_b, q_bt, do_bt;
    typename DSTile::Cursor ds_store, ds_at;

    float dk[MK][Cfg::DKV_N_TILES][4];
    float dv[MK][Cfg::DKV_N_TILES][4];

    CF_DEVICE BackwardKVCTA(const BackwardParams& params, unsigned char* smem)
        : p(params),
          tid(threadIdx.x),
          lane(threadIdx.x & 31),
          warp(threadIdx.x >> 5),
          warp_key0(((threadIdx.x >> 5) % Cfg::KEY_GROUPS) * Cfg::WARP_KEYS),
          split((threadIdx.x >> 5) / Cfg::KEY_GROUPS) {
        if constexpr (CAUSAL) {
            const int3 c = kv_block_coords<CAUSAL>();
            causal_kb = c.x;
            causal_batch = c.z;
        }
        // K, V, Q(0), dO(0), [Q(1), dO(1)], dS^T, statistics(0), [statistics(1)]
        k_tile.base = shared_address(smem);
        v_tile.base = k_tile.base + KVTile::BYTES;
        q_tile.base = v_tile.base + KVTile::BYTES;
        do_tile.base = q_tile.base + QTile::BYTES;
        ds_tile.base = q_tile.base + Cfg::Q_BUFFERS * Cfg::Q_BUFFER_SHIFT;
        stats = ds_tile.base + DSTile::BYTES;
        const int matrix = lane >> 3;
        const int d_chunk0 = split * Cfg::DKV_N_TILES;  // this warp's first dK/dV column chunk
        k_a = a_fragment_cursor(k_tile, warp_key0, lane);
        v_a = a_fragment_cursor(v_tile, warp_key0, lane);
        q_b = b_fragment_cursor(q_tile, lane);
        do_b = b_fragment_cursor(do_tile, lane);
        // Transposed B cursors with the warp's column slice folded in, so loop displacements
        // stay compile-time constants.
        q_bt = q_tile.cursor((lane & 7) + (matrix & 1) * 8, (matrix >> 1) + d_chunk0);
        do_bt = do_tile.cursor((lane & 7) + (matrix & 1) * 8, (matrix >> 1) + d_chunk0);
        ds_store = accumulator_cursor(ds_tile, warp_key0, lane);
        // dQ step: this warp's m-tile(s) of queries and column slice.
        int mt0, n_chunk0;
        if constexpr (Cfg::N_WARPS > Cfg::Q_M_TILES) {
            mt0 = warp % Cfg::Q_M_TILES;
            n_chunk0 = (warp / Cfg::Q_M_TILES) * Cfg::DQ_N_TILES;
        } else {
            mt0 = warp;
            n_chunk0 = 0;
        }
        ds_at = ds_tile.cursor((lane & 7) + (matrix >> 1) * 8, (matrix & 1) + 2 * mt0);
        k_bt = k_tile.cursor((lane & 7) + (matrix & 1) * 8, (matrix >> 1) + n_chunk0);
#pragma unroll
        for (int m = 0; m < MK; ++m)
#pragma unroll
            for (int n = 0; n < Cfg::DKV_N_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    dk[m][n][e] = 0.f;
                    dv[m][n][e] = 0.f;
                }
    }

    // (key block, k/v head, batch): the grid's coordinates, or under causal masking the
    // heavy-first order of kv_block_coords, decoded once (it divides) into causal_kb/batch.
    int causal_kb, causal_batch;
    CF_DEVICE int key_block() const { return CAUSAL ? causal_kb : (int)blockIdx.x; }
    // (VARLEN: 0, since `p` then points at the CTA's sequence; see sequence_params)
    CF_DEVICE int batch_index() const { return VARLEN ? 0 : CAUSAL ? causal_batch : (int)blockIdx.z; }
    CF_DEVICE static int kv_head_index() { return kv_block_coords<CAUSAL>().y; }
    CF_DEVICE int k0() const { return key_block() * Cfg::BC; }
    CF_DEVICE int offset() const { return p.seq_len_k - p.seq_len_q; }  // causal diagonal shift

    // ---- global -> shared ----
    CF_DEVICE void load_kv() {
        const int kv_head = kv_head_index(), batch = batch_index();
        const u16* k_src = static_cast<const u16*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride +
                           (long long)k0() * p.k_seq_stride;
        const u16* v_src = static_cast<const u16*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride +
                           (long long)k0() * p.v_seq_stride;
        copy_tile_global_to_shared<Cfg::N_THREADS, true>(k_tile, k_src, p.k_seq_stride, p.seq_len_k - k0(), tid);
        copy_tile_global_to_shared<Cfg::N_THREADS, true>(v_tile, v_src, p.v_seq_stride, p.seq_len_k - k0(), tid);
    }

    // The Q/dO tiles and statistics of buffer `buf` (always 0 without double_buffer).
    CF_DEVICE static QTile shifted(QTile t, int buf) {
        t.base += buf * Cfg::Q_BUFFER_SHIFT;
        return t;
    }
    CF_DEVICE static typename QTile::Cursor shifted(typename QTile::Cursor c, int buf) {
        c.addr += buf * Cfg::Q_BUFFER_SHIFT;  // whole 1024-byte multiples: the swizzle phase is kept
        return c;
    }
    CF_DEVICE u32 stats_of(int buf) const { return stats + buf * Cfg::ROW_STATS_BYTES; }

    CF_DEVICE void load_q_block(int head, int qb, int buf) {
        const int batch = batch_index();
        const long long row0 = (long long)qb * Cfg::BR;
        const int rows_valid = p.seq_len_q - qb * Cfg::BR;
        const u16* q_src = static_cast<const u16*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride +
                           row0 * p.q_seq_stride;
        const u16* do_src = static_cast<const u16*>(p.dout) + batch * p.do_batch_stride +
                            head * p.do_head_stride + row0 * p.do_seq_stride;
        copy_tile_global_to_shared<Cfg::N_THREADS, true>(shifted(q_tile, buf), q_src, p.q_seq_stride, rows_valid, tid);
        copy_tile_global_to_shared<Cfg::N_THREADS, true>(shifted(do_tile, buf), do_src, p.do_seq_stride, rows_valid,
                                                         tid);
        // Row statistics: the workspace rows are padded to whole blocks, always in bounds.
        const long long stat0 = ((long long)batch * p.n_heads + head) * p.seq_len_q_pad + row0;
        const u32 st = stats_of(buf);
        if (tid < Cfg::BR / 4) cp_async_16(st + tid * 16, p.lse2 + stat0 + tid * 4, true);
        else if (tid < Cfg::BR / 2)
            cp_async_16(st + tid * 16, p.dvec + stat0 + (tid - Cfg::BR / 4) * 4, true);
    }

    // ---- S^T = K Q^T and dP^T = V dO^T (the same product over d_head, different operands) ----
    template <class ATile, class BTile>
    CF_DEVICE void key_by_query_product(float (&acc)[MK][Cfg::Q_N_TILES][4], const ATile& a_tile,
                                        const typename ATile::Cursor& a_cur, const BTile& b_tile,
                                        const typename BTile::Cursor& b_cur) {
#pragma unroll
        for (int m = 0; m < MK; ++m)
#pragma unroll
            for (int n = 0; n < Cfg::Q_N_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < Cfg::D_K_STEPS; ++ks) {
            u32 a[MK][4];
#pragma unroll
            for (int m = 0; m < MK; ++m) load_a_fragment(a[m], a_tile, a_cur, 16 * m, ks);
#pragma unroll
            for (int n = 0; n < Cfg::Q_N_TILES; n += 2) {
                u32 b0[2], b1[2];
                load_b_fragments(b0, b1, b_tile, b_cur, 8 * n, ks);
#pragma unroll
                for (int m = 0; m < MK; ++m) {
                    mma_m16n8k16<Cfg::dtype>(acc[m][n], a[m], b0[0], b0[1]);
                    mma_m16n8k16<Cfg::dtype>(acc[m][n + 1], a[m], b1[0], b1[1]);
                }
            }
        }
    }

    // Scores that must not count become -inf: keys past seq_len_k and, under causal masking,
    // keys after a query's diagonal (key > query + seq_len_k - seq_len_q).
    // The tile is S^T: rows are keys, columns queries.
    CF_DEVICE void mask_scores(float (&s)[MK][Cfg::Q_N_TILES][4], int q0, int keys_valid) {
        mask_fragments<true>(s, lane, [&](int m, int h, int query) {
            const int key = warp_key0 + 16 * m + 8 * h + (lane >> 2);
            bool masked = key >= keys_valid;
            if constexpr (CAUSAL) masked |= k0() + key > q0 + query + offset();
            return masked;
        });
    }

    // One query block of one head. On entry its Q, dO and row statistics are in shared memory.
    CF_DEVICE void process_q_block(int qb, int buf, bool has_next, int next_head, int next_qb, float* dq_rows) {
        const int q0 = qb * Cfg::BR;
        const QTile qt = shifted(q_tile, buf), dot = shifted(do_tile, buf);
        const u32 st = stats_of(buf);
        if constexpr (Cfg::Q_BUFFERS == 2) {
            // The other buffer was last read in the previous iteration, before the barrier that
            // preceded this call: copy the next block into it now, behind this whole iteration.
            if (has_next) load_q_block(next_head, next_qb, buf ^ 1);
            cp_async_commit();
        }
        float s[MK][Cfg::Q_N_TILES][4];
        key_by_query_product(s, k_tile, k_a, qt, shifted(q_b, buf));
        const int keys_valid = p.seq_len_k - k0();
        bool need_mask = keys_valid < Cfg::BC;
        if constexpr (CAUSAL)  // warp-uniform: does this warp's last key lie after the block's first diagonal?
            need_mask = need_mask || k0() + warp_key0 + Cfg::WARP_KEYS - 1 > q0 + offset();
        if (need_mask) mask_scores(s, q0, keys_valid);

        // P^T in place.
#pragma unroll
        for (int n = 0; n < Cfg::Q_N_TILES; ++n) {
            const float2 l = ld_shared_f32x2(st + (8 * n + 2 * (lane & 3)) * 4);
#pragma unroll
            for (int m = 0; m < MK; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    s[m][n][2 * h] = fast_exp2(fmaf(s[m][n][2 * h], p.softmax_scale_log2, -l.x));
                    s[m][n][2 * h + 1] = fast_exp2(fmaf(s[m][n][2 * h + 1], p.softmax_scale_log2, -l.y));
                }
        }

        float dp[MK][Cfg::Q_N_TILES][4];
        key_by_query_product(dp, v_tile, v_a, dot, shifted(do_b, buf));
        // dS^T in place of dP^T.
#pragma unroll
        for (int n = 0; n < Cfg::Q_N_TILES; ++n) {
            const float2 d = ld_shared_f32x2(st + (Cfg::BR + 8 * n + 2 * (lane & 3)) * 4);
#pragma unroll
            for (int m = 0; m < MK; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    dp[m][n][2 * h] = s[m][n][2 * h] * (dp[m][n][2 * h] - d.x);
                    dp[m][n][2 * h + 1] = s[m][n][2 * h + 1] * (dp[m][n][2 * h + 1] - d.y);
                }
        }

        u32 pa[MK][Cfg::Q_K_STEPS][4], dsa[MK][Cfg::Q_K_STEPS][4];
#pragma unroll
        for (int m = 0; m < MK; ++m)
#pragma unroll
            for (int k = 0; k < Cfg::Q_K_STEPS; ++k) {
                pack_a_fragment<Cfg::dtype>(pa[m][k], s[m][2 * k], s[m][2 * k + 1]);
                pack_a_fragment<Cfg::dtype>(dsa[m][k], dp[m][2 * k], dp[m][2 * k + 1]);
            }

        // dV += P^T dO, dK += dS^T Q over this warp's column slice.
#pragma unroll
        for (int ks = 0; ks < Cfg::Q_K_STEPS; ++ks)
#pragma unroll
            for (int n = 0; n < Cfg::DKV_N_TILES; n += 2) {
                u32 b0[2], b1[2];
                load_b_fragments_transposed(b0, b1, dot, shifted(do_bt, buf), 8 * n, ks);
#pragma unroll
                for (int m = 0; m < MK; ++m) {
                    mma_m16n8k16<Cfg::dtype>(dv[m][n], pa[m][ks], b0[0], b0[1]);
                    mma_m16n8k16<Cfg::dtype>(dv[m][n + 1], pa[m][ks], b1[0], b1[1]);
                }
                load_b_fragments_transposed(b0, b1, qt, shifted(q_bt, buf), 8 * n, ks);
#pragma unroll
                for (int m = 0; m < MK; ++m) {
                    mma_m16n8k16<Cfg::dtype>(dk[m][n], dsa[m][ks], b0[0], b0[1]);
                    mma_m16n8k16<Cfg::dtype>(dk[m][n + 1], dsa[m][ks], b1[0], b1[1]);
                }
            }

        if constexpr (!DETERMINISTIC) {
            // One warp of each key group publishes dS^T (unscaled, input precision).
            if (split == 0) {
#pragma unroll
                for (int m = 0; m < MK; ++m)
#pragma unroll
                    for (int k = 0; k < Cfg::Q_K_STEPS; ++k) store_a_fragment(ds_tile, ds_store, dsa[m][k], 16 * m, k);
            }
        }
        if constexpr (Cfg::Q_BUFFERS == 1) {
            __syncthreads();  // dS^T complete; every warp is done reading Q and dO
            if (has_next) load_q_block(next_head, next_qb, 0);
            cp_async_commit();
        } else if constexpr (!DETERMINISTIC) {
            __syncthreads();  // dS^T complete
        }
        if constexpr (!DETERMINISTIC) accumulate_dq(dq_rows);
    }

    // dq_accum[q0 + rows][cols] += dS K for this warp's m-tile(s) and column slice. `dq_rows`
    // points at this lane's element (row 16*mt0 + lane/4, column 8*n_chunk0 + 2*(lane%4)).
    CF_DEVICE void accumulate_dq(float* dq_rows) {
#pragma unroll
        for (int i = 0; i < Cfg::DQ_MTILES_PER_WARP; ++i) {
            u32 a[Cfg::KEY_K_STEPS][4];
#pragma unroll
            for (int ks = 0; ks < Cfg::KEY_K_STEPS; ++ks)
                load_a_fragment_transposed(a[ks], ds_tile, ds_at, i * Cfg::N_WARPS, ks);
#pragma unroll
            for (int c = 0; c < Cfg::DQ_N_TILES / Cfg::DQ_CHUNK; ++c) {
                float acc[Cfg::DQ_CHUNK][4];
#pragma unroll
                for (int n = 0; n < Cfg::DQ_CHUNK; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll
                for (int ks = 0; ks < Cfg::KEY_K_STEPS; ++ks)
#pragma unroll
                    for (int n = 0; n < Cfg::DQ_CHUNK; n += 2) {
                        u32 b0[2], b1[2];
                        load_b_fragments_transposed(b0, b1, k_tile, k_bt, 8 * (c * Cfg::DQ_CHUNK + n), ks);
                        mma_m16n8k16<Cfg::dtype>(acc[n], a[ks], b0[0], b0[1]);
                        mma_m16n8k16<Cfg::dtype>(acc[n + 1], a[ks], b1[0], b1[1]);
                    }
                float* row_ptr = dq_rows + (long long)i * Cfg::N_WARPS * 16 * Cfg::D;
#pragma unroll
                for (int n = 0; n < Cfg::DQ_CHUNK; ++n) {
                    const int col = 8 * (c * Cfg::DQ_CHUNK + n);
                    atomic_add_f32x2(row_ptr + col, acc[n][0], acc[n][1]);
                    atomic_add_f32x2(row_ptr + 8 * Cfg::D + col, acc[n][2], acc[n][3]);
                }
            }
        }
    }

    CF_DEVICE void run() {
        const int n_qb_all = (p.seq_len_q + Cfg::BR - 1) / Cfg::BR;
        // Under causal masking, query blocks before the first one that sees key k0 are skipped.
        const int qb_begin = CAUSAL ? max(0, k0() - offset()) / Cfg::BR : 0;
        const int n_qb = n_qb_all - qb_begin;
        const int total = n_qb > 0 ? n_qb * p.kv_group_size : 0;
        // Each head's query blocks in the order qb_first, ..., last, qb_begin, ..., qb_first - 1.
        const int qb_first = n_qb > 0 ? qb_begin + (int)((unsigned)key_block() % (unsigned)n_qb) : 0;
        int head = kv_head_index() * p.kv_group_size, qb = qb_first;
        load_kv();
        if (total > 0) load_q_block(head, qb, 0);
        cp_async_commit();

        // dQ step addressing: this lane's row/column in the dq_accum rows of (head, qb).
        int mt0, n_chunk0;
        if constexpr (Cfg::N_WARPS > Cfg::Q_M_TILES) {
            mt0 = warp % Cfg::Q_M_TILES;
            n_chunk0 = (warp / Cfg::Q_M_TILES) * Cfg::DQ_N_TILES;
        } else {
            mt0 = warp;
            n_chunk0 = 0;
        }
        const int lane_elem = (16 * mt0 + (lane >> 2)) * Cfg::D + 8 * n_chunk0 + 2 * (lane & 3);

        for (int it = 0; it < total; ++it) {
            cp_async_wait<0>();
            __syncthreads();  // this block's Q, dO, statistics (and on entry K, V) have landed
            int next_head = head, next_qb = qb + 1 == n_qb_all ? qb_begin : qb + 1;
            if (next_qb == qb_first) ++next_head;
            float* dq_rows = nullptr;
            if constexpr (!DETERMINISTIC)
                dq_rows = p.dq_accum +
                          (((long long)batch_index() * p.n_heads + head) * p.seq_len_q_pad + (long long)qb * Cfg::BR) *
                              Cfg::D +
                          lane_elem;
            process_q_block(qb, Cfg::Q_BUFFERS == 2 ? (it & 1) : 0, it + 1 < total, next_head, next_qb, dq_rows);
            head = next_head;
            qb = next_qb;
        }
        store_dk_dv();
    }

    // Stage dK * scale and dV through the K and V tiles, then write whole 16-byte chunks.
    CF_DEVICE void store_dk_dv() {
        cp_async_wait<0>();
        __syncthreads();  // every warp is done with the K and V tiles (and all copies landed)
        const int d_chunk0 = split * Cfg::DKV_N_TILES;
        const auto k_cur = k_tile.cursor(warp_key0 + (lane >> 2), d_chunk0, (lane & 3) * 4);
        const auto v_cur = v_tile.cursor(warp_key0 + (lane >> 2), d_chunk0, (lane & 3) * 4);
        const float scale = p.softmax_scale;
#pragma unroll
        for (int m = 0; m < MK; ++m)
#pragma unroll
            for (int n = 0; n < Cfg::DKV_N_TILES; ++n) {
                store_accumulator_tile<Cfg::dtype>(k_tile, k_cur, dk[m][n], 16 * m, n, scale, scale);
                store_accumulator_tile<Cfg::dtype>(v_tile, v_cur, dv[m][n], 16 * m, n, 1.f, 1.f);
            }
        __syncthreads();
        const int kv_head = kv_head_index(), batch = batch_index();
        u16* dk_dst = static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + kv_head * p.dk_head_stride +
                      (long long)k0() * p.dk_seq_stride;
        u16* dv_dst = static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + kv_head * p.dv_head_stride +
                      (long long)k0() * p.dv_seq_stride;
        const int rows_valid = p.seq_len_k - k0();
        copy_tile_shared_to_global<Cfg::N_THREADS>(k_tile, dk_dst, p.dk_seq_stride, rows_valid, tid);
        copy_tile_shared_to_global<Cfg::N_THREADS>(v_tile, dv_dst, p.dv_seq_stride, rows_valid, tid);
    }
};

