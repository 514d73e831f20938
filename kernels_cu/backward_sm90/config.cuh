// Static configuration of the Hopper backward dK/dV kernel, its shared-memory layout and the two
// PTX instructions it needs beyond kernels_cu/common/ptx_sm90.cuh (1-D bulk copy, vector fp32
// reduction).
//
// One CTA owns B_c keys of one (batch, kv head): K and V are loaded once; per query block
// (B_r rows of one query head of the GQA group) the producer loads Q, dO, lse2 and dvec into a
// ring stage. Tiles are stored as TMA writes them, swizzled: with 128-byte swizzling (D/64 column
// blocks of R rows x 128 bytes), or at d_head 96 (no multiple of 64 columns) with 64-byte
// swizzling (three blocks of R rows x 64 bytes), so every wgmma operand is a canonical swizzled
// layout. The dS^T tiles (keys x queries) are always 128B-swizzled: their columns are queries.
#pragma once

template <HopperBackwardKernelConfig C>
struct StaticHopperBackwardConfig : SwizzledTiles<C.d_head> {  // ROW_BYTES, COL_BLOCK, D_BLOCKS, ...
    static constexpr HopperBackwardKernelConfig cfg = C;
    static constexpr DType dtype = C.dtype;
    static constexpr int D = C.d_head;
    static constexpr int BR = C.B_r;   // query rows per iteration
    static constexpr int BC = C.B_c;   // key rows per CTA
    static constexpr int STAGES = C.n_stages;
    static constexpr bool DQ_BULK = C.dq_bulk;  // dQ staged in shared memory, bulk-reduced by a consumer warp
    static constexpr bool DQ_TMA = C.dq_tma;    // dQ staged in swizzled panels, TMA-reduced by a writer warp
    static constexpr bool DQ_MID = C.dq_mid;    // GEMM order dV | barrier | dQ, dK (else dV, dK | barrier | dQ)
    static constexpr bool NOMASK = C.nomask;    // causal score tiles below the diagonal skip its compare
    static constexpr bool LPT = C.lpt;          // causal: longest CTAs first, in chunks of heads sized to L2
    static constexpr bool PDL = C.pdl;          // programmatic dependent launches (griddepcontrol)
    static constexpr bool DQ_EARLY = C.dq_early;  // per-block counters: convert each dQ block once complete
    static constexpr bool ROTATE = C.rotate;      // non-causal: each CTA starts at its own query block
    static constexpr bool PERSISTENT = C.persistent;  // one CTA per SM walks tiles t, t + grid, ...
    static constexpr bool DYNAMIC = C.dynamic;        // ... tiles claimed from a counter instead
    static constexpr bool DQ_FRAG = C.dq_frag;        // dq_tma: dQ staged and added in fragment order
    // lpt: the Q and dO bytes of the heads one chunk of CTAs streams (H100: 50 MB of L2).
    static constexpr int LPT_L2_KIB = 16 << 10;

    static constexpr int WG_KEYS = 64;                 // keys of one consumer warpgroup (wgmma m64)
    // d_head 256 (KV_SPLIT): 64 keys x 256 columns of dK and dV would be 256 registers per thread of
    // one warpgroup, so two warpgroups share the CTA's 64 keys, each accumulating half of dK/dV's
    // columns; each computes S^T and dP^T for half of the query block, and the whole P^T and dS^T
    // tiles (the A operands of both warpgroups' dV, dK and dQ GEMMs) meet in shared memory.
    static constexpr bool KV_SPLIT = D == 256;
    // KV_SPLIT with sdp_roles: warpgroup 0 computes S^T (and P^T), warpgroup 1 dP^T (and dS^T), each
    // over all B_r queries (wgmma N = 64: a third less shared-memory reads than both computing both
    // at N = 32, which read 192 bytes per tensor clock against the SM's 128).
    static constexpr bool SDP_ROLES = C.sdp_roles;
    // qdo_split: a stage's Q (+ lse2) and dO (+ dvec) complete and are released on barriers of
    // their own, dO's once dV (its last reader) is done, so the next block's dO loads while dK and
    // dQ run (d_head 256's one stage).
    static constexpr bool QDO_SPLIT = C.qdo_split;
    // park: the varlen consumers keep a tile's sequence values in a shared-memory slot per warp
    // (mainloop.cuh, BwdConsumer::park_tile), not in registers across the loop; non-causal, two
    // idle producer warps zero a sequence's K/V rows past its end (tail_zeroer.cuh).
    static constexpr bool PARK = C.park;
    static constexpr int CONSUMERS = KV_SPLIT ? 2 : BC / WG_KEYS;
    static constexpr int DKV_N = KV_SPLIT ? D / 2 : D;       // dK/dV columns of one warpgroup
    static constexpr int S_QUERIES = KV_SPLIT && !SDP_ROLES ? BR / 2 : BR;  // queries of one warpgroup's S^T, dP^T
    static constexpr int N_THREADS = 128 * (CONSUMERS + 1);  // + the producer warpgroup
    // The CTA keeps the registers it was launched with (168 x 384 = 64512; setmaxnreg moves them
    // between warpgroups, an increase waits until they are free): 40 x 128 + 232 x 256 = 64512.
    static constexpr int PRODUCER_REGS = DQ_TMA ? 40 : 24;
    static constexpr int CONSUMER_REGS = CONSUMERS == 1 ? 256 : DQ_TMA ? 232 : 240;

