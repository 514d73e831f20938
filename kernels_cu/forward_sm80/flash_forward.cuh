// FlashAttention-2 forward kernel over a static configuration.
//
// One CTA computes B_r query rows of one (batch, head); each warp owns B_r / n_warps of those rows
// (whole 16-row m-tiles), so softmax statistics never leave the warp. The CTA walks the key/value
// sequence in blocks of B_c rows: S = Q K^T (mma.m16n8k16, fp32 accumulators), online softmax,
// O += P V with P converted straight from the S accumulators into A fragments (the C layout of
// two adjacent n-tiles is the A layout of one k-step). Tails past seq_len_q / seq_len_k are
// zero-filled on load, masked to -inf in S and not stored.
//
// VARLEN (forward_varlen): q/k/v/o are packed (total_tokens, heads, d_head) and sequence b holds
// tokens cu_seqlens[b] .. cu_seqlens[b + 1] - 1; each CTA reads its own sequence's lengths and
// token offsets, and CTAs past the end of a short sequence exit at once.
#pragma once

template <FlashForwardKernelConfig C>
struct StaticForwardKernelConfig {
    static constexpr FlashForwardKernelConfig cfg = C;
    static constexpr DType dtype = C.dtype;
    static constexpr int D = C.d_head;
    static constexpr int BR = C.B_r;
    static constexpr int BC = C.B_c;
    static constexpr int N_WARPS = C.n_warps;
    static constexpr int N_THREADS = 32 * C.n_warps;
    static constexpr int WARP_ROWS = BR / N_WARPS;
    static constexpr int M_TILES = WARP_ROWS / 16;
    static constexpr int S_N_TILES = BC / 8;   // n-tiles of S (keys)
    static constexpr int O_N_TILES = D / 8;    // n-tiles of O (head dim)
    static constexpr int QK_K_STEPS = D / 16;  // k-steps of Q K^T (over d_head)
    static constexpr int PV_K_STEPS = BC / 16; // k-steps of P V (over keys)

    // Fragment-load depths: k-steps loaded from shared memory per chunk (0 in the config = the
    // whole tile in one chunk). Q with 0 is loaded once per CTA and kept in registers.
    static constexpr bool Q_IN_REGISTERS = C.Q_mma_load_K_fragments == 0;
    static constexpr int K_STEPS_PER_CHUNK = C.K_mma_load_K_fragments ? C.K_mma_load_K_fragments : QK_K_STEPS;
    static constexpr int V_STEPS_PER_CHUNK = C.V_mma_load_K_fragments ? C.V_mma_load_K_fragments : PV_K_STEPS;
    static constexpr int QK_CHUNKS = QK_K_STEPS / K_STEPS_PER_CHUNK;
    static constexpr int PV_CHUNKS = PV_K_STEPS / V_STEPS_PER_CHUNK;
    // Double buffering needs a next chunk to prefetch; a whole-tile operand has none.
    static constexpr int QK_BUFFERS = (C.mma_double_buffer_loads && QK_CHUNKS > 1) ? 2 : 1;
    static constexpr int PV_BUFFERS = (C.mma_double_buffer_loads && PV_CHUNKS > 1) ? 2 : 1;

    using QTile = SmemTile<BR, D, C.swizzled>;
    using KVTile = SmemTile<BC, D, C.swizzled>;
    static constexpr int SMEM_BYTES = QTile::BYTES + 2 * KVTile::BYTES;

    static_assert(WARP_ROWS % 16 == 0, "each warp owns whole 16-row m-tiles");
    static_assert(C.Q_mma_load_K_fragments == 0 || C.Q_mma_load_K_fragments == K_STEPS_PER_CHUNK,
                  "Q fragments advance in step with K fragments");
    static_assert(!C.eager_load_blocks || C.async_copy, "eager K/V loads need cp.async");
};

// CAUSAL is a template parameter rather than a runtime flag: the non-causal kernel then carries
// none of the diagonal bookkeeping, which at 32 rows per warp would cost registers (measured:
// spills 36 -> 48 bytes and ~3% at d_head 128 with a runtime flag).
template <class Cfg, bool CAUSAL, bool VARLEN>
struct ForwardCTA {
    using Softmax = OnlineSoftmax<Cfg::M_TILES, Cfg::S_N_TILES, Cfg::cfg.optimized_softmax>;
    static constexpr bool ASYNC = Cfg::cfg.async_copy;
    static constexpr bool EAGER = Cfg::cfg.eager_load_blocks;

