// dq_tma's writer warp (warp 1 of the producer warpgroup): per query block, once a consumer
// warpgroup has staged its share of dQ (dq_cols(w) / 32 128B-swizzled fp32 panels of 64 rows x 32:
// at d_head 128 and 256 half of the columns over all keys, at d_head 96 with dq_colsplit 64 or 32 of
// them; at d_head 64 with B_r 128 half of the rows over all keys; with B_r 64 otherwise every
// column over its own keys), one lane adds each panel to the fp32 workspace with a TMA tensor
// reduction (8 KiB per instruction), or with dq_frag the warpgroup's fragment-order part
// (config.cuh) with one 1-D bulk reduction (8-32 KiB),
// and frees the panels when the reductions have read them. The consumers only store to shared memory; the
// reductions to L2 run beside their next iteration.
//
// Named barriers per consumer warpgroup w (128 consumer threads + this warp's 32):
// DQ_TMA_FULL_BARRIER + w (consumers arrive after staging, the writer waits) and
// DQ_TMA_EMPTY_BARRIER + w (the writer arrives once the panels are read, the consumers wait
// before staging the next block). Each has at most one phase outstanding: the writer frees a
// warpgroup's panels once before its first block and then once after each block but the last.
// With dq_early the writer also counts each (head, query block) it has finished adding to (one
// iteration late, so the wait for the reductions' completion rarely blocks). With rotate the
// walk over query blocks starts at the CTA's own block (BwdSchedule::rot) and wraps. Persistent
// CTAs walk one tile after another and free the panels after every block; the consumers then
// take the last hand-over after their last tile.
#pragma once

template <class Cfg, bool VARLEN = false>
struct BwdDqWriter {
    using Seq = BwdSeq<Cfg::BR, VARLEN>;
    const HopperBackwardParams& p;
    BwdSmem<Cfg> smem;
    BwdSchedule sched;  // the CTA's tile (persistent: the one being walked)
    int lane;

    // One CTA per tile.
    CF_DEVICE void run() const {
        const int n = sched.iterations();
        if (n == 0) return;
        start();
        // (head, query block) of iteration it, stepped instead of divided (this warp has few
        // registers): block sched.m_begin + j, or with rotate sched.m_begin + mm, mm = (rot + j)
        // mod m_blocks
        int head = sched.q_head(0), j = 0, mm = 0;
        if constexpr (Cfg::ROTATE) mm = sched.rot;
        int prev_head = head, prev_m = 0;  // dq_early: the block issued one iteration before, not yet counted
        for (int it = 0; it < n; ++it) {
            const int cur_m = sched.m_begin + (Cfg::ROTATE ? mm : j);
            reduce_block(cur_m * Cfg::BR, head);
            const int cur_head = head;
            step(head, j, mm);
            if (it + 1 < n) free_panels();
            if constexpr (Cfg::DQ_EARLY) {
                // The previous block's reductions (all but this iteration's CONSUMERS groups)
                // have completed by now or soon: count it done for the convert kernel.
                if (it > 0 && lane == 0) {
                    bulk_wait_group_done<Cfg::CONSUMERS>();
                    count_block(sched.batch, prev_head, prev_m);
                }
                __syncwarp();
                prev_head = cur_head;
                prev_m = cur_m;
            }
        }
        finish(sched.batch, prev_head, prev_m);
    }

    // persistent: tiles t, t + grid, ... of the launch order, or with dynamic the tiles the
    // producer hands over (as the other roles walk them); the panels are freed after every
    // block, and the consumers take the hand-over after the last.
    template <bool CAUSAL>
    CF_DEVICE void run_tiles() {
        start();
        int prev_batch = -1, prev_head = 0, prev_m = 0;  // dq_early: the block added one iteration before
        // (dynamic: the next tile from the producer's hand-over, lane 0 releasing the slot)
        constexpr bool DYNAMIC = Cfg::DYNAMIC && (CAUSAL || VARLEN);  // (as the kernel's roles walk them)
        for (int t = blockIdx.x, index = 0; DYNAMIC ? t >= 0 : t < BwdTile::count_of<Cfg::BC>(p);
             t = DYNAMIC ? tile_take(smem, index, lane == 0) : t + grid_ctas(), ++index) {
            sched = BwdSchedule::make<Cfg, CAUSAL, VARLEN>(p, BwdTile::of_linear<Cfg::BC>(p, t));
            const int n = sched.iterations();
            int head = sched.q_head(0), j = 0, mm = 0;
            if constexpr (Cfg::ROTATE) mm = sched.rot;
            for (int it = 0; it < n; ++it) {
                const int cur_m = sched.m_begin + (Cfg::ROTATE ? mm : j);
                reduce_block(cur_m * Cfg::BR, head);
                const int cur_head = head;
                step(head, j, mm);
                free_panels();
                if constexpr (Cfg::DQ_EARLY) {
                    if (prev_batch >= 0 && lane == 0) {
                        bulk_wait_group_done<Cfg::CONSUMERS>();
                        count_block(prev_batch, prev_head, prev_m);
                    }
                    __syncwarp();
                    prev_batch = sched.batch;
                    prev_head = cur_head;
                    prev_m = cur_m;
                }
            }
        }
        if (prev_batch >= 0 || !Cfg::DQ_EARLY) finish(prev_batch, prev_head, prev_m);
        else finish_plain();
    }