    // The backward_sm80 row kernels (preprocess, convert) reused in this family's module read
    // these two from their Cfg; they must match cupyflash/families/backward_sm80 (ROW_KERNEL_ROWS).
    static constexpr int ROW_KERNEL_ROWS = 64;
    static constexpr int ROW_KERNEL_THREADS = 256;

    static constexpr int DS_ROW_BYTES = 128;                   // dS^T rows: 64 queries, 128B-swizzled
    static constexpr int Q_BYTES = BR * D * 2;
    static constexpr int KV_BYTES = BC * D * 2;
    static constexpr int STAT_BYTES = BR * 4;          // lse2 or dvec of one query block
    static constexpr int STAGE_LOAD_BYTES = 2 * Q_BYTES + 2 * STAT_BYTES;  // one stage's q_full transaction
    static constexpr int HALF_LOAD_BYTES = Q_BYTES + STAT_BYTES;  // qdo_split: Q + lse2, or dO + dvec
    // Q and dO tiles of a stage (a multiple of 1024: tiles stay 1024-aligned); its lse2 and dvec
    // rows live in a separate small ring (STATS_OFFSET), so 3 stages fit beside dq_tma's panels.
    static constexpr int STAGE_BYTES = 2 * Q_BYTES;
    // One warpgroup's dS^T, [key][query]: a buffer holds BR / 64 query blocks of [B_c keys][128
    // bytes] (the warpgroups' keys contiguous in each, so one descriptor spans all B_c keys).
    // KV_SPLIT: a buffer holds the shared dS^T tile and the P^T tile (BwdSmem::ds_shared, pt).
    static constexpr int DS_BYTES = WG_KEYS * BR * 2;
    static constexpr int DS_BUFFERS = 2;               // alternating per iteration (one barrier each)
    static constexpr int DQ_STRIDE = D + 8;            // floats per staged dQ row: rows 8 banks apart
    // How dQ's GEMM (M = queries, one wgmma m64 tile per warpgroup) is shared by two warpgroups,
    // each reading every warpgroup's dS^T (so every dQ element is added once per CTA): by query
    // rows when the block has 128 (DQ_ROWS: warpgroup w takes rows 64 w ..), else by columns when
    // each part is made of whole swizzle blocks of K (DQ_SPLIT: halves at d_head 128 and 256, 64 +
    // 32 at d_head 96 with dq_colsplit); otherwise by keys (each warpgroup its own dS^T, all
    // columns: every dQ element is added twice per CTA).
    static constexpr bool DQ_ROWS = CONSUMERS == 2 && BR == 2 * WG_KEYS;
    static constexpr bool DQ_SPLIT = CONSUMERS == 2 && !DQ_ROWS && (D >= 128 || C.dq_colsplit);
    static constexpr bool DS_SHARED = DQ_ROWS || DQ_SPLIT;  // one dS^T barrier for both warpgroups
    static constexpr int DQ_M = DQ_ROWS ? BR / 2 : BR;      // dQ rows of one warpgroup
    // dQ columns of warpgroup 0 (the widest) and 1, of warpgroup w and its first (cupyflash's dq_columns)
    static constexpr int DQ_N = !DQ_SPLIT ? D : D == 96 ? 64 : D / 2;
    static constexpr int DQ_N1 = !DQ_SPLIT ? D : D == 96 ? 32 : D / 2;
    static constexpr bool DQ_UNEVEN = DQ_N1 != DQ_N;  // (the consumers' dQ code compiled per warpgroup)
    __host__ __device__ static constexpr int dq_cols(int w) { return w == 0 ? DQ_N : DQ_N1; }
    __host__ __device__ static constexpr int dq_col0(int w) { return DQ_SPLIT ? w * DQ_N : 0; }
    // dq_frag: a 64-row dq_accum block in fragment order (dq_block_counter's comment has the
    // layout); warpgroup w's DQ_M x dq_cols(w) share is the n-tiles from dq_col0(w) / 8 on
    static constexpr int DQ_PART_ROWS = 64;
    // dq_tma: per warpgroup, its DQ_M x dq_cols(w) share of the block's dQ as panels of [DQ_M rows][32
    // fp32] (128 bytes a row, 128B-swizzled as the TMA map reads them, 1024-byte aligned).
    static constexpr int DQ_PANEL_COLS = 32;
    static constexpr int DQ_PANEL_BYTES = DQ_M * DQ_PANEL_COLS * 4;
    __host__ __device__ static constexpr int dq_panels(int w) { return dq_cols(w) / DQ_PANEL_COLS; }  // of warpgroup w
    __host__ __device__ static constexpr int dq_panel0(int w) { return w * (DQ_N / DQ_PANEL_COLS); }  // its first (w 0, 1)
    static constexpr int DQ_BYTES = DQ_BULK  ? BR * DQ_STRIDE * 4
                                    : DQ_TMA ? (DQ_N + (CONSUMERS == 2 ? DQ_N1 : 0)) / DQ_PANEL_COLS * DQ_PANEL_BYTES
                                             : 0;
    // Named barrier (0 is __syncthreads; the consumers' dS^T barriers are 1 and 2): the staged dQ
    // is complete (every consumer arrives, the issuing warp waits).
    static constexpr int DQ_FULL_BARRIER = 3;
    // dq_tma, per consumer warpgroup w (128 consumer threads + the 32 of the writer warp):
    // 4 + w, its staged panels are complete; 6 + w, the writer's reductions have read them.
    static constexpr int DQ_TMA_FULL_BARRIER = 4;
    static constexpr int DQ_TMA_EMPTY_BARRIER = 6;
    static constexpr int DQ_TMA_THREADS = 128 + 32;
    // sdp_roles: warpgroup 0 has handed over P^T (it arrives, warpgroup 1 waits).
    static constexpr int PT_BARRIER = 8;

