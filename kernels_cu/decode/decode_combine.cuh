// Exact merge of split-KV partial results, and the in-place append of new keys/values.
#pragma once

// One warp per output row (batch, t, head): lse = log(sum_s exp(lse_s)), O = sum_s
// exp(lse_s - lse) * O_s. Splits that saw no key carry lse_s = -inf and weigh 0 (their partial
// rows hold zeros); a row no split saw gets O = 0 and lse = -inf.
template <class Cfg, bool CAUSAL, bool PAGED>
__global__ void __launch_bounds__(128) decode_combine_kernel(const __grid_constant__ DecodeParams p) {
    constexpr int D = Cfg::D;
    constexpr int PER_LANE = D / 32;  // 2, 4 or 8 consecutive elements
    __shared__ float weights[4][CF_DECODE_MAX_SPLITS];
    pdl_wait_for_predecessor();  // every split's partial rows are written
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * 4 + warp;
    if (row >= p.total_rows) return;  // warp-uniform; no CTA barrier follows
    const int n_splits = p.num_splits;

    // The first FIRST splits' partial rows are loaded together with the log-sum-exps (they do
    // not depend on them), so up to FIRST splits cost one L2 round trip instead of two.
    constexpr int FIRST = 8;
    const float* src = p.ws_o + (long long)row * D + lane * PER_LANE;
    const long long split_stride = (long long)p.total_rows * D;
    float2 first[FIRST][PER_LANE / 2];
#pragma unroll
    for (int s = 0; s < FIRST; ++s)
#pragma unroll
        for (int e = 0; e < PER_LANE / 2; ++e)
            first[s][e] = s < n_splits ? __ldcg(reinterpret_cast<const float2*>(src + s * split_stride) + e)
                                       : make_float2(0.f, 0.f);

    // Each lane keeps the log-sum-exp of splits lane, lane + 32, ... in registers: one load each.
    constexpr int PER_LANE_SPLITS = CF_DECODE_MAX_SPLITS / 32;
    float part[PER_LANE_SPLITS];
    float mx = CF_NEG_INF;
#pragma unroll
    for (int j = 0; j < PER_LANE_SPLITS; ++j) {
        const int s = lane + 32 * j;
        part[j] = s < n_splits ? __ldcg(p.ws_lse + (long long)s * p.total_rows + row) : CF_NEG_INF;
        mx = fmaxf(mx, part[j]);
    }
    mx = warp_max(mx);
    float lse = CF_NEG_INF;
    if (mx != CF_NEG_INF) {
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < PER_LANE_SPLITS; ++j) sum += __expf(part[j] - mx);  // exp(-inf) = 0
        lse = mx + __logf(warp_sum(sum));
    }
#pragma unroll
    for (int j = 0; j < PER_LANE_SPLITS; ++j) {
        const int s = lane + 32 * j;
        if (s < n_splits) weights[warp][s] = lse == CF_NEG_INF ? 0.f : __expf(part[j] - lse);
    }
    __syncwarp();

    // Every split wrote its rows (zeros where it saw no key), so all are read: unrolled, the
    // loads of several splits are in flight together instead of one L2 round trip per split.
    float acc[PER_LANE];
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) acc[e] = 0.f;
#pragma unroll
    for (int s = 0; s < FIRST; ++s) {
        const float w = s < n_splits ? weights[warp][s] : 0.f;
#pragma unroll
        for (int e = 0; e < PER_LANE / 2; ++e) {
            acc[2 * e] = fmaf(w, first[s][e].x, acc[2 * e]);
            acc[2 * e + 1] = fmaf(w, first[s][e].y, acc[2 * e + 1]);
        }
    }
#pragma unroll 8
    for (int s = FIRST; s < n_splits; ++s) {
        const float w = weights[warp][s];
        const float* x = src + s * split_stride;
#pragma unroll
        for (int e = 0; e < PER_LANE; e += 2) {
            const float2 v = __ldcg(reinterpret_cast<const float2*>(x + e));
            acc[e] = fmaf(w, v.x, acc[e]);
            acc[e + 1] = fmaf(w, v.y, acc[e + 1]);
        }
    }

    const int head = row % p.n_heads;
    const int bt = row / p.n_heads;
    const int t = bt % p.seq_q, batch = bt / p.seq_q;
    u32 packed[PER_LANE / 2];
#pragma unroll
    for (int e = 0; e < PER_LANE / 2; ++e) packed[e] = pack_pair<Cfg::dtype>(acc[2 * e], acc[2 * e + 1]);
    u16* o = static_cast<u16*>(p.o) + batch * p.o_batch_stride + t * p.o_seq_stride + head * p.o_head_stride +
             lane * PER_LANE;
    if constexpr (PER_LANE == 8) {
        st_global_16(o, make_uint4(packed[0], packed[1], packed[2], packed[3]));
    } else if constexpr (PER_LANE == 4) {
        *reinterpret_cast<uint2*>(o) = make_uint2(packed[0], packed[1]);
    } else {
        *reinterpret_cast<u32*>(o) = packed[0];
    }
    if (lane == 0 && p.lse != nullptr) p.lse[((long long)batch * p.n_heads + head) * p.seq_q + t] = lse;
}

// k_new / v_new (batch, seq_new, n_kv_heads, d) -> cache rows cache_seqlens[b] + t, through the
// page table when PAGED. One 16-byte chunk of K and of V per thread; grid (chunks / 128, batch).
template <class Cfg, bool CAUSAL, bool PAGED>
__global__ void __launch_bounds__(128) decode_append_kernel(const __grid_constant__ DecodeParams p) {
    constexpr int CPR = Cfg::CHUNKS_PER_ROW;
    pdl_launch_dependents();  // the attention kernel may launch; it waits for these rows
    const int idx = blockIdx.x * 128 + threadIdx.x;
    if (idx >= p.seq_new * p.n_kv_heads * CPR) return;
    const int batch = blockIdx.y;
    const int chunk = idx % CPR, rest = idx / CPR;
    const int head = rest % p.n_kv_heads, t = rest / p.n_kv_heads;
    const int pos = p.cache_seqlens[batch] + t;
    const long long k_dst = cache_row_offset<PAGED>(p, batch, pos, p.k_batch_stride, p.k_seq_stride) +
                            head * p.k_head_stride + chunk * 8;
    const long long v_dst = cache_row_offset<PAGED>(p, batch, pos, p.v_batch_stride, p.v_seq_stride) +
                            head * p.v_head_stride + chunk * 8;
    const u16* k_src = static_cast<const u16*>(p.k_new) + batch * p.knew_batch_stride + t * p.knew_seq_stride +
                       head * p.knew_head_stride + chunk * 8;
    const u16* v_src = static_cast<const u16*>(p.v_new) + batch * p.vnew_batch_stride + t * p.vnew_seq_stride +
                       head * p.vnew_head_stride + chunk * 8;
    st_global_16(static_cast<u16*>(const_cast<void*>(p.k_cache)) + k_dst, ld_global_16(k_src));
    st_global_16(static_cast<u16*>(const_cast<void*>(p.v_cache)) + v_dst, ld_global_16(v_src));
}
