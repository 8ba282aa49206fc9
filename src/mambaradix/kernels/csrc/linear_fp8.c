/* Decode linears over fp8 weights: out[m, n] = sum_k x[m, k] * w[n, k] * scale(n, k) (+ bias[n])
 * for a few bf16 rows m, w [N, K] in float8 e4m3 (the published FP8 checkpoints' format), one
 * fp32 scale per block of 128 x 128 weights (scale [ceil(N / 128), ceil(K / 128)]).
 *
 * Why: a decode step streams every weight once, so its speed is the weights' bytes over the
 * memory bandwidth; one byte a weight instead of bf16's two halves the read. The conversion
 * must cost less than the bytes it saves: with e4m3 -> fp32 by shifts and a multiply-add per 16
 * weights the two cores computed 17 GB/s of fp8 (slower than bf16 streamed); by table this kernel
 * converts 64 weights in 5 instructions. Against linear.c's bf16 kernel on the same matrices
 * (2048 x 2048 and 1024 x 3584, 512 MB of them cycled, AMD EPYC Zen 4, 2 threads): 1.6-2.4x
 * faster at one row, 1.3-1.8x at four, 0.85-1.06x at sixteen, where both compute more than they
 * read (docs/benchmarks.md, 2026-12-07).
 *
 * How: 64 weight bytes are one load. Their low 7 bits index two 128-entry byte tables (the high
 * and the low byte of each code's value in bf16, vpermi2b) and the sign bit is put back into the
 * high byte; e4m3's 4 exponent and 3 mantissa bits are exact in bf16, and its subnormals are
 * normal bf16 numbers, so the bf16 dot product (which flushes bf16 subnormals) sees every value
 * exactly. Unpacking the two bytes into words interleaves them by 128-bit lane: the x rows are
 * permuted once per call the same way (permute_rows), so each product pairs the right weight.
 * A block of 128 columns accumulates in fp32 from zero, is multiplied by its scale and added to
 * the row's total: an order fixed by K alone (a row's result does not depend on the other rows
 * of the batch, the thread count, or how rows are grouped). The single rounding to bf16 comes
 * after the bias is added. Products are exact (bf16 x bf16 in fp32).
 *
 * Threads split the weight rows in contiguous ranges, each range read as two streams side by
 * side (the prefetch runs PF_BYTES ahead within a stream, into the stream's next rows: with the
 * two rows of a pair adjacent, a prefetch past a short row landed on the row being read and the
 * kernel read half as fast).
 *
 * Any K: a row's last chunk is read masked and the x rows are zero-padded to whole chunks.
 * Needs AVX-512 BF16 and VBMI (Zen 4, Sapphire Rapids and later); linear_fp8_supported() says
 * whether this build has them (the caller dequantizes to bf16 otherwise).
 */
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "experts.h"
#include "vec_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_FP8 1
#else
#define HAVE_FP8 0
#endif

#define BLOCK 128   /* the scale blocks' side */
#define CHUNK 64    /* weights converted at once */
#define XR 4        /* x rows dotted with one converted chunk */
#define PF_BYTES 2048

int linear_fp8_supported(void) { return HAVE_FP8; }

/* The element of a 64-chunk at position j of the converted words: words 0-31 are bytes
 * [0-7, 16-23, 32-39, 48-55] (unpacklo within each 128-bit lane), words 32-63 the others. */
static inline int64_t chunk_source(int64_t j)
{
    const int64_t half = j / 32, lane = (j % 32) / 8, i = j % 8;
    return 16 * lane + 8 * half + i;
}

/* The permuted rows' length: K rounded up to whole chunks (zeros past K). */
#define KP(K) (((K) + CHUNK - 1) / CHUNK * CHUNK)

/* x row m (bf16, row stride xs) into xp row m ([M][KP(K)]), each 64-chunk in chunk_source's
 * order, zeros past K. */
static inline void permute_row(int64_t m, int64_t K, const uint16_t *x, int64_t xs, uint16_t *xp)
{
    const int64_t Kp = KP(K);
    for (int64_t c = 0; c < Kp; c += CHUNK)
        for (int64_t j = 0; j < CHUNK; j++) {
            const int64_t k = c + chunk_source(j);
            xp[m * Kp + c + j] = k < K ? x[m * xs + k] : 0;
        }
}

#if HAVE_FP8
typedef struct {
    __m512i hi0, hi1, lo0, lo1, sign;
} tables_t;

