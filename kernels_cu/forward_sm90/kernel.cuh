// Hopper (sm_90a) FlashAttention forward kernel: TMA loads into a ring of K/V stages guarded by
// mbarriers, wgmma GEMMs, online softmax in registers. With WARP_SPECIALIZED the first warpgroup
// is a producer (one thread issues every TMA copy, the warpgroup gives its registers to the
// consumers with setmaxnreg); without it, thread 0 of the first consumer warpgroup issues the
// loads between its own GEMMs; with CP_ASYNC every thread loads with cp.async instead of TMA
// (cp_async_loads.cuh). PERSISTENT CTAs loop over tiles (tile_scheduler.cuh): the
// producer runs ahead into the next tile's K/V while the consumers finish the epilogue.
// CLUSTER configs launch in clusters of two CTAs (__cluster_dims__ on the second of the two
// kernel templates below, which share this body); kv_multicast (config.cuh) says when the pair
// shares its K/V loads.
#pragma once

template <class BaseCfg, bool CAUSAL, bool VARLEN>
CF_DEVICE void flash_forward_sm90(const HopperForwardParams& params) {
    using Cfg = WithVarlen<BaseCfg, VARLEN>;
    using Scheduler = TileScheduler<Cfg, CAUSAL>;
    constexpr bool MULTICAST = kv_multicast<Cfg, CAUSAL>();
    if constexpr (VARLEN)  // before any CTA leaves: every one takes its share of the rows
        zero_forward_tail<Cfg::D>(params.o, params.o_seq_stride, params.o_head_stride, params.lse,
                                  params.lse_head_stride, params.n_heads, params.cu_seqlens_q, params.batch,
                                  params.tail_total_q);
    if constexpr ((VARLEN || Cfg::CLUSTER) && !Cfg::PERSISTENT) {
        // past its sequence's end (or the cluster grid's pad): uniform, before any barrier
        if (!Scheduler::first(params).valid) return;
    }
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const SmemLayout<Cfg> smem{(shared_address(smem_raw) + 1023u) & ~1023u};
    const int warpgroup = threadIdx.x / 128;

    if constexpr (Cfg::CP_ASYNC) {
        // No TMA and no mbarriers: every thread copies with cp.async (cp_async_loads.cuh).
        const auto tile = Scheduler::first(params);
        Consumer<Cfg, CAUSAL> consumer(params, smem, tile, warpgroup, threadIdx.x % 128);
        run_cp_async(consumer, CpAsyncLoader<Cfg, CAUSAL>{params, smem, tile, (int)threadIdx.x}, tile.kv_blocks(params));
        Epilogue<Cfg, CAUSAL>::store(consumer);
        return;
    }
    if (threadIdx.x == 0) {
        tma_prefetch_descriptor(&params.tma_q);
        tma_prefetch_descriptor(&params.tma_k);
        tma_prefetch_descriptor(&params.tma_v);
        for (int b = 0; b < Cfg::Q_BUFFERS; ++b) {
            mbarrier_init(smem.q_full(b), 1);
            mbarrier_init(smem.q_empty(b), 4 * Cfg::CONSUMERS);  // one arrival per consumer warp
        }
        // MULTICAST: the consumer warps of both CTAs release each stage
        constexpr u32 releases = 4 * Cfg::CONSUMERS * (MULTICAST ? Cfg::CLUSTER_SIZE : 1);
        for (int s = 0; s < Cfg::STAGES; ++s) {
            mbarrier_init(smem.k_full(s), 1);
            mbarrier_init(smem.v_full(s), 1);
            mbarrier_init(smem.k_empty(s), releases);
            mbarrier_init(smem.v_empty(s), releases);
        }
        if constexpr (VARLEN) mbarrier_init(smem.tail_cleared(), 128 * Cfg::CONSUMERS);
        fence_barrier_init();
    }
    __syncthreads();
    if constexpr (MULTICAST) cluster_sync();  // the peer's barriers exist before the first copy or release

    if constexpr (Cfg::WARP_SPECIALIZED) {
        if (warpgroup == 0) {
            setmaxnreg_dec<Cfg::PRODUCER_REGS>();
            if (threadIdx.x == 0) {
                int ring = 0, iter = 0;
                for (auto tile = Scheduler::first(params); tile.valid; tile = tile.next(params), ++iter) {
                    const int n_blocks = tile.kv_blocks(params);
                    Producer<Cfg, CAUSAL>(params, smem, tile).run(n_blocks, ring, iter);
                    ring += n_blocks;
                }
                if constexpr (MULTICAST) Producer<Cfg, CAUSAL>(params, smem, Scheduler::first(params)).drain(ring);
            }
            return;
        }
        setmaxnreg_inc<Cfg::CONSUMER_REGS>();
        using TileConsumer = Consumer<Cfg, CAUSAL>;
        TileConsumer::open_turns(warpgroup - 1);  // TURN_RING: the ping-pong turns run on across tiles
        int ring = 0, iter = 0;
        if constexpr (Cfg::CROSS_TILE) {
            // Each tile's last P V runs behind the next tile's first Q K^T (run_crossed): that
            // block's scores and statistics are carried from one tile to the next.
            typename TileConsumer::Scores s;
            typename TileConsumer::Softmax carried;
            bool have_first = false;
            for (auto tile = Scheduler::first(params); tile.valid; ++iter) {
                const int n_blocks = tile.kv_blocks(params);
                const auto next = tile.next(params);
                TileConsumer consumer(params, smem, tile, warpgroup - 1, threadIdx.x % 128, ring, iter);
                if (have_first) consumer.softmax = carried;
                have_first = consumer.run_crossed(n_blocks, s, have_first, next, next.valid ? next.kv_blocks(params) : 0,
                                                  carried);
                Epilogue<Cfg, CAUSAL>::store(consumer);
                ring += n_blocks;
                tile = next;
            }
        } else {
            for (auto tile = Scheduler::first(params); tile.valid; tile = tile.next(params), ++iter) {
                const int n_blocks = tile.kv_blocks(params);
                TileConsumer consumer(params, smem, tile, warpgroup - 1, threadIdx.x % 128, ring, iter);
                consumer.run(n_blocks, [](int) {});
                Epilogue<Cfg, CAUSAL>::store(consumer);
                ring += n_blocks;
            }
        }
        TileConsumer::close_turns(warpgroup - 1);
    } else {
        const auto tile = Scheduler::first(params);
        const int n_blocks = tile.kv_blocks(params);
        const Producer<Cfg, CAUSAL> producer(params, smem, tile);
        const bool is_loader = threadIdx.x == 0;
        if (is_loader) {
            producer.load_q(0);
            for (int b = 0; b < min(n_blocks, Cfg::STAGES); ++b) producer.load_block(b, b);
        }
        __syncwarp();
        Consumer<Cfg, CAUSAL> consumer(params, smem, tile, warpgroup, threadIdx.x % 128);
        // After block j's V is released, the loader refills its stage with block j + STAGES (it
        // waits there until the other warps have released it too).
        consumer.run(n_blocks, [&](int j) {
            if (is_loader && j + Cfg::STAGES < n_blocks) producer.load_block(j + Cfg::STAGES, j + Cfg::STAGES);
            __syncwarp();
        });
        Epilogue<Cfg, CAUSAL>::store(consumer);
    }
}

// The kernel NVRTC's name expressions name: one template per launch shape (SFINAE on CLUSTER),
// so that configs without clusters keep a plain launch.
template <bool B>
struct EnableIf {};
template <>
struct EnableIf<true> {
    using type = void;
};

template <class BaseCfg, bool CAUSAL, bool VARLEN>
__global__ typename EnableIf<!BaseCfg::CLUSTER>::type __launch_bounds__(BaseCfg::N_THREADS, 1)
    flash_forward_sm90_kernel(const __grid_constant__ HopperForwardParams params) {
    flash_forward_sm90<BaseCfg, CAUSAL, VARLEN>(params);
}

template <class BaseCfg, bool CAUSAL, bool VARLEN>
__global__ typename EnableIf<BaseCfg::CLUSTER>::type __cluster_dims__(BaseCfg::CLUSTER_SIZE, 1, 1)
    __launch_bounds__(BaseCfg::N_THREADS, 1) flash_forward_sm90_kernel(const __grid_constant__ HopperForwardParams params) {
    flash_forward_sm90<BaseCfg, CAUSAL, VARLEN>(params);
}
