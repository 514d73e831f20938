// Which (query block, head, batch) tiles a CTA computes, and how many key blocks each visits.
//
// Non-persistent: one CTA per tile, grid (ceil(seq_len_q / B_r), heads, batch); under causal
// masking each head's query blocks go last to first (longest first), and with `lpt` the longest
// tiles of a chunk of heads first (longest_first). Persistent, no masking: a
// grid of G (about one CTA per SM) takes the tile list in rounds of G tiles, CTA c taking tile
// (c + r) mod G of round r; consecutive tiles are the query blocks of one (head, batch), so CTAs
// running at the same time share its K/V in L2. The rotation spreads each head's partial last
// query block (seq_len_q not a multiple of B_r) over the CTAs. With a fixed position per round
// (the earlier snake, c / G-1-c) and a block count dividing G (d_head 64's 192-row tiles: 3, 6,
// 11 or 22 blocks at 512, 1k, 2k, 4k against G = 132) the partial blocks all fell to the same
// few CTAs and the others ran whole tiles only, so `wgblocks` (a partial tile's warpgroups
// without rows skip their GEMMs) could not shorten the longest CTA; rotated, it does (d_head 64
// at 512 / 1k: +2-4.5%).
// Persistent, causal: the unit of work is a pair of one (head, batch)'s query blocks i and
// nqb-1-i (the longer first), whose key blocks add up to the same count for every i; CTA c
// takes pairs c, c+G, c+2G, ... Equal units dealt round-robin balance the CTAs to within one
// pair. (The earlier snake over single tiles paired tile lengths by position in a round; with
// nqb not dividing G its pairing drifted from round to round and lost 25% at 16k.) Consecutive
// pairs still belong to one (head, batch), for L2.
//
// CLUSTER: the grid's query blocks are padded to an even count (whole clusters of two). Under
// kv_multicast the pad's CTA runs a tile of rows past the sequence's end (its peer needs its
// half of every K/V tile; the epilogue stores none of its rows); otherwise it leaves at once.
//
// VARLEN: the grid (or tile list) is sized for max_seqlen_q (params.seq_len_q); each tile reads
// its sequence's lengths and first tokens from cu_seqlens_q/k, and tiles past the end of their
// sequence are skipped (non-persistent CTAs exit, persistent ones move to their next round).
#pragma once

template <class Cfg, bool CAUSAL>
struct TileScheduler {
    int index;  // linear tile index (persistent) or -1
    int round;  // persistent: how many tiles this CTA took before
    int q_block, head, batch;
    bool valid;
    int len_q = 0, len_k = 0, tok_q = 0, tok_k = 0;  // VARLEN only: the sequence's lengths and first tokens

    CF_DEVICE void read_sequence(const HopperForwardParams& p) {
        tok_q = p.cu_seqlens_q[batch];
        len_q = p.cu_seqlens_q[batch + 1] - tok_q;
        tok_k = p.cu_seqlens_k[batch];
        len_k = p.cu_seqlens_k[batch + 1] - tok_k;
    }

    CF_DEVICE static int q_blocks(const HopperForwardParams& p) { return (p.seq_len_q + Cfg::BR - 1) / Cfg::BR; }
    CF_DEVICE static int tiles(const HopperForwardParams& p) { return q_blocks(p) * p.n_heads * p.batch; }

    // Persistent schedules. `round` counts this CTA's steps: a tile per step without masking,
    // half a pair per step under causal masking (even: the pair's long tile, odd: its short one).
    CF_DEVICE static TileScheduler decode(const HopperForwardParams& p, int round) {
        const int g = gridDim.x, c = blockIdx.x;
        const int nqb = q_blocks(p);
        for (;; ++round) {
            TileScheduler t;
            t.round = round;
            int rest;
            if constexpr (CAUSAL) {
                const int per = (nqb + 1) / 2;  // pairs per (head, batch); odd nqb: the middle block alone
                const int pair = (round >> 1) * g + c;
                const int i = pair % per;
                t.index = pair;
                t.valid = pair < per * p.n_heads * p.batch;
                if (!t.valid) return t;  // every later step's pair is larger
                if ((round & 1) && 2 * i == nqb - 1) continue;  // the middle block has no partner
                t.q_block = (round & 1) ? i : nqb - 1 - i;
                rest = pair / per;
            } else {
                const int index = round * g + (c + round) % g;
                t.index = index;
                t.valid = index < tiles(p);
                t.q_block = index % nqb;
                rest = index / nqb;
            }
            t.head = rest % p.n_heads;
            t.batch = rest / p.n_heads;
            if constexpr (Cfg::VARLEN) {
                if (!t.valid) return t;
                t.read_sequence(p);
                if (t.first_row() >= t.len_q) continue;  // past its sequence's end: the next round
            }
            return t;
        }
    }

