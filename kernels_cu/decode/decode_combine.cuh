// Exact merge of split-KV partial results (the in-place append of k_new / v_new is done by the
// attention kernel: see decode_attention.cuh).
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
    // not depend on them), so up to FIRST splits cost one L2 round trip instead of two. 16 where
    // a lane's slice is small (d_head <= 128: 32 registers), so that the 16 splits of a paged
    // batch-1 cache (one CTA per SM) need no second round trip; 8 at d_head 256.
    constexpr int FIRST = PER_LANE <= 4 ? 16 : 8;
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
