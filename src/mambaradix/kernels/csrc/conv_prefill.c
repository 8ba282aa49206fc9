/* The causal depthwise conv of S varlen prefill segments, carrying each segment's conv state.
 *
 * Segment s is rows cu[s] .. cu[s+1] - 1 of x ([T][C], rows strided, channels dense); its state
 * conv_pool[slots[s]] ([C][K-1]: the last K-1 inputs, oldest first) is the window before its
 * first token and is replaced by the window after its last; snapshot k (of segment snap_seq[k],
 * sorted by segment, then offset) gets the window after snap_off[k] tokens in
 * conv_pool[snap_slot[k]]. out[t][c] = act(bias[c] + sum_j w[c][j] window_t[j]) ([T][C], dense),
 * the sum in fp32 and, in bf16, rounded once before the activation and once after it, as the
 * torch reference (F.conv1d, then F.silu) holds them. act: SiLU or none.
 *
 * Row by row: out[t] reads the input rows t-K+1 .. t themselves (rows before a segment's first
 * token come from a copy of its state laid out as rows), so a task is a tile of TILE tokens of
 * one segment, walking its rows in order and each row's channels in order: every access runs
 * along a row, and tiles are independent. This kernel first carried each 32-channel block's
 * window down all of a segment's tokens instead, reading 64 bytes of every row, a page apart:
 * no prefetcher follows such a stride, and a Qwen3.5-0.8B layer's 2,048 tokens (6,144
 * channels) took ~20 ms on 2 cores of an AMX Xeon, ~10x what its bytes cost. The states and
 * snapshots (the K-1 inputs before an offset) are written after every output is, from the
 * copy: a segment's final state replaces the state its first rows read. The same operations in
 * the same order as before: the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "conv_window.h"
#include "vec_math.h"

#define TILE 32 /* tokens a task computes */
#define VL 32   /* channels the portable row loop takes at a time */

/* out[c] = act(bias[c] + sum_{j < K} wt[j][c] rows[j][c]) for c < C, the sum in that order
 * (bias, then the oldest input first), rounded where a bf16 tensor would hold it before and
 * after the activation. rows[j]: K rows of C inputs (the newest last), wt: [K][C] and bias:
 * [C] (or NULL) in fp32, out: C outputs. */
static inline __attribute__((always_inline)) void conv_row(
    const void *const *rows, const float *wt, const float *bias, void *out, int64_t C,
    int64_t K, int silu, const int bf)
{
    const int64_t k1 = K - 1;
    int64_t c0 = 0;
#if HAVE_CONV_WINDOW
    if (bf) {
        for (; c0 + 16 <= C; c0 += 16) {
            __m512 acc = bias ? _mm512_loadu_ps(bias + c0) : _mm512_setzero_ps();
            for (int64_t j = 0; j < k1; j++)
                acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(wt + j * C + c0),
                                                       cw_load_bf16((const uint16_t *)rows[j] + c0)));
            acc = cw_round_bf16(_mm512_add_ps(
                acc, _mm512_mul_ps(_mm512_loadu_ps(wt + k1 * C + c0),
                                   cw_load_bf16((const uint16_t *)rows[k1] + c0))));
            if (silu)
                acc = cw_silu(acc);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + c0), cw_ps_to_bf16(acc));
        }
    }
#endif
    for (; c0 < C; c0 += VL) {
        const int n = C - c0 < VL ? (int)(C - c0) : VL;
        float acc[VL];
#pragma omp simd
        for (int i = 0; i < n; i++)
            acc[i] = bias ? bias[c0 + i] : 0.0f;
        for (int64_t j = 0; j < k1; j++) {
            const float *wj = wt + j * C + c0;
#pragma omp simd
            for (int i = 0; i < n; i++)
                acc[i] += wj[i] * ld(rows[j], c0 + i, bf);
        }
        const float *wk = wt + k1 * C + c0;
#pragma omp simd
        for (int i = 0; i < n; i++)
            acc[i] = rnd(acc[i] + wk[i] * ld(rows[k1], c0 + i, bf), bf);
        if (silu) {
#pragma omp simd
            for (int i = 0; i < n; i++)
                st(out, c0 + i, silu_poly(acc[i]), bf);
        } else {
#pragma omp simd
            for (int i = 0; i < n; i++)
                st(out, c0 + i, acc[i], bf);
        }
    }
}

/* The input row at offset i of segment s (i < 0: the state's row k1 + i, from pre). */
static inline __attribute__((always_inline)) const char *conv_input_row(
    int64_t s, int64_t i, const int64_t *cu, const void *x, int64_t xs, const char *pre,
    int64_t C, int64_t k1, int64_t esz)
{
    return i >= 0 ? (const char *)x + (cu[s] + i) * xs * esz
                  : pre + ((s * k1) + k1 + i) * C * esz;
}

