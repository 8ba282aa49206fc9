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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "conv_window.h"
#include "experts.h"
#include "vec_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#if !HAVE_DPBF16 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_F32X 1 /* AVX2 without the bf16 dot product: dot_f32x */
#else
#define HAVE_F32X 0
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define XR 4 /* x rows dotted with one loaded weight chunk */
/* Weights are prefetched this many elements (2 KB) ahead of the loads: on an Intel Xeon VM the
 * two threads streamed 20-21 GB/s without, 25-26 with (in-process A/B over 1 GB of weights; a
 * plain read: 23-27); the hardware prefetchers alone kept too few lines in flight. 4 KB was no
 * better with two streams per thread. Prefetches past the matrix's end are hints and never
 * fault. */
#define PF_DIST 1024

#if HAVE_DPBF16
#define LD(p) ((__m512bh)_mm512_loadu_si512((const void *)(p)))

ALWAYS_INLINE void acc_zero(__m512 acc[2][XR], const int S, const int R)
{
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++)
            acc[s][r] = _mm512_setzero_ps();
}

/* res[s * XR + r]: the sum of acc[s][r]'s lanes */
ALWAYS_INLINE void acc_reduce(__m512 acc[2][XR], const int S, const int R, float *res)
{
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++)
            res[s * XR + r] = _mm512_reduce_add_ps(acc[s][r]);
}

/* R x rows (R a constant at each call) dotted with S weight rows w[0..S) of K bf16, one
 * stream each. Each dot keeps one fp32 accumulator (16 lanes) that takes the chunks of 32 pairs
 * in order, then a masked tail, and is summed by _mm512_reduce_add_ps: an order fixed by K alone,
 * the one the many-row kernel below follows, so a row's result does not depend on how the batch
 * or the weight rows are grouped, nor on which kernel ran. One chain per dot is enough here: a
 * group reads at most two weight streams, and each 64-byte chunk is one instruction. Each weight
 * chunk is loaded once for the R rows. res[s * XR + r]: x row r against weight row s. */
ALWAYS_INLINE void dot_rows(const uint16_t *x, int64_t xs, const uint16_t *const *w, const int S,
                            int64_t K, const int R, float *res)
{
    __m512 acc[2][XR];
    acc_zero(acc, S, R);
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
                acc[s][r] = _mm512_dpbf16_ps(acc[s][r], LD(xr), w0);
                acc[s][r] = _mm512_dpbf16_ps(acc[s][r], LD(xr + 32), w1);
                acc[s][r] = _mm512_dpbf16_ps(acc[s][r], LD(xr + 64), w2);
                acc[s][r] = _mm512_dpbf16_ps(acc[s][r], LD(xr + 96), w3);
            }
        }
    }
    for (; k + 32 <= K; k += 32)
        for (int s = 0; s < S; s++) {
            const __m512bh w0 = LD(w[s] + k);
            for (int r = 0; r < R; r++)
                acc[s][r] = _mm512_dpbf16_ps(acc[s][r], LD(x + r * xs + k), w0);
        }
    if (k < K) {
        const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        for (int s = 0; s < S; s++) {
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)(w[s] + k));
            for (int r = 0; r < R; r++) {
                const __m512bh xv =
                    (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)(x + r * xs + k));
                acc[s][r] = _mm512_dpbf16_ps(acc[s][r], xv, w0);
            }
        }
    }
    acc_reduce(acc, S, R, res);
}

/* dot_rows for groups of 3 or 4 x rows (a verify step's, a small decode batch's), x packed
 * chunk-major by pack_rows (chunk c of row r at xp + (c * R + r) * 32, zeros past K): one
 * sequential stream in L1 instead of R rows K apart, and the S = 2 weight streams side by side
 * (dot_rows reads them one after the other for more than two rows). The weight chunks are held
 * in registers for the R rows (left to itself the compiler loaded them again for every row, and
 * the load ports, not the dot products, bounded 3-4 rows). The weights are prefetched into L2,
 * not L1: with L1 prefetches the memory stream and the arithmetic took about the sum of their
 * times instead of overlapping (docs/benchmarks.md, 931eaf6-a1b218a). Each accumulator takes
 * the chunks in order, then the masked tail: dot_rows's sums, bit for bit. _part: the chunks of
 * [k0, k1) (k0 a multiple of 128) added into acc, the 32-element chunks and the tail only when
 * k1 = K. */
ALWAYS_INLINE void dot_packed_part(const uint16_t *xp, const uint16_t *const *w, const int S,
                                   int64_t K, int64_t k0, int64_t k1, const int R,
                                   __m512 acc[2][XR])
{
    int64_t k = k0;
    const uint16_t *xc = xp + k0 / 32 * R * 32;
    for (; k + 128 <= k1; k += 128, xc += 4 * R * 32) {
        __m512bh wv[2][4];
        for (int s = 0; s < S; s++) {
            for (int j = 0; j < 4; j++)
                _mm_prefetch((const char *)((uintptr_t)(w[s] + k) + 2 * (PF_DIST + 32 * j)),
                             _MM_HINT_T1);
            for (int j = 0; j < 4; j++)
                wv[s][j] = LD(w[s] + k + 32 * j);
        }
        if (S == 2)
            __asm__("" : "+v"(wv[0][0]), "+v"(wv[0][1]), "+v"(wv[0][2]), "+v"(wv[0][3]),
                    "+v"(wv[1][0]), "+v"(wv[1][1]), "+v"(wv[1][2]), "+v"(wv[1][3]));
        else
            __asm__("" : "+v"(wv[0][0]), "+v"(wv[0][1]), "+v"(wv[0][2]), "+v"(wv[0][3]));
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < R; r++) {
                const __m512bh xv = LD(xc + (j * R + r) * 32);
                for (int s = 0; s < S; s++)
                    acc[s][r] = _mm512_dpbf16_ps(acc[s][r], xv, wv[s][j]);
            }
    }
    if (k1 < K)
        return;
    for (; k + 32 <= K; k += 32, xc += R * 32) {
        __m512bh wv[2];
        for (int s = 0; s < S; s++)
            wv[s] = LD(w[s] + k);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = LD(xc + r * 32);
            for (int s = 0; s < S; s++)
                acc[s][r] = _mm512_dpbf16_ps(acc[s][r], xv, wv[s]);
        }
    }
    if (k < K) {
        const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        for (int s = 0; s < S; s++) {
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)(w[s] + k));
            for (int r = 0; r < R; r++)
                acc[s][r] = _mm512_dpbf16_ps(acc[s][r], LD(xc + r * 32), w0);
        }
    }
}