    // Before the CTA's first block: dq_accum is zeroed, and each warpgroup's panels are free.
    CF_DEVICE void start() const {
        if constexpr (Cfg::PDL) pdl_wait_for_predecessor();  // dq_accum is zeroed (and counters reset) by the preprocess
#pragma unroll
        for (int w = 0; w < Cfg::CONSUMERS; ++w) named_barrier_arrive(Cfg::DQ_TMA_EMPTY_BARRIER + w, Cfg::DQ_TMA_THREADS);
    }
    // The query block at row0 of `head`: each warpgroup's staged panels added to the workspace.
    CF_DEVICE void reduce_block(int row0, int head) const {
#pragma unroll
        for (int w = 0; w < Cfg::CONSUMERS; ++w) {
            named_barrier_sync(Cfg::DQ_TMA_FULL_BARRIER + w, Cfg::DQ_TMA_THREADS);
            if (Cfg::DQ_FRAG && lane == 0) {
                // the warpgroup's 64 x dq_cols(w) part (config.cuh): rows row0 + dq_row0, n-tiles from dq_col0 / 8
                const int part_row0 = row0 + (Cfg::DQ_ROWS ? w * Cfg::DQ_M : 0);
                float* dst = p.dq_accum + (Seq::of(p, sched.batch).ws_row(p, head) + part_row0) * Cfg::D +
                             Cfg::DQ_PART_ROWS * Cfg::dq_col0(w);
                bulk_reduce_add_f32(dst, smem.dq_panel(w, 0), Cfg::DQ_PART_ROWS * Cfg::dq_cols(w) * 4);
                bulk_commit_group();
            } else if (lane == 0) {
                const Seq seq = Seq::of(p, sched.batch);
#pragma unroll
                for (int c = 0; c < Cfg::dq_panels(w); ++c)
                    tma_reduce_add_4d(&p.tma_dq, smem.dq_panel(w, c), Cfg::dq_col0(w) + c * Cfg::DQ_PANEL_COLS,
                                      seq.ws_row0 + row0 + (Cfg::DQ_ROWS ? w * Cfg::DQ_M : 0), head, seq.coord);
                bulk_commit_group();
            }
        }
    }
    // The next (head, block) of the walk.
    CF_DEVICE void step(int& head, int& j, int& mm) const {
        if (++j == sched.m_blocks) {
            j = 0;
            ++head;
            if constexpr (Cfg::ROTATE) mm = sched.rot;
        } else if constexpr (Cfg::ROTATE) {
            if (++mm == sched.m_blocks) mm = 0;
        }
    }
    // Each warpgroup's panels, once the reductions have read them (warpgroup 0's group is the
    // older one: freed first).
    CF_DEVICE void free_panels() const {
        if (lane == 0) bulk_wait_group_read<1>();
        __syncwarp();
        named_barrier_arrive(Cfg::DQ_TMA_EMPTY_BARRIER, Cfg::DQ_TMA_THREADS);
        if (lane == 0) bulk_wait_group_read<0>();
        __syncwarp();
        named_barrier_arrive(Cfg::DQ_TMA_EMPTY_BARRIER + 1, Cfg::DQ_TMA_THREADS);
    }
    // The reductions are complete before the CTA exits (its shared memory is still read); with
    // dq_early the last block is counted.
    CF_DEVICE void finish(int batch, int head, int m) const {
        if (lane == 0) {
            bulk_wait_group_0<false>();
            if constexpr (Cfg::DQ_EARLY) count_block(batch, head, m);
        }
        __syncwarp();
    }
    CF_DEVICE void finish_plain() const {
        if (lane == 0) bulk_wait_group_0<false>();
        __syncwarp();
    }

    // dq_early: this CTA's additions to query block m of `head` are complete and visible (the
    // async proxy's writes ordered before the release by the proxy fence).
    // (VARLEN: `batch` is the sequence; its blocks' counters follow its workspace rows)
    CF_DEVICE void count_block(int batch, int head, int m) const {
        fence_proxy_async_global();
        const int batches = ws_batches<VARLEN>(Cfg::PERSISTENT ? p.batch : (int)gridDim.z);
        const Seq seq = Seq::of(p, batch);
        red_release_gpu_add(dq_block_counter<Cfg::D, Cfg::BR>(p.dq_accum, batches, p.n_heads, p.seq_len_q_pad,
                                                              seq.coord, head, seq.ws_row0 / Cfg::BR + m),
                            1u);
    }
};
