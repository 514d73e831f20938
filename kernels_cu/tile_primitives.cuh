// Tile primitives: a shared-memory tile layout, global<->shared tile copies, and the ldmatrix
// fragment loads that feed mma.m16n8k16. Each is named for the tile operation it performs so the
// kernel body reads as a sequence of them.
#pragma once

// A ROWS x COLS tile of 16-bit elements in shared memory, stored row-major in 16-byte chunks.
// SWIZZLED stores logical chunk c of row r at chunk c ^ (r % 8): the 8 row addresses that one
// ldmatrix phase (or one 8-lane cp.async group) touches then fall in 8 different bank groups
// instead of one, removing the 8-way bank conflict of the plain row-major layout.
//
// Addressing is split in two so that the inner loops cost no registers: a per-lane address
// (`lane_address`, computed once) for the lane's row inside an 8-row group and its lane-dependent
// chunk, and a compile-time displacement (`displace`) by whole 8-row groups and chunks. The
// swizzle term of the displacement is an XOR on address bits 4-6, which commutes with adding
// multiples of 128 bytes because every tile starts 1024-byte aligned and rows are >= 128 bytes.
template <int ROWS, int COLS, bool SWIZZLED>
struct SmemTile {
    static constexpr int CHUNKS_PER_ROW = COLS / 8;
    static constexpr int ROW_BYTES = COLS * 2;
    static constexpr int BYTES = ROWS * ROW_BYTES;
    static_assert(COLS % 64 == 0, "swizzle needs at least 8 chunks per row");
    static_assert(BYTES % 1024 == 0, "tiles keep the 1024-byte alignment the swizzle relies on");

    u32 base;  // shared-window address of element (0, 0), 1024-byte aligned

    // Address of chunk `chunk` of row `row` (both may be lane-dependent).
    CF_DEVICE u32 lane_address(int row, int chunk) const {
        const int physical = SWIZZLED ? (chunk ^ (row & 7)) : chunk;
        return base + row * ROW_BYTES + physical * 16;
    }

    // `addr` (from lane_address with row r, chunk c) moved to row r + row_offset, chunk
    // c + chunk_offset. Callers pass unrolled-loop constants, so this folds to one LOP3 and an
    // immediate. Valid for row_offset a multiple of 8 and chunk offsets whose low three bits do
    // not overlap c's (c is 0, or c is 0/1 and chunk_offset is even: true for every caller).
    CF_DEVICE static u32 displace(u32 addr, int row_offset, int chunk_offset) {
        if constexpr (SWIZZLED) {
            return (addr ^ ((chunk_offset & 7) << 4)) + row_offset * ROW_BYTES + ((chunk_offset & ~7) << 4);
        } else {
            return addr + row_offset * ROW_BYTES + chunk_offset * 16;
        }
    }
};

// Copy a whole tile from global memory (row stride `row_stride` elements) into shared memory,
// spread over N_THREADS threads: thread t copies chunk t % CHUNKS_PER_ROW of rows t / CHUNKS_PER_ROW,
// + ROWS_PER_PASS, + 2 * ROWS_PER_PASS, ... so a warp reads whole rows (coalesced) and each thread
// keeps one running global pointer; its shared addresses differ by immediates, because
// ROWS_PER_PASS is a multiple of 8 and so keeps the swizzle phase. Rows at or past `rows_valid`
// are zero-filled and never read from global memory.
template <int N_THREADS, bool ASYNC, class Tile>
CF_DEVICE void copy_tile_global_to_shared(const Tile& tile, const u16* __restrict__ src, long long row_stride,
                                          int rows_valid, int tid) {
    constexpr int ROWS_PER_PASS = N_THREADS / Tile::CHUNKS_PER_ROW;
    constexpr int PASSES = (Tile::BYTES / Tile::ROW_BYTES) / ROWS_PER_PASS;
    static_assert(N_THREADS % Tile::CHUNKS_PER_ROW == 0 && ROWS_PER_PASS % 8 == 0, "passes keep the swizzle phase");
    static_assert(PASSES * ROWS_PER_PASS * Tile::ROW_BYTES == Tile::BYTES, "tile rows spread evenly over the passes");
    const int row0 = tid / Tile::CHUNKS_PER_ROW;
    const int chunk = tid % Tile::CHUNKS_PER_ROW;
    const u16* g = src + row0 * row_stride + chunk * 8;
    const long long pass_stride = ROWS_PER_PASS * row_stride;
    const u32 s = tile.lane_address(row0, chunk);
    if constexpr (ASYNC) {
#pragma unroll
        for (int i = 0; i < PASSES; ++i) {
            const bool valid = row0 + i * ROWS_PER_PASS < rows_valid;
            // An invalid row still needs a mapped address operand: the tile's first row is.
            cp_async_16(s + i * ROWS_PER_PASS * Tile::ROW_BYTES, valid ? g : src, valid);
            g += pass_stride;
        }
    } else {
        // Synchronous path: all loads first so they are in flight together, then the stores.
        uint4 staged[PASSES];
#pragma unroll
        for (int i = 0; i < PASSES; ++i) {
            staged[i] = row0 + i * ROWS_PER_PASS < rows_valid ? ld_global_16(g) : make_uint4(0, 0, 0, 0);
            g += pass_stride;
        }
#pragma unroll
        for (int i = 0; i < PASSES; ++i) st_shared_16(s + i * ROWS_PER_PASS * Tile::ROW_BYTES, staged[i]);
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
        const uint4 v = ld_shared_16(tile.lane_address(row0 + row, chunk));
        if (row0 + row < rows_valid) st_global_16(dst + (row0 + row) * row_stride + chunk * 8, v);
    }
}

