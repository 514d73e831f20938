// TMA producer: Q once per tile, then K and V of each key block into a ring of STAGES slots.
// One thread issues everything; `k_full`/`v_full` of a stage complete when its bytes have landed,
// `k_empty`/`v_empty` when every consumer warp has finished reading its K (after Q K^T) or V
// (after P V). K and V are released separately: K is free a whole P V earlier, so the next K
// load starts that much sooner (with intra-warpgroup overlap, P V_j runs an iteration late).
// With kv_multicast (clusters of two) each CTA's producer loads every other 64-column block of a
// K or V tile into both CTAs' stage, so a stage is full when both halves have landed, and free
// when the consumers of both CTAs have released it (config.cuh).
#pragma once

template <class Cfg, bool CAUSAL>
struct Producer {
    const HopperForwardParams& p;
    SmemLayout<Cfg> smem;
    TileScheduler<Cfg, CAUSAL> tile;
    int kv_head;
    static constexpr bool MULTICAST = kv_multicast<Cfg, CAUSAL>();

    CF_DEVICE Producer(const HopperForwardParams& params, SmemLayout<Cfg> layout, TileScheduler<Cfg, CAUSAL> t)
        : p(params), smem(layout), tile(t), kv_head(t.head / params.kv_group_size) {}

    // One K or V tile (key rows key0..) into `dst`, completing on `full`: every 64-column block
    // from this CTA, or (MULTICAST) the blocks of this CTA's parity, into both CTAs of the pair.
    CF_DEVICE void load_kv(u32 dst, const void* desc, u32 full, int key0) const {
        const int rank = MULTICAST ? (int)cluster_rank() : 0;
#pragma unroll
        for (int c = 0; c < Cfg::D_BLOCKS; ++c) {
            const u32 block = dst + c * Cfg::BC * Cfg::ROW_BYTES;
            if constexpr (MULTICAST) {
                if (c % Cfg::CLUSTER_SIZE == rank)  // every CTA of the cluster: mask (1 << size) - 1
                    tma_load_4d_multicast(block, desc, full, c * Cfg::COL_BLOCK, tile.k_coord(key0), kv_head,
                                          tile.tma_batch(), (1u << Cfg::CLUSTER_SIZE) - 1);
            } else {
                tma_load_4d(block, desc, full, c * Cfg::COL_BLOCK, tile.k_coord(key0), kv_head, tile.tma_batch());
            }
        }
    }

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
    // (MULTICAST: the whole tile's bytes, half of them from the peer's copies; those may land
    // before this arrival, which the barrier's transaction count allows within a phase.)
    CF_DEVICE void load_k(int block, int slot) const {
        const int stage = ring_stage(slot, Cfg::STAGES);
        mbarrier_wait(smem.k_empty(stage), ring_phase(slot, Cfg::STAGES) ^ 1u);
        mbarrier_arrive_expect_tx(smem.k_full(stage), Cfg::KV_BYTES);
        load_kv(smem.k(stage), &p.tma_k, smem.k_full(stage), block * Cfg::BC);
    }
    CF_DEVICE void load_v(int block, int slot) const {
        const int stage = ring_stage(slot, Cfg::STAGES);
        mbarrier_wait(smem.v_empty(stage), ring_phase(slot, Cfg::STAGES) ^ 1u);
        mbarrier_arrive_expect_tx(smem.v_full(stage), Cfg::KV_BYTES);
        load_kv(smem.v(stage), &p.tma_v, smem.v_full(stage), block * Cfg::BC);
    }
    CF_DEVICE void load_block(int block, int slot) const {
        load_k(block, slot);
        load_v(block, slot);
    }

    // MULTICAST, after the last load: waits until the consumers of both CTAs have released every
    // stage's last block (ring slots up to `slots`), so that no arrival of the peer's consumers
    // on this CTA's barriers is still in flight when it exits.
    CF_DEVICE void drain(int slots) const {
        for (int slot = slots; slot < slots + Cfg::STAGES; ++slot) {
            const u32 free_phase = ring_phase(slot, Cfg::STAGES) ^ 1u;
            mbarrier_wait(smem.k_empty(ring_stage(slot, Cfg::STAGES)), free_phase);
            mbarrier_wait(smem.v_empty(ring_stage(slot, Cfg::STAGES)), free_phase);
        }
    }

    // The whole schedule of a tile (warp-specialised producer thread), each load issued in the
    // order its buffer frees up (the thread waits for each in turn). With one Q tile, a
    // persistent CTA's later tiles load their first K/V blocks before Q: Q waits for the
    // previous tile's epilogue (q_empty), the K/V stages free up during its mainloop, so those
    // loads run ahead. With EARLY_Q_RELEASE, Q is free once the previous tile's last Q K^T has
    // completed: after the stage of K_0 (freed by the second-to-last Q K^T) and with that of V_0
    // (freed by the second-to-last P V, issued in the same turn), so Q goes between the two
    // rather than behind the last block's V, which frees only when the previous tile ends. With
    // two Q tiles, Q goes first: its tile was freed by the epilogue before last.
    CF_DEVICE void run(int n_blocks, int ring_base, int tile_iter) const {
        const bool follows = Cfg::PERSISTENT && Cfg::Q_BUFFERS == 1 && tile_iter > 0;
        if (follows && Cfg::EARLY_Q_RELEASE && n_blocks > 0) {
            load_k(0, ring_base);
            load_q(tile_iter);
            load_v(0, ring_base);
            for (int block = 1; block < n_blocks; ++block) load_block(block, ring_base + block);
            return;
        }
        const int ahead = follows ? min(n_blocks, Cfg::STAGES) : 0;
        for (int block = 0; block < ahead; ++block) load_block(block, ring_base + block);
        load_q(tile_iter);
        for (int block = ahead; block < n_blocks; ++block) load_block(block, ring_base + block);
    }
};
