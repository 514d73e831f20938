// Hopper (sm_90a) FlashAttention backward, dK/dV kernel: one CTA per (key block, kv head,
// batch); warpgroup 0 is the TMA producer (one thread, registers given away with setmaxnreg),
// warpgroups 1.. are consumers of 64 keys each (mainloop.cuh); with dq_tma, warp 1 of the
// producer warpgroup adds dQ to the workspace (dq_writer.cuh); varlen, warps 2-3 zero K/V and Q/dO
// rows past a sequence's end (tail_zeroer.cuh). The preprocess (dvec, lse2,
// dq_accum zeroed), the dQ conversion and the deterministic dQ pass are backward_sm80's kernels,
// instantiated in the same module. With persistent, one CTA per SM walks tiles (kernel below).
#pragma once

// One tile of a persistent CTA's consumer warpgroup `wg` (the CTA's `index`-th, its query blocks
// from ring position `ring` on): dK and dV, the K/V release, the epilogue. Returns its query
// blocks (its share of the Q/dO ring).
template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN>
CF_DEVICE int consume_tile(const HopperBackwardParams& params, BwdSmem<Cfg> smem, int t, int wg, int ring, int index) {
    const BwdSchedule sched = BwdSchedule::make<Cfg, CAUSAL, VARLEN>(params, BwdTile::of_linear<Cfg::BC>(params, t));
    BwdConsumer<Cfg, CAUSAL, DETERMINISTIC, VARLEN> consumer(params, smem, sched, wg, threadIdx.x % 128, ring, index);
    consumer.run();
    consumer.release_kv();
    BwdEpilogue<Cfg, CAUSAL, DETERMINISTIC, VARLEN>::store(consumer);
    return sched.iterations();
}

