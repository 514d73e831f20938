// Thin wrappers around the PTX instructions the kernels use. Everything here is a single
// instruction (or a fixed pair); no toolkit header is needed, so NVRTC compiles this on a
// machine that has only the driver.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define CF_DEVICE __device__ __forceinline__

// Generic -> shared-window address, as the 32-bit operand that cp.async/ldmatrix/st.shared take.
CF_DEVICE u32 shared_address(const void* ptr) {
    return static_cast<u32>(__cvta_generic_to_shared(ptr));
}

// ---- global -> shared copies --------------------------------------------------------------
// 16-byte asynchronous copy, bypassing L1 (.cg). src_bytes = 0 writes zeros, which is how tail
// rows beyond the sequence end are filled without a branch around the instruction.
CF_DEVICE void cp_async_16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

CF_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N_PENDING>
CF_DEVICE void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N_PENDING));
}

CF_DEVICE uint4 ld_global_16(const void* src) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(src));
    return v;
}

CF_DEVICE void st_shared_16(u32 dst, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

CF_DEVICE uint4 ld_shared_16(u32 src) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(src));
    return v;
}

CF_DEVICE void st_shared_4(u32 dst, u32 v) { asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(dst), "r"(v)); }

CF_DEVICE void st_global_16(void* dst, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// ---- shared -> registers ------------------------------------------------------------------
// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, register i of every
// lane receives its piece of matrix i (row lane/4, columns 2*(lane%4) and +1).
CF_DEVICE void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Same, transposed: the lane receives column lane/4, rows 2*(lane%4) and +1.
CF_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// ---- tensor-core mma ----------------------------------------------------------------------
// D = A(16x16, row) * B(16x8, col) + D with fp32 accumulators.
template <DType T>
CF_DEVICE void mma_m16n8k16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);

template <>
CF_DEVICE void mma_m16n8k16<DType::FP16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
CF_DEVICE void mma_m16n8k16<DType::BF16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- conversions and special functions ----------------------------------------------------
// Two fp32 values -> one register of two 16-bit values, `lo` in the low half (round to nearest).
template <DType T>
CF_DEVICE u32 pack_pair(float lo, float hi);

template <>
CF_DEVICE u32 pack_pair<DType::FP16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <>
CF_DEVICE u32 pack_pair<DType::BF16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

CF_DEVICE float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

CF_DEVICE float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

CF_DEVICE float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// 4x4 transpose of 32-bit words across a lane quad: lane c's a[i] becomes lane i's a[c]. An mma
// accumulator row's words (two 16-bit columns each, lane c holding columns 2c, 2c + 1 of every
// 8-column n-tile) then give lane c the 8 consecutive columns of n-tile c of 4: one 16-byte store
// instead of four 4-byte ones. Two exchange steps (lane bits 1, then 0), each swapping the two
// words whose index bit differs from the lane's; every lane of the warp must take part.
CF_DEVICE void quad_transpose(u32 (&a)[4], int lane) {
    const bool b1 = lane & 2, b0 = lane & 1;
    u32 r0 = __shfl_xor_sync(0xffffffffu, b1 ? a[0] : a[2], 2);
    u32 r1 = __shfl_xor_sync(0xffffffffu, b1 ? a[1] : a[3], 2);
    a[0] = b1 ? r0 : a[0];
    a[1] = b1 ? r1 : a[1];
    a[2] = b1 ? a[2] : r0;
    a[3] = b1 ? a[3] : r1;
    r0 = __shfl_xor_sync(0xffffffffu, b0 ? a[0] : a[1], 1);
    r1 = __shfl_xor_sync(0xffffffffu, b0 ? a[2] : a[3], 1);
    a[0] = b0 ? r0 : a[0];
    a[2] = b0 ? r1 : a[2];
    a[1] = b0 ? a[1] : r0;
    a[3] = b0 ? a[3] : r1;
}

// One row's 16-byte chunk from a lane quad's accumulator fragments: n-tiles 4 g .. 4 g + 3 of
// `acc` (lane c holding columns 8 i + 2 c, + 1 of n-tile i as elements e, e + 1), times `scale`,
// packed to 16 bits and quad-transposed, so lane c gets the 8 consecutive columns of n-tile
// 4 g + c (columns 32 g + 8 c ..). Every lane of the warp must take part.
template <DType T, int N>
CF_DEVICE uint4 quad_row_chunk(const float (&acc)[N][4], int g, int e, float scale, int lane) {
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = pack_pair<T>(acc[4 * g + i][e] * scale, acc[4 * g + i][e + 1] * scale);
    quad_transpose(w, lane);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---- programmatic dependent launch (sm_90+) ----------------------------------------------------
// The launches: cupyflash/kvcache_pdl.py and cupyflash/families/backward_sm90/pdl_launch.py. A
// kernel launched as a programmatic dependent waits here until the kernel before it on the stream has completed and
// its writes are visible; without that launch attribute (and before sm_90) both are no-ops.
CF_DEVICE void pdl_wait_for_predecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel's grid launch as soon as every CTA of this one has started, so its
// launch overlaps this grid's run (it still waits for this grid's results before using them).
CF_DEVICE void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