    // Byte offsets from the 1024-byte aligned base of dynamic shared memory.
    static constexpr int K_OFFSET = 0;
    static constexpr int V_OFFSET = KV_BYTES;
    static constexpr int STAGE_OFFSET = 2 * KV_BYTES;
    static constexpr int DS_OFFSET = STAGE_OFFSET + STAGES * STAGE_BYTES;
    static constexpr int DQ_OFFSET = DS_OFFSET + DS_BUFFERS * CONSUMERS * DS_BYTES;
    static constexpr int STATS_OFFSET = DQ_OFFSET + DQ_BYTES;  // per stage: lse2 then dvec, STAT_BYTES each
    static constexpr int BAR_OFFSET = STATS_OFFSET + STAGES * 2 * STAT_BYTES;
    // kv_full, q_full[s], q_empty[s], kv_empty; dynamic: tile_full[2], tile_empty[2], two tile
    // slots; qdo_split: do_full[s], do_empty[s]; varlen (the tail zeroer's, tail_zeroer.cuh):
    // kv_ready, zero_done, q_tail[s]
    static constexpr int DO_BAR_OFFSET = BAR_OFFSET + 8 * (2 + 2 * STAGES) + (DYNAMIC ? 8 * 4 + 8 : 0);
    static constexpr int KV_READY_OFFSET = DO_BAR_OFFSET + (QDO_SPLIT ? 8 * 2 * STAGES : 0);
    static constexpr int BAR_BYTES = KV_READY_OFFSET + 8 * (2 + STAGES) - BAR_OFFSET;
    // park: a slot per consumer warp (cupyflash/families/backward_sm90/config.py PARK_SLOT_BYTES)
    static constexpr int PARK_SLOT_BYTES = 40;
    static constexpr int PARK_OFFSET = BAR_OFFSET + BAR_BYTES;
    static constexpr int SMEM_BYTES = PARK_OFFSET + (PARK ? 4 * CONSUMERS * PARK_SLOT_BYTES : 0) + 1024;  // + alignment slack

