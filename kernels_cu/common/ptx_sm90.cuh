// PTX wrappers for Hopper (sm_90a): wgmma control and shared-memory matrix descriptors, mbarrier
// pipelines, TMA bulk tensor copies (multicast too), thread-block clusters, register
// reallocation and named barriers. Each function is one instruction (or a wait loop around one).
// Needs ptx.cuh (u32/u64, CF_DEVICE).
#pragma once

// ---- wgmma ------------------------------------------------------------------------------------
// Shared-memory matrix descriptor for a 128-byte-swizzled operand: start address, leading and
// stride byte offsets (all >> 4, 14 bits each) and layout type 1 (128B swizzle) in bits 62-63.
// K-major (K contiguous): rows of 64 16-bit elements (128 bytes), 8-row core groups 1024 bytes
// apart (SBO); LBO unused. MN-major (transposed B): 64 contiguous N elements per 128-byte row,
// rows along K; SBO = 1024 between 8-row groups along K, LBO = distance between 64-wide N blocks.
// 64B-swizzled operands (SWIZZLE_BYTES 64, layout type 2) have rows of 32 16-bit elements,
// 8-row core groups 512 bytes apart; a K-major k-step (16 elements, 32 bytes) still lies inside
// one row, and MN-major B tiles hold 32 N elements per row, their N blocks LBO apart (d_head 96:
// three such blocks; 128-byte rows would leave the last one half-used, which no canonical wgmma
// layout describes).
template <int SWIZZLE_BYTES>
CF_DEVICE u64 smem_descriptor_swizzled(u32 smem_addr, u32 leading_bytes, u32 stride_bytes) {
    static_assert(SWIZZLE_BYTES == 128 || SWIZZLE_BYTES == 64, "128B or 64B swizzling");
    constexpr u64 layout = SWIZZLE_BYTES == 128 ? 1ull : 2ull;
    return (u64)((smem_addr & 0x3FFFF) >> 4) | ((u64)((leading_bytes >> 4) & 0x3FFF) << 16) |
           ((u64)((stride_bytes >> 4) & 0x3FFF) << 32) | (layout << 62);
}
CF_DEVICE u64 smem_descriptor_sw128(u32 smem_addr, u32 leading_bytes, u32 stride_bytes) {
    return smem_descriptor_swizzled<128>(smem_addr, leading_bytes, stride_bytes);
}

// Geometry of the Hopper families' 16-bit [rows][d_head] Q/K/V/dO tiles as TMA writes them:
// 128-byte swizzled rows of 64 elements where d_head is a multiple of 64, else (d_head 96)
// 64-byte swizzled rows of 32 (cupyflash/families/forward_sm90/tma.py col_block). A tile is
// D_BLOCKS column blocks of R rows; a K-major k-step (16 elements) is 32 bytes inside a row.
template <int D>
struct SwizzledTiles {
    static constexpr int ROW_BYTES = D % 64 == 0 ? 128 : 64;  // the swizzle span
    static constexpr int COL_BLOCK = ROW_BYTES / 2;           // 16-bit elements per swizzled row
    static constexpr int D_BLOCKS = D / COL_BLOCK;
    static constexpr int K_STEPS_PER_BLOCK = COL_BLOCK / 16;  // k-steps over d_head per column block
    static constexpr int CORE_GROUP_BYTES = 8 * ROW_BYTES;    // between 8-row core groups (SBO)
    static_assert(D % COL_BLOCK == 0 && (ROW_BYTES == 128 || D == 96),
                  "d_head a multiple of 64 (128-byte swizzled rows) or 96 (three 64-byte ones)");

    // Rows first .. ROWS - 1 of the ROWS-row tile at `tile` zeroed, by threads tid, tid + threads,
    // ... a 16-byte chunk at a time. A row is whole chunks of every column block and the swizzles
    // permute chunks within a row, so its bytes are the row's elements wherever they lie. (Not
    // unrolled: callers run it beside live accumulators or within a producer's few registers.)
    template <int ROWS>
    CF_DEVICE static void zero_rows(u32 tile, int first, int tid, int threads) {
        constexpr int CHUNKS = ROW_BYTES / 16;  // of one row in one column block
        const int count = (ROWS - first) * D_BLOCKS * CHUNKS;
#pragma unroll 1
        for (int i = tid; i < count; i += threads) {
            const int chunk = i % CHUNKS, rest = i / CHUNKS;
            st_shared_16(tile + (rest % D_BLOCKS) * ROWS * ROW_BYTES + (first + rest / D_BLOCKS) * ROW_BYTES + 16 * chunk,
                         make_uint4(0u, 0u, 0u, 0u));
        }
    }
};

// `desc` with its start address moved on by `bytes` (a multiple of 16). The start-address field is
// address >> 4 in the low 14 bits, and shared addresses stay below 228 KiB (< 2^18), so the add
// never carries into the leading-byte field: one add per k-step instead of re-encoding the
// descriptor from its address (an AND, a shift and the field ORs, each time).
CF_DEVICE u64 descriptor_advance(u64 desc, u32 bytes) {
    return (desc & 0xFFFFFFFF00000000ull) | (u32)((u32)desc + (bytes >> 4));
}

// `x` through an empty asm: ptxas no longer knows its value, so what a loop derives from it (a
// shared address, a wgmma descriptor) is computed where it is used instead of being hoisted and
// kept live across the loop, which at the consumers' register limits got spilled.
CF_DEVICE u32 opaque(u32 x) {
    asm volatile("" : "+r"(x));
    return x;
}