ALWAYS_INLINE void dot_packed(const uint16_t *xp, const uint16_t *const *w, const int S,
                              int64_t K, const int R, float *res)
{
    __m512 acc[2][XR];
    acc_zero(acc, S, R);
    dot_packed_part(xp, w, S, K, 0, K, R, acc);
    acc_reduce(acc, S, R, res);
}

/* dot_packed over the K block [k0, k1) (k0 a multiple of 128; the block ending at K takes the
 * tail), the S x XR accumulators carried in `saved` from the block before: the same additions
 * in the same order as dot_packed's. */
ALWAYS_INLINE void dot_packed_saved(const uint16_t *xp, const uint16_t *const *w, const int S,
                                    int64_t K, int64_t k0, int64_t k1, const int R,
                                    __m512 *saved)
{
    __m512 acc[2][XR];
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++)
            acc[s][r] = k0 == 0 ? _mm512_setzero_ps() : saved[s * XR + r];
    dot_packed_part(xp, w, S, K, k0, k1, R, acc);
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++)
            saved[s * XR + r] = acc[s][r];
}

/* x rows [0, R) into xp chunk-major (dot_packed's layout), zeros past K. */
static void pack_rows(const uint16_t *x, int64_t x_stride, int64_t K, int64_t R, uint16_t *xp)
{
    for (int64_t c = 0; c * 32 < K; c++)
        for (int64_t r = 0; r < R; r++) {
            const int64_t left = K - c * 32;
            const __mmask32 m = left >= 32 ? (__mmask32)~0u : (__mmask32)((1ull << left) - 1);
            const void *src = x + r * x_stride + c * 32;
            _mm512_storeu_si512((void *)(xp + (c * R + r) * 32), _mm512_maskz_loadu_epi16(m, src));
        }
}
#undef LD
#define HAVE_PACKED 1
#else
#define HAVE_PACKED 0
#if HAVE_F32X
/* AVX2 CPUs without a bf16 dot product (AMD Zen 1-3, Intel before Cooper Lake). The weights are
 * widened to fp32 as the tile kernel widens them: 16 bf16 loaded as 8 pairs, the odd elements
 * by a mask and the even ones by a shift (two instructions per 16, where a zero-extension and a
 * shift per 8 took a third of the vector pipes the multiply-adds need once several rows share
 * each chunk). Each dot keeps one fp32 accumulator of 8 lanes that takes, for the chunks of 16
 * in order (the last one zero-padded), the odd products and then the even ones, and is summed
 * by hsum8: an order fixed by K alone, so a row's result does not depend on how the batch or the
 * weight rows are grouped (a verify step's rows give decode's bits). x comes widened and split
 * the same way once per call (pack_f32), so the loop widens only the weights, each chunk once for
 * the R rows. Products of two bf16 values are exact in fp32. */
#define F32X_CH 16

/* pack_f32's row length: K rounded up to whole chunks */
ALWAYS_INLINE int64_t f32x_row(int64_t K) { return (K + F32X_CH - 1) / F32X_CH * F32X_CH; }

ALWAYS_INLINE void widen16(const uint16_t *p, __m256 *odd, __m256 *even)
{
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    __asm__("" : "+x"(v)); /* one load for both halves (GCC loaded the chunk again for the mask) */
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

ALWAYS_INLINE float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x rows into xf, each group of XR rows (the last one R = M - m0 rows) R x K16 floats at
 * xf + m0 * K16, chunk-major: chunk c (of 16) of row r at (c * R + r) * 16, its 8 odd elements
 * then its 8 even ones, zeros past K. A group's loads are then one sequential stream at
 * constant offsets from one pointer. */
static void pack_f32(const uint16_t *x, int64_t x_stride, int64_t K, int64_t M, float *xf)
{
    const int64_t K16 = f32x_row(K);
    for (int64_t m0 = 0; m0 < M; m0 += XR) {
        const int64_t R = M - m0 < XR ? M - m0 : XR;
        for (int64_t r = 0; r < R; r++) {
            const uint16_t *xr = x + (m0 + r) * x_stride;
            for (int64_t c = 0; c < K16; c += F32X_CH) {
                float *d = xf + m0 * K16 + (c * R + r * F32X_CH);
                if (c + F32X_CH <= K) { /* the weights' widening: the same numbers */
                    __m256 odd, even;
                    widen16(xr + c, &odd, &even);
                    _mm256_storeu_ps(d, odd);
                    _mm256_storeu_ps(d + 8, even);
                    continue;
                }
                for (int64_t i = 0; i < 8; i++) {
                    const int64_t ko = c + 2 * i + 1, ke = c + 2 * i;
                    d[i] = ko < K ? bf16_to_f32(xr[ko]) : 0.0f;
                    d[8 + i] = ke < K ? bf16_to_f32(xr[ke]) : 0.0f;
                }
            }
        }
    }
}

/* One chunk of 16 (w[s] at c; the R x rows' chunk at xc, pack_f32's) into the R x S
 * accumulators. Each x vector is loaded once into a register for both weight rows: left to
 * itself GCC folded the loads into the multiply-adds, loading every x vector twice, and Zen 1
 * (one 256-bit load a cycle) then spent more cycles on loads than on the multiply-adds: 4 rows
 * ran at 31-32 GFMA/s of the 47 its two cores reach, 38-39 with the loads held
 * (docs/benchmarks.md, 2026-12-05). The odd half of a row is used up before its even half is
 * loaded: with both held, 8 accumulators, 4 widened weights, 2 x vectors and the mask filled
 * the 16 registers and GCC copied and spilled accumulators in the loop. The arithmetic, and so
 * every bit, is the same. */
ALWAYS_INLINE void chunk_f32x(const float *xc, const uint16_t *const *w, int64_t c,
                              const int S, const int R, __m256 acc[2][XR])
{
    __m256 wo[2], we[2];
    for (int s = 0; s < S; s++)
        widen16(w[s] + c, &wo[s], &we[s]);
    for (int r = 0; r < R; r++) {
        __m256 xo = _mm256_loadu_ps(xc + r * F32X_CH);
        if (S == 2)
            __asm__("" : "+x"(xo));
        for (int s = 0; s < S; s++)
            acc[s][r] = _mm256_fmadd_ps(xo, wo[s], acc[s][r]);
        __m256 xe = _mm256_loadu_ps(xc + r * F32X_CH + 8);
        if (S == 2)
            __asm__("" : "+x"(xe));
        for (int s = 0; s < S; s++)
            acc[s][r] = _mm256_fmadd_ps(xe, we[s], acc[s][r]);
    }
}

/* Keeps GCC from interleaving two chunks of the loop below for 4 rows against two weight rows,
 * which took more registers than there are (accumulators copied and spilled in the hot loop;
 * 1.12x the multiply-adds a second with this, one core, weights in L2). With 3 rows the fence
 * made the loop slower (0.73x), so it is left to GCC there. */
ALWAYS_INLINE void chunk_fence(__m256 acc[2][XR], const int S, const int R)
{
    if (S == 2 && R == 4)
        __asm__("" : "+x"(acc[0][0]), "+x"(acc[0][1]), "+x"(acc[0][2]), "+x"(acc[0][3]),
                "+x"(acc[1][0]), "+x"(acc[1][1]), "+x"(acc[1][2]), "+x"(acc[1][3]));
}

/* R x rows (a group of pack_f32's, at xg) against S weight rows w[0..S), res[s * XR + r]. The
 * weights are prefetched PF_DIST elements ahead, a line per 32 elements. */
ALWAYS_INLINE void dot_f32x(const float *xg, const uint16_t *const *w, const int S, int64_t K,
                            const int R, float *res)
{
    __m256 acc[2][XR];
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++)
            acc[s][r] = _mm256_setzero_ps();
    int64_t k = 0;
    const float *xc = xg; /* the x rows' chunk at k */
    for (; k + 32 <= K; k += 32, xc += 2 * R * F32X_CH) {
        for (int s = 0; s < S; s++) /* an address, not a pointer past the matrix */
            _mm_prefetch((const char *)((uintptr_t)(w[s] + k) + 2 * PF_DIST), _MM_HINT_T0);
        chunk_f32x(xc, w, k, S, R, acc);
        chunk_fence(acc, S, R);
        chunk_f32x(xc + R * F32X_CH, w, k + 16, S, R, acc);
    }
    for (; k + 16 <= K; k += 16, xc += R * F32X_CH)
        chunk_f32x(xc, w, k, S, R, acc);
    if (k < K) { /* the last chunk through a zero-padded copy of the weights */
        uint16_t tail[2][F32X_CH] = {{0}};
        const uint16_t *tw[2] = {tail[0], tail[1]};
        for (int s = 0; s < S; s++)
            for (int64_t i = k; i < K; i++)
                tail[s][i - k] = w[s][i];
        chunk_f32x(xc, tw, 0, S, R, acc);
    }
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++)
            res[s * XR + r] = hsum8(acc[s][r]);
}
#endif
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
 * are read side by side for groups of up to two x rows, and for groups of three or four when
 * x comes packed (xp: pack_rows of each group of XR rows, one after the other; dot_packed);
 * otherwise wider groups take the weight rows one after another. */