    const ForwardParams& p;
    const int tid, lane, warp_row0;  // warp_row0: first query row of this warp inside the CTA tile
    // VARLEN only (dead code otherwise): this sequence's lengths and first token indices.
    int var_len_q = 0, var_len_k = 0, var_tok_q = 0, var_tok_k = 0;
    typename Cfg::QTile q_tile;
    typename Cfg::KVTile k_tile, v_tile;
    const u16* k_src;
    const u16* v_src;
    // Per-lane ldmatrix cursors, computed once; every load displaces them by constants.
    typename Cfg::QTile::Cursor q_frag;
    typename Cfg::KVTile::Cursor k_frag, v_frag;

    float o_acc[Cfg::M_TILES][Cfg::O_N_TILES][4];
    u32 q_regs[Cfg::Q_IN_REGISTERS ? Cfg::M_TILES : 1][Cfg::Q_IN_REGISTERS ? Cfg::QK_K_STEPS : 1][4];
    Softmax softmax;

    CF_DEVICE ForwardCTA(const ForwardParams& params, unsigned char* smem)
        : p(params),
          tid(threadIdx.x),
          lane(threadIdx.x & 31),
          warp_row0((threadIdx.x >> 5) * Cfg::WARP_ROWS) {
        const int head = blockIdx.y, batch = blockIdx.z;
        const int kv_head = head / params.kv_group_size;
        if constexpr (VARLEN) {
            var_tok_q = params.cu_seqlens_q[batch];
            var_len_q = params.cu_seqlens_q[batch + 1] - var_tok_q;
            var_tok_k = params.cu_seqlens_k[batch];
            var_len_k = params.cu_seqlens_k[batch + 1] - var_tok_k;
        }
        k_src = static_cast<const u16*>(params.k) + kv_offset(params.k_batch_stride, params.k_seq_stride) +
                kv_head * params.k_head_stride;
        v_src = static_cast<const u16*>(params.v) + kv_offset(params.v_batch_stride, params.v_seq_stride) +
                kv_head * params.v_head_stride;
        q_tile.base = shared_address(smem);
        k_tile.base = q_tile.base + Cfg::QTile::BYTES;
        v_tile.base = k_tile.base + Cfg::KVTile::BYTES;
        q_frag = a_fragment_cursor(q_tile, warp_row0, lane);
        k_frag = b_fragment_cursor(k_tile, lane);
        v_frag = b_transposed_fragment_cursor(v_tile, lane);
#pragma unroll
        for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
            for (int n = 0; n < Cfg::O_N_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) o_acc[m][n][e] = 0.f;
        softmax.init();
    }

    // The query block this CTA computes. Under causal masking later query blocks see more keys;
    // starting them first keeps the last wave of CTAs short. A function of special registers
    // rather than a member, so nothing forces it to stay live across the key loop.
    CF_DEVICE static int q_block() { return CAUSAL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x; }

    // Lengths and the element offset of this CTA's sequence in q/o and in k/v.
    CF_DEVICE int seq_len_q() const {
        if constexpr (VARLEN) return var_len_q;
        else return p.seq_len_q;
    }
    CF_DEVICE int seq_len_k() const {
        if constexpr (VARLEN) return var_len_k;
        else return p.seq_len_k;
    }
    CF_DEVICE long long q_offset(long long batch_stride, long long seq_stride) const {
        if constexpr (VARLEN) return (long long)var_tok_q * seq_stride;
        else return blockIdx.z * batch_stride;
    }
    CF_DEVICE long long kv_offset(long long batch_stride, long long seq_stride) const {
        if constexpr (VARLEN) return (long long)var_tok_k * seq_stride;
        else return blockIdx.z * batch_stride;
    }
    // Whether this CTA has query rows (a VARLEN grid is sized for the longest sequence).
    CF_DEVICE bool has_rows() const { return !VARLEN || q_block() * Cfg::BR < seq_len_q(); }

