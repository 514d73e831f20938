// Tile primitives: a shared-memory tile layout, global<->shared tile copies, and the ldmatrix
// fragment loads that feed mma.m16n8k16. Each is named for the tile operation it performs so the
// kernel body reads as a sequence of them.
#pragma once

// A ROWS x COLS tile of 16-bit elements in shared memory, stored row-major in 16-byte chunks.
// SWIZZLED stores logical chunk c of row r at chunk c ^ (r % 8): the 8 row addresses that one
// ldmatrix phase (or one 8-lane cp.async group) touches then fall in 8 different bank groups
// instead of one, removing the 8-way bank conflict of the plain row-major layout. A row of 12
// chunks (d_head 96) swizzles its first 8 chunks that way and its last 4 with c ^ (r % 4).
//
// Addressing is split in two so that the inner loops cost no registers: a per-lane `Cursor`
// (computed once) for the lane's row inside an 8-row group and its lane-dependent chunk, and a
// displacement by unrolled-loop constants (`at`). When rows are a multiple of 128 bytes the
// swizzle term of a displacement is an XOR on address bits 4-6, which commutes with adding whole
// rows because every tile starts 1024-byte aligned: one LOP3 and an immediate per access. Other
// row widths recompute the swizzled address from the cursor's row and chunk.
template <int ROWS, int COLS, bool SWIZZLED>
struct SmemTile {
    static constexpr int CHUNKS_PER_ROW = COLS / 8;
    static constexpr int ROW_BYTES = COLS * 2;
    static constexpr int BYTES = ROWS * ROW_BYTES;
    static constexpr int TAIL_CHUNKS = CHUNKS_PER_ROW % 8;  // 4 for d_head 96, else 0
    static constexpr bool XOR_DISPLACE = ROW_BYTES % 128 == 0;
    static_assert(CHUNKS_PER_ROW >= 8 && (TAIL_CHUNKS == 0 || TAIL_CHUNKS == 4), "rows of 8k or 8k+4 chunks");
    static_assert(BYTES % 1024 == 0, "tiles keep the 1024-byte alignment the swizzle relies on");

    u32 base;  // shared-window address of element (0, 0), 1024-byte aligned

    // Where logical chunk `chunk` of row `row` is stored.
    CF_DEVICE static int physical_chunk(int row, int chunk) {
        if constexpr (!SWIZZLED) {
            return chunk;
        } else if constexpr (TAIL_CHUNKS == 0) {
            return chunk ^ (row & 7);
        } else {
            return chunk < CHUNKS_PER_ROW - TAIL_CHUNKS ? chunk ^ (row & 7) : chunk ^ (row & (TAIL_CHUNKS - 1));
        }
    }

    // Address of chunk `chunk` of row `row` (both may be lane-dependent).
    CF_DEVICE u32 lane_address(int row, int chunk) const {
        return base + row * ROW_BYTES + physical_chunk(row, chunk) * 16;
    }

    struct Cursor {
        u32 addr;  // address of (row, chunk) plus `byte`
        int row, chunk, byte;
    };

    CF_DEVICE Cursor cursor(int row, int chunk, int byte = 0) const {
        return {lane_address(row, chunk) + byte, row, chunk, byte};
    }

    // The cursor's position moved by (row_offset, chunk_offset), for row_offset a multiple of 8
    // and chunk offsets whose low three bits do not overlap the cursor's chunk (its chunk is 0,
    // or 0/1 with an even offset: true for every caller).
    CF_DEVICE u32 at(const Cursor& c, int row_offset, int chunk_offset) const {
        if constexpr (!SWIZZLED) {
            return c.addr + row_offset * ROW_BYTES + chunk_offset * 16;
        } else if constexpr (XOR_DISPLACE) {
            return (c.addr ^ ((chunk_offset & 7) << 4)) + row_offset * ROW_BYTES + ((chunk_offset & ~7) << 4);
        } else {
            return lane_address(c.row + row_offset, c.chunk + chunk_offset) + c.byte;
        }
    }
};