ALWAYS_INLINE void rows_out(int64_t M, int64_t K, const uint16_t *x, int64_t x_stride,
                            const uint16_t *w, const int64_t *n, const int S, const uint16_t *bias,
                            uint16_t *out, int64_t out_stride, const uint16_t *xp)
{
    float res[2 * XR];
#if HAVE_F32X
    if (xp) { /* x widened by pack_f32: two weight rows side by side for any group */
        const float *xf = (const float *)(const void *)xp;
        const int64_t K16 = f32x_row(K);
        for (int64_t m0 = 0; m0 < M; m0 += XR) {
            const int64_t R = M - m0 < XR ? M - m0 : XR;
            for (int s0 = 0; s0 < S; s0 += 2) {
                const int step = S - s0 < 2 ? 1 : 2;
                const uint16_t *ws[2] = {w + n[s0] * K, w + n[s0 + step - 1] * K};
                const float *xm = xf + m0 * K16;
#define F(s_, r_) dot_f32x(xm, ws, s_, K, r_, res)
                if (step == 2)
                    switch (R) { /* constants: each case unrolled on its own */
                    case 4: F(2, 4); break;
                    case 3: F(2, 3); break;
                    case 2: F(2, 2); break;
                    default: F(2, 1); break;
                    }
                else
                    switch (R) {
                    case 4: F(1, 4); break;
                    case 3: F(1, 3); break;
                    case 2: F(1, 2); break;
                    default: F(1, 1); break;
                    }
#undef F
                for (int s = 0; s < step; s++) {
                    const float b = bias ? bf16_to_f32(bias[n[s0 + s]]) : 0.0f;
                    for (int64_t r = 0; r < R; r++)
                        out[(m0 + r) * out_stride + n[s0 + s]] =
                            f32_to_bf16(res[s * XR + r] + b);
                }
            }
        }
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += XR) {
        const uint16_t *xm = x + m0 * x_stride;
        const int64_t R = M - m0 < XR ? M - m0 : XR;
#if HAVE_PACKED
        if (xp && R > 2) {
            const uint16_t *ws[2] = {w + n[0] * K, w + n[S - 1] * K};
            const uint16_t *xg = xp + m0 * ((K + 31) / 32) * 32;
            if (S == 2 && R == 4)
                dot_packed(xg, ws, 2, K, 4, res);
            else if (S == 2)
                dot_packed(xg, ws, 2, K, 3, res);
            else if (R == 4)
                dot_packed(xg, ws, 1, K, 4, res);
            else
                dot_packed(xg, ws, 1, K, 3, res);
            for (int s = 0; s < S; s++) {
                const float b = bias ? bf16_to_f32(bias[n[s]]) : 0.0f;
                for (int64_t r = 0; r < R; r++)
                    out[(m0 + r) * out_stride + n[s]] = f32_to_bf16(res[s * XR + r] + b);
            }
            continue;
        }
#endif
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

#if HAVE_PACKED
/* rows_team's pairs of weight rows for x rows too wide to stay in L1 beside the weight streams
 * (M * K * 2 bytes over RB_X_BYTES, K >= RB_MIN_K): K in blocks whose x columns fit
 * (RB_X_BYTES), a group of RB_PAIRS pairs taking each block in turn with their accumulators
 * carried between blocks (dot_packed_saved: the same sums, bit for bit), and the next group's
 * weights fetched into L2 a slice per pair and block while this group computes, so that the
 * memory stream does not stop for the arithmetic. For a verify step's 4 rows through a feed-forward
 * down projection (K = 3,584) this read 1.26x the time of one row where the unblocked loop
 * read 1.5x; at 8 and 16 rows with K >= 2,048, 0.65-0.85x the unblocked time; with K of
 * 1,024 or less it was slower (docs/benchmarks.md). That was an AMD EPYC with a 32 KB L1d; on
 * an Intel Xeon with 48 KB (family 6 model 207) the blocks were the slower loop: 4 rows of the
 * down projection read 1.6-1.75x one row's time blocked and 1.0-1.1x unblocked, 8 rows 1.25x
 * the unblocked time. So only where the L1d holds at most RB_L1D bytes (or says nothing). */
#define RB_X_BYTES (16 << 10)
#define RB_MIN_K 2048
#define RB_PAIRS 4
#define RB_L1D (32 << 10)

static int rb_mode = -1; /* 1: rows_blocked where it applies, 0: never, -1: not yet decided */

/* Whether this CPU's L1d is small enough for rows_blocked (read once; every thread reads the
 * same answer, so the race to store it is harmless). */
static int rows_blocked_pays(void)
{
    int v = __atomic_load_n(&rb_mode, __ATOMIC_RELAXED);
    if (v < 0) {
        v = sysconf(_SC_LEVEL1_DCACHE_SIZE) <= RB_L1D;
        __atomic_store_n(&rb_mode, v, __ATOMIC_RELAXED);
    }
    return v;
}
#endif

/* Tests: mode 1 or 0 forces rows_blocked on or off (its sums are the unblocked loop's, so the
 * choice changes no output), -1 decides by the L1d again. Returns the setting now in force (0
 * where the build has no rows_blocked). Not to be called while a linear runs. */
int linear_rows_blocked(int mode)
{
#if HAVE_PACKED
    __atomic_store_n(&rb_mode, mode < 0 ? -1 : mode != 0, __ATOMIC_RELAXED);
    return rows_blocked_pays();
#else
    (void)mode;
    return 0;
#endif
}
#if HAVE_PACKED

static void rows_blocked(int64_t M, int64_t K, const uint16_t *xp, const uint16_t *w,
                         int64_t lo, int64_t half, const uint16_t *bias, uint16_t *out,
                         int64_t out_stride, __m512 *saved)
{
    const int64_t groups = (M + XR - 1) / XR, Kc = (K + 31) / 32;
    const int64_t kb = RB_X_BYTES / (2 * M) / 128 * 128 > 128 ? RB_X_BYTES / (2 * M) / 128 * 128
                                                              : 128;
    const int64_t blocks = (K + kb - 1) / kb;
    for (int64_t g0 = 0; g0 < half; g0 += RB_PAIRS) {
        const int64_t g1 = g0 + RB_PAIRS < half ? g0 + RB_PAIRS : half;
        /* the next group's rows: [lo + g1, lo + n1) and [lo + half + g1, lo + half + n1) */
        const int64_t n1 = g1 + RB_PAIRS < half ? g1 + RB_PAIRS : half;
        const int64_t next_half = (n1 - g1) * K * 2;
        const char *next[2] = {(const char *)(w + (lo + g1) * K),
                               (const char *)(w + (lo + half + g1) * K)};
        const int64_t slice = (2 * next_half / (blocks * (g1 - g0)) + 63) / 64 * 64;
        int64_t fetched = 0;
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
            const int64_t k1 = k0 + kb < K ? k0 + kb : K;
            for (int64_t i = g0; i < g1; i++) {
                for (int64_t end = fetched + slice; fetched < end && fetched < 2 * next_half;
                     fetched += 64)
                    _mm_prefetch(next[fetched >= next_half] + fetched % next_half, _MM_HINT_T1);
                const uint16_t *ws[2] = {w + (lo + i) * K, w + (lo + half + i) * K};
                for (int64_t gi = 0; gi < groups; gi++) {
                    const uint16_t *xg = xp + gi * XR * Kc * 32;
                    __m512 *sv = saved + ((i - g0) * groups + gi) * 2 * XR;
                    switch (M - gi * XR < XR ? M - gi * XR : XR) { /* constant R */
                    case 4: dot_packed_saved(xg, ws, 2, K, k0, k1, 4, sv); break;
                    case 3: dot_packed_saved(xg, ws, 2, K, k0, k1, 3, sv); break;
                    case 2: dot_packed_saved(xg, ws, 2, K, k0, k1, 2, sv); break;
                    default: dot_packed_saved(xg, ws, 2, K, k0, k1, 1, sv); break;
                    }
                }
            }
        }
        for (int64_t i = g0; i < g1; i++)
            for (int64_t gi = 0; gi < groups; gi++) {
                const __m512 *sv = saved + ((i - g0) * groups + gi) * 2 * XR;
                const int64_t R = M - gi * XR < XR ? M - gi * XR : XR;
                for (int s = 0; s < 2; s++) {
                    const int64_t n = s ? lo + half + i : lo + i;
                    const float b = bias ? bf16_to_f32(bias[n]) : 0.0f;
                    for (int64_t r = 0; r < R; r++)
                        out[(gi * XR + r) * out_stride + n] =
                            f32_to_bf16(_mm512_reduce_add_ps(sv[s * XR + r]) + b);
                }
            }
    }
}
#endif

/* ---------------------------------------------------------------------- AMX tiles
 * On CPUs with AMX (Intel Xeons from Sapphire Rapids, where the hypervisor passes the tiles
 * through), once asked for (linear_amx(1)), every bf16 decode linear runs on the tile unit:
 * out^T = w x^T, 16 weight rows (A: 16 rows x 32 bf16, loaded straight from w with its row
 * stride) against up to 16 x rows at a time (B: the same 32 columns of x as 16 pairs x R rows,
 * packed once per call); a pass over a weight group takes up to three full blocks of 16 x rows
 * (C tiles 0-2) and, in the last pass, the last block (C tile 3). One tile product does the
 * work of 16 dot-product instructions at any R <= 16, so 8-16 rows cost about what one does
 * while the weights stream (Intel Xeon family 6 model 207, 2 threads, over the dot-product
 * kernel's time: 1 row 1.05-1.07x, 4 rows 0.91x, 16 rows 0.32x, 32 rows 0.19x). The weights
 * of the group AMX_AHEAD groups ahead are fetched into L2 as one sequential stream, a slice per
 * chunk: 16 rows read side by side and left to the hardware prefetchers ran at half the
 * memory's speed.
 *
 * Each output is one fp32 sum over its K pairs in order (the tile unit's own order, rounding as
 * it rounds, denormals flushed), then the bias in fp32 and one rounding to bf16: fixed by K
 * alone, whatever the batch, its grouping or the thread count; not the dot-product kernels'
 * order, so where AMX is on every row count takes it (Python: kernels.cpu). */
#if HAVE_DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
long syscall(long number, ...); /* (unistd.h declares it for _DEFAULT_SOURCE only) */
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

static int amx_mode = 0; /* 1: the tiles are ours (asked for and granted), 0: not used */

/* Whether the linears run on the AMX tiles: once asked for (linear_amx(1); kernels.cpu asks
 * unless $MAMBARADIX_AMX=0). In the engine a one-token step took 1.06-1.13x its time with them
 * (the 1-row stream is slower), while 16 decode rows took 0.32-0.40x (docs/benchmarks.md,
 * 2026-12-06). */
static int amx_on(void) { return __atomic_load_n(&amx_mode, __ATOMIC_RELAXED); }

/* mode 1: use the AMX tiles where this build has them and Linux grants the tile state (asked
 * once per call; granted once, for all the process's threads); 0: the dot-product kernels.
 * Returns whether the tiles are now used. Not to be called while a linear runs. */
int linear_amx(int mode)
{
    int v = 0;
#if HAVE_AMX
    if (mode)
        v = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    (void)mode;
#endif
    __atomic_store_n(&amx_mode, v, __ATOMIC_RELAXED);
    return v;
}

int linear_uses_amx(void) { return amx_on(); }

#if HAVE_AMX
#define AMX_ROWS 16 /* weight rows per A tile, x rows per B tile */
#define AMX_CH 32   /* bf16 per tile row */
#define AMX_PASS 3  /* full x blocks (C tiles 0-2) per pass over a weight group */
#define AMX_AHEAD 2 /* groups fetched ahead into L2 */

/* This thread's scratch of at least `bytes` (64-byte aligned), kept between calls: the
 * OpenMP threads persist, and a fresh allocation per call cost page faults and zeroed pages
 * (7% of a 1-row down projection's time in perf where x and the padding took 224 KB). Out of
 * memory, the process ends saying why (a wrong result would hide it). */
static void *amx_scratch(size_t bytes)
{
    static _Thread_local void *buf;
    static _Thread_local size_t size;
    if (bytes > size) {
        free(buf);
        size = (bytes + 4095) / 4096 * 4096;
        buf = aligned_alloc(64, size);
        if (buf == NULL) {
            fprintf(stderr, "linear: cannot allocate %zu bytes of scratch\n", size);
            abort();
        }
    }
    return buf;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* x rows [0, R) (R <= 16) as B tiles: chunk c's pair p of row r at xb[(c * 16 + p) * R + r] (a
 * chunk's tile is 16 rows of R dwords), zeros past K. */
static void amx_pack(const uint16_t *x, int64_t x_stride, int64_t K, int64_t R, uint32_t *xb)
{
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)R));
    for (int64_t c = 0; c * AMX_CH < K; c++) {
        const int64_t left = K - c * AMX_CH;
        const __mmask32 m = left >= AMX_CH ? (__mmask32)~0u : (__mmask32)((1ull << left) - 1);
        for (int64_t r = 0; r < R; r++) {
            const __m512i v = _mm512_maskz_loadu_epi16(m, (const void *)(x + r * x_stride +
                                                                      c * AMX_CH));
            _mm512_i32scatter_epi32((void *)(xb + c * AMX_ROWS * R + r), idx, v, 4);
        }
    }
}