    static_assert(BR == 64 || (BR == 128 && CONSUMERS == 2), "one wgmma m64 dQ tile per warpgroup (B_r 128: rows split)");
    static_assert(DQ_M == 64, "dQ is one wgmma m64 tile per warpgroup");
    static_assert(BC % WG_KEYS == 0 && CONSUMERS >= 1 && CONSUMERS <= 2, "one or two consumer warpgroups");
    static_assert(!KV_SPLIT || (BC == WG_KEYS && BR == 64 && DQ_SPLIT && !DQ_BULK && !DQ_MID),
                  "d_head 256: two warpgroups over 64 keys, 64-query blocks, dQ split by columns (atomics or dq_tma)");
    static_assert(!SDP_ROLES || KV_SPLIT, "sdp_roles: d_head 256's two warpgroups over the same 64 keys");
    static_assert(!QDO_SPLIT || SDP_ROLES, "qdo_split: S^T (Q) and dP^T (dO) on different warpgroups");
    static_assert(STAGES >= 1, "at least one Q/dO stage");
    static_assert(!DQ_BULK || (CONSUMERS == 2 && D == 128), "dq_bulk: each warpgroup stages half of dQ's columns");
    static_assert(!DQ_TMA || (CONSUMERS == 2 && DQ_N % DQ_PANEL_COLS == 0 && DQ_N1 % DQ_PANEL_COLS == 0),
                  "dq_tma: two warpgroups, each staging whole 32-column panels (d_head 128: half of dQ's columns)");
    static_assert(!C.dq_colsplit || (D == 96 && BR == 64 && CONSUMERS == 2), "dq_colsplit: d_head 96, 64 + 32 columns");
    static_assert(!(DQ_BULK && DQ_TMA), "one dQ mode");
    static_assert(!PDL || DQ_TMA, "pdl: the consumers touch no workspace the preprocess writes (dq_tma)");
    static_assert(!DQ_EARLY || (PDL && DQ_TMA), "dq_early: the writer warp counts finished blocks");
    static_assert(!PERSISTENT || DQ_TMA, "persistent: the writer warp's panel hand-over runs on across tiles");
    static_assert(!DYNAMIC || (PERSISTENT && PDL), "dynamic: the family's (pdl) preprocess resets the tile counter");
    static_assert(!DQ_EARLY || BR == ROW_KERNEL_ROWS, "dq_early: one counter per query block and per convert CTA");
    static_assert(!DQ_BULK || BR == 64, "dq_bulk: the staged rows are one 64-row block");
    static_assert(!DQ_FRAG || (DQ_TMA && PDL && D % 32 == 0),
                  "dq_frag: the family's convert kernel reads the fragment order 32 columns a pass");
    static_assert(STAGE_BYTES % 1024 == 0, "Q/dO tiles of every stage 1024-byte aligned (swizzle atoms)");
    static_assert(KV_BYTES % 1024 == 0, "K/V tiles 1024-byte aligned (swizzle atoms)");
    static_assert(KV_READY_OFFSET % 8 == 0 && PARK_OFFSET % 8 == 0, "mbarriers are 8-byte aligned");
    static_assert(DQ_OFFSET % 1024 == 0, "dq_tma panels are 1024-byte aligned (128B swizzle atoms)");
};

template <class Cfg>
struct BwdSmem {
    u32 base;

