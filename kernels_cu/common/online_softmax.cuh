// Online softmax over the key blocks of one warp's query rows (FlashAttention-2 style), in fp32.
//
// A lane holds, for each 16-row m-tile, two rows (lane/4 and lane/4 + 8) and in each 8-column
// n-tile two columns of each; the four lanes of a quad share a row, so row reductions are
// thread-local followed by two xor-shuffles. Row sums stay per-lane partial sums until the end:
// nothing reads them before the final normalisation, so one quad reduction there replaces one
// per block.
#pragma once

// 2^x for x <= 0 on the FMA/ALU pipes instead of MUFU.EX2 (16 results per clock per SM): x is
// split as j + f with j = round(x) (the 1.5 * 2^23 shift puts j in the low mantissa bits, no
// conversion instruction) and f in [-1/2, 1/2]; 2^f by a degree-3 polynomial (relative error
// 1.0e-4, under the 16-bit rounding of P), then j added to the exponent field. x is clamped at
// -127, where f = 0 and p = 1 exactly give +0.0 (masked scores, -inf, come out as exact zeros).
CF_DEVICE float poly_exp2(float x) {
    x = fmaxf(x, -127.f);
    const float shifted = __fadd_rn(x, 12582912.f);
    const float j = __fsub_rn(shifted, 12582912.f);
    const float f = __fsub_rn(x, j);
    const float p = fmaf(fmaf(fmaf(0.05500871f, f, 0.24221069f), f, 0.6932829f), f, 1.f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(shifted) << 23));
}

// EMU_QUARTERS: of every four 8-column tiles of scores, this many take their exponentials from
// poly_exp2 (the optimized path only; 0 = all on MUFU.EX2).
// LAZY_LOG2 > 0 (optimized path only): a row's running max moves only when a block's max exceeds
// it by more than LAZY_LOG2 in exp2 units; otherwise the old max stays, the rescale factor is
// exactly 1 and the probabilities may reach 2^LAZY_LOG2. Sums, outputs and the log-sum-exp all
// refer to the same (stale) max, so the result is unchanged but for rounding.
template <int M_TILES, int N_TILES, bool OPTIMIZED, int EMU_QUARTERS = 0, int LAZY_LOG2 = 0>
struct OnlineSoftmax {
    // OPTIMIZED keeps the running max in raw score units and folds scale*log2(e) into one FFMA
    // that feeds ex2; the plain path scales every score first and converts to base 2 separately.
    static_assert(EMU_QUARTERS == 0 || OPTIMIZED, "exp2 emulation is a variant of the optimized path");
    static_assert(LAZY_LOG2 == 0 || OPTIMIZED, "lazy rescaling is a variant of the optimized path");
    float row_max[M_TILES][2];
    float row_sum[M_TILES][2];

    CF_DEVICE void init() {
#pragma unroll
        for (int m = 0; m < M_TILES; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                row_max[m][h] = CF_NEG_INF;
                row_sum[m][h] = 0.f;
            }
    }

    // Turn the scores of one key block into unnormalised probabilities in place and return in
    // `rescale` the factor by which the running output rows must be multiplied. FIRST (only
    // used by the optimized path) skips the rescale: nothing has been accumulated yet. `s` holds
    // N_TILES column tiles, or fewer (N) for a block whose later columns are masked for every row.
    template <bool FIRST, int N>
    CF_DEVICE void update(float (&s)[M_TILES][N][4], float (&rescale)[M_TILES][2], float scale,
                          float scale_log2) {
        static_assert(N <= N_TILES, "a block has at most N_TILES column tiles");
        if constexpr (!OPTIMIZED) {
#pragma unroll
            for (int m = 0; m < M_TILES; ++m)
#pragma unroll
                for (int n = 0; n < N; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[m][n][e] *= scale;
        }
#pragma unroll
        for (int m = 0; m < M_TILES; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float block_max = row_max[m][h];
#pragma unroll
                for (int n = 0; n < N; ++n) block_max = fmaxf(block_max, fmaxf(s[m][n][2 * h], s[m][n][2 * h + 1]));
                block_max = quad_max(block_max);
                // Lazy: keep the old max unless the block's exceeds it by more than 2^LAZY_LOG2 (an
                // all-masked row's -inf is replaced by any finite max). A select, not a branch:
                // the rows of a warp decide differently.
                bool keep = false;
                if constexpr (LAZY_LOG2 > 0 && !FIRST) {
                    keep = !(block_max * scale_log2 > fmaf(row_max[m][h], scale_log2, (float)LAZY_LOG2));
                    block_max = keep ? row_max[m][h] : block_max;
                }
                // A row whose keys are all masked so far has max -inf; use 0 so that
                // (-inf) - (-inf) never produces NaN. Its probabilities are exp2(-inf) = 0.
                const float safe_max = block_max == CF_NEG_INF ? 0.f : block_max;
                if constexpr (OPTIMIZED) {
                    const float max_scaled = safe_max * scale_log2;
                    if constexpr (FIRST) {
                        rescale[m][h] = 1.f;
                    } else {
                        rescale[m][h] = fast_exp2(fmaf(row_max[m][h], scale_log2, -max_scaled));
                        if constexpr (LAZY_LOG2 > 0) rescale[m][h] = keep ? 1.f : rescale[m][h];
                        row_sum[m][h] *= rescale[m][h];
                    }
                    float sum = 0.f;
#pragma unroll
                    for (int n = 0; n < N; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float x = fmaf(s[m][n][2 * h + e], scale_log2, -max_scaled);
                            const float p = (n % 4 < EMU_QUARTERS) ? poly_exp2(x) : fast_exp2(x);
                            s[m][n][2 * h + e] = p;
                            sum += p;
                        }
                    row_sum[m][h] += sum;
                } else {
                    rescale[m][h] = fast_exp2((row_max[m][h] - safe_max) * CF_LOG2E);
                    row_sum[m][h] *= rescale[m][h];
                    float sum = 0.f;
#pragma unroll
                    for (int n = 0; n < N; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float p = fast_exp2((s[m][n][2 * h + e] - safe_max) * CF_LOG2E);
                            s[m][n][2 * h + e] = p;
                            sum += p;
                        }
                    row_sum[m][h] += sum;
                }
                row_max[m][h] = block_max;
            }
        }
    }

    // Full row sums (after the quad reduction); call once, after the last block.
    CF_DEVICE void finish(float (&total)[M_TILES][2]) const {
#pragma unroll
        for (int m = 0; m < M_TILES; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) total[m][h] = quad_sum(row_sum[m][h]);
    }

    // Natural-log log-sum-exp of the scaled scores of row (m, h), given its full row sum.
    CF_DEVICE float log_sum_exp(int m, int h, float total, float scale) const {
        if (total == 0.f) return CF_NEG_INF;
        const float max_scaled = OPTIMIZED ? row_max[m][h] * scale : row_max[m][h];
        return max_scaled + __logf(total);
    }
};
