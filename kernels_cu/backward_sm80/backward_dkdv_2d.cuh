// The dK/dV kernel with P and dS exchanged through shared memory (config field pds_smem), the
// warp tiling of FlashAttention-2's backward: each of the three products gets its own 2-D warp
// layout with 32 x 32 (or 32 x D/k) warp tiles, instead of every warp owning 16 key rows of all
// of them. Per query block of B_r rows:
//   phase A, warps X_S_WM x (B_c/32) over (queries, keys), tiles of X_S_ROWS (32 or 64) queries x
//            32 keys: S = Q K^T, P = exp2(S*scale*log2 e -
//            lse2[row]), dP = dO V^T, dS = P * (dP - dvec[row]); P and dS (input precision) are
//            stored to shared [query][key] tiles;                        -- barrier --
//   phase B, warps (B_c/32) x (D/cols) over (keys, d): dV += P^T dO, dK += dS^T Q, with P^T and
//            dS^T read through the transposing ldmatrix (32 keys per warp: each B fragment of
//            dO / Q feeds two m-tiles, half the shared-memory reads of the 16-row layout);
//   phase C, warps (B_r/32) x (D/cols) over (queries, d), atomic variant only: dQ += dS K into the
//            fp32 workspace.
// Q, dO and the row statistics are double-buffered (required): the next block's copies are issued
// at the top of the iteration, since Q and dO are read until the end of phase B. Two barriers per
// iteration: the top one (block landed; every warp done with the previous phases B/C, whose Q/dO
// buffer the copy overwrites and whose P/dS phase A overwrites) and the one after phase A.
// pipelined: three Q/dO/statistics buffers and two P/dS pairs; the only barrier is the one after
// phase A (it also publishes the next block, waited for just before it), and the next-but-one
// block is copied right after it into the buffer that phases B/C of the previous iteration read.
// A warp done with phases B/C goes on to the next phase A without waiting for the others.
// mbarrier (with pipelined): two Q/dO/statistics buffers; block it + 1 is copied right after the
// barrier of iteration it into the buffer phases B/C of it - 1 read, each thread signals its
// copies on that buffer's mbarrier, and phase A of it + 1 waits on the mbarrier (not on a second
// barrier).
// dq_first: phase C before phase B (the dQ reductions drain under phase B's mma).
// dq_spread (with dq_first): phase C's reductions are issued a few after each k-step of phase B
// rather than in one burst that fills the load/store queue ahead of phase B's fragment loads.
// dq_late (pipelined): phase C's dQ tile is kept in registers and reduced during the next block's
// phase A, a few reductions after each row group's exponentials: the load/store queue is idle
// there, where in phases B/C the reductions queue up with the fragment loads (the last block's
// are reduced after the loop).
// dq_v4: phase C's reductions are 16-byte vectors (4 consecutive columns per lane after one
// exchange between lane pairs): half as many reduction instructions.
// load_mid: the next block's copies are issued after the first k-step of the first phase after
// the barrier (phase A without pipelined, else phase B or C), beside mma already issued.
#pragma once

// The no-op hook of a phase (see load_mid), and of phase B's k-steps (see dq_spread).
struct NoHook {
    CF_DEVICE void operator()() const {}
};
struct NoStep {
    CF_DEVICE void operator()(int) const {}
};

template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN = false>
struct BackwardKVCTA2D {
    using KVTile = typename Cfg::KVTile;
    using QTile = typename Cfg::QTile;
    using PTile = typename Cfg::PTile;  // [B_r queries][B_c keys], P or dS
    static constexpr int S_M = Cfg::X_S_ROWS / 16;  // phase A: m-tiles of queries per warp
    static constexpr int S_N = 4;                   // phase A: 32 keys per warp = 4 n-tiles
    static constexpr int DKV_N = Cfg::X_DKV_COLS / 8;
    static constexpr int KV_REG_STEPS = Cfg::KV_REGS ? Cfg::D_K_STEPS : 1;
    static constexpr int DQ_N = Cfg::X_DQ_COLS / 8;