/* C tile t (0..3), B tile b (4: a full block, 5: the last, partial one) and A tile a (6, 7):
 * the intrinsics take constant tile numbers. */
ALWAYS_INLINE void amx_zero(int t)
{
    switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
    }
}

ALWAYS_INLINE void amx_dot(int t, int a, int b)
{
#define DT(T)                        \
    if (a == 6 && b == 4)            \
        _tile_dpbf16ps(T, 6, 4);     \
    else if (a == 6)                 \
        _tile_dpbf16ps(T, 6, 5);     \
    else if (b == 4)                 \
        _tile_dpbf16ps(T, 7, 4);     \
    else                             \
        _tile_dpbf16ps(T, 7, 5);
    switch (t) {
    case 0: DT(0) break;
    case 1: DT(1) break;
    case 2: DT(2) break;
    default: DT(3) break;
    }
#undef DT
}

ALWAYS_INLINE void amx_store(int t, float *p)
{
    switch (t) {
    case 0: _tile_stored(0, p, 64); break;
    case 1: _tile_stored(1, p, 64); break;
    case 2: _tile_stored(2, p, 64); break;
    default: _tile_stored(3, p, 64); break;
    }
}

/* out[m][n] (row stride ldo) for this thread's share of the weight groups. Called by every
 * thread of a team; a barrier at its end. */