// VARLEN (backward_varlen): the tiles cover the longest sequence's key blocks for every sequence;
// a key block past its sequence's keys loads K/V it never reads, runs no query block and stores
// nothing (BwdSchedule::make), so every role walks the same tiles and ring positions.
template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN = false>
__global__ void __launch_bounds__(Cfg::N_THREADS, 1)
    backward_sm90_dkdv_kernel(const __grid_constant__ HopperBackwardParams params) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const BwdSmem<Cfg> smem{(shared_address(smem_raw) + 1023u) & ~1023u};
    const int warpgroup = threadIdx.x / 128;
    constexpr bool WRITER = Cfg::DQ_TMA && !DETERMINISTIC;
    constexpr bool ZEROER = VARLEN;  // warps 2-3 (tail_zeroer.cuh)
    using Zeroer = BwdTailZeroer<Cfg, CAUSAL>;

    if (threadIdx.x == 0) {
        tma_prefetch_descriptor(&params.tma_q);
        tma_prefetch_descriptor(&params.tma_k);
        tma_prefetch_descriptor(&params.tma_v);
        tma_prefetch_descriptor(&params.tma_do);
        if constexpr (WRITER) tma_prefetch_descriptor(&params.tma_dq);
        mbarrier_init(smem.kv_full(), 1);
        if constexpr (Cfg::PERSISTENT) mbarrier_init(smem.kv_empty(), 128 * Cfg::CONSUMERS);
        if constexpr (ZEROER) {
            mbarrier_init(smem.kv_ready(), Zeroer::THREADS);
            mbarrier_init(smem.zero_done(), Zeroer::THREADS);
            for (int s = 0; s < Cfg::STAGES; ++s) mbarrier_init(smem.q_tail(s), Cfg::QDO_SPLIT ? 2 : 1);  // the producer's arrivals
        }
        if constexpr (Cfg::DYNAMIC) {
            for (int s = 0; s < 2; ++s) {
                mbarrier_init(smem.tile_full(s), 1);
                mbarrier_init(smem.tile_empty(s),
                              128 * Cfg::CONSUMERS + (WRITER ? 1 : 0) + (ZEROER ? Zeroer::THREADS : 0));
            }
        }
        for (int s = 0; s < Cfg::STAGES; ++s) {
            mbarrier_init(smem.q_full(s), 1);
            mbarrier_init(smem.q_empty(s), 128 * Cfg::CONSUMERS);  // one arrival per consumer thread
            if constexpr (Cfg::QDO_SPLIT) {
                mbarrier_init(smem.do_full(s), 1);
                mbarrier_init(smem.do_empty(s), 128 * Cfg::CONSUMERS);
            }
        }
        fence_barrier_init();
    }
    __syncthreads();

    // (VARLEN: non-causal tiles differ too, a sequence's by its length, and many are empty: claimed
    // as well)
    if constexpr (Cfg::DYNAMIC && (CAUSAL || VARLEN) && !DETERMINISTIC) {
        // Tile blockIdx.x first, then the tiles the producer claims from the counter (after it
        // has issued the current tile's loads; tile 0's run waited for the preprocess, which
        // zeroed the counter) and hands to the other roles (-1: none left). Non-causal tiles are
        // all alike, so those calls keep the static walk below (whose consumers ptxas also
        // keeps from serialising the wgmma chain, C7512, which it did with the hand-over there).
        if (warpgroup == 0) {
            setmaxnreg_dec<Cfg::PRODUCER_REGS>();
            if (threadIdx.x == 0) {
                int ring = 0, t = blockIdx.x;
                for (int index = 0; t >= 0; ++index) {
                    const BwdSchedule sched = BwdSchedule::make<Cfg, CAUSAL, VARLEN>(params, BwdTile::of_linear<Cfg::BC>(params, t));
                    BwdProducer<Cfg, CAUSAL, VARLEN>{params, smem, sched}.run_tile(index, ring);
                    ring += sched.iterations();
                    t = grid_ctas() + (int)atomicAdd(bwd_tile_counter<Cfg>(params.dq_accum, ws_batches<VARLEN>(params.batch),
                                                                                      params.n_heads, params.seq_len_q_pad),
                                                     1u);
                    if (t >= BwdTile::count_of<Cfg::BC>(params)) t = -1;
                    tile_publish(smem, index, t);
                }
            }
            if constexpr (ZEROER) {
                if (threadIdx.x >= 64) {
                    Zeroer{params, smem, (int)threadIdx.x - 64}.template run_tiles<true>();
                    return;
                }
            }
            if constexpr (WRITER) {
                if (threadIdx.x / 32 == 1) BwdDqWriter<Cfg, VARLEN>{params, smem, {}, (int)(threadIdx.x % 32)}.template run_tiles<CAUSAL>();
            }
            return;
        }
        setmaxnreg_inc<Cfg::CONSUMER_REGS>();
        int ring = 0, t = blockIdx.x;
        for (int index = 0; t >= 0; ++index) {
            ring += consume_tile<Cfg, CAUSAL, DETERMINISTIC, VARLEN>(params, smem, t, warpgroup - 1, ring, index);
            t = tile_take(smem, index, true);
        }
        if constexpr (WRITER) named_barrier_sync(Cfg::DQ_TMA_EMPTY_BARRIER + warpgroup - 1, Cfg::DQ_TMA_THREADS);
        return;
    }
    if constexpr (Cfg::PERSISTENT) {
        // Tiles t = blockIdx.x, + gridDim.x, ... of the launch order; every role walks the same
        // ones, the Q/dO ring (position `ring`) and the barriers' phases running on across them.
        if (warpgroup == 0) {
            setmaxnreg_dec<Cfg::PRODUCER_REGS>();
            if (threadIdx.x == 0) {
                // (the grid size and the tile count are read where used, not kept in registers:
                // at the producer's 40 registers ptxas spilled them)
                int ring = 0;
                for (int t = blockIdx.x; t < BwdTile::count_of<Cfg::BC>(params); t += grid_ctas()) {
                    const BwdSchedule sched = BwdSchedule::make<Cfg, CAUSAL, VARLEN>(params, BwdTile::of_linear<Cfg::BC>(params, t));
                    BwdProducer<Cfg, CAUSAL, VARLEN>{params, smem, sched}.run_tile((t - (int)blockIdx.x) / grid_ctas(), ring);
                    ring += sched.iterations();
                }
            }
            if constexpr (ZEROER) {
                if (threadIdx.x >= 64) {
                    Zeroer{params, smem, (int)threadIdx.x - 64}.template run_tiles<false>();
                    return;
                }
            }
            if constexpr (WRITER) {
                if (threadIdx.x / 32 == 1) BwdDqWriter<Cfg, VARLEN>{params, smem, {}, (int)(threadIdx.x % 32)}.template run_tiles<CAUSAL>();
            }
            return;
        }
        setmaxnreg_inc<Cfg::CONSUMER_REGS>();
        int ring = 0, index = 0;
        for (int t = blockIdx.x; t < BwdTile::count_of<Cfg::BC>(params); t += gridDim.x, ++index)
            ring += consume_tile<Cfg, CAUSAL, DETERMINISTIC, VARLEN>(params, smem, t, warpgroup - 1, ring, index);
        // The writer's hand-over after the CTA's last query block.
        if constexpr (WRITER) named_barrier_sync(Cfg::DQ_TMA_EMPTY_BARRIER + warpgroup - 1, Cfg::DQ_TMA_THREADS);
        return;
    }

    const BwdSchedule sched = BwdSchedule::make<Cfg, CAUSAL, VARLEN>(params, BwdTile::of_block());
    if (warpgroup == 0) {
        setmaxnreg_dec<Cfg::PRODUCER_REGS>();
        if (threadIdx.x == 0) BwdProducer<Cfg, CAUSAL, VARLEN>{params, smem, sched}.run();
        if constexpr (ZEROER) {
            if (threadIdx.x >= 64) {
                // (its own schedule: the shared one, kept from before the roles split, was spilled
                // at d_head 256)
                u32 q_phases = 0;
                Zeroer{params, smem, (int)threadIdx.x - 64}.tile(
                    BwdSchedule::make<Cfg, CAUSAL, VARLEN>(params, BwdTile::of_block()), 0, 0, q_phases);
                return;
            }
        }
        if constexpr (WRITER) {
            if (threadIdx.x / 32 == 1) BwdDqWriter<Cfg, VARLEN>{params, smem, sched, (int)(threadIdx.x % 32)}.run();
        }
        return;
    }
    setmaxnreg_inc<Cfg::CONSUMER_REGS>();
    BwdConsumer<Cfg, CAUSAL, DETERMINISTIC, VARLEN> consumer(params, smem, sched, warpgroup - 1, threadIdx.x % 128);
    consumer.run();
    consumer.drain();
    BwdEpilogue<Cfg, CAUSAL, DETERMINISTIC, VARLEN>::store(consumer);
}