    const BackwardParams& p;
    const int tid, lane, warp;
    KVTile k_tile, v_tile;
    QTile q_tile, do_tile;
    PTile p_tile, ds_tile;
    u32 stats;
    // phase A
    const int a_q0, a_k0;  // warp tile origin (query row, key) inside the blocks
    typename QTile::Cursor q_a, do_a;
    typename KVTile::Cursor k_b, v_b;
    // phase B
    const int b_k0, b_d0;
    typename PTile::Cursor p_at, ds_at;
    typename QTile::Cursor q_bt, do_bt;
    // phase C
    const int c_q0, c_d0;
    typename PTile::Cursor ds_a;
    typename KVTile::Cursor k_bt;

    float dk[2][DKV_N][4];
    float dv[2][DKV_N][4];
    // dq_late: the previous block's dQ tile and its dq_accum rows (this lane's element)
    float dq_late[2][DQ_N][4];
    float* dq_late_rows;
    // kv_regs: this warp's K and V B fragments (32 keys: two n-tile pairs per k-step over d_head)
    u32 k_frag[KV_REG_STEPS][S_N / 2][4];
    u32 v_frag[KV_REG_STEPS][S_N / 2][4];

    CF_DEVICE BackwardKVCTA2D(const BackwardParams& params, unsigned char* smem)
        : p(params),
          tid(threadIdx.x),
          lane(threadIdx.x & 31),
          warp(threadIdx.x >> 5),
          a_q0(((threadIdx.x >> 5) / Cfg::X_S_WN) * Cfg::X_S_ROWS),
          a_k0(((threadIdx.x >> 5) % Cfg::X_S_WN) * 32),
          b_k0(((threadIdx.x >> 5) / Cfg::X_DKV_WD) * 32),
          b_d0(((threadIdx.x >> 5) % Cfg::X_DKV_WD) * Cfg::X_DKV_COLS),
          c_q0(((threadIdx.x >> 5) / Cfg::X_DQ_WD) * 32),
          c_d0(((threadIdx.x >> 5) % Cfg::X_DQ_WD) * Cfg::X_DQ_COLS) {
        if constexpr (CAUSAL) {
            const int3 c = kv_block_coords<CAUSAL>();
            causal_kb = c.x;
            causal_batch = c.z;
        }
            // K, V, Q(0), dO(0), Q(1), dO(1), [Q(2), dO(2)], P(0), dS(0), [P(1), dS(1)], statistics(0..)
        k_tile.base = shared_address(smem);
        v_tile.base = k_tile.base + KVTile::BYTES;
        q_tile.base = v_tile.base + KVTile::BYTES;
        do_tile.base = q_tile.base + QTile::BYTES;
        p_tile.base = q_tile.base + Cfg::PDS_Q_BUFFERS * Cfg::Q_BUFFER_SHIFT;
        ds_tile.base = p_tile.base + PTile::BYTES;
        stats = p_tile.base + Cfg::P_BUFFERS * Cfg::P_BUFFER_SHIFT;
        const int matrix = lane >> 3;
        // phase A: A operands (Q, dO rows a_q0..), B operands (K, V rows a_k0..) with the warp's
        // offsets folded into the cursors (multiples of 8 rows: the swizzle phase is kept)
        q_a = a_fragment_cursor(q_tile, a_q0, lane);
        do_a = a_fragment_cursor(do_tile, a_q0, lane);
        k_b = k_tile.cursor(a_k0 + (lane & 7) + (matrix >> 1) * 8, matrix & 1);
        v_b = v_tile.cursor(a_k0 + (lane & 7) + (matrix >> 1) * 8, matrix & 1);
        // phase B: P^T / dS^T as A operands from [query][key] tiles (keys b_k0..), dO / Q as
        // transposed B operands (columns b_d0..)
        p_at = p_tile.cursor((lane & 7) + (matrix >> 1) * 8, (matrix & 1) + b_k0 / 8);
        ds_at = ds_tile.cursor((lane & 7) + (matrix >> 1) * 8, (matrix & 1) + b_k0 / 8);
        q_bt = q_tile.cursor((lane & 7) + (matrix & 1) * 8, (matrix >> 1) + b_d0 / 8);
        do_bt = do_tile.cursor((lane & 7) + (matrix & 1) * 8, (matrix >> 1) + b_d0 / 8);
        // phase C: dS rows c_q0.. as A, K columns c_d0.. as transposed B
        ds_a = a_fragment_cursor(ds_tile, c_q0, lane);
        k_bt = k_tile.cursor((lane & 7) + (matrix & 1) * 8, (matrix >> 1) + c_d0 / 8);
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < DKV_N; ++n)
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
    CF_DEVICE int offset() const { return p.seq_len_k - p.seq_len_q; }