// `x`, which the caller knows is the same in every lane (a warpgroup index), taken from lane 0.
// ptxas cannot prove a value derived from threadIdx is warp-uniform, so a wgmma descriptor built
// from it lives in vector registers and is moved to uniform ones (R2UR) before every wgmma;
// built from the broadcast value it stays on the uniform datapath. Broadcast where the
// descriptor is built: one broadcast per kernel kept live across the loop made ptxas serialise
// the wgmma chain (C7512).
CF_DEVICE int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// Four 8x8 16-bit matrices to shared memory (stmatrix .x4): register i of every lane holds its
// pair of matrix i in the mma fragment layout (row lane / 4, columns 2 (lane % 4) and + 1), and
// lane 8 i + r gives the address of row r of matrix i. One instruction for what takes four
// 4-byte stores, each with its own address.
CF_DEVICE void stmatrix_x4(u32 dst, u32 a0, u32 a1, u32 a2, u32 a3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(a0), "r"(a1),
                 "r"(a2), "r"(a3));
}

// Orders this thread's register and shared-memory accesses before the wgmma ops that follow
// (needed before the first wgmma and whenever accumulators or A registers were touched).
CF_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
CF_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N_PENDING>
CF_DEVICE void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N_PENDING) : "memory");
}

// Keeps the compiler from moving reads or writes of accumulator registers across an async
// wgmma window (the registers are in flight between issue and wait).
template <int ROWS, int COLS>
CF_DEVICE void fence_registers(float (&r)[ROWS][COLS]) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int j = 0; j < COLS; ++j) asm volatile("" : "+f"(r[i][j])::"memory");
}
template <int ROWS, int COLS>
CF_DEVICE void fence_registers(u32 (&r)[ROWS][COLS]) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int j = 0; j < COLS; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// ---- mbarrier -------------------------------------------------------------------------------
CF_DEVICE void mbarrier_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}

// Makes the barrier initialisations visible to the async proxy (TMA complete_tx) as well.
CF_DEVICE void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// One arrival that also announces `bytes` of TMA transactions the current phase waits for.
CF_DEVICE void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

CF_DEVICE void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Blocks until the phase with parity `phase` has completed (a fresh barrier counts the phase
// before its first as completed, so waiting for parity 1 returns at once).
CF_DEVICE void mbarrier_wait(u32 bar, u32 phase) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(phase)
        : "memory");
}

// Arrive on `bar` and wait until the phase arrived on completes: a meeting of the barrier's
// arrival count of threads, each on its own (the phase is the arrival's state, so no parity is
// kept; that phase's next one cannot complete before this thread arrives again). Unlike bar.sync
// it takes threads of a warp that arrive split.
CF_DEVICE void mbarrier_meet(u32 bar) {
    asm volatile(
        "{\n"
        ".reg .b64 state;\n"
        ".reg .pred done;\n"
        "mbarrier.arrive.shared::cta.b64 state, [%0];\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.shared::cta.b64 done, [%0], state;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar)
        : "memory");
}

// Orders this thread's earlier generic-proxy shared-memory accesses before later async-proxy
// (TMA, wgmma) accesses of the same memory.
CF_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- TMA --------------------------------------------------------------------------------------
// `desc`: the generic address of a CUtensorMap (a member of the __grid_constant__ parameters).
CF_DEVICE void tma_prefetch_descriptor(const void* desc) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(desc)) : "memory");
}

// Copies the box at coordinates (c0 innermost .. c3) of a 4-D tensor into shared memory at
// `dst`, completing `bytes` of the current phase of mbarrier `bar`. Out-of-range elements of the
// box are written as zeros (the tail rows of a sequence).
CF_DEVICE void tma_load_4d(u32 dst, const void* desc, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(desc)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// ---- thread-block clusters ------------------------------------------------------------------------
// This CTA's rank in its cluster (0 .. cluster size - 1).
CF_DEVICE u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

// Every thread of every CTA of the cluster meets here: what each wrote before (barrier
// initialisations included) is visible cluster-wide after.
CF_DEVICE void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// One arrival on the mbarrier at the same shared offset `bar` in CTA `rank` of the cluster
// (mapa turns the local address into that CTA's window of the cluster's shared memory). The
// default (CTA-scope) release: a consumer releasing a stage has only read it, through wgmma,
// which it has waited for, so nothing of its own must become visible to the peer first.
CF_DEVICE void mbarrier_arrive_remote(u32 bar, u32 rank) {
    asm volatile(
        "{\n"
        ".reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
        "}\n" ::"r"(bar),
        "r"(rank)
        : "memory");
}

// tma_load_4d into the same shared offset `dst` of every CTA in `cta_mask` (bit i: cluster rank
// i), each copy completing its bytes on the mbarrier at offset `bar` of its own CTA.
CF_DEVICE void tma_load_4d_multicast(u32 dst, const void* desc, u32 bar, int c0, int c1, int c2, int c3,
                                     unsigned short cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(desc)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(cta_mask)
        : "memory");
}

// ---- warpgroup register reallocation and named barriers -----------------------------------------
// Only honoured when the kernel is compiled with __launch_bounds__(threads, 1) (ptxas C7508).
template <int REGS>
CF_DEVICE void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
CF_DEVICE void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// Named barriers 1..15 (0 is __syncthreads): `threads` counts every participant, syncing or not.
CF_DEVICE void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
CF_DEVICE void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
