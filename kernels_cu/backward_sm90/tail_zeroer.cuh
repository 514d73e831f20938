// park, non-causal varlen: the tail zeroer, warps 2-3 of the producer warpgroup (otherwise idle:
// warp 0 loads, warp 1 writes dQ). In a packed batch the K/V rows of a sequence's last key block
// past its end are the next sequence's keys, where the dense kernel's TMA zero fill leaves zeros.
// Once the tile's K and V have landed (kv_full) the zeroer zeroes those rows and arrives on
// kv_ready, which the consumers wait for: every block then runs the dense kernel's tail (the
// exponent clamped at 0, mainloop.cuh's probabilities), whose zero K rows add nothing to dQ and
// zero V rows make dP^T 0, in one instance of the loop. A sequence's last key block compared
// every key with the parked end instead, in a second instance, and with it ptxas serialised the
// wgmma chain of the consumers' build with dq_mid (C7512, NOTES.md items 342 and 347).
// It walks the same tiles as the consumers (its arrivals keep kv_ready's phase with kv_full's;
// dynamic: it takes every hand-over too), so the producer's next K/V load, which follows the
// consumers' kv_empty, never meets its stores.
#pragma once

// Whether a build runs the tail zeroer (the causal mask hides every key past the sequence's end).
template <class Cfg, bool CAUSAL, bool VARLEN>
constexpr bool zeroes_tail_keys = Cfg::PARK && VARLEN && !CAUSAL;

template <class Cfg>
struct BwdTailZeroer {
    static constexpr int THREADS = 64;  // kv_ready's arrival count
    using Seq = BwdSeq<Cfg::BR, true>;
    const HopperBackwardParams& p;
    BwdSmem<Cfg> smem;
    int tid;  // 0 .. THREADS - 1

    // Tile `index` of the CTA (kv_full's and kv_ready's phase index & 1).
    CF_DEVICE void tile(const BwdSchedule& sched, int index) const {
        mbarrier_wait(smem.kv_full(), (u32)index & 1u);
        const int valid = Seq::of(p, sched.batch).len_k - sched.n_block * Cfg::BC;  // keys of the block that exist
        // (a block with no query block runs no GEMM: nothing to zero)
        if (sched.iterations() > 0 && valid < Cfg::BC) {
            zero_rows(max(valid, 0));
            fence_proxy_async_shared();  // the consumers' wgmma read K and V through the async proxy
        }
        mbarrier_arrive(smem.kv_ready());
    }

    // persistent: the tiles the consumers walk, t = blockIdx.x, + grid, ... of the launch order,
    // or (DYNAMIC) the producer's hand-overs, which the zeroer takes too (as the writer warp does)
    template <bool DYNAMIC>
    CF_DEVICE void run_tiles() const {
        for (int t = blockIdx.x, index = 0; DYNAMIC ? t >= 0 : t < BwdTile::count_of<Cfg::BC>(p);
             t = DYNAMIC ? tile_take(smem, index, true) : t + grid_ctas(), ++index)
            tile(BwdSchedule::make<Cfg, false, true>(p, BwdTile::of_linear<Cfg::BC>(p, t)), index);
    }

    // Rows first .. B_c - 1 of K and V: each row is whole 16-byte chunks of every column block, and
    // the 128B / 64B swizzles permute chunks within a row, so the row's bytes are the key's.
    CF_DEVICE void zero_rows(int first) const {
        constexpr int CHUNKS = Cfg::ROW_BYTES / 16;  // of one row in one column block
        const int count = (Cfg::BC - first) * Cfg::D_BLOCKS * CHUNKS;
        for (int i = tid; i < count; i += THREADS) {
            const int chunk = i % CHUNKS, rest = i / CHUNKS;
            const u32 offset = (rest % Cfg::D_BLOCKS) * Cfg::BC * Cfg::ROW_BYTES +
                               (first + rest / Cfg::D_BLOCKS) * Cfg::ROW_BYTES + 16 * chunk;
            st_shared_16(smem.k() + offset, make_uint4(0u, 0u, 0u, 0u));
            st_shared_16(smem.v() + offset, make_uint4(0u, 0u, 0u, 0u));
        }
    }
};
