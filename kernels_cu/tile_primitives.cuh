// Tile primitives: a shared-memory tile layout, global<->shared tile copies, and the ldmatrix
// fragment loads that feed mma.m16n8k16. Each is named for the tile operation it performs so the
// kernel body reads as a sequence of them.
#pragma once

// A ROWS x COLS tile of 16-bit elements in shared memory, stored row-major in 16-byte chunks.
// SWIZZLED stores logical chunk c of row r at chunk c ^ (r % 8): the 8 row addresses that one
// ldmatrix phase (or one 8-lane cp.async group) touches then fall in 8 different bank groups
// instead of one, removing the 8-way bank conflict of the plain row-major layout.
template <int ROWS, int COLS, bool SWIZZLED>
struct SmemTile {
    static constexpr int CHUNKS_PER_ROW = COLS / 8;
    static constexpr int ROW_BYTES = COLS * 2;
    static constexpr int BYTES = ROWS * ROW_BYTES;
    static_assert(COLS % 64 == 0, "swizzle needs at least 8 chunks per row");

    u32 base;  // shared-window address of element (0, 0)

    // Byte address of 16-byte chunk `chunk` of row `row`.
    CF_DEVICE u32 chunk_address(int row, int chunk) const {
        const int physical = SWIZZLED ? (chunk ^ (row & 7)) : chunk;
        return base + row * ROW_BYTES + physical * 16;
    }
};

// Copy ROWS rows of a tile from global memory (row stride `row_stride` elements, 16-byte chunks
// along the row) into shared memory, spread evenly over N_THREADS threads. Rows at or past
// `rows_valid` are zero-filled and never read from global memory.
template <int N_THREADS, bool ASYNC, class Tile>
CF_DEVICE void copy_tile_global_to_shared(const Tile& tile, const u16* __restrict__ src, long long row_stride,
                                          int rows_valid, int tid) {
    constexpr int TOTAL_CHUNKS = Tile::BYTES / 16;
    static_assert(TOTAL_CHUNKS % N_THREADS == 0, "tile chunks must spread evenly over the threads");
    constexpr int PER_THREAD = TOTAL_CHUNKS / N_THREADS;
    if constexpr (ASYNC) {
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int idx = tid + i * N_THREADS;
            const int row = idx / Tile::CHUNKS_PER_ROW;
            const int chunk = idx % Tile::CHUNKS_PER_ROW;
            const bool valid = row < rows_valid;
            // An invalid row still needs a mapped address operand; row 0 is always in bounds.
            const u16* g = src + (valid ? row : 0) * row_stride + chunk * 8;
            cp_async_16(tile.chunk_address(row, chunk), g, valid);
        }
    } else {
        // Synchronous path: all loads first so they are in flight together, then the stores.
        uint4 staged[PER_THREAD];
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int idx = tid + i * N_THREADS;
            const int row = idx / Tile::CHUNKS_PER_ROW;
            const int chunk = idx % Tile::CHUNKS_PER_ROW;
            staged[i] = row < rows_valid ? ld_global_16(src + row * row_stride + chunk * 8) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int idx = tid + i * N_THREADS;
            st_shared_16(tile.chunk_address(idx / Tile::CHUNKS_PER_ROW, idx % Tile::CHUNKS_PER_ROW), staged[i]);
        }
    }
}

// Copy `ROWS` rows of a tile that one warp owns (rows row0 .. row0+ROWS-1) from shared memory to
// global memory with 16-byte stores; rows at or past `rows_valid` are not written.
template <int ROWS, class Tile>
CF_DEVICE void copy_warp_rows_shared_to_global(const Tile& tile, int row0, u16* __restrict__ dst,
                                               long long row_stride, int rows_valid, int lane) {
    constexpr int TOTAL_CHUNKS = ROWS * Tile::CHUNKS_PER_ROW;
    static_assert(TOTAL_CHUNKS % 32 == 0, "warp rows must spread evenly over the lanes");
#pragma unroll
    for (int i = 0; i < TOTAL_CHUNKS / 32; ++i) {
        const int idx = lane + i * 32;
        const int row = idx / Tile::CHUNKS_PER_ROW;
        const int chunk = idx % Tile::CHUNKS_PER_ROW;
        const uint4 v = ld_shared_16(tile.chunk_address(row0 + row, chunk));
        if (row0 + row < rows_valid) st_global_16(dst + (row0 + row) * row_stride + chunk * 8, v);
    }
}

// ---- fragment loads (ldmatrix.x4) -----------------------------------------------------------
// Lane l addresses row (l % 8) of matrix (l / 8). Tile origins are multiples of 8 rows, so the
// swizzle term (row & 7) is simply l & 7 for every load below.

// A operand (16 x 16, row-major) at rows row0.., k-step `k_step` (columns 16*k_step..): a Q tile.
template <class Tile>
CF_DEVICE void load_a_fragment(u32 (&a)[4], const Tile& tile, int row0, int k_step, int lane) {
    const int matrix = lane >> 3;
    const int row = row0 + (lane & 7) + (matrix & 1) * 8;
    const int chunk = 2 * k_step + (matrix >> 1);
    ldmatrix_x4(a, tile.chunk_address(row, chunk));
}

// B operands of two adjacent n-tiles (keys key0..key0+15) at k-step `k_step` from a K tile
// stored [key][d]: B = K^T, which row-major K already is in the "col" layout mma wants.
template <class Tile>
CF_DEVICE void load_b_fragments_from_rows(u32 (&b)[2][2], const Tile& tile, int key0, int k_step, int lane) {
    const int matrix = lane >> 3;
    const int row = key0 + (lane & 7) + (matrix >> 1) * 8;
    const int chunk = 2 * k_step + (matrix & 1);
    u32 r[4];
    ldmatrix_x4(r, tile.chunk_address(row, chunk));
    b[0][0] = r[0];
    b[0][1] = r[1];
    b[1][0] = r[2];
    b[1][1] = r[3];
}

// B operands of two adjacent n-tiles (columns col0..col0+15) at k-step `k_step` (rows
// 16*k_step..) from a V tile stored [key][d]: the transposing ldmatrix gives the "col" layout.
template <class Tile>
CF_DEVICE void load_b_fragments_transposed(u32 (&b)[2][2], const Tile& tile, int col0, int k_step, int lane) {
    const int matrix = lane >> 3;
    const int row = 16 * k_step + (lane & 7) + (matrix & 1) * 8;
    const int chunk = col0 / 8 + (matrix >> 1);
    u32 r[4];
    ldmatrix_x4_trans(r, tile.chunk_address(row, chunk));
    b[0][0] = r[0];
    b[0][1] = r[1];
    b[1][0] = r[2];
    b[1][1] = r[3];
}

// Accumulator (16 x 8 fp32 C fragment) element pair -> shared tile, as 16-bit values:
// the lane holds row lane/4 (+8 for the second pair), columns 2*(lane%4) and +1.
template <DType T, class Tile>
CF_DEVICE void store_accumulator_tile(const Tile& tile, const float (&c)[4], int row0, int col0, float scale_lo,
                                      float scale_hi, int lane) {
    const int row = row0 + (lane >> 2);
    const int chunk = col0 / 8;
    const int byte_in_chunk = (lane & 3) * 4;
    st_shared_4(tile.chunk_address(row, chunk) + byte_in_chunk, pack_pair<T>(c[0] * scale_lo, c[1] * scale_lo));
    st_shared_4(tile.chunk_address(row + 8, chunk) + byte_in_chunk, pack_pair<T>(c[2] * scale_hi, c[3] * scale_hi));
}
