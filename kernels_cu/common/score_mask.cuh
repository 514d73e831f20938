// Masking of attention scores held in mma.m16n8k16 accumulator fragments (the C layout, which a
// wgmma m64nN accumulator repeats per warp): per 16-row m-tile a lane holds rows lane/4 and
// lane/4 + 8 (h = 0, 1), per 8-column n-tile columns 2*(lane%4) and +1 (e = 0, 1), so element
// s[m][n][2h + e] sits at row 16m + 8h + lane/4 and column 8n + 2*(lane%4) + e of the warp's tile.
#pragma once

#define CF_NEG_INF (-__int_as_float(0x7f800000))
#define CF_LOG2E 1.4426950408889634f

// Every element for which masked(m, h, col) holds becomes -inf; `col` is the element's column in
// the warp's tile, (m, h) its row as above (the caller adds its own row offsets, lane/4
// included). Fully unrolled, so the predicate's arithmetic folds per element. ROWS_OUTER walks
// rows in the outer loops (predicates built mostly from the row) instead of columns: the order
// moves ptxas' register allocation, and kernels near 255 registers (backward_sm80's dK/dV
// kernels) or with little headroom (forward_sm90 at 168) spill with the other one. How the
// predicate is written moves it too: with short-circuits (||) forward_sm80's causal kernel came
// out 15% longer than with | (ptxas then predicates the stores directly), while backward_sm80's
// 2-D dK/dV kernel needs the || form to stay within 255 registers.
template <bool ROWS_OUTER = false, int M, int N, class Masked>
CF_DEVICE void mask_fragments(float (&s)[M][N][4], int lane, Masked&& masked) {
    if constexpr (ROWS_OUTER) {
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int n = 0; n < N; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (masked(m, h, 8 * n + 2 * (lane & 3) + e)) s[m][n][2 * h + e] = CF_NEG_INF;
    } else {
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
#pragma unroll
                for (int m = 0; m < M; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        if (masked(m, h, 8 * n + 2 * (lane & 3) + e)) s[m][n][2 * h + e] = CF_NEG_INF;
    }
}

// One m-tile held without its m index (s[n][4]).
template <bool ROWS_OUTER = false, int N, class Masked>
CF_DEVICE void mask_fragments(float (&s)[N][4], int lane, Masked&& masked) {
    mask_fragments<ROWS_OUTER>(reinterpret_cast<float (&)[1][N][4]>(s), lane, masked);
}
