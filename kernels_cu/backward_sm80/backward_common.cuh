// Shared pieces of the mma.sync backward family (FlashAttention-2's backward): the static
// configuration, the few PTX wrappers the forward kernel does not need, and fragment helpers for
// the operand layouts that only the backward pass uses.
//
// Workspaces (fp32, per (batch, q-head) row-major, rows padded to seq_len_q_pad, a multiple of
// B_r, so every block of B_r rows is whole and 16-byte aligned):
//   lse2[row] = lse * log2(e) of the forward (or +inf for rows that saw no key and padding rows,
//               so that P = exp2(S * scale * log2(e) - lse2) is exactly 0 there);
//   dvec[row] = rowsum(dO * O) (0 for padding rows);
//   dq_accum[row][d] = sum over key blocks of dS K, unscaled (atomics; not in deterministic mode).
#pragma once

#define CF_POS_INF (__int_as_float(0x7f800000))

template <BackwardKernelConfig C>
struct StaticBackwardKernelConfig {
    static constexpr BackwardKernelConfig cfg = C;
    static constexpr DType dtype = C.dtype;
    static constexpr int D = C.d_head;
    static constexpr int BR = C.B_r;  // query rows per inner iteration
    static constexpr int BC = C.B_c;  // key rows per CTA of the dK/dV kernel
    static constexpr int N_WARPS = C.n_warps;
    static constexpr int N_THREADS = 32 * N_WARPS;
    // dK/dV: warps split first over key rows, then (D_SPLIT > 1) over the head dimension. Warps of
    // one key group compute the same S^T and dP^T (redundantly) and accumulate different columns.
    static constexpr int D_SPLIT = C.d_split;
    static constexpr int KEY_GROUPS = N_WARPS / D_SPLIT;
    static constexpr int WARP_KEYS = BC / KEY_GROUPS;
    static constexpr int MK = WARP_KEYS / 16;          // key m-tiles per warp
    static constexpr int D_COLS = D / D_SPLIT;         // dK/dV columns per warp
    static constexpr int DKV_N_TILES = D_COLS / 8;
    static constexpr int Q_N_TILES = BR / 8;           // n-tiles of S^T over queries
    static constexpr int Q_K_STEPS = BR / 16;          // k-steps over queries (dV, dK)
    static constexpr int D_K_STEPS = D / 16;           // k-steps over d_head (S^T, dP^T)
    static constexpr int KEY_K_STEPS = BC / 16;        // k-steps over keys (dQ)
    // dQ partial products of one iteration: (B_r / 16) m-tiles x D columns spread over the warps.
    static constexpr int Q_M_TILES = BR / 16;
    static constexpr int DQ_WARPS_PER_MTILE = N_WARPS > Q_M_TILES ? N_WARPS / Q_M_TILES : 1;
    static constexpr int DQ_MTILES_PER_WARP = N_WARPS > Q_M_TILES ? 1 : Q_M_TILES / N_WARPS;
    static constexpr int DQ_N_TILES = D / 8 / DQ_WARPS_PER_MTILE;  // columns (n-tiles) per warp
    static constexpr int DQ_CHUNK = DQ_N_TILES % 4 == 0 ? 4 : 2;   // n-tiles accumulated at once