// ---- fragment loads (ldmatrix.x4) -----------------------------------------------------------
// Lane l addresses row (l % 8) of matrix (l / 8). Each loader has a per-lane address function
// (called once per tile) and a load at compile-time (row, k-step) displacements.

// A operand (16 x 16, row-major), e.g. Q: matrices (rows 0-7 | 8-15) x (columns 0-7 | 8-15),
// in the order a0 = (0-7, 0-7), a1 = (8-15, 0-7), a2 = (0-7, 8-15), a3 = (8-15, 8-15).
template <class Tile>
CF_DEVICE u32 a_fragment_lane_address(const Tile& tile, int row0, int lane) {
    const int matrix = lane >> 3;
    return tile.lane_address(row0 + (lane & 7) + (matrix & 1) * 8, matrix >> 1);
}

template <class Tile>
CF_DEVICE void load_a_fragment(u32 (&a)[4], u32 lane_addr, int row_offset, int k_step) {
    ldmatrix_x4(a, Tile::displace(lane_addr, row_offset, 2 * k_step));
}

// B operands of two adjacent n-tiles from a tile stored [n][k] (K: keys x d_head): B = K^T is
// already the "col" layout mma wants. Matrices: (n 0-7, k 0-7) = b0 of n-tile 0, (n 0-7, k 8-15)
// = b1 of n-tile 0, (n 8-15, k 0-7) and (n 8-15, k 8-15) for n-tile 1.
template <class Tile>
CF_DEVICE u32 b_fragment_lane_address(const Tile& tile, int lane) {
    const int matrix = lane >> 3;
    return tile.lane_address((lane & 7) + (matrix >> 1) * 8, matrix & 1);
}

template <class Tile>
CF_DEVICE void load_b_fragments(u32 (&b0)[2], u32 (&b1)[2], u32 lane_addr, int n0, int k_step) {
    u32 r[4];
    ldmatrix_x4(r, Tile::displace(lane_addr, n0, 2 * k_step));
    b0[0] = r[0];
    b0[1] = r[1];
    b1[0] = r[2];
    b1[1] = r[3];
}

// B operands of two adjacent n-tiles from a tile stored [k][n] (V: keys x d_head), through the
// transposing ldmatrix. Matrices: (k 0-7, n 0-7) = b0 of n-tile 0, (k 8-15, n 0-7) = b1 of
// n-tile 0, then the same for columns 8-15 (n-tile 1): the A-fragment lane pattern.
template <class Tile>
CF_DEVICE u32 b_transposed_fragment_lane_address(const Tile& tile, int lane) {
    return a_fragment_lane_address(tile, 0, lane);
}

template <class Tile>
CF_DEVICE void load_b_fragments_transposed(u32 (&b0)[2], u32 (&b1)[2], u32 lane_addr, int n0, int k_step) {
    u32 r[4];
    ldmatrix_x4_trans(r, Tile::displace(lane_addr, 16 * k_step, n0 / 8));
    b0[0] = r[0];
    b0[1] = r[1];
    b1[0] = r[2];
    b1[1] = r[3];
}

// Accumulator (16 x 8 fp32 C fragment) -> shared tile as 16-bit values. The lane holds row
// lane/4 (and +8), columns 2*(lane%4) and +1.
template <class Tile>
CF_DEVICE u32 accumulator_lane_address(const Tile& tile, int row0, int lane) {
    return tile.lane_address(row0 + (lane >> 2), 0) + (lane & 3) * 4;
}

template <DType T, class Tile>
CF_DEVICE void store_accumulator_tile(u32 lane_addr, const float (&c)[4], int row_offset, int n_tile, float scale_lo,
                                      float scale_hi) {
    st_shared_4(Tile::displace(lane_addr, row_offset, n_tile), pack_pair<T>(c[0] * scale_lo, c[1] * scale_lo));
    st_shared_4(Tile::displace(lane_addr, row_offset + 8, n_tile), pack_pair<T>(c[2] * scale_hi, c[3] * scale_hi));
}