/* 64 e4m3 bytes -> two vectors of 32 bf16 (chunk_source's order); the bytes past ``left``
 * are not read, and zeros (a row's last chunk where K is not a multiple of 64). */
static inline __attribute__((always_inline)) void convert(const uint8_t *w, int64_t left,
                                                          const tables_t *t, __m512i *w0,
                                                          __m512i *w1)
{
    const __m512i b = left >= CHUNK ? _mm512_loadu_si512((const void *)w)
                                    : _mm512_maskz_loadu_epi8((__mmask64)((1ULL << left) - 1), w);
    __m512i hi = _mm512_permutex2var_epi8(t->hi0, b, t->hi1);
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, b, t->lo1);
    hi = _mm512_ternarylogic_epi32(hi, b, t->sign, 0xF8); /* hi | (b & 0x80) */
    *w0 = _mm512_unpacklo_epi8(lo, hi);
    *w1 = _mm512_unpackhi_epi8(lo, hi);
}

#define DP(acc, xv, wv) _mm512_dpbf16_ps((acc), (__m512bh)(xv), (__m512bh)(wv))

/* A group of R <= XR x rows (xg: permuted, row length KP(K)) against weight rows wr[s < S] over
 * the whole of K, the running lanes in registers. res[s * XR + r]: the dots' lane sums. */
static inline __attribute__((always_inline)) void dot_group(const uint16_t *xg, int64_t K,
                                                            const uint8_t *const *wr,
                                                            const float *const *sr,
                                                            const int S, const int R,
                                                            const tables_t *t, float *res)
{
    __m512 tot[2][XR];
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++)
            tot[s][r] = _mm512_setzero_ps();
    const int64_t Kp = KP(K);
    for (int64_t k0 = 0; k0 < Kp; k0 += BLOCK) {
        const int NC = k0 + BLOCK <= Kp ? 2 : 1;
        __m512 acc[2][XR];
        for (int s = 0; s < S; s++)
            for (int r = 0; r < R; r++)
                acc[s][r] = _mm512_setzero_ps();
        for (int c = 0; c < NC; c++) {
            const int64_t k = k0 + c * CHUNK;
            __m512i wv[2][2];
            for (int s = 0; s < S; s++) {
                _mm_prefetch((const char *)((uintptr_t)(wr[s] + k) + PF_BYTES), _MM_HINT_T0);
                convert(wr[s] + k, K - k, t, &wv[s][0], &wv[s][1]);
            }
            for (int r = 0; r < R; r++) {
                const __m512i x0 = _mm512_loadu_si512((const void *)(xg + r * Kp + k));
                const __m512i x1 = _mm512_loadu_si512((const void *)(xg + r * Kp + k + 32));
                for (int s = 0; s < S; s++) {
                    acc[s][r] = DP(acc[s][r], x0, wv[s][0]);
                    acc[s][r] = DP(acc[s][r], x1, wv[s][1]);
                }
            }
        }
        for (int s = 0; s < S; s++) {
            const __m512 scale = _mm512_set1_ps(sr[s][k0 / BLOCK]);
            for (int r = 0; r < R; r++)
                tot[s][r] = _mm512_fmadd_ps(acc[s][r], scale, tot[s][r]);
        }
    }
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++)
            res[s * XR + r] = _mm512_reduce_add_ps(tot[s][r]);
}

/* Weight rows na (and nb when S = 2) against every x row, into out: group by group of XR
 * rows, each converting the weights again (the two rows stay in L1 between groups). Converting
 * once per block for all groups, with each group's running lanes kept in memory, took 1.2-1.4x
 * the time at 16 rows: the lanes' round trips cost more than the conversions they saved. */
static inline __attribute__((always_inline)) void rows_fp8(
    int64_t M, int64_t N, int64_t K, const uint16_t *xp, const uint8_t *w, const float *scale,
    int64_t na, int64_t nb, const int S, const uint16_t *bias, uint16_t *out, const tables_t *t)
{
    const int64_t KB = (K + BLOCK - 1) / BLOCK;
    const uint8_t *wr[2] = {w + na * K, w + nb * K};
    const float *sr[2] = {scale + na / BLOCK * KB, scale + nb / BLOCK * KB};
    const int64_t ns[2] = {na, nb};
    for (int64_t m0 = 0; m0 < M; m0 += XR) {
        const int64_t R = M - m0 < XR ? M - m0 : XR;
        float res[2 * XR];
#define F(s_, r_) dot_group(xp + m0 * KP(K), K, wr, sr, s_, r_, t, res)
        if (S == 2)
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
        for (int s = 0; s < S; s++) {
            const float b = bias ? bf16_to_f32(bias[ns[s]]) : 0.0f;
            for (int64_t r = 0; r < R; r++)
                out[(m0 + r) * N + ns[s]] = f32_to_bf16(res[s * XR + r] + b);
        }
    }
}