static void amx_team(int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t x_stride,
                     const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t ldo)
{
#ifdef _OPENMP
    const int64_t nt = omp_get_num_threads(), th = omp_get_thread_num();
#else
    const int64_t nt = 1, th = 0;
#endif
    const int64_t groups = (N + AMX_ROWS - 1) / AMX_ROWS, per = (groups + nt - 1) / nt;
    const int64_t g_lo = th * per < groups ? th * per : groups;
    const int64_t g_hi = g_lo + per < groups ? g_lo + per : groups;
    const int64_t C = (K + AMX_CH - 1) / AMX_CH, blocks = (M + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t full = blocks - 1, r_last = M - full * AMX_ROWS;
    const int64_t passes = full == 0 ? 1 : (full + AMX_PASS - 1) / AMX_PASS;
    uint32_t *xb = NULL;
    uint16_t *pad = NULL; /* a partial group's rows, or a K tail's chunk, zero-padded */
    if (g_hi > g_lo) {
        /* x's blocks (full ones 16 rows a chunk, the last r_last), then the padding */
        const size_t xb_words = (size_t)(C * AMX_ROWS * M);
        char *scratch = amx_scratch(xb_words * 4 + (size_t)(AMX_ROWS * C * AMX_CH * 2) + 64);
        xb = (uint32_t *)(void *)scratch;
        pad = (uint16_t *)(void *)(scratch + (xb_words * 4 + 63) / 64 * 64);
        for (int64_t b = 0; b < blocks; b++)
            amx_pack(x + b * AMX_ROWS * x_stride, x_stride, K,
                     b < blocks - 1 ? AMX_ROWS : r_last, xb + b * C * AMX_ROWS * AMX_ROWS);
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++)
            cfg.rows[t] = AMX_ROWS;
        /* C tiles 0-2 and B tile 4: full blocks of 16 x rows; C tile 3 and B tile 5: the last
         * block (r_last rows); A tiles 6 and 7: weight chunks, taken in turn */
        cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[2] = cfg.colsb[4] = 64;
        cfg.colsb[3] = cfg.colsb[5] = (uint16_t)(4 * r_last);
        cfg.colsb[6] = cfg.colsb[7] = 64;
        _tile_loadconfig(&cfg);
    }
    float tmp[AMX_ROWS * AMX_ROWS] __attribute__((aligned(64)));
    const __m512i col = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(AMX_ROWS));
    for (int64_t g = g_lo; g < g_hi; g++) {
        const int64_t n0 = g * AMX_ROWS, rows = N - n0 < AMX_ROWS ? N - n0 : AMX_ROWS;
        const uint16_t *wg = w + n0 * K;
        int64_t ws = K; /* the A tiles' row stride, in elements */
        if (rows < AMX_ROWS) { /* the last group: its rows zero-padded to 16, K to chunks */
            memset(pad, 0, (size_t)(AMX_ROWS * C * AMX_CH * 2));
            for (int64_t i = 0; i < rows; i++)
                memcpy(pad + i * C * AMX_CH, wg + i * K, (size_t)K * 2);
            wg = pad;
            ws = C * AMX_CH;
        } else if (K % AMX_CH) { /* a full group's last chunk, zero-padded past K */
            memset(pad, 0, AMX_ROWS * AMX_CH * 2);
            for (int64_t i = 0; i < AMX_ROWS; i++)
                memcpy(pad + i * AMX_CH, wg + i * K + (C - 1) * AMX_CH,
                       (size_t)(K - (C - 1) * AMX_CH) * 2);
        }
        /* the group AMX_AHEAD ahead, one slice per chunk (an address, never dereferenced) */
        const uintptr_t next = (uintptr_t)w + (uintptr_t)((n0 + AMX_AHEAD * AMX_ROWS) * K * 2);
        const int64_t slice = (AMX_ROWS * K * 2 / C + 63) / 64 * 64;
        const uintptr_t end = (uintptr_t)w + (uintptr_t)(N * K * 2);
        for (int64_t p = 0; p < passes; p++) {
            /* full blocks [b0, b0 + nf) in C tiles 0..nf-1, the last block in the last pass */
            const int64_t b0 = p * AMX_PASS, nf = full - b0 < AMX_PASS ? full - b0 : AMX_PASS;
            const int last = p == passes - 1;
            for (int t = 0; t < nf; t++)
                amx_zero(t);
            if (last)
                amx_zero(3);
            for (int64_t c = 0; c < C; c++) {
                if (p == 0)
                    for (uintptr_t q = next + c * slice; q < next + (c + 1) * slice && q < end;
                         q += 64)
                        _mm_prefetch((const char *)q, _MM_HINT_T1);
                const int a = (c & 1) ? 7 : 6;
                const int tail = ws == K && c == C - 1 && K % AMX_CH;
                const uint16_t *ac = tail ? pad : wg + c * AMX_CH;
                const int64_t as = tail ? AMX_CH * 2 : ws * 2;
                if (a == 6)
                    _tile_loadd(6, ac, as);
                else
                    _tile_loadd(7, ac, as);
                for (int t = 0; t < nf; t++) {
                    _tile_loadd(4, xb + ((b0 + t) * C + c) * AMX_ROWS * AMX_ROWS, 64);
                    amx_dot(t, a, 4);
                }
                if (last) {
                    _tile_loadd(5, xb + (full * C * AMX_ROWS + c * r_last) * AMX_ROWS, r_last * 4);
                    amx_dot(3, a, 5);
                }
            }
            __m512 bv = _mm512_setzero_ps();
            const __mmask16 live = (__mmask16)((1u << rows) - 1);
            if (bias)
                bv = cw_bf16_to_ps(_mm256_maskz_loadu_epi16(live, (const void *)(bias + n0)));
            for (int t = 0; t < nf + last; t++) {
                const int64_t b = t < nf ? b0 + t : full, R = t < nf ? AMX_ROWS : r_last;
                amx_store(t < nf ? t : 3, tmp); /* tmp[i * 16 + r]: weight row n0 + i, x row
                                                 * b * 16 + r */
                for (int64_t r = 0; r < R; r++) {
                    const __m512 v = _mm512_i32gather_ps(col, tmp + r, 4);
                    _mm256_mask_storeu_epi16((void *)(out + (b * AMX_ROWS + r) * ldo + n0), live,
                                             cw_ps_to_bf16(_mm512_add_ps(v, bv)));
                }
            }
        }
    }
    if (g_hi > g_lo)
        _tile_release();
