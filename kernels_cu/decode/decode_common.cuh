// Decode family: the static configuration and the helpers its three kernels share.
//
// Geometry (see decode_attention.cuh): a CTA owns HEADS consecutive KV heads of one sequence,
// ROWS packed query rows per head (the GQA group's query heads x seq_q, row r = t * group + g)
// and one split of the keys. Warp w serves head slot w % HEADS; the N_WARPS / HEADS warps of a
// slot (its team) stream interleaved shares of the split's keys, each through its own cp.async
// ring of STAGES slots, so the main loop needs no CTA barrier; a team's partial softmax states
// merge once at the end through shared memory. With HEADS > 1 the CTA reads every head's rows
// of a key range (in a paged cache: all of a page) at about the same time.
#pragma once

template <DecodeKernelConfig C>
struct StaticDecodeKernelConfig {
    static constexpr DecodeKernelConfig cfg = C;
    static constexpr DType dtype = C.dtype;
    static constexpr int D = C.d_head;
    static constexpr int ROWS = C.rows;          // packed query rows per CTA tile
    static constexpr int BC = C.B_c;             // keys per warp step
    static constexpr int N_WARPS = C.n_warps;
    static constexpr int N_THREADS = 32 * C.n_warps;
    static constexpr int STAGES = C.stages;      // cp.async ring depth per warp (1 = no prefetch)
    static constexpr bool EVICT_FIRST = C.evict_first;
    static constexpr int HEADS = C.heads;        // KV heads per CTA
    static constexpr int TEAM = C.n_warps / C.heads;  // warps per head
    static constexpr bool INTERLEAVE = C.interleave;  // splits take warp steps round-robin

    static constexpr int M_TILES = ROWS / 16;
    static constexpr int S_N_TILES = BC / 8;     // n-tiles of S (keys of one warp step)
    static constexpr int O_N_TILES = D / 8;      // n-tiles of O (head dim)
    static constexpr int QK_K_STEPS = D / 16;
    static constexpr int PV_K_STEPS = BC / 16;
    static constexpr int CHUNKS_PER_ROW = D / 8; // 16-byte chunks per K/V/Q row
    static constexpr int ROWS_PER_PASS = 32 / CHUNKS_PER_ROW;  // rows one warp copies per pass
    static constexpr int COPY_PASSES = BC / ROWS_PER_PASS;
    static constexpr int SUB_BLOCKS = BC / 16;   // 16-key sub-blocks of a step (one page each)

    using QTile = SmemTile<ROWS, D, true>;
    using KVTile = SmemTile<BC, D, true>;
    static constexpr int STAGE_BYTES = 2 * KVTile::BYTES;           // K then V
    static constexpr int WARP_BYTES = STAGES * STAGE_BYTES;
    static constexpr int KV_BYTES = N_WARPS * WARP_BYTES;
    // Merge area (reuses the K/V rings after the loop): per-warp row max and sum, the merged
    // max and sum, and each warp's fp32 output rows, padded by 8 floats so that the float2
    // stores of the accumulator layout (8 rows x 4 lanes) hit 32 different banks.
    static constexpr int O_STRIDE = D + 8;
    static constexpr int MERGE_BYTES = (2 * N_WARPS * ROWS + 2 * HEADS * ROWS) * 4 + N_WARPS * ROWS * O_STRIDE * 4;
    static constexpr int Q_BYTES = HEADS * QTile::BYTES;  // one Q tile per head slot
    static constexpr int SMEM_BYTES = Q_BYTES + (KV_BYTES > MERGE_BYTES ? KV_BYTES : MERGE_BYTES);

    static_assert(ROWS % 16 == 0 && BC % 16 == 0, "whole m16n8k16 tiles");
    static_assert(32 % CHUNKS_PER_ROW == 0 && BC % ROWS_PER_PASS == 0, "a warp copies whole rows per pass");
    static_assert(16 % ROWS_PER_PASS == 0, "a copy pass never straddles a 16-key sub-block");
    static_assert(SUB_BLOCKS <= 32 && 32 % SUB_BLOCKS == 0, "a page list holds whole steps, a lane per sub-block");
    static_assert(N_WARPS % HEADS == 0, "every head slot has a whole team of warps");
};

// Largest split count the combine kernel merges (its per-warp weight table).
#define CF_DECODE_MAX_SPLITS 128

// 16-byte cp.async with an L2 eviction-priority hint: K and V are read exactly once, so marking
// them evict-first keeps them from pushing Q, the page table and the partial outputs out of L2.
CF_DEVICE u64 l2_evict_first_policy() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}

CF_DEVICE void cp_async_16_hinted(u32 dst, const void* src, bool valid, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0), "l"(policy));
}

CF_DEVICE float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

CF_DEVICE float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Element offset of cache row `key` of (batch, kv head 0): a page-table lookup when PAGED
// (batch_stride is then the page stride), else a plain row offset.
template <bool PAGED>
CF_DEVICE long long cache_row_offset(const DecodeParams& p, int batch, int key, long long batch_stride,
                                     long long seq_stride) {
    if constexpr (PAGED) {
        const int page = p.block_table[batch * p.block_table_stride + (key >> p.page_shift)];
        return page * batch_stride + (key & ((1 << p.page_shift) - 1)) * seq_stride;
    } else {
        return batch * batch_stride + key * seq_stride;
    }
}
