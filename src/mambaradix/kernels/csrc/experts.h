/* The parts of a mixture-of-experts decode call that do not depend on the weights' format,
 * shared by linear.c (bf16 experts) and linear_fp8.c (fp8 experts): the gated and the plain
 * activation over a team, the pairs sorted by expert, and the weighted sum of each token's
 * experts. Header-only, static inline. */
#ifndef MAMBARADIX_EXPERTS_H
#define MAMBARADIX_EXPERTS_H

#include <stdint.h>

#include "conv_window.h"
#include "vec_math.h"

#define ACT_CHUNK 64 /* the gated blocks' activation in chunks of a row (act_team) */

/* h = silu(gate) * up for M rows of gu = [gate | up] ([M][2I] -> [M][I], bf16: the activation
 * and the product each rounded, as torch's bf16 ops hold them), in chunks of ACT_CHUNK of a row
 * (the last one of a row shorter where I is not a multiple). Called by every thread of a team;
 * the loop's barrier at its end. */
static inline __attribute__((always_inline)) void act_team(int64_t M, int64_t I, const uint16_t *gu, uint16_t *h)
{
    const int64_t chunks = (I + ACT_CHUNK - 1) / ACT_CHUNK; /* a row's */
#pragma omp for schedule(static)
    for (int64_t c = 0; c < M * chunks; c++) {
        const int64_t m = c / chunks, i0 = c % chunks * ACT_CHUNK;
        const int64_t n = I - i0 < ACT_CHUNK ? I - i0 : ACT_CHUNK;
        const uint16_t *g = gu + m * 2 * I + i0;
        uint16_t *hc = h + m * I + i0;
        int64_t i = 0;
#if HAVE_CONV_WINDOW
        for (; i + 16 <= n; i += 16) {
            const __m512 act = cw_round_bf16(cw_silu(cw_load_bf16(g + i)));
            _mm256_storeu_si256((__m256i *)(hc + i),
                                cw_ps_to_bf16(_mm512_mul_ps(act, cw_load_bf16(g + I + i))));
        }
#endif
        for (; i < n; i++) {
            const float a = bf16_to_f32(g[i]);
            const float act = round_bf16(silu_poly(a));
            hc[i] = f32_to_bf16(act * bf16_to_f32(g[I + i]));
        }
    }
}

#define MOE_SUM_COLS 256 /* moe_experts_bf16's weighted sums, columns at a time */

/* h = relu(u)^2 over M rows of I (Nemotron-H's plain experts): relu is exact in bf16 and the
 * square is rounded once, as torch's bf16 ops give it; NaN stays NaN. */
static inline __attribute__((always_inline)) void relu2_team(int64_t M, int64_t I, const uint16_t *u, uint16_t *h)
{
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < I; i++) {
            const float a = bf16_to_f32(u[m * I + i]);
            const float r = a < 0.0f ? 0.0f : a;
            h[m * I + i] = f32_to_bf16(r * r);
        }
}

/* The T * K (token, expert) pairs grouped by expert with a counting sort (stable: an expert's
 * rows in pair order) into idx [2P + 2E + 1]: slot[p] (idx) pair p's row in the sorted order
 * or -1 for an id outside 0..E-1 (it contributes nothing), pair[s] (idx + P) the pair at row s,
 * start[e] .. start[e + 1] (idx + 2P) expert e's rows. Returns the rows. */
static inline int64_t experts_sort(int64_t P, int64_t E, const int64_t *ids, int64_t *idx)
{
    int64_t *slot = idx, *pair = idx + P, *start = idx + 2 * P;
    int64_t *next = idx + 2 * P + E + 1; /* the sort's cursors */
    for (int64_t e = 0; e <= E; e++)
        start[e] = 0;
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0 && ids[p] < E)
            start[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) {
        start[e + 1] += start[e];
        next[e] = start[e];
    }
    for (int64_t p = 0; p < P; p++) {
        const int64_t e = ids[p];
        slot[p] = e >= 0 && e < E ? next[e]++ : -1;
        if (slot[p] >= 0)
            pair[slot[p]] = p;
    }
    return start[E];
}

/* out[t] = sum_k weights[t*K + k] * y[slot[t*K + k]] over a team: in fp32, in k order, rounded
 * once (as moe_unpad_bf16's). */
static inline __attribute__((always_inline)) void experts_sum_team(
    int64_t T, int64_t K, int64_t H, const int64_t *slot, const float *weights,
    const uint16_t *y, uint16_t *out)
{
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t d0 = 0; d0 < H; d0 += MOE_SUM_COLS) {
            const int64_t n = H - d0 < MOE_SUM_COLS ? H - d0 : MOE_SUM_COLS;
            float acc[MOE_SUM_COLS];
            for (int64_t d = 0; d < n; d++)
                acc[d] = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                const int64_t s = slot[t * K + k];
                if (s < 0)
                    continue;
                const float w = weights[t * K + k];
                const uint16_t *ys = y + s * H + d0;
#pragma omp simd
                for (int64_t d = 0; d < n; d++)
                    acc[d] += w * bf16_to_f32(ys[d]);
            }
#pragma omp simd
            for (int64_t d = 0; d < n; d++)
                out[t * H + d0 + d] = f32_to_bf16(acc[d]);
        }
}

#endif
