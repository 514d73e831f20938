// Which (query block, head, batch) tile a CTA computes, and how many key blocks it visits.
// One CTA per tile (grid = (ceil(seq_len_q / B_r), heads, batch)).
#pragma once

template <class Cfg, bool CAUSAL>
struct TileScheduler {
    int q_block, head, batch;

    // Under causal masking later query blocks see more keys: starting them first keeps the last
    // wave of CTAs short.
    CF_DEVICE static TileScheduler current() {
        TileScheduler t;
        t.q_block = CAUSAL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
        t.head = blockIdx.y;
        t.batch = blockIdx.z;
        return t;
    }

    CF_DEVICE int first_row() const { return q_block * Cfg::BR; }

    // Key blocks to visit: all, or under (bottom-right) causal masking those up to the last row's
    // diagonal; none when every row of the tile precedes the first visible key.
    CF_DEVICE int kv_blocks(const HopperForwardParams& p) const {
        const int all = (p.seq_len_k + Cfg::BC - 1) / Cfg::BC;
        if constexpr (!CAUSAL) return all;
        const int last_row = min(p.seq_len_q, first_row() + Cfg::BR) - 1;
        const int last_key = last_row + p.seq_len_k - p.seq_len_q;
        return last_key < 0 ? 0 : min(all, last_key / Cfg::BC + 1);
    }
};