#pragma omp barrier
}
#endif

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
#if HAVE_AMX
    if (amx_on()) {
        amx_team(M, N, K, x, x_stride, w, bias, out, out_stride);
        return;
    }
#endif
#ifdef _OPENMP
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const int64_t nt = 1, t = 0;
#endif
    const int64_t per = (N + nt - 1) / nt;
    const int64_t lo = t * per < N ? t * per : N, hi = lo + per < N ? lo + per : N;
    const int64_t half = (hi - lo) / 2;
    uint16_t *xp = NULL; /* this thread's copy of x: packed per group of 3-4 rows (pack_rows), or
                          * every row widened to fp32 on AVX2 (pack_f32) */
#if HAVE_F32X
    const size_t xf_bytes = (size_t)((M * f32x_row(K) * 4 + 63) / 64 * 64);
    if (hi > lo && (xp = aligned_alloc(64, xf_bytes)) != NULL)
        pack_f32(x, x_stride, K, M, (float *)(void *)xp);
#endif
#if HAVE_PACKED
    const int64_t Kc = (K + 31) / 32;
    if (M > 2 && hi > lo && (xp = aligned_alloc(64, (size_t)(M * Kc * 64))) != NULL)
        for (int64_t m0 = 0; m0 < M; m0 += XR)
            pack_rows(x + m0 * x_stride, x_stride, K, M - m0 < XR ? M - m0 : XR,
                      xp + m0 * Kc * 32);
    __m512 *saved = NULL; /* rows_blocked's accumulators */
    if (xp && K >= RB_MIN_K && M * K * 2 > RB_X_BYTES && rows_blocked_pays())
        saved = aligned_alloc(64, sizeof(__m512) * (size_t)(RB_PAIRS * (M + XR - 1) / XR * 2 * XR));
    if (saved)
        rows_blocked(M, K, xp, w, lo, half, bias, out, out_stride, saved);
    else
#endif
        for (int64_t i = 0; i < half; i++) {
            const int64_t n[2] = {lo + i, lo + half + i};
            rows_out(M, K, x, x_stride, w, n, 2, bias, out, out_stride, xp);
        }
    if ((hi - lo) & 1) {
        const int64_t n[1] = {hi - 1};
        rows_out(M, K, x, x_stride, w, n, 1, bias, out, out_stride, xp);
    }
#if HAVE_PACKED
    free(saved);
#endif
    free(xp);
#pragma omp barrier
}

void linear_bf16(int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t x_stride,
                 const uint16_t *w, const uint16_t *bias, uint16_t *out)
{
#pragma omp parallel
    rows_team(M, N, K, x, x_stride, w, bias, out, N);
}

