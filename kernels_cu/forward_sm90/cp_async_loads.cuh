// Loads without TMA (cp_async configs: the progression's first step, wgmma alone). Every consumer
// thread copies 16-byte chunks of Q, K and V with cp.async into the same swizzled tiles TMA writes
// (128-byte rows, 64-byte at d_head 96), zero-filling rows past the sequence ends (src-size 0),
// and the K/V ring's stages are handed over with cp.async groups and CTA barriers instead of
// mbarriers.
//
// The parameter struct's descriptor slots then hold a plain record of the tensor (params.py,
// global_tensor_record): opaque[0] the pointer, opaque[1..3] the batch, seq and head strides in
// elements.
#pragma once

template <class Cfg, bool CAUSAL>
struct CpAsyncLoader {
    static constexpr int THREADS = 128 * Cfg::CONSUMERS;  // every thread of the (non-specialised) CTA
    static constexpr int ROW_CHUNKS = Cfg::D / 8;         // 16-byte chunks per row

    const HopperForwardParams& p;
    SmemLayout<Cfg> smem;
    TileScheduler<Cfg, CAUSAL> tile;
    int tid;

    // Element (seq, head, column 0) of the tile's batch in the tensor of record `t`.
    CF_DEVICE static const u16* row_pointer(const TmaDescriptor& t, int batch, int seq, int head) {
        return reinterpret_cast<const u16*>(t.opaque[0]) + batch * (long long)t.opaque[1] +
               seq * (long long)t.opaque[2] + head * (long long)t.opaque[3];
    }

    // ROWS rows from `src` (row stride `stride`) into the tile at `dst`: 16-byte chunk ch of row r
    // goes to column block ch / BLOCK_CHUNKS, row r, at its swizzled chunk (swizzled_chunk: the
    // layout TMA writes). Consecutive threads take consecutive chunks of a row: coalesced reads,
    // and each 8 of them write 128 bytes of one or two rows, conflict-free. Rows at or past
    // `valid` are written as zeros without being read.
    template <int ROWS>
    CF_DEVICE void load_tile(u32 dst, const u16* src, long long stride, int valid) const {
        constexpr int CHUNKS = ROWS * ROW_CHUNKS;
#pragma unroll
        for (int i = tid; i < CHUNKS; i += THREADS) {
            const int r = i / ROW_CHUNKS, ch = i % ROW_CHUNKS;
            constexpr int BLOCK_CHUNKS = Cfg::ROW_BYTES / 16;
            const u32 at = dst + (ch / BLOCK_CHUNKS) * ROWS * Cfg::ROW_BYTES + r * Cfg::ROW_BYTES +
                           (swizzled_chunk<Cfg>(r, ch % BLOCK_CHUNKS) << 4);
            const bool in = r < valid;
            cp_async_16(at, in ? src + r * stride + 8 * ch : src, in);
        }
    }

    CF_DEVICE void load_q() const {
        load_tile<Cfg::BR>(smem.q(), row_pointer(p.tma_q, tile.tma_batch(), tile.q_coord(), tile.head),
                           (long long)p.tma_q.opaque[2], tile.seq_len_q(p) - tile.first_row());
    }
    // K (or V) of key block `block` into ring stage `stage`.
    CF_DEVICE void load_kv(const TmaDescriptor& t, u32 dst, int block) const {
        const int key0 = block * Cfg::BC;
        load_tile<Cfg::BC>(dst, row_pointer(t, tile.tma_batch(), tile.k_coord(key0), tile.head / p.kv_group_size),
                           (long long)t.opaque[2], tile.seq_len_k(p) - key0);
    }
    CF_DEVICE void load_k(int block, int stage) const { load_kv(p.tma_k, smem.k(stage), block); }
    CF_DEVICE void load_v(int block, int stage) const { load_kv(p.tma_v, smem.v(stage), block); }
};

// Makes this CTA's copies of the groups before the newest `PENDING` visible to wgmma: each thread
// waits for its own copies, orders them (generic proxy) before the async proxy's reads, then the
// barrier gathers every thread's.
template <int PENDING>
CF_DEVICE void cp_async_publish() {
    cp_async_wait<PENDING>();
    fence_proxy_async_shared();
    __syncthreads();
}

// The consumer mainloop over a cp.async ring of STAGES K/V slots. Groups are committed in the
// order K_0 (with Q), V_0, K_1, V_1, ...: K_b is group 2b and V_b group 2b + 1 (a commit without
// copies past the last block keeps the count). K_{j+S} is issued after the barrier before P V_j
// (every warpgroup's Q K_j^T has completed: its stage is free), V_{j+S} after the barrier before
// Q K_{j+1}^T (every P V_j has completed); at each wait 2S - 2 later groups may still be in
// flight (2S - 1 before Q K_0^T, when V_{S-1} is the newest).
template <class Cfg, bool CAUSAL>
CF_DEVICE void run_cp_async(Consumer<Cfg, CAUSAL>& c, const CpAsyncLoader<Cfg, CAUSAL>& loads, int n_blocks) {
    if (n_blocks <= 0) return;  // uniform over the CTA: nothing loaded, O stays zero
    constexpr int S = Cfg::STAGES;
    loads.load_q();
#pragma unroll
    for (int b = 0; b < S; ++b) {
        if (b < n_blocks) loads.load_k(b, b);
        cp_async_commit();
        if (b < n_blocks) loads.load_v(b, b);
        cp_async_commit();
    }
    typename Consumer<Cfg, CAUSAL>::Scores s;
    for (int j = 0; j < n_blocks; ++j) {
        const int stage = ring_stage(j, S);
        if (j == 0) cp_async_publish<2 * S - 1>();
        else cp_async_publish<2 * S - 2>();
        if (j > 0) {
            if (j - 1 + S < n_blocks) loads.load_v(j - 1 + S, ring_stage(j - 1, S));
            cp_async_commit();
        }
        c.issue_qk(s, stage);
        wgmma_wait<0>();
        fence_registers(s[0]);
        c.softmax_block(s, j);
        cp_async_publish<2 * S - 2>();
        if (j + S < n_blocks) loads.load_k(j + S, stage);
        cp_async_commit();
        c.issue_pv(stage);
        wgmma_wait<0>();
        fence_registers(c.o);
    }
}