/* out [M][N] = x [M][K] (bf16, row stride xs) times the fp8 weights' transpose (+ bias), by
 * every thread of a team: the rows permuted into xp (scratch M x KP(K)) first, then each thread's
 * contiguous range of weight rows as two streams. Barriers after the permutation and at the
 * end (the caller's next phase reads out). */
static inline __attribute__((always_inline)) void fp8_team(
    int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t xs, const uint8_t *w,
    const float *scale, const uint16_t *bias, uint16_t *out, uint16_t *xp, const tables_t *t)
{
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        permute_row(m, K, x, xs, xp);
#ifdef _OPENMP
    const int64_t nt = omp_get_num_threads(), th = omp_get_thread_num();
#else
    const int64_t nt = 1, th = 0;
#endif
    const int64_t lo = N * th / nt, hi = N * (th + 1) / nt, half = (hi - lo) / 2;
    for (int64_t i = 0; i < half; i++)
        rows_fp8(M, N, K, xp, w, scale, lo + i, lo + half + i, 2, bias, out, t);
    if ((hi - lo) % 2)
        rows_fp8(M, N, K, xp, w, scale, hi - 1, hi - 1, 1, bias, out, t);
#pragma omp barrier
}

static inline tables_t load_tables(const uint8_t *lut_hi, const uint8_t *lut_lo)
{
    tables_t t;
    t.hi0 = _mm512_loadu_si512((const void *)lut_hi);
    t.hi1 = _mm512_loadu_si512((const void *)(lut_hi + 64));
    t.lo0 = _mm512_loadu_si512((const void *)lut_lo);
    t.lo1 = _mm512_loadu_si512((const void *)(lut_lo + 64));
    t.sign = _mm512_set1_epi8((char)0x80);
    return t;
}
#endif

/* out [M, N] (bf16) = x [M, K] (bf16, row stride xs) times the fp8 weights' transpose, + bias
 * (bf16, nullable). lut_hi / lut_lo: the 128 e4m3 magnitudes' bf16 bytes (kernels/fp8.py).
 * xp: scratch of M x KP(K) bf16 (K rounded up to 64). A build with linear_fp8_supported()
 * (else nothing is written: the caller checks). */
void linear_fp8(int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t xs, const uint8_t *w,
               const float *scale, const uint16_t *bias, uint16_t *out, const uint8_t *lut_hi,
               const uint8_t *lut_lo, uint16_t *xp)
{
#if HAVE_FP8
    const tables_t t = load_tables(lut_hi, lut_lo);
#pragma omp parallel
    fp8_team(M, N, K, x, xs, w, scale, bias, out, xp, &t);
#else
    (void)M, (void)N, (void)K, (void)x, (void)xs, (void)w, (void)scale, (void)bias, (void)out;
    (void)lut_hi, (void)lut_lo, (void)xp;
#endif
}

/* The routed experts of a mixture-of-experts layer for a decode batch over fp8 expert stacks,
 * one call: linear.c's moe_experts_bf16 (the pairs sorted by expert, each expert over its
 * rows, the activation, the weighted sum: experts.h) with each expert's GEMMs from its codes
 * (fp8_team): w_up [E][U][H] codes with scales [E][ceil(U/128)][ceil(H/128)], U = 2I gated
 * (gate rows first) else I; w_down [E][H][I] with [E][ceil(H/128)][ceil(I/128)] (the caller
 * checks that the build has the kernel). Scratch, P = T * K: xs [P][H], gu [P][U], h [P][I],
 * y [P][H], xp [P][KP(max(H, I))] bf16; idx [2P + 2E + 1]. */
