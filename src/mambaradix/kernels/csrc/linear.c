/* Skinny bf16 matmul for decode: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few
 * rows m, w [N, K] row-major (nn.Linear's weight), x rows strided, out [M, N] dense.
 *
 * Why: a decode step reads every weight once for one or a few tokens, so it runs at the speed
 * the weights stream from memory. torch's bf16 linear for one row read its weights at 14-20
 * GB/s here (bench/bench_linear.py, weights out of cache) where a plain read reaches 31-50;
 * this kernel reaches 24-31.
 *
 * How: output features are split over the threads, each thread reading its block as two
 * streams; each weight row is streamed once and dotted with every x row while it sits in L1.
 * Products are exact (bf16 x bf16 fits in fp32; the AVX-512 instruction flushes denormals) and
 * accumulate in fp32 lanes summed at the end, in an order fixed by K alone: a row's result
 * never depends on the other rows of the batch, the grouping of weight rows or the thread
 * count. The bias is added in fp32
 * before the single rounding to bf16, as torch's addmm does.
 */
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "conv_window.h"
#include "vec_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define XR 4 /* x rows dotted with one loaded weight chunk */
/* Weights are prefetched this many elements (2 KB) ahead of the loads: on an Intel Xeon VM the
 * two threads streamed 20-21 GB/s without, 25-26 with (in-process A/B over 1 GB of weights; a
 * plain read: 23-27); the hardware prefetchers alone kept too few lines in flight. 4 KB was no
 * better with two streams per thread. Prefetches past the matrix's end are hints and never
 * fault. */
#define PF_DIST 1024
#define ACT_CHUNK 64 /* gated_mlp_bf16's activation in chunks (I a multiple of it) */

#if HAVE_DPBF16
/* R x rows (R a constant at each call) dotted with S weight rows w[0..S) of K bf16, one
 * stream each. Each dot keeps four fp32 accumulators, chunk j of every 128 pairs going to
 * accumulator j (32 pairs per instruction), then whole chunks of 32 into the first and a masked
 * tail into the second, summed as (a0 + a1) + (a2 + a3): the same order for every R and S, so a
 * row's result does not depend on how the batch or the weight rows are grouped. Four
 * independent chains per dot hide the instruction's latency when R is 1; each weight chunk is
 * loaded once for the R rows. res[s * XR + r]: x row r against weight row s. */
ALWAYS_INLINE void dot_rows(const uint16_t *x, int64_t xs, const uint16_t *const *w, const int S,
                            int64_t K, const int R, float *res)
{
    __m512 acc[2][XR][4];
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++)
                acc[s][r][j] = _mm512_setzero_ps();
#define LD(p) ((__m512bh)_mm512_loadu_si512((const void *)(p)))
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        for (int s = 0; s < S; s++) {
            for (int j = 0; j < 4; j++) /* an address, not a pointer past the matrix */
                _mm_prefetch((const char *)((uintptr_t)(w[s] + k) + 2 * (PF_DIST + 32 * j)),
                             _MM_HINT_T0);
            const __m512bh w0 = LD(w[s] + k), w1 = LD(w[s] + k + 32), w2 = LD(w[s] + k + 64),
                           w3 = LD(w[s] + k + 96);
            for (int r = 0; r < R; r++) {
                const uint16_t *xr = x + r * xs + k;
                acc[s][r][0] = _mm512_dpbf16_ps(acc[s][r][0], LD(xr), w0);
                acc[s][r][1] = _mm512_dpbf16_ps(acc[s][r][1], LD(xr + 32), w1);
                acc[s][r][2] = _mm512_dpbf16_ps(acc[s][r][2], LD(xr + 64), w2);
                acc[s][r][3] = _mm512_dpbf16_ps(acc[s][r][3], LD(xr + 96), w3);
            }
        }
    }
    for (; k + 32 <= K; k += 32)
        for (int s = 0; s < S; s++) {
            const __m512bh w0 = LD(w[s] + k);
            for (int r = 0; r < R; r++)
                acc[s][r][0] = _mm512_dpbf16_ps(acc[s][r][0], LD(x + r * xs + k), w0);
        }
#undef LD
    if (k < K) {
        const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        for (int s = 0; s < S; s++) {
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)(w[s] + k));
            for (int r = 0; r < R; r++) {
                const __m512bh xv =
                    (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)(x + r * xs + k));
                acc[s][r][1] = _mm512_dpbf16_ps(acc[s][r][1], xv, w0);
            }
        }
    }
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++)
            res[s * XR + r] = _mm512_reduce_add_ps(
                _mm512_add_ps(_mm512_add_ps(acc[s][r][0], acc[s][r][1]),
                              _mm512_add_ps(acc[s][r][2], acc[s][r][3])));
}
#else
ALWAYS_INLINE void dot_rows(const uint16_t *x, int64_t xs, const uint16_t *const *w, const int S,
                            int64_t K, const int R, float *res)
{
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++) {
            const uint16_t *xr = x + r * xs, *ws = w[s];
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < K; k++)
                acc += bf16_to_f32(xr[k]) * bf16_to_f32(ws[k]);
            res[s * XR + r] = acc;
        }
}
#endif

/* Weight rows n[0..S) against every x row: out[m][n[s]] (row stride out_stride). The S rows
 * are read side by side only for groups of up to two x rows (2 x 2 x 4 accumulators fit in the
 * registers); wider groups take the weight rows one after another. */
