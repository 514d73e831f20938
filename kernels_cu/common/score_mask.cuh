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
    // (a, b, c, d) is (m, h, n, e) with ROWS_OUTER, else (n, e, m, h): one nest, two orders
    constexpr int A = ROWS_OUTER ? M : N, C = ROWS_OUTER ? N : M;
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
        for (int b = 0; b < 2; ++b)
#pragma unroll
            for (int c = 0; c < C; ++c)
#pragma unroll
                for (int d = 0; d < 2; ++d) {
                    const int m = ROWS_OUTER ? a : c, h = ROWS_OUTER ? b : d;
                    const int n = ROWS_OUTER ? c : a, e = ROWS_OUTER ? d : b;
                    if (masked(m, h, 8 * n + 2 * (lane & 3) + e)) s[m][n][2 * h + e] = CF_NEG_INF;
                }
}

// One m-tile held without its m index (s[n][4]).
template <bool ROWS_OUTER = false, int N, class Masked>
CF_DEVICE void mask_fragments(float (&s)[N][4], int lane, Masked&& masked) {
    mask_fragments<ROWS_OUTER>(reinterpret_cast<float (&)[1][N][4]>(s), lane, masked);
}