    CF_DEVICE static TileScheduler first(const HopperForwardParams& p) {
        if constexpr (Cfg::PERSISTENT) return decode(p, 0);
        TileScheduler t;
        // Under causal masking later query blocks see more keys: starting them first keeps the
        // last wave of CTAs short.
        t.index = -1;
        t.round = 0;
        t.valid = true;
        t.q_block = CAUSAL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
        t.head = blockIdx.y;
        t.batch = blockIdx.z;
        if constexpr (CAUSAL && Cfg::LPT) t.longest_first(p);
        if constexpr (Cfg::VARLEN) {
            t.read_sequence(p);
            t.valid = t.first_row() < t.len_q;
        } else if constexpr (Cfg::CLUSTER && !kv_multicast<Cfg, CAUSAL>()) {
            t.valid = t.first_row() < p.seq_len_q;  // the grid's pad to whole clusters
        }
        return t;
    }

    // lpt: the CTAs started first get the longest tiles (launch_order.cuh): query block nqb - 1
    // of every (head, batch) pair of a chunk, then nqb - 2, ...; a chunk holds the pairs whose K
    // and V fit in LPT_L2_KIB. With each head's tiles in turn, the last heads' long tiles start
    // late and run alone at the end. Heads of one GQA group are neighbours (head fastest) and
    // share their K/V. (VARLEN: nqb is the longest sequence's; tiles past their sequence's end
    // still exit at once.)
    CF_DEVICE void longest_first(const HopperForwardParams& p) {
        const int nqb = gridDim.x, pairs = gridDim.y * gridDim.z;
        // KiB of K + V (16-bit) per (head, batch) pair: 4 * seq_len_k * D bytes over the group
        const long long pair_kib = max(1LL, (long long)p.seq_len_k * Cfg::D / (256LL * p.kv_group_size));
        const int per = (int)max(1LL, min((long long)pairs, Cfg::LPT_L2_KIB / pair_kib));
        const int linear = blockIdx.x + nqb * (blockIdx.y + gridDim.y * blockIdx.z);
        const LaunchSlot slot = longest_first_slot(linear, nqb, pairs, per);
        q_block = nqb - 1 - slot.rank;
        head = slot.pair % gridDim.y;
        batch = slot.pair / gridDim.y;
    }

    CF_DEVICE TileScheduler next(const HopperForwardParams& p) const {
        // Once a round's index passes the end, every later one does (index >= round * G).
        if constexpr (Cfg::PERSISTENT) return decode(p, round + 1);
        TileScheduler t = *this;
        t.valid = false;
        return t;
    }

    CF_DEVICE int first_row() const { return q_block * Cfg::BR; }

    // This tile's sequence lengths, and its TMA / global coordinates.
    CF_DEVICE int seq_len_q(const HopperForwardParams& p) const {
        if constexpr (Cfg::VARLEN) return len_q;
        else return p.seq_len_q;
    }
    CF_DEVICE int seq_len_k(const HopperForwardParams& p) const {
        if constexpr (Cfg::VARLEN) return len_k;
        else return p.seq_len_k;
    }
    CF_DEVICE int q_coord() const { return (Cfg::VARLEN ? tok_q : 0) + first_row(); }  // seq coordinate of Q's box
    CF_DEVICE int k_coord(int key0) const { return (Cfg::VARLEN ? tok_k : 0) + key0; }
    CF_DEVICE int tma_batch() const { return Cfg::VARLEN ? 0 : batch; }  // packed arrays: one 'batch'
    // Element offset of the tile's (sequence, head) row 0 in o, and index of its row 0 in lse
    // ((batch, n_heads, seq_len_q), or (n_heads, total_q) for VARLEN).
    CF_DEVICE long long o_offset(const HopperForwardParams& p) const {
        if constexpr (Cfg::VARLEN) return (long long)tok_q * p.o_seq_stride + head * p.o_head_stride;
        else return batch * p.o_batch_stride + head * p.o_head_stride;
    }
    CF_DEVICE long long lse_offset(const HopperForwardParams& p) const {
        if constexpr (Cfg::VARLEN) return (long long)head * p.lse_head_stride + tok_q;
        else return ((long long)batch * p.n_heads + head) * p.seq_len_q;
    }

    // VARLEN: whether the tile's last key block (of `n_blocks`) reads packed k/v rows past the
    // sequence's end (varlen_tail.cuh; the mask gives those keys P = 0, but P V then adds 0 * V):
    // it is the sequence's last, partial block and the arrays hold rows past that end (the next
    // sequences' tokens, rows past the last sequence). Its rows past the sequence's end are all
    // masked, whichever sequence they belong to: the consumers zero them all (mainloop.cuh
    // clear_rows_past_end).
    CF_DEVICE bool tail_reads_past_end(const HopperForwardParams& p, int n_blocks) const {
        if constexpr (!Cfg::VARLEN) return false;
        if (n_blocks * Cfg::BC <= len_k) return false;
        return reads_rows_past_sequence_end(tok_k + len_k, p.total_k);
    }

    // Key blocks to visit: all, or under (bottom-right) causal masking those up to the last row's
    // diagonal; none when every row of the tile precedes the first visible key.
    CF_DEVICE int kv_blocks(const HopperForwardParams& p) const {
        const int all = (seq_len_k(p) + Cfg::BC - 1) / Cfg::BC;
        if constexpr (!CAUSAL) return all;
        const int last_row = min(seq_len_q(p), first_row() + Cfg::BR) - 1;
        const int last_key = last_row + seq_len_k(p) - seq_len_q(p);
        return last_key < 0 ? 0 : min(all, last_key / Cfg::BC + 1);
    }
};