    // ---- global -> shared block loads ----
    // Query rows of this CTA inside seq_len_q; recomputed where needed rather than held live.
    CF_DEVICE int q_rows_valid() const { return min(Cfg::BR, seq_len_q() - q_block() * Cfg::BR); }

    CF_DEVICE void load_q() {
        const u16* q_src = static_cast<const u16*>(p.q) + q_offset(p.q_batch_stride, p.q_seq_stride) + blockIdx.y * p.q_head_stride +
                           (long long)q_block() * Cfg::BR * p.q_seq_stride;
        copy_tile_global_to_shared<Cfg::N_THREADS, ASYNC>(q_tile, q_src, p.q_seq_stride, q_rows_valid(), tid);
    }
    CF_DEVICE void load_k(int block) {
        copy_tile_global_to_shared<Cfg::N_THREADS, ASYNC>(k_tile, k_src + (long long)block * Cfg::BC * p.k_seq_stride,
                                                          p.k_seq_stride, seq_len_k() - block * Cfg::BC, tid);
    }
    CF_DEVICE void load_v(int block) {
        copy_tile_global_to_shared<Cfg::N_THREADS, ASYNC>(v_tile, v_src + (long long)block * Cfg::BC * p.v_seq_stride,
                                                          p.v_seq_stride, seq_len_k() - block * Cfg::BC, tid);
    }

    CF_DEVICE void load_q_into_registers() {
#pragma unroll
        for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
            for (int k = 0; k < Cfg::QK_K_STEPS; ++k)
                load_a_fragment(q_regs[m][k], q_tile, q_frag, 16 * m, k);
    }

    // ---- S = Q K^T for the current K tile, in chunks of K_STEPS_PER_CHUNK k-steps ----
    struct QKChunk {
        u32 k[Cfg::K_STEPS_PER_CHUNK][Cfg::S_N_TILES][2];
        u32 q[Cfg::Q_IN_REGISTERS ? 1 : Cfg::K_STEPS_PER_CHUNK][Cfg::M_TILES][4];
    };

    CF_DEVICE void load_qk_chunk(QKChunk& chunk, int c) {
#pragma unroll
        for (int f = 0; f < Cfg::K_STEPS_PER_CHUNK; ++f) {
            const int k_step = c * Cfg::K_STEPS_PER_CHUNK + f;
#pragma unroll
            for (int n = 0; n < Cfg::S_N_TILES; n += 2)
                load_b_fragments(chunk.k[f][n], chunk.k[f][n + 1], k_tile, k_frag, 8 * n, k_step);
            if constexpr (!Cfg::Q_IN_REGISTERS) {
#pragma unroll
                for (int m = 0; m < Cfg::M_TILES; ++m)
                    load_a_fragment(chunk.q[f][m], q_tile, q_frag, 16 * m, k_step);
            }
        }
    }

    CF_DEVICE const u32 (&q_fragment(const QKChunk& chunk, int m, int f, int k_step) const)[4] {
        if constexpr (Cfg::Q_IN_REGISTERS) return q_regs[m][k_step];
        else return chunk.q[f][m];
    }

    CF_DEVICE void mma_qk_chunk(float (&s)[Cfg::M_TILES][Cfg::S_N_TILES][4], const QKChunk& chunk, int c) {
#pragma unroll
        for (int f = 0; f < Cfg::K_STEPS_PER_CHUNK; ++f) {
            const int k_step = c * Cfg::K_STEPS_PER_CHUNK + f;
#pragma unroll
            for (int m = 0; m < Cfg::M_TILES; ++m) {
                const u32(&a)[4] = q_fragment(chunk, m, f, k_step);
#pragma unroll
                for (int n = 0; n < Cfg::S_N_TILES; ++n)
                    mma_m16n8k16<Cfg::dtype>(s[m][n], a, chunk.k[f][n][0], chunk.k[f][n][1]);
            }
        }
    }

