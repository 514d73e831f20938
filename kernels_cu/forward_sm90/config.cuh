// Static configuration of the Hopper forward kernel: constants derived from the config value and
// the shared-memory layout of one CTA.
//
// Tiles are stored as TMA writes them with 128-byte swizzling (cp_async configs write the same
// layout with 16-byte copies): a tile of R rows and D columns is
// D/64 column blocks, each R rows of 128 bytes (64 16-bit elements), so every wgmma operand is a
// canonical 128B-swizzled layout (see smem_descriptor_swizzled). d_head 96 is not a multiple of
// 64: its tiles use 64-byte swizzling, three column blocks of R rows x 64 bytes (32 elements).
// P tiles (P_SMEM) are 128B-swizzled whatever d_head is: their columns are keys.
#pragma once

template <HopperForwardKernelConfig C>
struct StaticHopperForwardConfig : SwizzledTiles<C.d_head> {  // ROW_BYTES, COL_BLOCK, D_BLOCKS, ...
    static constexpr HopperForwardKernelConfig cfg = C;
    static constexpr DType dtype = C.dtype;
    static constexpr int D = C.d_head;
    static constexpr int BR = C.B_r;
    static constexpr int BC = C.B_c;
    static constexpr int STAGES = C.n_stages;
    static constexpr bool WARP_SPECIALIZED = C.warp_specialized;
    static constexpr bool PINGPONG = C.pingpong;
    static constexpr bool OVERLAP = C.intra_wg_overlap;
    static constexpr bool PERSISTENT = C.persistent;
    static constexpr int Q_BUFFERS = C.double_q ? 2 : 1;  // tile t uses Q tile t % Q_BUFFERS
    static constexpr int EXP_EMULATION = C.exp_emulation;  // quarters of the scores: exp2 on FMA
    static constexpr bool CP_ASYNC = C.cp_async;  // consumer threads load Q/K/V with cp.async, no TMA
    static constexpr bool O_DIRECT = C.o_direct;  // O stored from registers, not staged in the Q tile
    // A persistent CTA's Q tile is free once the tile's last Q K^T has completed (O_DIRECT: the
    // epilogue no longer stages O in it), so the consumers release it there.
    static constexpr bool EARLY_Q_RELEASE = O_DIRECT && PERSISTENT;
    static constexpr bool LAZY_RESCALE = C.lazy_rescale;  // running max moved only when it grows by > 2^8
    static constexpr bool TURN_RING = C.turn_ring;  // ping-pong turns run on across a persistent CTA's tiles
    static constexpr bool CROSS_TILE = C.cross_tile;  // a tile's last P V behind the next tile's first Q K^T
    static constexpr bool WG_BLOCKS = C.wg_blocks;    // a warpgroup stops at its own last needed block
    static constexpr bool P_SMEM = C.p_smem;  // P V reads P from a shared tile per consumer warpgroup
    static constexpr bool Q_REGS = C.q_regs;  // Q K^T reads Q's fragments from registers (ldmatrix once per tile)
    // a warpgroup's last block, when its second half is masked for all its rows: softmax and P V on the first half
    static constexpr bool HALF_LAST = C.half_last;
    // CTAs launched in clusters of two (query blocks 2i and 2i + 1 of one head); see kv_multicast.
    static constexpr bool CLUSTER = C.cluster;
    // lpt: causal grids start the longest tiles of a chunk of heads first, a chunk the (head, batch)
    // pairs whose K and V fit in LPT_L2_KIB (H100: 50 MB of L2)
    static constexpr bool LPT = C.lpt_mib > 0;
    static constexpr int LPT_L2_KIB = C.lpt_mib << 10;
    static constexpr int CLUSTER_SIZE = CLUSTER ? 2 : 1;
    static constexpr bool VARLEN = false;  // packed ragged batches: see WithVarlen

    static constexpr int WG_ROWS = 64;  // rows of one wgmma m64 tile: one consumer warpgroup
    static constexpr int CONSUMERS = BR / WG_ROWS;
    static constexpr int PRODUCER_WARPGROUPS = WARP_SPECIALIZED ? 1 : 0;
    static constexpr int N_THREADS = 128 * (CONSUMERS + PRODUCER_WARPGROUPS);
    // setmaxnreg budgets (multiples of 8): the producer only runs one thread's TMA loop; the
    // consumers share the rest of the 64K registers (128 * 24 + 3 * 128 * 160 <= 65536).
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int CONSUMER_REGS = CONSUMERS == 3 ? 160 : CONSUMERS == 2 ? 240 : 256;