    CF_DEVICE u32 k() const { return base + Cfg::K_OFFSET; }
    CF_DEVICE u32 v() const { return base + Cfg::V_OFFSET; }
    CF_DEVICE u32 q(int s) const { return base + Cfg::STAGE_OFFSET + s * Cfg::STAGE_BYTES; }
    CF_DEVICE u32 dout(int s) const { return q(s) + Cfg::Q_BYTES; }
    CF_DEVICE u32 lse2(int s) const { return base + Cfg::STATS_OFFSET + s * 2 * Cfg::STAT_BYTES; }
    CF_DEVICE u32 dvec(int s) const { return lse2(s) + Cfg::STAT_BYTES; }
    // dS^T of warpgroup wg in buffer buf (its first query block; the next is B_c rows on); a
    // buffer's warpgroups are contiguous (keys 0..B_c-1).
    CF_DEVICE u32 ds(int buf, int wg) const {
        return base + Cfg::DS_OFFSET + (buf * Cfg::CONSUMERS * (Cfg::BR / 64) + wg) * (Cfg::WG_KEYS * Cfg::DS_ROW_BYTES);
    }
    // KV_SPLIT: buffer buf's dS^T and P^T tiles, [64 keys][64 queries], both warpgroups' halves
    // (sdp_roles: the two P^T tiles hold P^T's fp32 hand-over, n-tiles 0-3 and 4-7)
    CF_DEVICE u32 ds_shared(int buf) const { return ds(buf, 0); }
    CF_DEVICE u32 pt(int buf) const { return ds(buf, 1); }
    CF_DEVICE u32 dq(int row) const { return base + Cfg::DQ_OFFSET + row * Cfg::DQ_STRIDE * 4; }
    // dq_tma: panel `panel` of consumer warpgroup `wg`.
    CF_DEVICE u32 dq_panel(int wg, int panel) const {
        return base + Cfg::DQ_OFFSET + (Cfg::dq_panel0(wg) + panel) * Cfg::DQ_PANEL_BYTES;
    }
    CF_DEVICE u32 kv_full() const { return base + Cfg::BAR_OFFSET; }
    CF_DEVICE u32 q_full(int s) const { return base + Cfg::BAR_OFFSET + 8 * (1 + s); }
    CF_DEVICE u32 q_empty(int s) const { return base + Cfg::BAR_OFFSET + 8 * (1 + Cfg::STAGES + s); }
    // qdo_split: stage s's dO and dvec have landed / are no longer read (else q_full, q_empty)
    CF_DEVICE u32 do_full(int s) const { return Cfg::QDO_SPLIT ? base + Cfg::DO_BAR_OFFSET + 8 * s : q_full(s); }
    CF_DEVICE u32 do_empty(int s) const {
        return Cfg::QDO_SPLIT ? base + Cfg::DO_BAR_OFFSET + 8 * (Cfg::STAGES + s) : q_empty(s);
    }
    // persistent: every consumer thread's GEMMs of a tile (the last ones read K and V) are done
    CF_DEVICE u32 kv_empty() const { return base + Cfg::BAR_OFFSET + 8 * (1 + 2 * Cfg::STAGES); }
    // dynamic: tile index hand-over j (the CTA's (j + 1)-th claimed tile) in slot j & 1
    CF_DEVICE u32 tile_full(int s) const { return base + Cfg::BAR_OFFSET + 8 * (2 + 2 * Cfg::STAGES + s); }
    CF_DEVICE u32 tile_empty(int s) const { return base + Cfg::BAR_OFFSET + 8 * (4 + 2 * Cfg::STAGES + s); }
    CF_DEVICE u32 tile_slot(int s) const { return base + Cfg::BAR_OFFSET + 8 * (6 + 2 * Cfg::STAGES) + 4 * s; }
    CF_DEVICE u32 park_slot(int consumer_warp) const { return base + Cfg::PARK_OFFSET + consumer_warp * Cfg::PARK_SLOT_BYTES; }
    // varlen: the tile's K and V have landed and the tail zeroer has zeroed what it zeroes of them
    // (tail_zeroer.cuh); the consumers wait for it after kv_full
    CF_DEVICE u32 kv_ready() const { return base + Cfg::KV_READY_OFFSET; }
    // varlen: every tail zeroer thread has zeroed its share of a Q/dO stage (its meeting)
    CF_DEVICE u32 zero_done() const { return base + Cfg::KV_READY_OFFSET + 8; }
    // varlen: stage s's Q/dO block reading rows past its sequence's end has landed (instead of
    // q_full / do_full, which the tail zeroer completes once it has zeroed those rows)
    CF_DEVICE u32 q_tail(int s) const { return base + Cfg::KV_READY_OFFSET + 8 * (2 + s); }
};

// Query blocks of one CTA: every query head of the GQA group times the query blocks that see at
// least one of the CTA's keys (causal, bottom-right aligned: query i sees key j <= i + seq_k - seq_q).
// Per head the blocks are walked from m_begin + rot, wrapping (rot is 0 unless rotate, non-causal).
// gridDim.x, read where it is used (asm volatile: not hoisted into a register across a loop).
CF_DEVICE int grid_ctas() {
    int n;
    asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
    return n;
}

// A dK/dV tile (key block x, kv head y, batch z) of a grid of nx x ny x nz tiles: the CTA's own
// block (one CTA per tile), or with persistent CTAs tile `linear` of the launch order.
struct BwdTile {
    int x, y, z, nx, ny, nz;