ALWAYS_INLINE void rows_out(int64_t M, int64_t K, const uint16_t *x, int64_t x_stride,
                            const uint16_t *w, const int64_t *n, const int S, const uint16_t *bias,
                            uint16_t *out, int64_t out_stride)
{
    float res[2 * XR];
    for (int64_t m0 = 0; m0 < M; m0 += XR) {
        const uint16_t *xm = x + m0 * x_stride;
        const int64_t R = M - m0 < XR ? M - m0 : XR;
        const int step = R <= 2 ? S : 1; /* weight rows read side by side */
        for (int s0 = 0; s0 < S; s0 += step) {
            const uint16_t *ws[2] = {w + n[s0] * K, w + n[s0 + step - 1] * K};
            if (step == 2 && R == 2)
                dot_rows(xm, x_stride, ws, 2, K, 2, res);
            else if (step == 2)
                dot_rows(xm, x_stride, ws, 2, K, 1, res);
            else
                switch (R) { /* constant R: each case is unrolled on its own */
                case 4: dot_rows(xm, x_stride, ws, 1, K, 4, res); break;
                case 3: dot_rows(xm, x_stride, ws, 1, K, 3, res); break;
                case 2: dot_rows(xm, x_stride, ws, 1, K, 2, res); break;
                default: dot_rows(xm, x_stride, ws, 1, K, 1, res); break;
                }
            for (int s = 0; s < step; s++) {
                const float b = bias ? bf16_to_f32(bias[n[s0 + s]]) : 0.0f;
                for (int64_t r = 0; r < R; r++)
                    out[(m0 + r) * out_stride + n[s0 + s]] = f32_to_bf16(res[s * XR + r] + b);
            }
        }
    }
}

/* out[m][n] (row stride out_stride) for this thread's block of weight rows, read as two
 * streams: the block's first and second halves side by side (row by row for groups of more than
 * two x rows), each row once, each dotted with every x row while it sits in L1. Two streams per
 * thread keep more lines in flight than one: over the weight matrices of LFM2-350M, 1.10-1.15x
 * the GB/s of one stream at one x row, 1.14-1.23x at two, 1.07x at four (in-process, 10
 * alternated rounds, twice); in a C loop, 0.94-0.96 of a plain read against 0.88-0.91. Called
 * by every thread of a team; a barrier at its end. */
ALWAYS_INLINE void rows_team(int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t x_stride,
                             const uint16_t *w, const uint16_t *bias, uint16_t *out,
                             int64_t out_stride)
{
#ifdef _OPENMP
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const int64_t nt = 1, t = 0;
#endif
    const int64_t per = (N + nt - 1) / nt;
    const int64_t lo = t * per < N ? t * per : N, hi = lo + per < N ? lo + per : N;
    const int64_t half = (hi - lo) / 2;
    for (int64_t i = 0; i < half; i++) {
        const int64_t n[2] = {lo + i, lo + half + i};
        rows_out(M, K, x, x_stride, w, n, 2, bias, out, out_stride);
    }
    if ((hi - lo) & 1) {
        const int64_t n[1] = {hi - 1};
        rows_out(M, K, x, x_stride, w, n, 1, bias, out, out_stride);
    }
#pragma omp barrier
}

void linear_bf16(int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t x_stride,
                 const uint16_t *w, const uint16_t *bias, uint16_t *out)
{
#pragma omp parallel
    rows_team(M, N, K, x, x_stride, w, bias, out, N);
}

/* A gated feed-forward block for a few rows, one call: gu = x w_gu^T ([M][2I], bf16, gate
 * first), h = silu(gate) * up ([M][I], bf16: the activation and the product each rounded, as
 * torch's bf16 ops hold them), out = h w_down^T ([M][H]). gu and h: caller's scratch. Three
 * phases of one team, where the composed block took two linear calls and three torch ops. */
void gated_mlp_bf16(int64_t M, int64_t I, int64_t H, const uint16_t *x, int64_t x_stride,
                    const uint16_t *w_gu, const uint16_t *w_down, uint16_t *gu, uint16_t *h,
                    uint16_t *out)
{
#pragma omp parallel
    {
        rows_team(M, 2 * I, H, x, x_stride, w_gu, NULL, gu, 2 * I);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < M * I; c += ACT_CHUNK) { /* rows of I are whole chunks */
            const uint16_t *g = gu + c / I * 2 * I + c % I;
            uint16_t *hc = h + c;
            int64_t i = 0;
#if HAVE_CONV_WINDOW
            for (; i < ACT_CHUNK; i += 16) {
                const __m512 act = cw_round_bf16(cw_silu(cw_load_bf16(g + i)));
                _mm256_storeu_si256((__m256i *)(hc + i),
                                    cw_ps_to_bf16(_mm512_mul_ps(act, cw_load_bf16(g + I + i))));
            }
#endif
            for (; i < ACT_CHUNK; i++) {
                const float a = bf16_to_f32(g[i]);
                const float act = round_bf16(a / (1.0f + exp_poly(-a)));
                hc[i] = f32_to_bf16(act * bf16_to_f32(g[I + i]));
            }
        }
        rows_team(M, H, I, h, I, w_down, NULL, out, H);
    }
}

/* Whether this build uses the AVX-512 BF16 dot-product instruction (else the portable loop). */
int linear_uses_dpbf16(void) { return HAVE_DPBF16; }