// Copy a whole tile from global memory (row stride `row_stride` elements) into shared memory,
// spread over N_THREADS threads. When a row's chunks divide the threads, thread t copies chunk
// t % CHUNKS_PER_ROW of rows t / CHUNKS_PER_ROW, + ROWS_PER_PASS, ... so a warp reads whole rows
// (coalesced) and each thread keeps one running global pointer; if ROWS_PER_PASS is a multiple of
// 8 (it keeps the swizzle phase) its shared addresses differ by immediates. Other shapes (d_head
// 96) index chunk by chunk. Rows at or past `rows_valid` are zero-filled and never read from
// global memory.
template <int N_THREADS, bool ASYNC, class Tile>
CF_DEVICE void copy_tile_global_to_shared(const Tile& tile, const u16* __restrict__ src, long long row_stride,
                                          int rows_valid, int tid) {
    constexpr int ROWS = Tile::BYTES / Tile::ROW_BYTES;
    constexpr int TOTAL_CHUNKS = ROWS * Tile::CHUNKS_PER_ROW;
    static_assert(TOTAL_CHUNKS % N_THREADS == 0, "tile chunks must spread evenly over the threads");
    constexpr int PASSES = TOTAL_CHUNKS / N_THREADS;
    constexpr bool ROW_PASSES = N_THREADS % Tile::CHUNKS_PER_ROW == 0;
    constexpr int ROWS_PER_PASS = ROW_PASSES ? N_THREADS / Tile::CHUNKS_PER_ROW : 0;
    constexpr bool IMMEDIATE_SMEM = ROW_PASSES && ROWS_PER_PASS % 8 == 0;

    int row = tid / Tile::CHUNKS_PER_ROW;
    int chunk = tid % Tile::CHUNKS_PER_ROW;
    const u16* g = src + row * row_stride + chunk * 8;
    const long long pass_stride = ROWS_PER_PASS * row_stride;
    const u32 s0 = tile.lane_address(row, chunk);
    uint4 staged[ASYNC ? 1 : PASSES];
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
        if constexpr (!ROW_PASSES) {
            const int idx = tid + i * N_THREADS;
            row = idx / Tile::CHUNKS_PER_ROW;
            chunk = idx % Tile::CHUNKS_PER_ROW;
            g = src + row * row_stride + chunk * 8;
        }
        const bool valid = row < rows_valid;
        const u32 s = IMMEDIATE_SMEM ? s0 + i * ROWS_PER_PASS * Tile::ROW_BYTES : tile.lane_address(row, chunk);
        if constexpr (ASYNC) {
            // An invalid row still needs a mapped address operand: the tile's row 0 is.
            cp_async_16(s, valid ? g : src, valid);
        } else {
            staged[i] = valid ? ld_global_16(g) : make_uint4(0, 0, 0, 0);
        }
        if constexpr (ROW_PASSES) {
            g += pass_stride;
            row += ROWS_PER_PASS;
        }
    }
    if constexpr (!ASYNC) {
        // Synchronous path: all loads above are in flight together; now the stores.
#pragma unroll
        for (int i = 0; i < PASSES; ++i) {
            const int idx = tid + i * N_THREADS;
            const u32 s = IMMEDIATE_SMEM ? s0 + i * ROWS_PER_PASS * Tile::ROW_BYTES
                                         : tile.lane_address(idx / Tile::CHUNKS_PER_ROW, idx % Tile::CHUNKS_PER_ROW);
            st_shared_16(s, staged[i]);
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
        const uint4 v = ld_shared_16(tile.lane_address(row0 + row, chunk));
        if (row0 + row < rows_valid) st_global_16(dst + (row0 + row) * row_stride + chunk * 8, v);
    }
}

// ---- fragment loads (ldmatrix.x4) -----------------------------------------------------------
// Lane l addresses row (l % 8) of matrix (l / 8). Each loader has a per-lane cursor function
// (called once per tile) and a load at unrolled-loop constant (row, k-step) displacements.