    using QTile = SmemTile<BR, D, C.swizzled>;
    using KVTile = SmemTile<BC, D, C.swizzled>;
    using DSTile = SmemTile<BC, BR, C.swizzled>;  // dS^T, [key][query]
    static constexpr int ROW_STATS_BYTES = 2 * BR * 4;  // lse2 and dvec of one query block
    // double_buffer: two Q/dO/statistics buffers, so the next query block is copied during the
    // whole of the current one (one buffer: only during the dQ step).
    static constexpr int Q_BUFFERS = C.double_buffer ? 2 : 1;
    static constexpr int Q_BUFFER_SHIFT = 2 * QTile::BYTES;  // Q(1) - Q(0) = dO(1) - dO(0)
    // pds_smem: P and dS exchanged through two [B_r][B_c] tiles, 2-D warp layouts per product
    // (see backward_dkdv_2d.cuh); X_* are its warp grids: phase A X_S_WM x X_S_WN warps of
    // X_S_ROWS queries x 32 keys (32 x 32, or 64 x 32 as FlashAttention-2 tiles d_head 64),
    // phase B (B_c/32) x X_DKV_WD warps of 32 keys x X_DKV_COLS, phase C (B_r/32) x X_DQ_WD
    // warps of 32 queries x X_DQ_COLS.
    static constexpr bool PDS_SMEM = C.pds_smem;
    // (a [B_r][64] stand-in when unused: SmemTile needs rows of >= 8 chunks, B_c may be 32)
    using PTile = SmemTile<BR, (PDS_SMEM ? BC : 64), C.swizzled>;
    static constexpr int X_S_WN = BC >= 32 ? BC / 32 : 1;
    static constexpr int X_S_WM = N_WARPS / X_S_WN;
    static constexpr int X_S_ROWS = X_S_WM > 0 ? BR / X_S_WM : BR;
    static constexpr int X_DKV_WD = N_WARPS / (BC / 32);
    static constexpr int X_DKV_COLS = D / X_DKV_WD;
    static constexpr int X_DQ_WD = N_WARPS / (BR / 32);
    static constexpr int X_DQ_COLS = D / X_DQ_WD;
    // kv_regs: each phase-A warp holds the B fragments of its 32 keys of K and V in registers.
    static constexpr bool KV_REGS = C.kv_regs;
    static_assert(!KV_REGS || PDS_SMEM, "kv_regs needs pds_smem");
    // pipelined (pds_smem only): three Q/dO/statistics buffers and two P/dS pairs, one barrier per
    // iteration (backward_dkdv_2d.cuh).
    static constexpr bool PIPELINED = C.pipelined;
    static_assert(!PIPELINED || PDS_SMEM, "pipelined needs pds_smem");
    // mbarrier (pipelined only): two Q/dO/statistics buffers whose arrival each thread signals on
    // the buffer's mbarrier (cp.async.mbarrier.arrive) instead of a third buffer.
    static constexpr bool MBARRIER = C.mbarrier;
    static_assert(!MBARRIER || PIPELINED, "mbarrier needs pipelined");
    // dq_first: phase C (dQ and its atomics) before phase B; load_mid: the next block's copies
    // issued after the first k-step of the phase that follows the barrier (pds_smem only).
    static constexpr bool DQ_FIRST = C.dq_first;
    static constexpr bool LOAD_MID = C.load_mid;
    // dq_spread: phase C's reductions issued a few per k-step of phase B (after it: dq_first).
    static constexpr bool DQ_SPREAD = C.dq_spread;
    static_assert(!DQ_SPREAD || DQ_FIRST, "dq_spread needs dq_first");
    // dq_late: phase C's dQ tile reduced during the next block's phase A (pipelined loops).
    static constexpr bool DQ_LATE = C.dq_late;
    // dq_v4: phase C's reductions as 4-column vectors, formed by one exchange between lane pairs.
    static constexpr bool DQ_V4 = C.dq_v4;
    static_assert(!DQ_V4 || (PDS_SMEM && !DQ_SPREAD && !DQ_LATE), "dq_v4: pds_smem, not dq_spread/dq_late");
    static_assert(!DQ_LATE || (PIPELINED && !DQ_SPREAD), "dq_late needs pipelined, not dq_spread");
    static_assert(!(DQ_FIRST || LOAD_MID) || PDS_SMEM, "dq_first and load_mid need pds_smem");
    static constexpr int PDS_Q_BUFFERS = PIPELINED ? (MBARRIER ? 2 : 3) : 2;
    static constexpr int P_BUFFERS = PIPELINED ? 2 : 1;
    static constexpr int P_BUFFER_SHIFT = 2 * PTile::BYTES;  // P(1) - P(0) = dS(1) - dS(0)
    static constexpr int MBARRIER_BYTES = MBARRIER ? 2 * 8 : 0;  // one 8-byte mbarrier per Q/dO buffer
    static constexpr int SMEM_BYTES =
        PDS_SMEM ? 2 * KVTile::BYTES + PDS_Q_BUFFERS * (2 * QTile::BYTES + ROW_STATS_BYTES) +
                       P_BUFFERS * 2 * PTile::BYTES + MBARRIER_BYTES
                 : 2 * KVTile::BYTES + Q_BUFFERS * (2 * QTile::BYTES + ROW_STATS_BYTES) + DSTile::BYTES;
    static_assert(!PDS_SMEM || (C.double_buffer && C.d_split == 1), "pds_smem needs double_buffer, d_split 1");
    static_assert(!PDS_SMEM || (BR % 32 == 0 && BC % 32 == 0 && N_WARPS % (BR / 32) == 0 &&
                                N_WARPS % X_S_WN == 0 && X_S_WM > 0 && BR % X_S_WM == 0 && X_S_ROWS % 16 == 0 &&
                                X_S_ROWS <= 64),
                  "pds_smem warp grids: 16/32/64 x 32 tiles of S, 32-key and 32-query warp rows");
    static_assert(!PDS_SMEM || (X_DKV_COLS % 16 == 0 && X_DQ_COLS % 16 == 0), "column slices of whole n-tile pairs");