/* ---------------------------------------------------------------------- many rows
 * out = x w^T (+ bias) for batches where the products, not the weight reads, are the cost
 * (decode batches of tens of rows). On Xeons without AMX the bf16 dot-product instruction runs
 * at half the rate of fp32 fused multiply-adds (one core: 86 against 175 GFLOP/s in a register
 * loop), so this kernel widens each weight chunk to fp32 in registers (a mask and a shift) and
 * uses FMAs: no fp32 copy of the weight is written anywhere.
 *
 * The sums are the dot-product instruction's, bit for bit: that instruction adds, per fp32 lane
 * i, the product of pair element 2i+1 and then of 2i, each as an FMA with denormals in and out
 * flushed to zero (an exact bf16 x bf16 product rounded once into the sum). So x is split once
 * into fp32 odd and even halves of each 32-element chunk, each tile's accumulators take
 * fma(odd) then fma(even) chunk by chunk with DAZ and FTZ set, and end in _mm512_reduce_add_ps,
 * exactly as dot_rows: a row's output is the same from either kernel and any batch.
 *
 * A tile is GM x rows by GN weight rows (24 accumulators); x rows are packed per tile, chunk
 * after chunk, so a tile's loads are sequential. Threads split the weight rows; each walks its
 * rows in blocks of GBLK that stay in L2 while every x tile passes over them. */
#define GM 6
#define GN 4
#define GBLK 192 /* weight rows per block: 192 x K bf16 (384 KB at K = 1,024) */
#define CH 32  /* elements per chunk */

#if HAVE_DPBF16
/* x rows [m0, m0 + R) of a tile into xs: chunk c (of Kp / 32, K padded with zeros) at
 * xs + c * 32 * R, row r's odd elements then its even ones. */
static void pack_tile(const uint16_t *x, int64_t x_stride, int64_t K, int64_t Kp, int64_t R,
                      float *xs)
{
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < Kp; c += CH) {
            const int64_t left = K - c;
            const __mmask32 m = left >= CH ? (__mmask32)~0u : (__mmask32)((1ull << left) - 1);
            const __m512i v = _mm512_maskz_loadu_epi16(m, (const void *)(x + r * x_stride + c));
            float *d = xs + c * R + r * CH;
            _mm512_storeu_si512((void *)d, _mm512_and_si512(v, hi));
            _mm512_storeu_si512((void *)(d + 16), _mm512_slli_epi32(v, 16));
        }
}

/* R x rows (packed) against S weight rows w[n * K] (R <= GM, S <= GN, constants at each call):
 * out[r * ldo + n] = bf16(sum + bias[n]). pf: the weight rows come from memory (the block's
 * first x tile), so they are prefetched as dot_rows prefetches them. */
ALWAYS_INLINE void tile_rows(const float *xs, const uint16_t *w, int64_t K, const int R,
                             const int S, const uint16_t *bias, uint16_t *out, int64_t ldo,
                             const int pf)
{
    __m512 acc[GM][GN];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int s = 0; s < S; s++)
            acc[r][s] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t c = 0; c < K; c += CH) {
        const int64_t left = K - c;
        const __mmask32 m = left >= CH ? (__mmask32)~0u : (__mmask32)((1ull << left) - 1);
        __m512 wo[GN], we[GN];
        if (pf)
#pragma GCC unroll 8
            for (int s = 0; s < S; s++)
                _mm_prefetch((const char *)((uintptr_t)(w + s * K + c) + 2 * PF_DIST),
                             _MM_HINT_T0);
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) {
            const __m512i v = _mm512_maskz_loadu_epi16(m, (const void *)(w + s * K + c));
            wo[s] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
            we[s] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        }
        const float *xc = xs + c * R;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512 xo = _mm512_loadu_ps(xc + r * CH), xe = _mm512_loadu_ps(xc + r * CH + 16);
#pragma GCC unroll 8
            for (int s = 0; s < S; s++) {
                acc[r][s] = _mm512_fmadd_ps(xo, wo[s], acc[r][s]);
                acc[r][s] = _mm512_fmadd_ps(xe, we[s], acc[r][s]);
            }
        }
    }
#pragma GCC unroll 8
    for (int s = 0; s < S; s++) {
        const float b = bias ? bf16_to_f32(bias[s]) : 0.0f;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            out[r * ldo + s] = f32_to_bf16(_mm512_reduce_add_ps(acc[r][s]) + b);
    }
}

/* One tile of R rows over weight rows [n0, n0 + S), S and R dispatched to constants. */
static void tile_any(const float *xs, const uint16_t *w, int64_t K, int64_t R, int64_t S,
                     const uint16_t *bias, uint16_t *out, int64_t ldo, int pf)
{
#define T(r, s) tile_rows(xs, w, K, r, s, bias, out, ldo, pf)
    if (S == GN)
        switch (R) {
        case 6: T(6, GN); break;
        case 5: T(5, GN); break;
        case 4: T(4, GN); break;
        case 3: T(3, GN); break;
        case 2: T(2, GN); break;
        default: T(1, GN); break;
        }
    else /* the last few weight rows of a thread, one at a time */
        for (int64_t s = 0; s < S; s++) {
            const uint16_t *b = bias ? bias + s : NULL;
            switch (R) {
            case 6: tile_rows(xs, w + s * K, K, 6, 1, b, out + s, ldo, pf); break;
            case 5: tile_rows(xs, w + s * K, K, 5, 1, b, out + s, ldo, pf); break;
            case 4: tile_rows(xs, w + s * K, K, 4, 1, b, out + s, ldo, pf); break;
            case 3: tile_rows(xs, w + s * K, K, 3, 1, b, out + s, ldo, pf); break;
            case 2: tile_rows(xs, w + s * K, K, 2, 1, b, out + s, ldo, pf); break;
            default: tile_rows(xs, w + s * K, K, 1, 1, b, out + s, ldo, pf); break;
            }
        }
#undef T
}

/* out[m][n] (row stride ldo) for this thread's share of the weight rows, x packed first by the
 * whole team into xs (M x Kp fp32, Kp = K rounded up to 32). Called by every thread of a team;
 * a barrier at its end. */
static void many_team(int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t x_stride,
                      const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t ldo,
                      float *xs)
{
#if HAVE_AMX
    if (amx_on()) {
        amx_team(M, N, K, x, x_stride, w, bias, out, ldo);
        return;
    }
#endif
    const int64_t Kp = (K + CH - 1) / CH * CH, tiles = (M + GM - 1) / GM;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t m0 = t * GM, R = M - m0 < GM ? M - m0 : GM;
        pack_tile(x + m0 * x_stride, x_stride, K, Kp, R, xs + m0 * Kp);
    } /* (the loop's implicit barrier: every tile packed before any is read) */
#ifdef _OPENMP
    const int64_t nt = omp_get_num_threads(), th = omp_get_thread_num();
#else
    const int64_t nt = 1, th = 0;