// A operand (16 x 16, row-major), e.g. Q: matrices (rows 0-7 | 8-15) x (columns 0-7 | 8-15),
// in the order a0 = (0-7, 0-7), a1 = (8-15, 0-7), a2 = (0-7, 8-15), a3 = (8-15, 8-15).
template <class Tile>
CF_DEVICE typename Tile::Cursor a_fragment_cursor(const Tile& tile, int row0, int lane) {
    const int matrix = lane >> 3;
    return tile.cursor(row0 + (lane & 7) + (matrix & 1) * 8, matrix >> 1);
}

template <class Tile>
CF_DEVICE void load_a_fragment(u32 (&a)[4], const Tile& tile, const typename Tile::Cursor& cur, int row_offset,
                               int k_step) {
    ldmatrix_x4(a, tile.at(cur, row_offset, 2 * k_step));
}

// B operands of two adjacent n-tiles from a tile stored [n][k] (K: keys x d_head): B = K^T is
// already the "col" layout mma wants. Matrices: (n 0-7, k 0-7) = b0 of n-tile 0, (n 0-7, k 8-15)
// = b1 of n-tile 0, (n 8-15, k 0-7) and (n 8-15, k 8-15) for n-tile 1.
template <class Tile>
CF_DEVICE typename Tile::Cursor b_fragment_cursor(const Tile& tile, int lane) {
    const int matrix = lane >> 3;
    return tile.cursor((lane & 7) + (matrix >> 1) * 8, matrix & 1);
}

template <class Tile>
CF_DEVICE void load_b_fragments(u32 (&b0)[2], u32 (&b1)[2], const Tile& tile, const typename Tile::Cursor& cur,
                                int n0, int k_step) {
    u32 r[4];
    ldmatrix_x4(r, tile.at(cur, n0, 2 * k_step));
    b0[0] = r[0];
    b0[1] = r[1];
    b1[0] = r[2];
    b1[1] = r[3];
}

// B operands of two adjacent n-tiles from a tile stored [k][n] (V: keys x d_head), through the
// transposing ldmatrix. Matrices: (k 0-7, n 0-7) = b0 of n-tile 0, (k 8-15, n 0-7) = b1 of
// n-tile 0, then the same for columns 8-15 (n-tile 1): the A-fragment lane pattern.
template <class Tile>
CF_DEVICE typename Tile::Cursor b_transposed_fragment_cursor(const Tile& tile, int lane) {
    return a_fragment_cursor(tile, 0, lane);
}

template <class Tile>
CF_DEVICE void load_b_fragments_transposed(u32 (&b0)[2], u32 (&b1)[2], const Tile& tile,
                                           const typename Tile::Cursor& cur, int n0, int k_step) {
    u32 r[4];
    ldmatrix_x4_trans(r, tile.at(cur, 16 * k_step, n0 / 8));
    b0[0] = r[0];
    b0[1] = r[1];
    b1[0] = r[2];
    b1[1] = r[3];
}

// Accumulator (16 x 8 fp32 C fragment) -> shared tile as 16-bit values. The lane holds row
// lane/4 (and +8), columns 2*(lane%4) and +1.
template <class Tile>
CF_DEVICE typename Tile::Cursor accumulator_cursor(const Tile& tile, int row0, int lane) {
    return tile.cursor(row0 + (lane >> 2), 0, (lane & 3) * 4);
}

template <DType T, class Tile>
CF_DEVICE void store_accumulator_tile(const Tile& tile, const typename Tile::Cursor& cur, const float (&c)[4],
                                      int row_offset, int n_tile, float scale_lo, float scale_hi) {
    st_shared_4(tile.at(cur, row_offset, n_tile), pack_pair<T>(c[0] * scale_lo, c[1] * scale_lo));
    st_shared_4(tile.at(cur, row_offset + 8, n_tile), pack_pair<T>(c[2] * scale_hi, c[3] * scale_hi));
}