#define CONV_PREFILL_ARGS                                                                    \
    int64_t S, const int64_t *cu, const int64_t *slots, const void *x, int64_t xs,          \
        void *pool, const void *w, const void *bias, void *out, int64_t C, int64_t K,       \
        int silu, int64_t NS, const int64_t *snap_seq, const int64_t *snap_off,             \
        const int64_t *snap_slot

/* Returns 0, or -1 (nothing done) for a kernel wider than 64 or scratch it could not allocate.
 * Scratch: the weights and bias in fp32 ([K][C], [C]), every segment's state as K-1 rows
 * ([S][K-1][C], the pool's dtype) and the tasks (segment, first token). Four loops in one
 * parallel region, each waiting for the one before: the scratch, the outputs by tile, the
 * states and snapshots by segment. */
#define CONV_PREFILL(bf)                                                                     \
    do {                                                                                     \
        if (K < 1 || K > 64)                                                                 \
            return -1;                                                                       \
        const int64_t k1 = K - 1, esz = (bf) ? 2 : 4;                                         \
        int64_t tasks = 0;                                                                   \
        for (int64_t s = 0; s < S; s++)                                                      \
            tasks += (cu[s + 1] - cu[s] + TILE - 1) / TILE;                                  \
        float *wt = malloc(sizeof(float) * (K + 1) * C);                                     \
        char *pre = malloc((size_t)(S * k1 * C * esz) + 1);                                  \
        int64_t *task = malloc(sizeof(int64_t) * 2 * (tasks + 1));                           \
        if (!wt || !pre || !task) {                                                          \
            free(wt);                                                                        \
            free(pre);                                                                       \
            free(task);                                                                      \
            return -1;                                                                       \
        }                                                                                    \
        float *bias32 = bias ? wt + K * C : NULL;                                              \
        for (int64_t s = 0, n = 0; s < S; s++)                                               \
            for (int64_t t = 0; t < cu[s + 1] - cu[s]; t += TILE, n++) {                     \
                task[2 * n] = s;                                                             \
                task[2 * n + 1] = t;                                                         \
            }                                                                                \
        _Pragma("omp parallel")                                                              \
        {                                                                                    \
            _Pragma("omp for schedule(static)")                                              \
            for (int64_t c = 0; c < C; c++) {                                                \
                for (int64_t j = 0; j < K; j++)                                              \
                    wt[j * C + c] = ld(w, c * K + j, bf);                                    \
                if (bias)                                                                    \
                    bias32[c] = ld(bias, c, bf);                                               \
            }                                                                                \
            _Pragma("omp for schedule(static)")                                              \
            for (int64_t s = 0; s < S; s++)                                                  \
                for (int64_t c = 0; c < C; c++)                                              \
                    for (int64_t p = 0; p < k1; p++)                                         \
                        st(pre, (s * k1 + p) * C + c, ld(pool, (slots[s] * C + c) * k1 + p, bf), \
                           bf);                                                              \
            _Pragma("omp for schedule(dynamic, 2)")                                          \
            for (int64_t n = 0; n < tasks; n++) {                                            \
                const int64_t s = task[2 * n], t0 = task[2 * n + 1];                         \
                const int64_t len = cu[s + 1] - cu[s];                                       \
                const int64_t t1 = t0 + TILE < len ? t0 + TILE : len;                        \
                const void *rows[64];                                                        \
                for (int64_t t = t0; t < t1; t++) {                                          \
                    for (int64_t j = 0; j < K; j++)                                          \
                        rows[j] = conv_input_row(s, t - k1 + j, cu, x, xs, pre, C, k1, esz); \
                    conv_row(rows, wt, bias32, (char *)out + (cu[s] + t) * C * esz, C, K, silu, \
                             bf);                                                            \
                }                                                                            \
            }                                                                                \
            _Pragma("omp for schedule(dynamic, 1)")                                          \
            for (int64_t s = 0; s < S; s++) {                                                \
                const int64_t len = cu[s + 1] - cu[s];                                       \
                for (int64_t k = 0; k <= NS; k++) {                                          \
                    if (k < NS && snap_seq[k] != s)                                          \
                        continue;                                                            \
                    const int64_t off = k < NS ? snap_off[k] : len;                          \
                    const int64_t dst = k < NS ? snap_slot[k] : slots[s];                    \
                    for (int64_t p = 0; p < k1; p++) {                                       \
                        const char *row =                                                    \
                            conv_input_row(s, off - k1 + p, cu, x, xs, pre, C, k1, esz);     \
                        for (int64_t c = 0; c < C; c++)                                      \
                            st(pool, (dst * C + c) * k1 + p, ld(row, c, bf), bf);            \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        free(wt);                                                                            \
        free(pre);                                                                           \
        free(task);                                                                          \
        return 0;                                                                            \
    } while (0)

int conv1d_prefill(CONV_PREFILL_ARGS) { CONV_PREFILL(0); }

int conv1d_prefill_bf16(CONV_PREFILL_ARGS) { CONV_PREFILL(1); }