#endif
    /* whole tiles of GN rows per thread, the last thread taking the remainder */
    const int64_t per = (N / GN + nt - 1) / nt * GN;
    const int64_t lo = th * per < N ? th * per : N;
    const int64_t hi = th == nt - 1 ? N : (lo + per < N ? lo + per : N);
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u); /* FTZ | DAZ: as the dot-product instruction */
    for (int64_t b0 = lo; b0 < hi; b0 += GBLK) {
        const int64_t b1 = b0 + GBLK < hi ? b0 + GBLK : hi;
        /* The next block is fetched into L2 a slice per tile while this one is computed, so
         * memory and arithmetic overlap; only the first block is read as it is used. */
        const int64_t next_rows = (b1 + GBLK < hi ? b1 + GBLK : hi) - b1;
        const char *next = (const char *)(w + b1 * K);
        const char *const next_end = next + next_rows * K * 2;
        const int64_t slice = (next_rows * K * 2) / (tiles * ((b1 - b0 + GN - 1) / GN)) + 64;
        for (int64_t m0 = 0; m0 < M; m0 += GM) {
            const int64_t R = M - m0 < GM ? M - m0 : GM;
            for (int64_t n0 = b0; n0 < b1; n0 += GN) {
                const int64_t S = b1 - n0 < GN ? b1 - n0 : GN;
                for (const char *p = next; p < next + slice && p < next_end; p += 64)
                    _mm_prefetch(p, _MM_HINT_T1);
                next += slice;
                tile_any(xs + m0 * Kp, w + n0 * K, K, R, S, bias ? bias + n0 : NULL,
                         out + m0 * ldo + n0, ldo, b0 == lo && m0 == 0);
            }
        }
    }
    _mm_setcsr(csr);
#pragma omp barrier
}
#else
static void many_team(int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t x_stride,
                      const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t ldo,
                      float *xs)
{
    (void)xs; /* no AVX-512 BF16: the portable loop, in its own order */
    rows_team(M, N, K, x, x_stride, w, bias, out, ldo);
}
#endif

/* xs: caller's scratch of M x Kp fp32, Kp = K rounded up to 32. */
void linear_bf16_many(int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t x_stride,
                      const uint16_t *w, const uint16_t *bias, uint16_t *out, float *xs)
{
#pragma omp parallel
    many_team(M, N, K, x, x_stride, w, bias, out, N, xs);
}

/* A gated feed-forward block of a decode batch, one call: gu = x w_gu^T ([M][2I], bf16, gate
 * first), h = silu(gate) * up ([M][I], bf16: the activation and the product each rounded, as
 * torch's bf16 ops hold them), out = h w_down^T ([M][H]). gu and h: caller's scratch; xs: NULL
 * for the products of dot_rows (a few rows), else scratch of M x max(H, I) fp32 (rounded up to
 * 32) for the tile kernel. Three phases of one team, where the composed block took two linear
 * calls and three torch ops; either kernel gives the same bits. */
void gated_mlp_bf16(int64_t M, int64_t I, int64_t H, const uint16_t *x, int64_t x_stride,
                    const uint16_t *w_gu, const uint16_t *w_down, uint16_t *gu, uint16_t *h,
                    uint16_t *out, float *xs)
{
#pragma omp parallel
    {
        if (xs)
            many_team(M, 2 * I, H, x, x_stride, w_gu, NULL, gu, 2 * I, xs);
        else
            rows_team(M, 2 * I, H, x, x_stride, w_gu, NULL, gu, 2 * I);
        act_team(M, I, gu, h);
        if (xs)
            many_team(M, H, I, h, I, w_down, NULL, out, H, xs);
        else
            rows_team(M, H, I, h, I, w_down, NULL, out, H);
    }
}

/* The routed experts of a mixture-of-experts layer for a decode batch, one call:
 * out[t] = sum_k weights[t*K + k] * expert_e(x[t]), e = ids[t*K + k], each expert over the rows
 * routed to it, so only the routed experts' weights are read: at batch 1 the k of E, where
 * the padded batched GEMM (kernels/moe.py) reads every expert's. gated: a gated block as
 * gated_mlp_bf16's (w_up [E][2I][H], gate rows first, silu); else a plain one, relu(up)^2
 * (w_up [E][I][H], Nemotron-H's). w_down [E][H][I]. The sum runs in fp32 in k order and is
 * rounded once, as moe_unpad_bf16's. Pairs are grouped by expert with a counting sort (stable:
 * an expert's rows in pair order); an id outside 0..E-1 contributes nothing (nothing is read or
 * written out of bounds). Nothing is returned for Python to read, so a decode step holding the
 * call can be recorded (engine/step_graph.py).
 * Scratch, P = T * K: xs [P][H], gu [P][2I] (or [P][I]), h [P][I], y [P][H] bf16;
 * idx [2P + 2E + 1]. */
void moe_experts_bf16(int64_t T, int64_t K, int64_t E, int64_t I, int64_t H, int gated,
                      const uint16_t *x, int64_t x_stride, const int64_t *ids,
                      const float *weights, const uint16_t *w_up, const uint16_t *w_down,
                      uint16_t *xs, uint16_t *gu, uint16_t *h, uint16_t *y, int64_t *idx,
                      uint16_t *out)
{
    const int64_t P = T * K;
    const int64_t U = gated ? 2 * I : I; /* the first GEMM's columns */
    int64_t *slot = idx, *pair = idx + P, *start = idx + 2 * P;
    const int64_t rows = experts_sort(P, E, ids, idx);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t s = 0; s < rows; s++)
            memcpy(xs + s * H, x + pair[s] / K * x_stride, (size_t)H * sizeof(uint16_t));
        for (int64_t e = 0; e < E; e++) /* every thread walks every expert: the teams' barriers */
            if (start[e + 1] > start[e])
                rows_team(start[e + 1] - start[e], U, H, xs + start[e] * H, H, w_up + e * U * H,
                          NULL, gu + start[e] * U, U);
        if (gated)
            act_team(rows, I, gu, h);
        else
            relu2_team(rows, I, gu, h);
        for (int64_t e = 0; e < E; e++)
            if (start[e + 1] > start[e])
                rows_team(start[e + 1] - start[e], H, I, h + start[e] * I, I,
                          w_down + e * H * I, NULL, y + start[e] * H, H);
        experts_sum_team(T, K, H, slot, weights, y, out);
    }
}

/* Whether this build uses the AVX-512 BF16 dot-product instruction (else the portable loop). */
int linear_uses_dpbf16(void) { return HAVE_DPBF16; }

/* Whether this build widens to fp32 with AVX2 (dot_f32x: no bf16 dot product here). */
int linear_uses_f32x(void) { return HAVE_F32X; }