    CF_DEVICE static BwdTile of_block() {
        return {(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z, (int)gridDim.x, (int)gridDim.y, (int)gridDim.z};
    }
    template <int BC>
    CF_DEVICE static BwdTile of_linear(const HopperBackwardParams& p, int linear) {
        const int nx = (p.seq_len_k + BC - 1) / BC;
        return {linear % nx, linear / nx % p.n_kv_heads, linear / (nx * p.n_kv_heads), nx, p.n_kv_heads, p.batch};
    }
    CF_DEVICE int count() const { return nx * ny * nz; }
    // Tiles of the call, from the parameters where it is needed (kept in a register across the
    // roles' loops, ptxas spilled it at the producer warpgroup's 40 registers).
    template <int BC>
    CF_DEVICE static int count_of(const HopperBackwardParams& p) {
        return (p.seq_len_k + BC - 1) / BC * p.n_kv_heads * p.batch;
    }
};

// The sequence of a tile. Dense calls: every batch entry has seq_len_q queries and seq_len_k keys,
// `coord` (the TMA and stride batch index) is the batch entry and the workspaces hold (batch,
// n_heads, seq_len_q_pad) rows. VARLEN (backward_varlen): q, k, v, dO, dk, dv are packed
// (total_tokens, heads, d) seen as one batch entry, sequence b holding tokens cu_seqlens[b] ..
// cu_seqlens[b + 1] - 1; the workspaces are (n_heads, seq_len_q_pad) rows with sequence b's from
// floor((cu_seqlens_q[b] + b B_r) / B_r) B_r (as backward_sm80's sequence_params: whole, disjoint
// B_r blocks). Read where needed, not kept: the producer and writer run at 40 registers.
template <int BR, bool VARLEN>
struct BwdSeq {
    int len_q, len_k, tok_q, tok_k, ws_row0, coord;

    CF_DEVICE static BwdSeq of(const HopperBackwardParams& p, int b) {
        if constexpr (VARLEN) {
            const int tq = p.cu_seqlens_q[b], tk = p.cu_seqlens_k[b];
            return {p.cu_seqlens_q[b + 1] - tq, p.cu_seqlens_k[b + 1] - tk, tq, tk, (int)varlen_ws_row0<BR>(tq, b), 0};
        } else {
            return {p.seq_len_q, p.seq_len_k, 0, 0, 0, b};
        }
    }
    // VARLEN, a block reading packed rows past the sequence's end (the next sequences' tokens, rows
    // past the last sequence: varlen_tail.cuh): those rows are zeroed before any GEMM reads them
    // (tail_zeroer.cuh); the masks and lse2 = +inf (dvec 0) give them P = 0 and dS = 0, but the
    // GEMMs would still add 0 * NaN.
    // The query block from row0 of the sequence: its rows (those from there on are zeroed) when it
    // reads rows past the sequence's end, else -1.
    CF_DEVICE int tail_query_rows(const HopperBackwardParams& p, int row0) const {
        if constexpr (!VARLEN) return -1;
        if (row0 + BR <= len_q) return -1;
        return reads_rows_past_sequence_end(tok_q + len_q, p.total_q) ? len_q - row0 : -1;
    }
    // The key block from key0 (BC keys): its keys when it reads rows past the sequence's end, else -1.
    template <int BC>
    CF_DEVICE int tail_key_rows(const HopperBackwardParams& p, int key0) const {
        if constexpr (!VARLEN) return -1;
        if (key0 + BC <= len_k) return -1;
        return reads_rows_past_sequence_end(tok_k + len_k, p.total_k) ? len_k - key0 : -1;
    }
    // First workspace row (lse2, dvec; times D for dq_accum) of query row 0 of `head`.
    CF_DEVICE long long ws_row(const HopperBackwardParams& p, int head) const {
        return ((long long)coord * p.n_heads + head) * p.seq_len_q_pad + ws_row0;
    }
};

// Batch entries of the workspaces (the counters lie behind batch_count * n_heads * seq_len_q_pad *
// D fp32 elements): one for VARLEN, else `batches`.
template <bool VARLEN>
CF_DEVICE int ws_batches(int batches) { return VARLEN ? 1 : batches; }

struct BwdSchedule {
    int n_block, kv_head, batch;  // batch: the batch entry, or with VARLEN the sequence
    int m_begin, m_blocks, group, rot;

