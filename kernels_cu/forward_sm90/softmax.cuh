// Score masking and the conversion of probabilities to the A operand of P V (in registers, or
// stored to the warpgroup's shared P tile with P_SMEM), for one consumer warpgroup. The running statistics are the shared OnlineSoftmax (online_softmax.cuh):
// a wgmma m64nN accumulator is, per warp, the mma.m16n8k16 C layout over N/8 column tiles, i.e.
// OnlineSoftmax's [1 m-tile][N/8][4].
#pragma once

template <class Cfg, bool CAUSAL>
struct WarpgroupSoftmax {
    static constexpr int S_TILES = Cfg::BC / 8;
    static constexpr int PV_STEPS = Cfg::BC / 16;
    using Scores = float[1][S_TILES][4];
    using Probabilities = u32[PV_STEPS][4];
    // The first B_c / 2 columns of a block's scores (HALF_LAST): a view of Scores' leading half.
    template <bool HALF>
    using Columns = float[1][HALF ? S_TILES / 2 : S_TILES][4];
    template <bool HALF>
    CF_DEVICE static Columns<HALF>& columns(Scores& s) { return reinterpret_cast<Columns<HALF>&>(s); }

    OnlineSoftmax<1, S_TILES, true, Cfg::EXP_EMULATION, Cfg::LAZY_RESCALE ? 8 : 0> stats;

    CF_DEVICE void init() { stats.init(); }

    // Scores that must not count become -inf: keys at or past seq_len_k and, under causal
    // masking, keys after the row's diagonal. `wg_row0` is the warpgroup's first query row,
    // `row` this lane's first row (the second is row + 8); both absolute.
    template <int N>
    CF_DEVICE static void mask(float (&s)[1][N][4], int seq_len_q, int seq_len_k, int block, int wg_row0, int row,
                               int lane) {
        const int key0 = block * Cfg::BC;
        const int keys_valid = seq_len_k - key0;
        bool cut = keys_valid < Cfg::BC;
        int diagonal = 0;  // last visible key of `row`, relative to key0
        if constexpr (CAUSAL) {
            const int shift = seq_len_k - seq_len_q;
            diagonal = row + shift - key0;
            // uniform over the warpgroup: does its first row end inside this block?
            cut = cut || (wg_row0 + shift - key0 < Cfg::BC - 1);
        }
        if (!cut) return;
        mask_fragments(s, lane, [&](int, int h, int key) {
            bool masked = key >= keys_valid;
            if constexpr (CAUSAL) masked |= key > diagonal + 8 * h;
            return masked;
        });
    }

    // The A fragment of P for k-step k (keys 16k..16k+15): two adjacent column tiles of the C
    // layout are exactly the A layout of one k-step.
    CF_DEVICE static void fragment(const Scores& s, int k, u32 (&a)[4]) {
        a[0] = pack_pair<Cfg::dtype>(s[0][2 * k][0], s[0][2 * k][1]);
        a[1] = pack_pair<Cfg::dtype>(s[0][2 * k][2], s[0][2 * k][3]);
        a[2] = pack_pair<Cfg::dtype>(s[0][2 * k + 1][0], s[0][2 * k + 1][1]);
        a[3] = pack_pair<Cfg::dtype>(s[0][2 * k + 1][2], s[0][2 * k + 1][3]);
    }

    // Probabilities -> A fragments of P in registers, one per k-step (the first STEPS).
    template <int STEPS = PV_STEPS>
    CF_DEVICE static void convert(const Scores& s, Probabilities& pa) {
#pragma unroll
        for (int k = 0; k < STEPS; ++k) fragment(s, k, pa[k]);
    }

    // P_SMEM: probabilities -> the warpgroup's shared P tile (K-major, 128B-swizzled like the Q
    // tile), one stmatrix.x4 per k-step: the four A-fragment registers of convert() are the 8x8
    // matrices (rows 0-7 | 8-15) x (keys 0-7 | 8-15) of the k-step, and lane 8 i + r gives the
    // address of row r of matrix i. `lane_row` is store_address()'s value for this lane.
    template <int STEPS = PV_STEPS>
    CF_DEVICE static void store(const Scores& s, u32 lane_row) {
#pragma unroll
        for (int k = 0; k < STEPS; ++k) {
            u32 a[4];
            fragment(s, k, a);
            // key chunk 2k + (i >> 1) of the row: column block k / 4, chunk (2k) % 8 XOR the lane's
            stmatrix_x4((lane_row ^ (u32)(((2 * k) % 8) << 4)) + (k / 4) * Cfg::WG_ROWS * Cfg::P_ROW_BYTES, a[0], a[1],
                        a[2], a[3]);
        }
    }
    // This lane's stmatrix row address in the P tile at `p_tile` for k-step 0: row
    // 16 warp + 8 (i & 1) + r, 16-byte chunk (i >> 1) XOR the 128B swizzle (row & 7 = r).
    CF_DEVICE static u32 store_address(u32 p_tile, int warp, int lane) {
        const u32 r = lane & 7, i = (lane >> 3) & 3;
        const u32 row = 16 * warp + 8 * (i & 1) + r;
        return p_tile + row * Cfg::P_ROW_BYTES + (((i >> 1) ^ r) << 4);
    }
};
