// Epilogue of one consumer warpgroup: O / row sum, converted to 16-bit, staged through the
// warpgroup's own 64 rows of the Q tile (swizzled, so the 4-byte writes of the accumulator
// layout are bank-conflict free), then written to global memory in 16-byte chunks; plus the
// log-sum-exp of each row when requested. O_DIRECT configs store O from the accumulator
// registers instead (16-byte stores after a quad transpose), leaving the Q tile alone.
#pragma once

template <class Cfg, bool CAUSAL>
struct Epilogue {
    // Shared address of the 16-bit element (r, col) of the warpgroup's rows in the Q tile.
    CF_DEVICE static u32 q_tile_address(u32 q_base, int wg, int r, int col) {
        return q_tile_element<Cfg>(q_base, wg * Cfg::WG_ROWS + r, col);
    }

    CF_DEVICE static void store_lse(const Consumer<Cfg, CAUSAL>& c, const float (&total)[1][2]) {
        const HopperForwardParams& p = c.p;
        if (p.lse != nullptr && (c.lane & 3) == 0) {
            const long long row_base = c.tile.lse_offset(p);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = c.row() + 8 * h;
                if (row < c.tile.seq_len_q(p))
                    p.lse[row_base + row] = c.softmax.stats.log_sum_exp(0, h, total[0][h], p.softmax_scale);
            }
        }
    }

    // O_DIRECT: each thread's two rows, quad-transposed (quad_transpose) so that every lane writes
    // 8 consecutive columns with one 16-byte store: a warp instruction covers 64 contiguous bytes
    // of each of 8 rows.
    CF_DEVICE static void store_direct(const Consumer<Cfg, CAUSAL>& c, float inv0, float inv1) {
        const HopperForwardParams& p = c.p;
        u16* o_dst = static_cast<u16*>(p.o) + c.tile.o_offset(p);
        const int rows_valid = c.tile.seq_len_q(p);
        const int row = c.row();
        const bool ok0 = row < rows_valid, ok1 = row + 8 < rows_valid;  // (every lane shuffles)
#pragma unroll
        for (int g = 0; g < Cfg::D / 32; ++g) {
            const uint4 v0 = quad_row_chunk<Cfg::dtype>(c.o, g, 0, inv0, c.lane);
            const uint4 v1 = quad_row_chunk<Cfg::dtype>(c.o, g, 2, inv1, c.lane);
            const int col = 32 * g + 8 * (c.lane & 3);
            if (ok0) st_global_16(o_dst + (long long)row * p.o_seq_stride + col, v0);
            if (ok1) st_global_16(o_dst + (long long)(row + 8) * p.o_seq_stride + col, v1);
        }
    }

    CF_DEVICE static void store(Consumer<Cfg, CAUSAL>& c) {
        const HopperForwardParams& p = c.p;
        float total[1][2];
        c.softmax.stats.finish(total);
        const float inv0 = total[0][0] > 0.f ? 1.f / total[0][0] : 0.f;
        const float inv1 = total[0][1] > 0.f ? 1.f / total[0][1] : 0.f;
        const int r0 = 16 * c.warp + (c.lane >> 2);  // row inside the warpgroup's 64
        if constexpr (Cfg::O_DIRECT) {
            store_lse(c, total);
            store_direct(c, inv0, inv1);
            return;  // the Q tile was released after the last Q K^T (persistent) or is not reused
        }
        const u32 q_base = c.q_tile();
        // Every wgmma of this warpgroup that read its Q rows has completed (waited in the
        // mainloop), and the Q load itself has landed (q_full waited), so the rows are free.
#pragma unroll
        for (int n = 0; n < Cfg::D / 8; ++n) {
            const int col = 8 * n + 2 * (c.lane & 3);
            st_shared_4(q_tile_address(q_base, c.wg, r0, col), pack_pair<Cfg::dtype>(c.o[n][0] * inv0, c.o[n][1] * inv0));
            st_shared_4(q_tile_address(q_base, c.wg, r0 + 8, col),
                        pack_pair<Cfg::dtype>(c.o[n][2] * inv1, c.o[n][3] * inv1));
        }
        store_lse(c, total);
        named_barrier_sync(Consumer<Cfg, CAUSAL>::EPILOGUE_BARRIER + c.wg, 128);
        constexpr int CHUNKS = Cfg::D / 8;  // 16-byte chunks per row
        u16* o_dst = static_cast<u16*>(p.o) + c.tile.o_offset(p);
        const int rows_valid = c.tile.seq_len_q(p);
        const int row0 = c.wg_row0();
#pragma unroll
        for (int i = c.tid; i < Cfg::WG_ROWS * CHUNKS; i += 128) {
            const int r = i / CHUNKS, ch = i % CHUNKS;
            const int row = row0 + r;
            if (row < rows_valid)
                st_global_16(o_dst + (long long)row * p.o_seq_stride + 8 * ch,
                             ld_shared_16(q_tile_address(q_base, c.wg, r, 8 * ch)));
        }
        if constexpr (Cfg::PERSISTENT) {
            // The next tile's Q (a TMA write, async proxy) may overwrite these rows once every
            // consumer warp is done with them: order this warp's generic-proxy accesses first.
            fence_proxy_async_shared();
            __syncwarp();
            if (c.lane == 0) mbarrier_arrive(c.smem.q_empty(q_buffer<Cfg>(c.tile_iter)));
        }
    }
};