    template <class Cfg, bool CAUSAL, bool VARLEN = false>
    CF_DEVICE static BwdSchedule make(const HopperBackwardParams& p, const BwdTile& t) {
        BwdSchedule s;
        s.n_block = t.x;
        s.kv_head = t.y;
        s.batch = t.z;
        if constexpr (CAUSAL && Cfg::LPT) s.longest_first<Cfg>(p, t);
        s.group = p.kv_group_size;
        const BwdSeq<Cfg::BR, VARLEN> seq = BwdSeq<Cfg::BR, VARLEN>::of(p, s.batch);
        const int m_end = (seq.len_q + Cfg::BR - 1) / Cfg::BR;
        int first = 0;
        if constexpr (CAUSAL) first = max(0, s.n_block * Cfg::BC - (seq.len_k - seq.len_q)) / Cfg::BR;
        s.m_begin = first;
        s.m_blocks = max(0, m_end - first);
        // (VARLEN: a key block past its sequence's keys has no work: the grid covers the longest)
        if (VARLEN && s.n_block * Cfg::BC >= seq.len_k) s.m_blocks = 0;
        s.rot = 0;
        // key block n of N starts at query block n M / N: the CTAs of a head (started together)
        // add into different dQ rows at any one time
        if constexpr (Cfg::ROTATE && !CAUSAL) s.rot = (int)((long long)s.n_block * s.m_blocks / t.nx);
        return s;
    }
    // lpt: the CTAs started first get the most query blocks (launch_order.cuh): key block 0 of
    // every (kv head, batch) pair of a chunk, then key block 1, ... (a causal key block has fewer
    // query blocks the later it is); a chunk holds the pairs whose Q and dO fit in LPT_L2_KIB.
    template <class Cfg>
    CF_DEVICE void longest_first(const HopperBackwardParams& p, const BwdTile& t) {
        const int pairs = t.ny * t.nz;
        // KiB of Q + dO (16-bit) per (kv head, batch): 32-bit up to seq_len_q * group < 2^31 / (D / 256)
        const int pair_kib = max(1, p.kv_group_size * p.seq_len_q / (1024 / (Cfg::D * 4)));
        const int per = max(1, min(pairs, Cfg::LPT_L2_KIB / pair_kib));
        const LaunchSlot slot = longest_first_slot(t.x + t.nx * (t.y + t.ny * t.z), t.nx, pairs, per);
        n_block = slot.rank;
        kv_head = slot.pair % t.ny;
        batch = slot.pair / t.ny;
    }
    CF_DEVICE int iterations() const { return group * m_blocks; }
    // Without GQA (group 1, the common case) iteration it is query block it of the CTA's own head:
    // a uniform branch skips the runtime division (~40 instructions per block in the consumers'
    // loop; a stepped cursor instead needs live registers the consumers do not have).
    CF_DEVICE int q_head(int it) const { return group == 1 ? kv_head : kv_head * group + it / m_blocks; }
    // ROTATE: the config's rotate knob (rot is then the CTA's start, 0 for causal CTAs); without
    // it the walk is the plain one, with no wrap arithmetic.
    template <bool ROTATE>
    CF_DEVICE int m_block(int it) const {
        const int i = group == 1 ? it : it % m_blocks;
        if constexpr (!ROTATE) return m_begin + i;
        const int j = rot + i;
        return m_begin + (j >= m_blocks ? j - m_blocks : j);
    }
};

CF_DEVICE int bwd_stage(int it, int stages) { return it % stages; }
CF_DEVICE u32 bwd_phase(int it, int stages) { return (u32)(it / stages) & 1u; }

// 1-D bulk copy global -> shared completing `bytes` on mbarrier `bar` (16-byte aligned, size a
// multiple of 16).
CF_DEVICE void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(reinterpret_cast<u64>(src)), "r"(bytes), "r"(bar)
                 : "memory");
}

// Bulk reduction dst[0..bytes/4) += src[...] (fp32, shared -> global, async proxy), tracked by the
// issuing thread's bulk async-group; 16-byte aligned, size a multiple of 16.
CF_DEVICE void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}
// Tensor reduction: the box at (c0 innermost .. c3) of a 4-D fp32 tensor += the box in shared
// memory at `src` (laid out as the map's swizzle mode stores it), tracked by the issuing thread's
// bulk async-group.
CF_DEVICE void tma_reduce_add_4d(const void* desc, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                     reinterpret_cast<u64>(desc)),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
CF_DEVICE void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk groups have finished reading shared memory (READ_ONLY) or
// completed entirely.
template <bool READ_ONLY>
CF_DEVICE void bulk_wait_group_0() {
    if constexpr (READ_ONLY)
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    else
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// Waits until at most N of this thread's most recent bulk groups are still reading shared memory.
template <int N>
CF_DEVICE void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// Waits until at most N of this thread's most recent bulk groups are pending (writes included).
template <int N>
CF_DEVICE void bulk_wait_group_done() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// Orders this thread's completed async-proxy writes to global memory (TMA reductions) before its
// later generic-proxy operations (the counter's release below).
CF_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
CF_DEVICE void red_release_gpu_add(unsigned* dst, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(dst), "r"(v) : "memory");
}
CF_DEVICE unsigned ld_acquire_gpu(const unsigned* src) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(src) : "memory");
    return v;
}

