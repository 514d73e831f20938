// TMA producer: Q once per tile, then K and V of each key block into a ring of STAGES slots.
// One thread issues everything; `k_full`/`v_full` of a stage complete when its bytes have landed,
// `k_empty`/`v_empty` when every consumer warp has finished reading its K (after Q K^T) or V
// (after P V). K and V are released separately: K is free a whole P V earlier, so the next K
// load starts that much sooner (with intra-warpgroup overlap, P V_j runs an iteration late).
#pragma once

template <class Cfg, bool CAUSAL>
struct Producer {
    const HopperForwardParams& p;
    SmemLayout<Cfg> smem;
    TileScheduler<Cfg, CAUSAL> tile;
    int kv_head;

    CF_DEVICE Producer(const HopperForwardParams& params, SmemLayout<Cfg> layout, TileScheduler<Cfg, CAUSAL> t)
        : p(params), smem(layout), tile(t), kv_head(t.head / params.kv_group_size) {}

    // Q of the tile; `tile_iter` counts this CTA's tiles (persistent CTAs wait until the
    // consumers' epilogue of the previous tile has released the Q tile it stages O in).
    CF_DEVICE void load_q(int tile_iter) const {
        const int buf = q_buffer<Cfg>(tile_iter);
        if constexpr (Cfg::PERSISTENT) mbarrier_wait(smem.q_empty(buf), q_phase<Cfg>(tile_iter) ^ 1u);
        mbarrier_arrive_expect_tx(smem.q_full(buf), Cfg::Q_BYTES);
#pragma unroll
        for (int c = 0; c < Cfg::D_BLOCKS; ++c)
            tma_load_4d(smem.q(buf) + c * Cfg::BR * Cfg::ROW_BYTES, &p.tma_q, smem.q_full(buf), c * Cfg::COL_BLOCK,
                        tile.q_coord(), tile.head, tile.tma_batch());
    }

    // Key block `block` of the tile into its stage, each of K and V once the consumers have
    // released the stage's previous K or V. `slot` is the block's position in the CTA's ring
    // sequence (tiles of a persistent CTA continue the sequence).
    CF_DEVICE void load_block(int block, int slot) const {
        const int stage = ring_stage(slot, Cfg::STAGES);
        const u32 free_phase = ring_phase(slot, Cfg::STAGES) ^ 1u;
        const int key0 = block * Cfg::BC;
        mbarrier_wait(smem.k_empty(stage), free_phase);
        mbarrier_arrive_expect_tx(smem.k_full(stage), Cfg::KV_BYTES);
#pragma unroll
        for (int c = 0; c < Cfg::D_BLOCKS; ++c)
            tma_load_4d(smem.k(stage) + c * Cfg::BC * Cfg::ROW_BYTES, &p.tma_k, smem.k_full(stage),
                        c * Cfg::COL_BLOCK, tile.k_coord(key0), kv_head, tile.tma_batch());
        mbarrier_wait(smem.v_empty(stage), free_phase);
        mbarrier_arrive_expect_tx(smem.v_full(stage), Cfg::KV_BYTES);
#pragma unroll
        for (int c = 0; c < Cfg::D_BLOCKS; ++c)
            tma_load_4d(smem.v(stage) + c * Cfg::BC * Cfg::ROW_BYTES, &p.tma_v, smem.v_full(stage),
                        c * Cfg::COL_BLOCK, tile.k_coord(key0), kv_head, tile.tma_batch());
    }

    // The whole schedule of a tile (warp-specialised producer thread). With one Q tile, a
    // persistent CTA's later tiles load their first K/V blocks before Q: Q waits for the
    // previous tile's epilogue (q_empty), the K/V stages free up during its mainloop, so those
    // loads run ahead. With two, Q goes first: its tile was freed by the epilogue before last.
    CF_DEVICE void run(int n_blocks, int ring_base, int tile_iter) const {
        const int ahead = (Cfg::PERSISTENT && Cfg::Q_BUFFERS == 1 && tile_iter > 0) ? min(n_blocks, Cfg::STAGES) : 0;
        for (int block = 0; block < ahead; ++block) load_block(block, ring_base + block);
        load_q(tile_iter);
        for (int block = ahead; block < n_blocks; ++block) load_block(block, ring_base + block);
    }
};