void moe_experts_fp8(int64_t T, int64_t K, int64_t E, int64_t I, int64_t H, int gated,
                     const uint16_t *x, int64_t x_stride, const int64_t *ids,
                     const float *weights, const uint8_t *w_up, const float *s_up,
                     const uint8_t *w_down, const float *s_down, const uint8_t *lut_hi,
                     const uint8_t *lut_lo, uint16_t *xs, uint16_t *gu, uint16_t *h, uint16_t *y,
                     uint16_t *xp, int64_t *idx, uint16_t *out)
{
#if HAVE_FP8
    const int64_t P = T * K, U = gated ? 2 * I : I;
    const int64_t up_scales = (U + BLOCK - 1) / BLOCK * ((H + BLOCK - 1) / BLOCK);
    const int64_t down_scales = (H + BLOCK - 1) / BLOCK * ((I + BLOCK - 1) / BLOCK);
    int64_t *slot = idx, *pair = idx + P, *start = idx + 2 * P;
    const int64_t rows = experts_sort(P, E, ids, idx);
    const tables_t t = load_tables(lut_hi, lut_lo);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t s = 0; s < rows; s++)
            memcpy(xs + s * H, x + pair[s] / K * x_stride, (size_t)H * sizeof(uint16_t));
        for (int64_t e = 0; e < E; e++) /* every thread walks every expert: the teams' barriers */
            if (start[e + 1] > start[e])
                fp8_team(start[e + 1] - start[e], U, H, xs + start[e] * H, H, w_up + e * U * H,
                         s_up + e * up_scales, NULL, gu + start[e] * U, xp, &t);
        if (gated)
            act_team(rows, I, gu, h);
        else
            relu2_team(rows, I, gu, h);
        for (int64_t e = 0; e < E; e++)
            if (start[e + 1] > start[e])
                fp8_team(start[e + 1] - start[e], H, I, h + start[e] * I, I, w_down + e * H * I,
                         s_down + e * down_scales, NULL, y + start[e] * H, xp, &t);
        experts_sum_team(T, K, H, slot, weights, y, out);
    }
#else
    (void)T, (void)K, (void)E, (void)I, (void)H, (void)gated, (void)x, (void)x_stride, (void)ids;
    (void)weights, (void)w_up, (void)s_up, (void)w_down, (void)s_down, (void)lut_hi, (void)lut_lo;
    (void)xs, (void)gu, (void)h, (void)y, (void)xp, (void)idx, (void)out;
#endif
}

#if HAVE_FP8
/* 16 e4m3 codes (zero-extended bytes) -> their values in fp32, exactly: the 7 magnitude bits
 * placed as an fp32 exponent and mantissa 120 below e4m3's bias (e4m3 subnormals become fp32
 * subnormals), the sign bit moved up, then times 2^120. (Exact while the CPU does not treat
 * subnormal inputs as zero: MXCSR's DAZ, which nothing in this process sets; the tests check
 * every code.) */
static inline __attribute__((always_inline)) __m512 e4m3_f32(__m512i b)
{
    const __m512i mag = _mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32(0x07F00000));
    const __m512i sign = _mm512_slli_epi32(_mm512_srli_epi32(b, 7), 31);
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(mag, sign)),
                         _mm512_set1_ps(0x1p120f));
}
#endif

/* w [N, K] fp8 with its block scales -> out [N, K] bf16: bf16(code * scale), rounded once (the
 * reference's dequantization; the many-row path then runs the bf16 matmul). Any K. */
void dequantize_fp8(int64_t N, int64_t K, const uint8_t *w, const float *scale,
                    const uint8_t *lut_hi, const uint8_t *lut_lo, uint16_t *out)
{
    const int64_t KB = (K + BLOCK - 1) / BLOCK;
    float value[256];
    for (int c = 0; c < 256; c++) {
        const uint16_t bits = (uint16_t)(lut_hi[c & 127] << 8 | lut_lo[c & 127]) |
                              (uint16_t)((c & 128) << 8);
        value[c] = bf16_to_f32(bits);
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *sr = scale + n / BLOCK * KB;
        const uint8_t *wr = w + n * K;
        uint16_t *orow = out + n * K;
        for (int64_t k0 = 0; k0 < K; k0 += BLOCK) {
            const float s = sr[k0 / BLOCK];
            const int64_t k1 = k0 + BLOCK < K ? k0 + BLOCK : K;
            int64_t k = k0;
#if HAVE_FP8
            const __m512 sv = _mm512_set1_ps(s);
            for (; k + 32 <= k1; k += 32) {
                const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(wr + k)));
                const __m512i b1 =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(wr + k + 16)));
                const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(e4m3_f32(b1), sv),
                                                       _mm512_mul_ps(e4m3_f32(b0), sv));
                _mm512_storeu_si512((void *)(orow + k), (__m512i)v);
            }
#endif
            for (; k < k1; k++)
                orow[k] = f32_to_bf16(value[wr[k]] * s);
        }
    }
}