    CF_DEVICE void compute_scores(float (&s)[Cfg::M_TILES][Cfg::S_N_TILES][4]) {
#pragma unroll
        for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
            for (int n = 0; n < Cfg::S_N_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[m][n][e] = 0.f;
        QKChunk chunks[Cfg::QK_BUFFERS];
        if constexpr (Cfg::QK_BUFFERS == 2) {
            // Fragments of chunk c+1 are requested before the mma of chunk c is issued, so
            // ldmatrix latency hides behind tensor-core work.
            load_qk_chunk(chunks[0], 0);
#pragma unroll
            for (int c = 0; c < Cfg::QK_CHUNKS; ++c) {
                if (c + 1 < Cfg::QK_CHUNKS) load_qk_chunk(chunks[(c + 1) & 1], c + 1);
                mma_qk_chunk(s, chunks[c & 1], c);
            }
        } else {
#pragma unroll
            for (int c = 0; c < Cfg::QK_CHUNKS; ++c) {
                load_qk_chunk(chunks[0], c);
                mma_qk_chunk(s, chunks[0], c);
            }
        }
    }

    // ---- O += P V for the current V tile, in chunks of V_STEPS_PER_CHUNK k-steps ----
    using VChunk = u32[Cfg::V_STEPS_PER_CHUNK][Cfg::O_N_TILES][2];

    CF_DEVICE void load_v_chunk(VChunk& chunk, int c) {
#pragma unroll
        for (int f = 0; f < Cfg::V_STEPS_PER_CHUNK; ++f)
#pragma unroll
            for (int n = 0; n < Cfg::O_N_TILES; n += 2)
                load_b_fragments_transposed(chunk[f][n], chunk[f][n + 1], v_tile, v_frag, 8 * n,
                                                                  c * Cfg::V_STEPS_PER_CHUNK + f);
    }

    CF_DEVICE void mma_pv_chunk(const u32 (&pa)[Cfg::M_TILES][Cfg::PV_K_STEPS][4], const VChunk& chunk, int c) {
#pragma unroll
        for (int f = 0; f < Cfg::V_STEPS_PER_CHUNK; ++f)
#pragma unroll
            for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
                for (int n = 0; n < Cfg::O_N_TILES; ++n)
                    mma_m16n8k16<Cfg::dtype>(o_acc[m][n], pa[m][c * Cfg::V_STEPS_PER_CHUNK + f], chunk[f][n][0],
                                             chunk[f][n][1]);
    }

    CF_DEVICE void accumulate_pv(const u32 (&pa)[Cfg::M_TILES][Cfg::PV_K_STEPS][4]) {
        VChunk chunks[Cfg::PV_BUFFERS];
        if constexpr (Cfg::PV_BUFFERS == 2) {
            load_v_chunk(chunks[0], 0);
#pragma unroll
            for (int c = 0; c < Cfg::PV_CHUNKS; ++c) {
                if (c + 1 < Cfg::PV_CHUNKS) load_v_chunk(chunks[(c + 1) & 1], c + 1);
                mma_pv_chunk(pa, chunks[c & 1], c);
            }
        } else {
#pragma unroll
            for (int c = 0; c < Cfg::PV_CHUNKS; ++c) {
                load_v_chunk(chunks[0], c);
                mma_pv_chunk(pa, chunks[0], c);
            }
        }
    }

    // Scores that must not count become -inf: keys at or past seq_len_k (only the last block has
    // them) and, under causal masking, keys after the row's diagonal. `diagonal` is the last
    // visible key, relative to the block's first key, for this lane's first row (m = 0, h = 0).
    CF_DEVICE void mask_scores(float (&s)[Cfg::M_TILES][Cfg::S_N_TILES][4], int keys_valid, bool causal,
                               int diagonal) {
        mask_fragments(s, lane, [&](int m, int h, int key) {
            return (key >= keys_valid) | (causal & (key > diagonal + 16 * m + 8 * h));
        });
    }

    // Probabilities (fp32 C fragments of S) -> A fragments of P, per k-step of 16 keys.
    CF_DEVICE void convert_probabilities(const float (&s)[Cfg::M_TILES][Cfg::S_N_TILES][4],
                                         u32 (&pa)[Cfg::M_TILES][Cfg::PV_K_STEPS][4]) {
#pragma unroll
        for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
            for (int k = 0; k < Cfg::PV_K_STEPS; ++k) {
                pa[m][k][0] = pack_pair<Cfg::dtype>(s[m][2 * k][0], s[m][2 * k][1]);
                pa[m][k][1] = pack_pair<Cfg::dtype>(s[m][2 * k][2], s[m][2 * k][3]);
                pa[m][k][2] = pack_pair<Cfg::dtype>(s[m][2 * k + 1][0], s[m][2 * k + 1][1]);
                pa[m][k][3] = pack_pair<Cfg::dtype>(s[m][2 * k + 1][2], s[m][2 * k + 1][3]);
            }
    }

    CF_DEVICE void rescale_output(const float (&rescale)[Cfg::M_TILES][2]) {
#pragma unroll
        for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
            for (int n = 0; n < Cfg::O_N_TILES; ++n) {
                o_acc[m][n][0] *= rescale[m][0];
                o_acc[m][n][1] *= rescale[m][0];
                o_acc[m][n][2] *= rescale[m][1];
                o_acc[m][n][3] *= rescale[m][1];
            }
    }

    // One key/value block. Copy schedule with eager loads: on entry K(block) and V(block) are in
    // flight; K(block+1) is issued once every warp is done reading K(block), and V(block+1) once
    // every warp is done with V(block), so copies overlap the softmax and the mma work.
    template <bool FIRST>
    CF_DEVICE void process_kv_block(int block, int n_blocks) {
        if constexpr (EAGER) {
            cp_async_wait<1>();  // K(block) has landed; V(block) may still be in flight
        } else {
            load_k(block);
            load_v(block);
            if constexpr (ASYNC) {
                cp_async_commit();
                cp_async_wait<0>();
            }
        }
        __syncthreads();

        float s[Cfg::M_TILES][Cfg::S_N_TILES][4];
        compute_scores(s);
        const int keys_valid = seq_len_k() - block * Cfg::BC;
        if constexpr (CAUSAL) {
            // Last visible key of this lane's first row, relative to the block's first key.
            const int diagonal =
                q_block() * Cfg::BR + warp_row0 + (lane >> 2) + (seq_len_k() - seq_len_q()) - block * Cfg::BC;
            // Warp-uniform test: does any row of this warp end before the block does?
            const bool causal_cut = diagonal - (lane >> 2) < Cfg::BC - 1;
            if (keys_valid < Cfg::BC || causal_cut) mask_scores(s, keys_valid, causal_cut, diagonal);
        } else {
            if (keys_valid < Cfg::BC) mask_scores(s, keys_valid, false, 0);
        }

        if constexpr (EAGER) {
            __syncthreads();  // every warp has read K(block)
            if (block + 1 < n_blocks) load_k(block + 1);
            cp_async_commit();  // possibly empty: keeps the group count uniform for the waits
        }

        float rescale[Cfg::M_TILES][2];
        softmax.template update<FIRST>(s, rescale, p.softmax_scale, p.softmax_scale_log2);
        if (!(FIRST && Cfg::cfg.optimized_softmax)) rescale_output(rescale);
        u32 pa[Cfg::M_TILES][Cfg::PV_K_STEPS][4];
        convert_probabilities(s, pa);

        if constexpr (EAGER) {
            cp_async_wait<1>();  // V(block) has landed; K(block+1) may still be in flight
            __syncthreads();
        }
        accumulate_pv(pa);
        __syncthreads();  // every warp has read V(block) (and K(block) when not eager)
        if constexpr (EAGER) {
            if (block + 1 < n_blocks) load_v(block + 1);
            cp_async_commit();
        }
    }

    // Key blocks this CTA must visit: all of them, or under causal masking those up to the last
    // row's diagonal (none at all when every row of the CTA precedes the first key).
    CF_DEVICE int kv_blocks() const {
        const int all = (seq_len_k() + Cfg::BC - 1) / Cfg::BC;
        if constexpr (!CAUSAL) return all;
        const int last_row = min(seq_len_q(), (q_block() + 1) * Cfg::BR) - 1;
        const int last_key = last_row + seq_len_k() - seq_len_q();
        return last_key < 0 ? 0 : min(all, last_key / Cfg::BC + 1);
    }

    CF_DEVICE void run() {
        const int n_blocks = kv_blocks();
        load_q();
        if constexpr (ASYNC) cp_async_commit();
        if constexpr (EAGER) {
            load_k(0);
            cp_async_commit();
            load_v(0);
            cp_async_commit();
        }
        if constexpr (Cfg::Q_IN_REGISTERS) {
            if constexpr (EAGER) cp_async_wait<2>();  // Q has landed; K(0), V(0) may be in flight
            else if constexpr (ASYNC) cp_async_wait<0>();
            __syncthreads();
            load_q_into_registers();
        }

        if constexpr (Cfg::cfg.optimized_softmax) {
            // Dense non-causal CTAs always have a first block (seq_len_k >= 1): an unconditional
            // call keeps the block loop's entry free of a join, which measurably changed register
            // allocation (spills 36 -> 48 bytes, +19 register moves per block at d_head 128). A
            // varlen sequence may have no keys: then no block, output 0 and lse -inf.
            if ((!CAUSAL && !VARLEN) || n_blocks > 0) process_kv_block<true>(0, n_blocks);
            for (int block = 1; block < n_blocks; ++block) process_kv_block<false>(block, n_blocks);
        } else {
            for (int block = 0; block < n_blocks; ++block) process_kv_block<false>(block, n_blocks);
        }
        store_output();
    }

    // Normalise O by the row sums, stage it through this warp's own rows of the Q tile (no other
    // warp reads them), then write whole 16-byte chunks to global memory.
    CF_DEVICE void store_output() {
        float row_sum[Cfg::M_TILES][2];
        softmax.finish(row_sum);
        // Every thread's copies into the Q tile must have landed, and every warp's reads of it
        // be done, before this warp overwrites its rows: Q rows are copied by all threads, and a
        // CTA that visits no key block (causal, every row before the first visible key) has had
        // no barrier since the copies were issued.
        if constexpr (ASYNC) cp_async_wait<0>();
        __syncthreads();
        const auto o_cursor = accumulator_cursor(q_tile, warp_row0, lane);
#pragma unroll
        for (int m = 0; m < Cfg::M_TILES; ++m) {
            const float inv0 = row_sum[m][0] > 0.f ? 1.f / row_sum[m][0] : 0.f;
            const float inv1 = row_sum[m][1] > 0.f ? 1.f / row_sum[m][1] : 0.f;
#pragma unroll
            for (int n = 0; n < Cfg::O_N_TILES; ++n)
                store_accumulator_tile<Cfg::dtype>(q_tile, o_cursor, o_acc[m][n], 16 * m, n, inv0, inv1);
        }
        if (p.lse != nullptr && (lane & 3) == 0) {
            // lse is (batch, n_heads, seq_len_q), or with VARLEN (n_heads, total_q) as in
            // FlashAttention's varlen functions (lse_head_stride = total_q).
            const long long row_base = VARLEN ? (long long)blockIdx.y * p.lse_head_stride + var_tok_q
                                              : ((long long)blockIdx.z * p.n_heads + blockIdx.y) * p.seq_len_q;
#pragma unroll
            for (int m = 0; m < Cfg::M_TILES; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = q_block() * Cfg::BR + warp_row0 + 16 * m + 8 * h + (lane >> 2);
                    if (row < seq_len_q()) p.lse[row_base + row] = softmax.log_sum_exp(m, h, row_sum[m][h], p.softmax_scale);
                }
        }
        __syncwarp();
        u16* o_dst = static_cast<u16*>(p.o) + q_offset(p.o_batch_stride, p.o_seq_stride) + blockIdx.y * p.o_head_stride +
                     (long long)q_block() * Cfg::BR * p.o_seq_stride;
        copy_warp_rows_shared_to_global<Cfg::WARP_ROWS>(q_tile, warp_row0, o_dst, p.o_seq_stride, q_rows_valid(), lane);
    }
};

template <class Cfg, bool CAUSAL, bool VARLEN>
__global__ void __launch_bounds__(Cfg::N_THREADS) flash_forward_kernel(const __grid_constant__ ForwardParams params) {
    extern __shared__ __align__(1024) unsigned char smem[];
    if constexpr (VARLEN)  // before any CTA leaves: every one takes its share of the rows
        zero_forward_tail<Cfg::D>(params.o, params.o_seq_stride, params.o_head_stride, params.lse,
                                  params.lse_head_stride, params.n_heads, params.cu_seqlens_q, gridDim.z,
                                  (int)params.tail_total_q);
    ForwardCTA<Cfg, CAUSAL, VARLEN> cta(params, smem);
    if (!cta.has_rows()) return;  // uniform over the CTA, before any barrier
    cta.run();
}
