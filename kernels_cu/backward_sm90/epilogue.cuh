// Epilogue of one consumer warpgroup: dK * softmax_scale and dV (sums over every query head of
// the GQA group; d_head 256: the warpgroup's half of the columns) converted to 16-bit and stored
// from the accumulator layout, rows past seq_len_k skipped. A lane quad holds a row's 32 columns of 4 n-tiles, 2 per lane and n-tile;
// quad_transpose gives every lane 8 consecutive columns, so one 16-byte store instruction of a
// warp writes 64 contiguous bytes of each of its 8 rows. The 4-byte stores of the accumulator layout (four times the store instructions, 16 bytes
// per row each) kept the consumers in the epilogue ~6 us per tile (NOTES.md item 153). The
// validation guarantees 16-byte aligned rows (pointer and strides).
#pragma once

template <class Cfg, bool CAUSAL, bool DETERMINISTIC, bool VARLEN = false>
struct BwdEpilogue {
    CF_DEVICE static void store(const BwdConsumer<Cfg, CAUSAL, DETERMINISTIC, VARLEN>& c) {
        const HopperBackwardParams& p = c.p;
        const BwdSeq<Cfg::BR, VARLEN> seq = c.seq();
        const int key0 = c.sched.n_block * Cfg::BC;
        u16* dk = static_cast<u16*>(p.dk) + seq.coord * p.dk_batch_stride + c.sched.kv_head * p.dk_head_stride +
                  (long long)seq.tok_k * p.dk_seq_stride;
        u16* dv = static_cast<u16*>(p.dv) + seq.coord * p.dv_batch_stride + c.sched.kv_head * p.dv_head_stride +
                  (long long)seq.tok_k * p.dv_seq_stride;
        const int quad_lane = c.lane & 3;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = key0 + c.key_row(2 * h);
            const bool inside = key < seq.len_k;  // (the shuffles below need every lane)
#pragma unroll
            for (int g = 0; g < Cfg::DKV_N / 32; ++g) {
                const uint4 k = quad_row_chunk<Cfg::dtype>(c.dk, g, 2 * h, p.softmax_scale, c.lane);
                const uint4 v = quad_row_chunk<Cfg::dtype>(c.dv, g, 2 * h, 1.f, c.lane);
                const int col = c.dkv_col0() + 32 * g + 8 * quad_lane;  // n-tile 4 g + quad_lane of its columns
                if (inside) {
                    st_global_16(dk + key * p.dk_seq_stride + col, k);
                    st_global_16(dv + key * p.dv_seq_stride + col, v);
                }
            }
        }
    }
};