    static constexpr int Q_BYTES = BR * D * 2;
    static constexpr int KV_BYTES = BC * D * 2;
    // P_SMEM: each consumer warpgroup's P (64 rows x BC keys, 16-bit) as a K-major A operand,
    // laid out as a 128B-swizzled Q tile: ceil(BC / 64) column blocks of 64 rows x 128 bytes.
    static constexpr int P_ROW_BYTES = 128;
    static constexpr int P_COL_BLOCK = 64;
    static constexpr int P_COL_BLOCKS = (BC + P_COL_BLOCK - 1) / P_COL_BLOCK;
    static constexpr int P_WG_BYTES = P_COL_BLOCKS * WG_ROWS * P_ROW_BYTES;
    static constexpr int P_BYTES = P_SMEM ? CONSUMERS * P_WG_BYTES : 0;

    // Byte offsets from the 1024-byte aligned base of dynamic shared memory.
    static constexpr int Q_OFFSET = 0;
    static constexpr int K_OFFSET = Q_OFFSET + Q_BUFFERS * Q_BYTES;
    static constexpr int V_OFFSET = K_OFFSET + STAGES * KV_BYTES;
    static constexpr int P_OFFSET = V_OFFSET + STAGES * KV_BYTES;
    static constexpr int BAR_OFFSET = P_OFFSET + P_BYTES;
    // q_full, q_empty per Q tile, then per stage k_full, v_full, k_empty, v_empty, then tail_cleared:
    // 8 bytes each
    static constexpr int Q_BARS = 2 * Q_BUFFERS;
    static constexpr int BAR_BYTES = 8 * (Q_BARS + 4 * STAGES + 1);
    // + 1024: the kernel rounds the dynamic shared memory base up to a 1024-byte boundary (the
    // 128B swizzle pattern repeats every 1024 bytes and wgmma/TMA assume atoms aligned to it).
    static constexpr int SMEM_BYTES = BAR_OFFSET + BAR_BYTES + 1024;

    static_assert(Q_BYTES % 1024 == 0 && KV_BYTES % 1024 == 0, "tiles keep the swizzle patterns' alignment");
    static_assert(BR % WG_ROWS == 0 && CONSUMERS >= 1 && CONSUMERS <= 3, "one to three consumer warpgroups");
    static_assert(CONSUMERS < 3 || WARP_SPECIALIZED, "three consumer warpgroups need setmaxnreg's registers");
    static_assert(BC % 16 == 0 && BC <= 256, "key tile is a wgmma N (<= 256) and whole k-steps of P V");
    static_assert(!PINGPONG || (CONSUMERS >= 2 && WARP_SPECIALIZED), "ping-pong rotates two or three consumer warpgroups");
    static_assert(STAGES >= 1, "at least one K/V stage");
    static_assert(!PERSISTENT || WARP_SPECIALIZED, "persistent CTAs need the producer warpgroup");
    static_assert(Q_BUFFERS == 1 || PERSISTENT, "a second Q tile serves only a CTA's next tile");
    static_assert(!TURN_RING || (PERSISTENT && PINGPONG), "the turn ring carries ping-pong turns across tiles");
    static_assert(!CROSS_TILE || (TURN_RING && Q_BUFFERS == 2 && OVERLAP),
                  "cross_tile: the next tile's Q in the other Q tile, its first turn merged into the ring");
    static_assert(!CP_ASYNC || (!WARP_SPECIALIZED && !OVERLAP), "cp.async loads run in the plain mainloop");
    static_assert(!Q_REGS || (!CP_ASYNC && !CROSS_TILE), "qreg: Q from its TMA tile, one tile's fragments at a time");
    static_assert(!HALF_LAST || (OVERLAP && !CROSS_TILE && BC % 32 == 0),
                  "halflast: the overlapped mainloop's last block, whole k-steps of P V in each half");
    static_assert(EXP_EMULATION >= 0 && EXP_EMULATION <= 2, "at most half of the exponentials on the FMA units");
    static_assert(!CLUSTER || (WARP_SPECIALIZED && !PERSISTENT && SwizzledTiles<D>::D_BLOCKS % 2 == 0),
                  "cluster: the producer warpgroup's TMA, one tile per CTA, whole 64-column blocks per CTA");
};

// The 16-byte chunk at which logical chunk `chunk` of row `row` of a Q/K/V column block lies:
// TMA's 128B swizzle XORs address bits 4-6 with bits 7-9 (row % 8 for 128-byte rows), its 64B
// swizzle bits 4-5 with bits 7-8 (row / 2 % 4 for 64-byte rows); blocks are aligned to the
// pattern's period (1024 / 512 bytes).
template <class Cfg>
CF_DEVICE int swizzled_chunk(int row, int chunk) {
    if constexpr (Cfg::ROW_BYTES == 128)
        return chunk ^ (row % 8);
    else
        return chunk ^ ((row >> 1) % 4);
}

