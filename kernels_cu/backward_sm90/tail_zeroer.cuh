// Varlen: the tail zeroer, warps 2-3 of the producer warpgroup (otherwise idle: warp 0 loads, warp
// 1 writes dQ). It walks the same tiles and Q/dO ring positions as the consumers (dynamic: it
// takes every hand-over too, as the writer warp does) and zeroes rows of the shared tiles before
// the consumers' GEMMs read them:
// - K/V. A sequence's last key block's rows past its end, when the packed arrays hold some
//   (varlen_tail.cuh: the next sequences' tokens, rows past the last sequence; past the arrays
//   TMA zero-fills). The consumers then run the dense kernel's tail on them (non-causal: the
//   exponent clamped at 0, mainloop.cuh's probabilities; causal: the diagonal), whose zero K
//   rows add nothing to dQ and zero V rows make dP^T 0. With park, non-causal, every block
//   clamps, in one instance of the loop (a second instance made ptxas serialise the wgmma chain
//   of the consumers' build with dq_mid, C7512, NOTES.md items 342 and 347).
//   Once the tile's K and V have landed (kv_full) the zeroer zeroes, fences and arrives on
//   kv_ready, which the consumers wait for, every tile.
// - Q/dO. A query block reading rows past its sequence's end lands on its stage's q_tail instead of
//   q_full (and do_full) (producer.cuh); the zeroer waits for it, zeroes the rows past the
//   sequence's end, meets its other threads on zero_done and completes q_full (and do_full),
//   which the consumers wait for as for any stage. The stage's next load follows the consumers'
//   q_empty, which follows that q_full: each q_tail is one use behind at most.
// So the producer's next K/V or Q/dO load, which follows the consumers' release, never meets its
// stores.
#pragma once

template <class Cfg, bool CAUSAL>
struct BwdTailZeroer {
    static constexpr int THREADS = 64;  // kv_ready's and zero_done's arrival count
    using Seq = BwdSeq<Cfg::BR, true>;
    const HopperBackwardParams& p;
    BwdSmem<Cfg> smem;
    int tid;  // 0 .. THREADS - 1

    // Tile `index` of the CTA (kv_full's and kv_ready's phase index & 1), its query blocks from
    // ring position `ring` on; `q_phases` bit s: the phase of stage s's next q_tail use.
    CF_DEVICE void tile(const BwdSchedule& sched, int index, int ring, u32& q_phases) const {
        const Seq s = Seq::of(p, sched.batch);
        const int n = sched.iterations();
        mbarrier_wait(smem.kv_full(), (u32)index & 1u);
        const int key0 = sched.n_block * Cfg::BC;
        // (a block with no query block runs no GEMM: nothing to zero)
        const int keys = n == 0 ? Cfg::BC : s.template tail_key_rows<Cfg::BC>(p, key0);
        if (keys >= 0 && keys < Cfg::BC) {
            Cfg::template zero_rows<Cfg::BC>(smem.k(), keys, tid, THREADS);
            Cfg::template zero_rows<Cfg::BC>(smem.v(), keys, tid, THREADS);
            fence_proxy_async_shared();  // the consumers' wgmma read K and V through the async proxy
        }
        mbarrier_arrive(smem.kv_ready());
#pragma unroll 1
        for (int it = 0; it < n; ++it) {
            const int rows = s.tail_query_rows(p, sched.template m_block<Cfg::ROTATE>(it) * Cfg::BR);
            if (rows >= 0) finish_stage(bwd_stage(ring + it, Cfg::STAGES), rows, q_phases);
        }
    }

    // Stage `stage`'s Q/dO block, landed on q_tail: rows `rows` .. B_r - 1 zeroed, then q_full (and
    // with qdo_split do_full) completed by one thread once every zeroer thread is done.
    CF_DEVICE void finish_stage(int stage, int rows, u32& q_phases) const {
        mbarrier_wait(smem.q_tail(stage), (q_phases >> stage) & 1u);
        q_phases ^= 1u << stage;
        Cfg::template zero_rows<Cfg::BR>(smem.q(stage), rows, tid, THREADS);
        Cfg::template zero_rows<Cfg::BR>(smem.dout(stage), rows, tid, THREADS);
        fence_proxy_async_shared();
        mbarrier_meet(smem.zero_done());
        if (tid == 0) {
            mbarrier_arrive(smem.q_full(stage));
            if constexpr (Cfg::QDO_SPLIT) mbarrier_arrive(smem.do_full(stage));
        }
    }

    // persistent: the tiles the consumers walk, t = blockIdx.x, + grid, ... of the launch order,
    // or (DYNAMIC) the producer's hand-overs, which the zeroer takes too (as the writer warp does)
    template <bool DYNAMIC>
    CF_DEVICE void run_tiles() const {
        u32 q_phases = 0;
        int ring = 0;
        for (int t = blockIdx.x, index = 0; DYNAMIC ? t >= 0 : t < BwdTile::count_of<Cfg::BC>(p);
             t = DYNAMIC ? tile_take(smem, index, true) : t + grid_ctas(), ++index) {
            const BwdSchedule sched = BwdSchedule::make<Cfg, CAUSAL, true>(p, BwdTile::of_linear<Cfg::BC>(p, t));
            tile(sched, index, ring, q_phases);
            ring += sched.iterations();
        }
    }
};