    CF_DEVICE static QTile shifted(QTile t, int buf) {
        t.base += buf * Cfg::Q_BUFFER_SHIFT;
        return t;
    }
    CF_DEVICE static typename QTile::Cursor shifted(typename QTile::Cursor c, int buf) {
        c.addr += buf * Cfg::Q_BUFFER_SHIFT;
        return c;
    }
    CF_DEVICE u32 stats_of(int buf) const { return stats + buf * Cfg::ROW_STATS_BYTES; }
    // The P and dS tiles (and cursors) of P/dS buffer `pbuf` (always 0 unless pipelined).
    CF_DEVICE static PTile pshifted(PTile t, int pbuf) {
        t.base += pbuf * Cfg::P_BUFFER_SHIFT;
        return t;
    }
    CF_DEVICE static typename PTile::Cursor pshifted(typename PTile::Cursor c, int pbuf) {
        c.addr += pbuf * Cfg::P_BUFFER_SHIFT;  // whole 1024-byte multiples: the swizzle phase is kept
        return c;
    }

    CF_DEVICE void load_kv() {
        const int kv_head = kv_head_index(), batch = batch_index();
        const u16* k_src = static_cast<const u16*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride +
                           (long long)k0() * p.k_seq_stride;
        const u16* v_src = static_cast<const u16*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride +
                           (long long)k0() * p.v_seq_stride;
        copy_tile_global_to_shared<Cfg::N_THREADS, true>(k_tile, k_src, p.k_seq_stride, p.seq_len_k - k0(), tid);
        copy_tile_global_to_shared<Cfg::N_THREADS, true>(v_tile, v_src, p.v_seq_stride, p.seq_len_k - k0(), tid);
    }

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
        const long long stat0 = ((long long)batch * p.n_heads + head) * p.seq_len_q_pad + row0;
        const u32 st = stats_of(buf);
        if (tid < Cfg::BR / 4) cp_async_16(st + tid * 16, p.lse2 + stat0 + tid * 4, true);
        else if (tid < Cfg::BR / 2)
            cp_async_16(st + tid * 16, p.dvec + stat0 + (tid - Cfg::BR / 4) * 4, true);
    }

    // kv_regs: read this warp's K and V B fragments once (the tiles must have landed).
    CF_DEVICE void load_kv_fragments() {
#pragma unroll
        for (int ks = 0; ks < KV_REG_STEPS; ++ks)
#pragma unroll
            for (int j = 0; j < S_N / 2; ++j) {
                ldmatrix_x4(k_frag[ks][j], k_tile.at(k_b, 16 * j, 2 * ks));
                ldmatrix_x4(v_frag[ks][j], v_tile.at(v_b, 16 * j, 2 * ks));
            }
    }

    // acc (X_S_ROWS rows x 32 keys) = A B^T over d_head: A rows from a query-major tile, B rows from K or V
    // (with kv_regs: from `b_regs`, the same fragments kept in registers).
    CF_DEVICE void query_by_key_product(float (&acc)[S_M][S_N][4], const QTile& a_tile,
                                        const typename QTile::Cursor& a_cur, const KVTile& b_tile,
                                        const typename KVTile::Cursor& b_cur,
                                        const u32 (&b_regs)[KV_REG_STEPS][S_N / 2][4]) {
#pragma unroll
        for (int m = 0; m < S_M; ++m)
#pragma unroll
            for (int n = 0; n < S_N; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < Cfg::D_K_STEPS; ++ks) {
            u32 a[S_M][4];
#pragma unroll
            for (int m = 0; m < S_M; ++m) load_a_fragment(a[m], a_tile, a_cur, 16 * m, ks);
#pragma unroll
            for (int n = 0; n < S_N; n += 2) {
                u32 b0[2], b1[2];
                if constexpr (Cfg::KV_REGS) {
                    b0[0] = b_regs[ks][n / 2][0];
                    b0[1] = b_regs[ks][n / 2][1];
                    b1[0] = b_regs[ks][n / 2][2];
                    b1[1] = b_regs[ks][n / 2][3];
                } else {
                    load_b_fragments(b0, b1, b_tile, b_cur, 8 * n, ks);
                }
#pragma unroll
                for (int m = 0; m < S_M; ++m) {
                    mma_m16n8k16<Cfg::dtype>(acc[m][n], a[m], b0[0], b0[1]);
                    mma_m16n8k16<Cfg::dtype>(acc[m][n + 1], a[m], b1[0], b1[1]);
                }
            }
        }
    }

    // Phase A for one query block: P and dS of this warp's X_S_ROWS x 32 tile into shared memory.
    // `hook` runs after the S product (load_mid).
    // `spread(m)` runs after row group m's exponentials (dq_late).
    template <class Hook = NoHook, class Spread = NoStep>
    CF_DEVICE void phase_a(int q0, int buf, int pbuf, Hook&& hook = Hook{}, Spread&& spread = Spread{}) {
        const QTile qt = shifted(q_tile, buf), dot = shifted(do_tile, buf);
        const PTile pt = pshifted(p_tile, pbuf), dst = pshifted(ds_tile, pbuf);
        const u32 st = stats_of(buf);
        float s[S_M][S_N][4];
        query_by_key_product(s, qt, shifted(q_a, buf), k_tile, k_b, k_frag);
        hook();
        const int keys_valid = p.seq_len_k - k0();
        bool need_mask = a_k0 + 32 > keys_valid;
        if constexpr (CAUSAL)  // warp-uniform: does the tile's last key lie after its first row's diagonal?
            need_mask = need_mask || k0() + a_k0 + 31 > q0 + a_q0 + offset();
        if (need_mask) {
            mask_fragments<true>(s, lane, [&](int m, int h, int col) {
                const int row = a_q0 + 16 * m + 8 * h + (lane >> 2), key = a_k0 + col;
                bool masked = key >= keys_valid;
                if constexpr (CAUSAL) masked = masked || k0() + key > q0 + row + offset();
                return masked;
            });
        }
        float lse2[S_M][2], dvec[S_M][2];
#pragma unroll
        for (int m = 0; m < S_M; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = a_q0 + 16 * m + 8 * h + (lane >> 2);
                lse2[m][h] = ld_shared_f32(st + row * 4);
                dvec[m][h] = ld_shared_f32(st + (Cfg::BR + row) * 4);
            }
#pragma unroll
        for (int m = 0; m < S_M; ++m) {
#pragma unroll
            for (int n = 0; n < S_N; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[m][n][e] = fast_exp2(fmaf(s[m][n][e], p.softmax_scale_log2, -lse2[m][e >> 1]));
            spread(m);
        }
        float dp[S_M][S_N][4];
        query_by_key_product(dp, dot, shifted(do_a, buf), v_tile, v_b, v_frag);
        const auto p_cur = pt.cursor(a_q0 + (lane >> 2), a_k0 / 8, (lane & 3) * 4);
        const auto ds_cur = dst.cursor(a_q0 + (lane >> 2), a_k0 / 8, (lane & 3) * 4);
#pragma unroll
        for (int m = 0; m < S_M; ++m)
#pragma unroll
            for (int k = 0; k < S_N / 2; ++k) {
                float ds0[4], ds1[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    ds0[e] = s[m][2 * k][e] * (dp[m][2 * k][e] - dvec[m][e >> 1]);
                    ds1[e] = s[m][2 * k + 1][e] * (dp[m][2 * k + 1][e] - dvec[m][e >> 1]);
                }
                u32 a[4];
                pack_a_fragment<Cfg::dtype>(a, s[m][2 * k], s[m][2 * k + 1]);
                store_a_fragment(pt, p_cur, a, 16 * m, k);
                pack_a_fragment<Cfg::dtype>(a, ds0, ds1);
                store_a_fragment(dst, ds_cur, a, 16 * m, k);
            }
    }

    // Phase B: dV += P^T dO and dK += dS^T Q for this warp's 32 keys and column slice; `hook`
    // runs after the first k-step (load_mid), `step(ks)` after every k-step (dq_spread).
    template <class Hook = NoHook, class Step = NoStep>
    CF_DEVICE void phase_b(int buf, int pbuf, Hook&& hook = Hook{}, Step&& step = Step{}) {
        const QTile qt = shifted(q_tile, buf), dot = shifted(do_tile, buf);
        const auto q_cur = shifted(q_bt, buf), do_cur = shifted(do_bt, buf);
        const PTile pt = pshifted(p_tile, pbuf), dst = pshifted(ds_tile, pbuf);
        const auto p_cur = pshifted(p_at, pbuf), ds_cur = pshifted(ds_at, pbuf);
#pragma unroll
        for (int ks = 0; ks < Cfg::Q_K_STEPS; ++ks) {
            u32 pa[2][4], da[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                load_a_fragment_transposed(pa[m], pt, p_cur, m, ks);
                load_a_fragment_transposed(da[m], dst, ds_cur, m, ks);
            }
#pragma unroll
            for (int n = 0; n < DKV_N; n += 2) {
                u32 b0[2], b1[2];
                load_b_fragments_transposed(b0, b1, dot, do_cur, 8 * n, ks);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    mma_m16n8k16<Cfg::dtype>(dv[m][n], pa[m], b0[0], b0[1]);
                    mma_m16n8k16<Cfg::dtype>(dv[m][n + 1], pa[m], b1[0], b1[1]);
                }
                load_b_fragments_transposed(b0, b1, qt, q_cur, 8 * n, ks);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    mma_m16n8k16<Cfg::dtype>(dk[m][n], da[m], b0[0], b0[1]);
                    mma_m16n8k16<Cfg::dtype>(dk[m][n + 1], da[m], b1[0], b1[1]);
                }
            }
            if (ks == 0) hook();
            step(ks);
        }
    }

    // Phase C: dq_accum rows c_q0.. (32), columns c_d0.. += dS K. `dq_rows` points at this lane's
    // element (row c_q0 + lane/4, column c_d0 + 2*(lane%4)) of the query block; `hook` runs after
    // the first k-step (load_mid).
    template <class Hook = NoHook>
    CF_DEVICE void phase_c(float* dq_rows, int pbuf, Hook&& hook = Hook{}) {
        float acc[2][DQ_N][4];
        dq_product(acc, pbuf, hook);
        if constexpr (Cfg::DQ_V4) {
            reduce_dq_v4(dq_rows, acc);
        } else {
#pragma unroll
            for (int i = 0; i < DQ_REDUCTIONS; ++i) reduce_dq(dq_rows, acc, i);
        }
    }

    // dq_v4: lanes 2j and 2j + 1 (columns 4j' .. of an n-tile pair) swap one fp32 pair per
    // (m-tile, row half, n-tile pair), so the even lane holds 4 consecutive columns of n-tile n
    // and the odd lane 4 of n-tile n + 1; each reduces them with one 16-byte vector reduction:
    // half the reduction instructions, each covering 64 contiguous bytes of a row per lane quad.
    CF_DEVICE void reduce_dq_v4(float* dq_rows, const float (&acc)[2][DQ_N][4]) const {
        const bool odd = lane & 1;
        // dq_rows points at column 2 * (lane % 4); the vector starts at the even lane's column
        float* const base = dq_rows - (odd ? 2 : 0);
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < DQ_N; n += 2)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    // selects of values, not of pointers into acc (which would put it in local memory)
                    const float a0 = acc[m][n][2 * h], a1 = acc[m][n][2 * h + 1];
                    const float b0 = acc[m][n + 1][2 * h], b1 = acc[m][n + 1][2 * h + 1];
                    const float g0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : b0, 1);
                    const float g1 = __shfl_xor_sync(0xffffffffu, odd ? a1 : b1, 1);
                    float* const at = base + (16 * m + 8 * h) * Cfg::D + 8 * n + (odd ? 8 : 0);
                    atomic_add_f32x4(at, odd ? g0 : a0, odd ? g1 : a1, odd ? b0 : g0, odd ? b1 : g1);
                }
    }

    // The 2 * 2 * DQ_N fp32 pairs phase C adds into dq_accum.
    static constexpr int DQ_REDUCTIONS = 4 * DQ_N;

    // Reduction i (m-tile i / (2 DQ_N), n-tile (i / 2) % DQ_N, row half i % 2) of acc into dq_accum.
    CF_DEVICE void reduce_dq(float* dq_rows, const float (&acc)[2][DQ_N][4], int i) const {
        const int m = i / (2 * DQ_N), n = (i / 2) % DQ_N, h = i % 2;
        atomic_add_f32x2(dq_rows + (16 * m + 8 * h) * Cfg::D + 8 * n, acc[m][n][2 * h], acc[m][n][2 * h + 1]);
    }

    // Share `part` of PARTS equal shares of the reductions (the last may be shorter): dq_spread
    // issues one per phase-B k-step, dq_late one per phase-A row group.
    template <int PARTS>
    CF_DEVICE void reduce_share(float* dq_rows, const float (&acc)[2][DQ_N][4], int part) const {
        constexpr int PER = (DQ_REDUCTIONS + PARTS - 1) / PARTS;
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if (part * PER + j < DQ_REDUCTIONS) reduce_dq(dq_rows, acc, part * PER + j);
    }
    CF_DEVICE void reduce_late(int m) const { reduce_share<S_M>(dq_late_rows, dq_late, m); }

    // acc (32 queries x X_DQ_COLS) = dS K for this warp's tile; `hook` runs after the first k-step.
    template <class Hook = NoHook>
    CF_DEVICE void dq_product(float (&acc)[2][DQ_N][4], int pbuf, Hook&& hook = Hook{}) {
        const PTile dst = pshifted(ds_tile, pbuf);
        const auto ds_cur = pshifted(ds_a, pbuf);
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < DQ_N; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < Cfg::KEY_K_STEPS; ++ks) {
            u32 a[2][4];
            load_a_fragment(a[0], dst, ds_cur, 0, ks);
            load_a_fragment(a[1], dst, ds_cur, 16, ks);
#pragma unroll
            for (int n = 0; n < DQ_N; n += 2) {
                u32 b0[2], b1[2];
                load_b_fragments_transposed(b0, b1, k_tile, k_bt, 8 * n, ks);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    mma_m16n8k16<Cfg::dtype>(acc[m][n], a[m], b0[0], b0[1]);
                    mma_m16n8k16<Cfg::dtype>(acc[m][n + 1], a[m], b1[0], b1[1]);
                }
            }
            if (ks == 0) hook();
        }
    }

    // The block after (head, qb) in this CTA's order: each head's query blocks from qb_first to the
    // last, then from qb_begin to qb_first - 1; then the next head of the group.
    CF_DEVICE void advance(int& head, int& qb, int qb_first, int n_qb_all) const {
        qb = qb + 1 == n_qb_all ? first_query_block() : qb + 1;
        if (qb == qb_first) ++head;
    }

    // Under causal masking, query blocks before the first one that sees key k0 are skipped
    // (recomputed where needed rather than held in a register across the loop).
    CF_DEVICE int first_query_block() const { return CAUSAL ? max(0, k0() - offset()) / Cfg::BR : 0; }

    // This lane's element of the dq_accum rows of (head, qb) in phase C: row c_q0 + lane/4,
    // column c_d0 + 2*(lane%4) (recomputed from the thread index: nothing held across the loop).
    CF_DEVICE float* dq_rows_of(int head, int qb) const {
        const int lane_elem = (c_q0 + (lane >> 2)) * Cfg::D + c_d0 + 2 * (lane & 3);
        return p.dq_accum +
               (((long long)batch_index() * p.n_heads + head) * p.seq_len_q_pad + (long long)qb * Cfg::BR) * Cfg::D +
               lane_elem;
    }

    // Phases B and C of block (head, qb) in the configured order; `hook` runs inside the first.
    template <class Hook>
    CF_DEVICE void phases_bc(int head, int qb, int buf, int pbuf, Hook&& hook) {
        if constexpr (DETERMINISTIC) {
            phase_b(buf, pbuf, hook);
        } else if constexpr (Cfg::DQ_LATE) {  // reduced during the next block's phase A
            if constexpr (Cfg::DQ_FIRST) {
                dq_product(dq_late, pbuf, hook);
                phase_b(buf, pbuf);
            } else {
                phase_b(buf, pbuf, hook);
                dq_product(dq_late, pbuf);
            }
            dq_late_rows = dq_rows_of(head, qb);
        } else if constexpr (Cfg::DQ_SPREAD) {
            float acc[2][DQ_N][4];
            dq_product(acc, pbuf, hook);
            float* const dq_rows = dq_rows_of(head, qb);
            phase_b(buf, pbuf, NoHook{}, [&](int ks) { reduce_share<Cfg::Q_K_STEPS>(dq_rows, acc, ks); });
        } else if constexpr (Cfg::DQ_FIRST) {
            phase_c(dq_rows_of(head, qb), pbuf, hook);
            phase_b(buf, pbuf);
        } else {
            phase_b(buf, pbuf, hook);
            phase_c(dq_rows_of(head, qb), pbuf);
        }
    }

    // Phases B and C with `issue` (the next copies) before them, or inside the first (load_mid).
    template <class Issue>
    CF_DEVICE void issue_then_phases_bc(int head, int qb, int buf, int pbuf, Issue&& issue) {
        if constexpr (Cfg::LOAD_MID) {
            phases_bc(head, qb, buf, pbuf, issue);
        } else {
            issue();
            phases_bc(head, qb, buf, pbuf, NoHook{});
        }
    }

    CF_DEVICE void run() {
        const int n_qb_all = (p.seq_len_q + Cfg::BR - 1) / Cfg::BR;
        const int qb_begin = first_query_block();
        const int n_qb = n_qb_all - qb_begin;
        const int total = n_qb > 0 ? n_qb * p.kv_group_size : 0;
        const int qb_first = n_qb > 0 ? qb_begin + (int)((unsigned)key_block() % (unsigned)n_qb) : 0;
        int head = kv_head_index() * p.kv_group_size, qb = qb_first;
        if constexpr (Cfg::MBARRIER) {
            // mbarrier of Q/dO buffer b at mbar + 8 b: N_THREADS arrivals (one per thread's copies)
            const u32 mbar = stats_of(Cfg::PDS_Q_BUFFERS);
            if (tid == 0) {
                mbar_init(mbar, Cfg::N_THREADS);
                mbar_init(mbar + 8, Cfg::N_THREADS);
            }
            __syncthreads();  // initialised before any thread's copies can arrive
            load_kv();
            if (total > 0) load_q_block(head, qb, 0);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();  // K, V and block 0 have landed
            if constexpr (Cfg::KV_REGS) load_kv_fragments();
            for (int it = 0; it < total; ++it) {
                const int buf = it & 1;  // block it's Q/dO buffer and P/dS pair
                // block it >= 1 is the ((it - 1) / 2)-th arrival on its buffer's mbarrier
                if (it > 0) mbar_wait_parity(mbar + 8 * buf, ((it - 1) >> 1) & 1);
                phase_a(qb * Cfg::BR, buf, buf, NoHook{}, [&](int m) { reduce_previous(it, m); });
                __syncthreads();  // P/dS(it) complete; every warp past phases B/C(it - 1)
                auto issue = [&]() {  // block it + 1 into the buffer that phases B/C(it - 1) read
                    if (it + 1 < total) {
                        int next_head = head, next_qb = qb;
                        advance(next_head, next_qb, qb_first, n_qb_all);
                        load_q_block(next_head, next_qb, buf ^ 1);
                        cp_async_commit();
                        mbar_arrive_on_copies(mbar + 8 * (buf ^ 1));
                    }
                };
                issue_then_phases_bc(head, qb, buf, buf, issue);
                advance(head, qb, qb_first, n_qb_all);
            }
        } else if constexpr (Cfg::PIPELINED) {
            load_kv();
            if (total > 0) load_q_block(head, qb, 0);
            cp_async_commit();
            if (total > 1) {
                int head1 = head, qb1 = qb;
                advance(head1, qb1, qb_first, n_qb_all);
                load_q_block(head1, qb1, 1);  // block 1, one iteration ahead
            }
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();  // K, V and block 0 have landed
            if constexpr (Cfg::KV_REGS) load_kv_fragments();
            int buf = 0;  // buffer of block it (it % 3)
            for (int it = 0; it < total; ++it) {
                phase_a(qb * Cfg::BR, buf, it & 1, NoHook{}, [&](int m) { reduce_previous(it, m); });
                cp_async_wait<0>();  // block it + 1 (this thread's copies)
                __syncthreads();     // P/dS(it) complete, block it + 1 visible, every warp past phases B/C(it - 1)
                auto issue = [&]() {
                    if (it + 2 < total) {  // block it + 2 into the buffer of block it - 1
                        int head2 = head, qb2 = qb;
                        advance(head2, qb2, qb_first, n_qb_all);
                        advance(head2, qb2, qb_first, n_qb_all);
                        load_q_block(head2, qb2, buf == 0 ? 2 : buf - 1);
                    }
                    cp_async_commit();
                };
                issue_then_phases_bc(head, qb, buf, it & 1, issue);
                advance(head, qb, qb_first, n_qb_all);
                buf = buf == 2 ? 0 : buf + 1;
            }
        } else {
            load_kv();
            if (total > 0) load_q_block(head, qb, 0);
            cp_async_commit();
            if constexpr (Cfg::KV_REGS) {
                cp_async_wait<0>();
                __syncthreads();  // K and V have landed
                load_kv_fragments();
            }
            for (int it = 0; it < total; ++it) {
                const int buf = it & 1;
                cp_async_wait<0>();
                __syncthreads();  // block `it` has landed; every warp is done with iteration it-1
                auto issue = [&]() {
                    if (it + 1 < total) {
                        int next_head = head, next_qb = qb;
                        advance(next_head, next_qb, qb_first, n_qb_all);
                        load_q_block(next_head, next_qb, buf ^ 1);
                    }
                    cp_async_commit();
                };
                if constexpr (Cfg::LOAD_MID) {
                    phase_a(qb * Cfg::BR, buf, 0, issue);
                } else {
                    issue();
                    phase_a(qb * Cfg::BR, buf, 0);
                }
                __syncthreads();  // P and dS complete
                phases_bc(head, qb, buf, 0, NoHook{});
                advance(head, qb, qb_first, n_qb_all);
            }
        }
        if constexpr (Cfg::DQ_LATE && !DETERMINISTIC) {
            if (total > 0) {  // the last block's dQ tile
#pragma unroll
                for (int m = 0; m < S_M; ++m) reduce_late(m);
            }
        }
        store_dk_dv();
    }

    // dq_late: block it - 1's reductions for row group m, inside block it's phase A.
    CF_DEVICE void reduce_previous(int it, int m) const {
        if constexpr (Cfg::DQ_LATE && !DETERMINISTIC) {
            if (it > 0) reduce_late(m);
        }
    }

    CF_DEVICE void store_dk_dv() {
        cp_async_wait<0>();
        __syncthreads();
        const auto k_cur = k_tile.cursor(b_k0 + (lane >> 2), b_d0 / 8, (lane & 3) * 4);
        const auto v_cur = v_tile.cursor(b_k0 + (lane >> 2), b_d0 / 8, (lane & 3) * 4);
        const float scale = p.softmax_scale;
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < DKV_N; ++n) {
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

template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN>
CF_DEVICE void run_dkdv(const BackwardParams& params, unsigned char* smem) {
    if constexpr (Cfg::PDS_SMEM) {
        BackwardKVCTA2D<Cfg, CAUSAL, DETERMINISTIC, VARLEN> cta(params, smem);
        cta.run();
    } else {
        BackwardKVCTA<Cfg, CAUSAL, DETERMINISTIC, VARLEN> cta(params, smem);
        cta.run();
    }
}

template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN = false>
__global__ void __launch_bounds__(Cfg::N_THREADS)
    backward_dkdv_kernel(const __grid_constant__ BackwardParams params) {
    extern __shared__ __align__(1024) unsigned char smem[];
    if constexpr (VARLEN) {
        // The grid covers the longest sequence: key blocks past this one's keys have nothing to do.
        const int3 c = kv_block_coords<CAUSAL>();
        const BackwardParams s = sequence_params<Cfg>(params, c.z);
        if (c.x * Cfg::BC < s.seq_len_k) run_dkdv<Cfg, CAUSAL, DETERMINISTIC, true>(s, smem);
    } else {
        run_dkdv<Cfg, CAUSAL, DETERMINISTIC, false>(params, smem);
    }
}
