// Epilogue of one consumer warpgroup: dK * softmax_scale and dV (sums over every query head of
// the GQA group) converted to 16-bit and stored from the accumulator layout, 4 bytes per pair of
// columns, rows past seq_len_k skipped.
#pragma once

template <class Cfg, bool CAUSAL, bool DETERMINISTIC>
struct BwdEpilogue {
    CF_DEVICE static void store(const BwdConsumer<Cfg, CAUSAL, DETERMINISTIC>& c) {
        const HopperBackwardParams& p = c.p;
        const int key0 = c.sched.n_block * Cfg::BC;
        u16* dk = static_cast<u16*>(p.dk) + c.sched.batch * p.dk_batch_stride + c.sched.kv_head * p.dk_head_stride;
        u16* dv = static_cast<u16*>(p.dv) + c.sched.batch * p.dv_batch_stride + c.sched.kv_head * p.dv_head_stride;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = key0 + c.key_row(2 * h);
            if (key >= p.seq_len_k) continue;
#pragma unroll
            for (int j = 0; j < Cfg::D / 8; ++j) {
                const int col = 8 * j + 2 * (c.lane & 3);
                *reinterpret_cast<u32*>(dk + key * p.dk_seq_stride + col) =
                    pack_pair<Cfg::dtype>(c.dk[j][2 * h] * p.softmax_scale, c.dk[j][2 * h + 1] * p.softmax_scale);
                *reinterpret_cast<u32*>(dv + key * p.dv_seq_stride + col) =
                    pack_pair<Cfg::dtype>(c.dv[j][2 * h], c.dv[j][2 * h + 1]);
            }
        }
    }
};