    // The deterministic dQ kernel: one CTA per query block, one warp per 16 query rows.
    static constexpr int DQK_WARPS = BR / 16;
    static constexpr int DQK_THREADS = 32 * DQK_WARPS;
    static constexpr int DQK_SMEM_BYTES = 2 * QTile::BYTES + 2 * KVTile::BYTES;

    // Preprocess / convert kernels: 64 rows per CTA, 4 threads per row.
    static constexpr int ROW_KERNEL_ROWS = 64;
    static constexpr int ROW_KERNEL_THREADS = 256;

    static_assert(N_WARPS % D_SPLIT == 0 && BC % KEY_GROUPS == 0, "warps split evenly over keys and columns");
    static_assert(PDS_SMEM || (WARP_KEYS % 16 == 0 && MK >= 1), "each warp owns whole 16-key m-tiles");
    static_assert(DKV_N_TILES % 2 == 0, "dK/dV columns per warp come in pairs of n-tiles");
    static_assert(DQ_N_TILES % 2 == 0, "dQ columns per warp come in pairs of n-tiles");
    static_assert((BR * D / 8) % N_THREADS == 0 && (BC * D / 8) % N_THREADS == 0, "tiles spread over threads");
    static_assert((BR * D / 8) % DQK_THREADS == 0 && (BC * D / 8) % DQK_THREADS == 0, "dQ-kernel tiles spread");
    static_assert(BR % ROW_KERNEL_ROWS == 0, "padded rows are whole preprocess blocks");
    static_assert(BR / 2 <= N_THREADS, "one 16-byte row-statistics copy per thread");
};

// ---- varlen: one CTA's sequence ------------------------------------------------------------
// VARLEN kernels (backward_varlen): q, k, v, o, dO, dq, dk, dv are packed (total_tokens, heads,
// d_head), sequence b holding tokens cu_seqlens[b] .. cu_seqlens[b + 1] - 1, and the forward's
// lse is (n_heads, total_q). The workspaces are (n_heads, seq_len_q_pad) rows in which sequence
// b's start at row floor((cu_seqlens_q[b] + b B_r) / B_r) B_r: a B_r multiple, and the next
// sequence's start lies at or past this one's rows rounded up to B_r, so every sequence has whole,
// disjoint blocks (seq_len_q_pad >= total_q + batch B_r covers the last). A VARLEN kernel makes
// sequence b's parameters here (pointers at its first token and workspace row, its own lengths)
// and runs the dense code on them with batch index 0.
// First workspace row of sequence b, whose first query token is tq (both families' varlen kernels).
template <int BR>
CF_DEVICE long long varlen_ws_row0(int tq, int b) {
    return ((long long)tq + (long long)b * BR) / BR * BR;
}

template <class Cfg>
CF_DEVICE BackwardParams sequence_params(const BackwardParams& p, int b) {
    BackwardParams s = p;
    const int tq = p.cu_seqlens_q[b], tk = p.cu_seqlens_k[b];
    s.seq_len_q = p.cu_seqlens_q[b + 1] - tq;
    s.seq_len_k = p.cu_seqlens_k[b + 1] - tk;
    s.q = static_cast<const u16*>(p.q) + (long long)tq * p.q_seq_stride;
    s.o = static_cast<const u16*>(p.o) + (long long)tq * p.o_seq_stride;
    s.dout = static_cast<const u16*>(p.dout) + (long long)tq * p.do_seq_stride;
    s.dq = static_cast<u16*>(p.dq) + (long long)tq * p.dq_seq_stride;
    s.lse = p.lse + (long long)tq * p.lse_seq_stride;
    s.k = static_cast<const u16*>(p.k) + (long long)tk * p.k_seq_stride;
    s.v = static_cast<const u16*>(p.v) + (long long)tk * p.v_seq_stride;
    s.dk = static_cast<u16*>(p.dk) + (long long)tk * p.dk_seq_stride;
    s.dv = static_cast<u16*>(p.dv) + (long long)tk * p.dv_seq_stride;
    const long long ws_row0 = varlen_ws_row0<Cfg::BR>(tq, b);
    s.lse2 = p.lse2 + ws_row0;
    s.dvec = p.dvec + ws_row0;
    if (p.dq_accum != nullptr) s.dq_accum = p.dq_accum + ws_row0 * Cfg::D;
    return s;
}