// Shared address of the 16-bit element (row, col) of a Q tile at `q_tile`: column block
// col / COL_BLOCK (BR rows each), its row's swizzled 16-byte chunk.
template <class Cfg>
CF_DEVICE u32 q_tile_element(u32 q_tile, int row, int col) {
    const int chunk = swizzled_chunk<Cfg>(row, (col % Cfg::COL_BLOCK) / 8);
    return q_tile + (col / Cfg::COL_BLOCK) * Cfg::BR * Cfg::ROW_BYTES + row * Cfg::ROW_BYTES + chunk * 16 + (col % 8) * 2;
}

// Whether the two CTAs of a cluster share their K/V loads: each loads every other 64-column
// block of each K and V tile and multicasts it into both CTAs' stage, so every block crosses
// from L2 once per pair. Only where both tiles of a pair visit the same key blocks in the same
// order: dense calls without the causal mask (causal tiles of a pair differ in length, varlen
// tiles may lie in different sequences); there the CTAs of a cluster run independently.
template <class Cfg, bool CAUSAL>
__host__ __device__ constexpr bool kv_multicast() {
    return Cfg::CLUSTER && !CAUSAL && !Cfg::VARLEN;
}

// Shared-memory addresses (shared window, 32-bit) of one CTA's tiles and barriers.
template <class Cfg>
struct SmemLayout {
    u32 base;

    CF_DEVICE u32 q(int buf = 0) const { return base + Cfg::Q_OFFSET + buf * Cfg::Q_BYTES; }
    CF_DEVICE u32 k(int stage) const { return base + Cfg::K_OFFSET + stage * Cfg::KV_BYTES; }
    CF_DEVICE u32 v(int stage) const { return base + Cfg::V_OFFSET + stage * Cfg::KV_BYTES; }
    CF_DEVICE u32 p(int wg) const { return base + Cfg::P_OFFSET + wg * Cfg::P_WG_BYTES; }
    CF_DEVICE u32 q_full(int buf = 0) const { return base + Cfg::BAR_OFFSET + 16 * buf; }
    // the Q tile (and O staging in it) is free
    CF_DEVICE u32 q_empty(int buf = 0) const { return base + Cfg::BAR_OFFSET + 16 * buf + 8; }
    CF_DEVICE u32 k_full(int stage) const { return base + Cfg::BAR_OFFSET + 8 * (Cfg::Q_BARS + stage); }
    CF_DEVICE u32 v_full(int stage) const { return base + Cfg::BAR_OFFSET + 8 * (Cfg::Q_BARS + Cfg::STAGES + stage); }
    CF_DEVICE u32 k_empty(int stage) const { return base + Cfg::BAR_OFFSET + 8 * (Cfg::Q_BARS + 2 * Cfg::STAGES + stage); }
    CF_DEVICE u32 v_empty(int stage) const { return base + Cfg::BAR_OFFSET + 8 * (Cfg::Q_BARS + 3 * Cfg::STAGES + stage); }
    // VARLEN: every consumer thread has zeroed its share of a tail block's V rows past the sequence's end (mainloop.cuh)
    CF_DEVICE u32 tail_cleared() const { return base + Cfg::BAR_OFFSET + 8 * (Cfg::Q_BARS + 4 * Cfg::STAGES); }
};

// Q tile of a CTA's `tile_iter`-th tile, and the parity of that tile's use of it.
template <class Cfg>
CF_DEVICE int q_buffer(int tile_iter) { return tile_iter % Cfg::Q_BUFFERS; }
template <class Cfg>
CF_DEVICE u32 q_phase(int tile_iter) { return (u32)(tile_iter / Cfg::Q_BUFFERS) & 1u; }

// Stage and phase parity of key block `block` in the K/V ring.
CF_DEVICE int ring_stage(int block, int stages) { return block % stages; }
CF_DEVICE u32 ring_phase(int block, int stages) { return (u32)(block / stages) & 1u; }

// The kernel's varlen template flag folded into its static configuration, so that every role
// (scheduler, producer, consumer, epilogue) sees it as Cfg::VARLEN without another template
// parameter: q/k/v/o are packed (total_tokens, heads, d_head) and each tile reads its sequence's
// token range from cu_seqlens_q/k.
template <class Base, bool V>
struct WithVarlen : Base {
    static constexpr bool VARLEN = V;
};
