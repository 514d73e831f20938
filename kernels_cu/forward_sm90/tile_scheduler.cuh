// Which (query block, head, batch) tiles a CTA computes, and how many key blocks each visits.
//
// Non-persistent: one CTA per tile, grid (ceil(seq_len_q / B_r), heads, batch). Persistent: a
// grid of about one CTA per SM walks the tile list with stride gridDim.x. Either way consecutive
// tiles are the query blocks of one (head, batch), so CTAs running at the same time share its K/V
// in L2; under causal masking each head's query blocks go last to first (longest first).
// (Numbering causal tiles longest-first across all heads instead lost 10-30% to L2 misses.)
#pragma once

template <class Cfg, bool CAUSAL>
struct TileScheduler {
    int index;  // linear tile index (persistent) or -1
    int q_block, head, batch;
    bool valid;

    CF_DEVICE static int q_blocks(const HopperForwardParams& p) { return (p.seq_len_q + Cfg::BR - 1) / Cfg::BR; }
    CF_DEVICE static int tiles(const HopperForwardParams& p) { return q_blocks(p) * p.n_heads * p.batch; }

    CF_DEVICE static TileScheduler decode(const HopperForwardParams& p, int index) {
        TileScheduler t;
        t.index = index;
        t.valid = index < tiles(p);
        const int nqb = q_blocks(p);
        const int rest = index / nqb;
        t.q_block = CAUSAL ? nqb - 1 - index % nqb : index % nqb;
        t.head = rest % p.n_heads;
        t.batch = rest / p.n_heads;
        return t;
    }

    CF_DEVICE static TileScheduler first(const HopperForwardParams& p) {
        if constexpr (Cfg::PERSISTENT) return decode(p, blockIdx.x);
        TileScheduler t;
        // Under causal masking later query blocks see more keys: starting them first keeps the
        // last wave of CTAs short.
        t.index = -1;
        t.valid = true;
        t.q_block = CAUSAL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
        t.head = blockIdx.y;
        t.batch = blockIdx.z;
        return t;
    }

    CF_DEVICE TileScheduler next(const HopperForwardParams& p) const {
        if constexpr (Cfg::PERSISTENT) return decode(p, index + gridDim.x);
        TileScheduler t = *this;
        t.valid = false;
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