// VARLEN with new outputs: the tokens past the last sequence get zero gradients (varlen_tail.cuh).
// The preprocess grid's CTAs share those rows of dq (tail_total_q) and dk, dv (tail_total_k).
template <class Cfg>
CF_DEVICE void zero_varlen_tail(const BackwardParams& p) {
    if (p.tail_total_q == 0 && p.tail_total_k == 0) return;
    const int batch = gridDim.z;
    const long long first = grid_thread_index(), step = grid_thread_count();
    const int k0 = p.cu_seqlens_k[batch];
    zero_rows<Cfg::D>(p.dq, p.dq_seq_stride, p.dq_head_stride, p.n_heads, p.cu_seqlens_q[batch], p.tail_total_q, first,
                      step);
    zero_rows<Cfg::D>(p.dk, p.dk_seq_stride, p.dk_head_stride, p.n_kv_heads, k0, p.tail_total_k, first, step);
    zero_rows<Cfg::D>(p.dv, p.dv_seq_stride, p.dv_head_stride, p.n_kv_heads, k0, p.tail_total_k, first, step);
}

// ---- which key block a dK/dV CTA owns -------------------------------------------------------
// Returns (key block, k/v head, batch) of this CTA of a dK/dV grid (n_key_blocks, n_kv_heads, batch).
// Without causal masking every CTA does the same work: the grid's own coordinates (consecutive
// CTAs, which run together, share one head's Q and dO in L2). Under causal masking a key block
// sees fewer query blocks the later it lies, and in grid order each head's light CTAs end up
// running beside the next heads' heavy ones, leaving a tail of heavy CTAs (list scheduling of the
// SPEC grid on 132 SMs: 5-7% over the ideal at S = 1k-8k). So the CTAs (in launch order) are
// dealt out heaviest first within groups of w (head, batch) pairs, with w * n_key_blocks about
// two waves (CAUSAL_GROUP_CTAS): the same simulation gives 0.1-1.5% over the ideal, and a group's
// Q/dO (w heads, S rows) stays small enough for L2.
#define CF_CAUSAL_GROUP_CTAS 256
template <bool CAUSAL>
CF_DEVICE int3 kv_block_coords() {
    if constexpr (!CAUSAL) {
        return make_int3((int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z);
    } else {
        const int n_kb = (int)gridDim.x, n_heads = (int)gridDim.y, n_hb = n_heads * (int)gridDim.z;
        const int linear = (int)blockIdx.x + n_kb * ((int)blockIdx.y + n_heads * (int)blockIdx.z);
        const int w = min(n_hb, (CF_CAUSAL_GROUP_CTAS + n_kb - 1) / n_kb);
        const int group = linear / (w * n_kb);
        const int wg = min(w, n_hb - group * w);  // the last group may be smaller
        const int within = linear - group * w * n_kb;
        const int hb = group * w + within % wg;
        return make_int3(within / wg, hb % n_heads, hb / n_heads);
    }
}

// ---- PTX the forward kernel does not use --------------------------------------------------
CF_DEVICE float2 ld_shared_f32x2(u32 addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}

CF_DEVICE float ld_shared_f32(u32 addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
    return v;
}

CF_DEVICE float ld_global_f32(const float* p) {
    float v;
    asm volatile("ld.global.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
    return v;
}

// Two fp32 atomic adds to adjacent addresses (8-byte aligned). Hopper has a vector reduction,
// one instruction for both; older archs issue two.
CF_DEVICE void atomic_add_f32x2(float* addr, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;\n" ::"l"(addr), "f"(a) : "memory");
    asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;\n" ::"l"(addr + 1), "f"(b) : "memory");
#endif
}

// dst[0..3] += (a, b, c, d), 16-byte aligned (sm_90: one vector reduction; else four scalar ones).
CF_DEVICE void atomic_add_f32x4(float* addr, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(addr), "f"(a), "f"(b), "f"(c),
                 "f"(d)
                 : "memory");
#else
    atomic_add_f32x2(addr, a, b);
    atomic_add_f32x2(addr + 2, c, d);
#endif
}

// ---- mbarriers for cp.async arrival (sm_80+; named apart from the Hopper families' TMA wrappers) --
CF_DEVICE void mbar_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

CF_DEVICE float4 ld_global_cg_f32x4(const float* src) {  // L2 only: other CTAs' reductions land there
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(src));
    return v;
}