// dq_early: the counter of query block m of (batch, head), behind the dq_accum workspace's
// fp32 (batch, n_heads, seq_len_q_pad, D) elements, one unsigned per B_r rows.
template <int D, int BR>
CF_DEVICE unsigned* dq_block_counter(float* dq_accum, int batch_count, int n_heads, int seq_len_q_pad, int batch,
                                     int head, int m) {
    unsigned* base = reinterpret_cast<unsigned*>(dq_accum + (long long)batch_count * n_heads * seq_len_q_pad * D);
    return base + ((long long)batch * n_heads + head) * (seq_len_q_pad / BR) + m;
}

// dq_frag's dq_accum layout: every 64-row block of a (batch, head) starts where its rows start in
// the row-major layout and holds its D / 8 n-tiles in column order, each in the order a wgmma
// m64 accumulator leaves it in registers:
// float4 (j, t) at float (j * 128 + t) * 4, for n-tile j and warpgroup thread t, holds (r, c),
// (r, c + 1), (r + 8, c), (r + 8, c + 1) with r = 16 (t / 32) + (t % 32) / 4, c = 8 j + 2 (t % 4).
// So a warpgroup's accumulator of columns c0 .. c0 + N - 1 (its part: all of them, or its half,
// or 64 / 32 of d_head 96's) is one contiguous run from float 64 c0: the consumers stage it with
// one conflict-free 16-byte store per n-tile and the writer adds it with one 1-D bulk reduction;
// the convert kernel undoes the order.
// dynamic: the tile counter, right behind dq_early's block counters, or without them right behind
// the dq_accum elements (the family's preprocess zeroes it; the producers claim tiles from it).
template <class Cfg>
CF_DEVICE unsigned* bwd_tile_counter(float* dq_accum, int batch_count, int n_heads, int seq_len_q_pad) {
    return dq_block_counter<Cfg::D, Cfg::BR>(dq_accum, batch_count, n_heads, seq_len_q_pad,
                                             Cfg::DQ_EARLY ? batch_count : 0, 0, 0);
}

// dynamic: hand-over j of the CTA's next tile index (-1: none left) from the producer thread to
// the consumers and the writer warp, through slot j & 1 (mbarrier arrive/wait order the slot's
// store before its loads).
template <class Cfg>
CF_DEVICE void tile_publish(const BwdSmem<Cfg>& smem, int j, int tile) {
    const int s = j & 1;
    mbarrier_wait(smem.tile_empty(s), ((u32)(j >> 1) & 1u) ^ 1u);
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(smem.tile_slot(s)), "r"(tile) : "memory");
    mbarrier_arrive(smem.tile_full(s));
}
template <class Cfg>
CF_DEVICE int tile_take(const BwdSmem<Cfg>& smem, int j, bool arrive) {
    const int s = j & 1;
    mbarrier_wait(smem.tile_full(s), (u32)(j >> 1) & 1u);
    int tile;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(tile) : "r"(smem.tile_slot(s)) : "memory");
    if (arrive) mbarrier_arrive(smem.tile_empty(s));
    return tile;
}

// Number of dK/dV CTAs (key blocks of BC) that add to query block m (of BR rows): every key
// block, or causal (bottom-right: key j visible from query i when j <= i + seq_k - seq_q) those
// whose BwdSchedule starts at or before m: max(0, n BC - (seq_k - seq_q)) / BR <= m, i.e.
// n BC < (m + 1) BR + seq_k - seq_q.
template <int BR, int BC, bool CAUSAL>
CF_DEVICE int dq_block_contributors(int m, int seq_len_q, int seq_len_k) {
    const int n_blocks = (seq_len_k + BC - 1) / BC;
    if constexpr (!CAUSAL) return n_blocks;
    const long long x = (long long)(m + 1) * BR + seq_len_k - seq_len_q;
    if (x <= 0) return 0;
    return (int)min((long long)n_blocks, (x + BC - 1) / BC);
}

CF_DEVICE void st_shared_f32x2(u32 dst, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(dst), "f"(a), "f"(b));
}
CF_DEVICE void st_shared_f32x4(u32 dst, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "f"(a), "f"(b), "f"(c), "f"(d));
}
CF_DEVICE float4 ld_shared_f32x4(u32 addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
    return v;
}

// dst[0..1] += (a, b) in one vector reduction (sm_90).
CF_DEVICE void red_add_v2(float* dst, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
}