// One arrival on `bar`, made when every cp.async this thread issued before it has completed
// (.noinc: the barrier's expected count already includes it).
CF_DEVICE void mbar_arrive_on_copies(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Blocks until the phase of parity `parity` has completed; its copies are then visible.
CF_DEVICE void mbar_wait_parity(u32 bar, u32 parity) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "MBAR_WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra MBAR_WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#else
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "MBAR_WAIT_%=:\n"
        "mbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra MBAR_WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#endif
}

// One register of two 16-bit values -> two fp32 values (low half first).
template <DType T>
CF_DEVICE float2 unpack_pair(u32 v);

template <>
CF_DEVICE float2 unpack_pair<DType::BF16>(u32 v) {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}

template <>
CF_DEVICE float2 unpack_pair<DType::FP16>(u32 v) {
    float lo, hi;
    asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
        : "=f"(lo), "=f"(hi)
        : "r"(v));
    return make_float2(lo, hi);
}

// ---- fragment helpers ---------------------------------------------------------------------
// A operand (16 x 16, rows m, columns k) from a tile stored transposed, [k][m] (dS^T stored
// [key][query] feeding dQ = dS K). Transposing ldmatrix on the 8x8 blocks (k 0-7 | 8-15) x
// (m 0-7 | 8-15) gives lane l (m = l/4, k = 2(l%4), +1) of each block, i.e. the A layout when
// block i is (k offset 8*(i>>1), m offset 8*(i&1)): the B-operand lane pattern.
template <class Tile>
CF_DEVICE typename Tile::Cursor a_transposed_fragment_cursor(const Tile& tile, int lane) {
    return b_fragment_cursor(tile, lane);
}

template <class Tile>
CF_DEVICE void load_a_fragment_transposed(u32 (&a)[4], const Tile& tile, const typename Tile::Cursor& cur,
                                          int m_tile, int k_step) {
    ldmatrix_x4_trans(a, tile.at(cur, 16 * k_step, 2 * m_tile));
}

// fp32 C fragments of two adjacent n-tiles (16 x 16) -> the A fragment of one k-step.
template <DType T>
CF_DEVICE void pack_a_fragment(u32 (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = pack_pair<T>(c0[0], c0[1]);
    a[1] = pack_pair<T>(c0[2], c0[3]);
    a[2] = pack_pair<T>(c1[0], c1[1]);
    a[3] = pack_pair<T>(c1[2], c1[3]);
}

// A packed A fragment (16 x 16 16-bit) -> shared tile rows row_offset.., n-tiles 2k, 2k+1, with
// an accumulator_cursor (lane holds row lane/4 (+8), columns 2(lane%4), +1 of each n-tile).
template <class Tile>
CF_DEVICE void store_a_fragment(const Tile& tile, const typename Tile::Cursor& cur, const u32 (&a)[4],
                                int row_offset, int k_step) {
    st_shared_4(tile.at(cur, row_offset, 2 * k_step), a[0]);
    st_shared_4(tile.at(cur, row_offset + 8, 2 * k_step), a[1]);
    st_shared_4(tile.at(cur, row_offset, 2 * k_step + 1), a[2]);
    st_shared_4(tile.at(cur, row_offset + 8, 2 * k_step + 1), a[3]);
}

// Copy a whole tile from shared to global memory over N_THREADS threads (rows at or past
// rows_valid are not written). Every thread's writes to the tile must be visible (barrier first).
template <int N_THREADS, class Tile>
CF_DEVICE void copy_tile_shared_to_global(const Tile& tile, u16* __restrict__ dst, long long row_stride,
                                          int rows_valid, int tid) {
    constexpr int ROWS = Tile::BYTES / Tile::ROW_BYTES;
    constexpr int TOTAL_CHUNKS = ROWS * Tile::CHUNKS_PER_ROW;
    static_assert(TOTAL_CHUNKS % N_THREADS == 0, "tile chunks must spread evenly over the threads");
#pragma unroll
    for (int i = 0; i < TOTAL_CHUNKS / N_THREADS; ++i) {
        const int idx = tid + i * N_THREADS;
        const int row = idx / Tile::CHUNKS_PER_ROW;
        const int chunk = idx % Tile::CHUNKS_PER_ROW;
        const uint4 v = ld_shared_16(tile.lane_address(row, chunk));
        if (row < rows_valid) st_global_16(dst + row * row_stride + chunk * 8, v);
    }
}
