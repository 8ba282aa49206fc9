/* The decode window of a depthwise causal conv in bf16, 16 channels at a time (AVX-512 BW).
 *
 * A conv state is [C][K-1] (oldest input first), the weight [C][K]: a channel's values are
 * interleaved with its neighbours', so a scalar loop over channels does not vectorise (and ran
 * 16-20 ns a channel: 30-60 us for the 1,792 channels of a Granite-4.0-H layer, more than its
 * scan step). Here 16 channels' states and weights are loaded whole and split into one vector
 * per window position with 16-bit lane permutes; the shifted state (x appended) is written
 * back the same way. Only the kernel widths of the published models: K = 4 (Mamba2, Gated
 * DeltaNet) and K = 3 (LFM2); a caller runs its scalar loop for any other width and for the
 * last C % 16 channels.
 *
 * Also the vector forms of vec_math.h's helpers, computed with the same operations in the same
 * order (no fused multiply-add: the kernels build as ISO C, where GCC does not contract), so a
 * vector lane gives bit for bit what the scalar helper gives.
 */
#ifndef MAMBARADIX_CONV_WINDOW_H
#define MAMBARADIX_CONV_WINDOW_H

#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_CONV_WINDOW 1

#define CW_INLINE static inline __attribute__((always_inline))

/* 16 lanes i -> stride * i + j (the window position j of channel i); the upper half unused */
#define CW_L16(s, j)                                                                        \
    {0 * (s) + (j), 1 * (s) + (j), 2 * (s) + (j), 3 * (s) + (j), 4 * (s) + (j),             \
     5 * (s) + (j), 6 * (s) + (j), 7 * (s) + (j), 8 * (s) + (j), 9 * (s) + (j),             \
     10 * (s) + (j), 11 * (s) + (j), 12 * (s) + (j), 13 * (s) + (j), 14 * (s) + (j),        \
     15 * (s) + (j)}
static const uint16_t CW_S2[2][32] __attribute__((aligned(64))) = {CW_L16(2, 0), CW_L16(2, 1)};
static const uint16_t CW_S3[3][32]
    __attribute__((aligned(64))) = {CW_L16(3, 0), CW_L16(3, 1), CW_L16(3, 2)};
static const uint16_t CW_S4[4][32] __attribute__((aligned(64))) = {
    CW_L16(4, 0), CW_L16(4, 1), CW_L16(4, 2), CW_L16(4, 3)};
/* The shifted state, lane L of the output = channel L / k1, position L % k1: the old position
 * + 1 (lane L + 1 of the old state) or, for the newest, x (lane 32 + L / 2 of the second
 * source for k1 = 2; for k1 = 3 the second source is old lanes 32..47 then x, so x of channel
 * i is lane 48 + i). */
#define CW_SH2(L) ((L) % 2 == 0 ? (L) + 1 : 32 + (L) / 2)
#define CW_SH3(L) ((L) % 3 < 2 ? (L) + 1 : 48 + (L) / 3)
#define CW_8(F, b) F(b), F(b + 1), F(b + 2), F(b + 3), F(b + 4), F(b + 5), F(b + 6), F(b + 7)
static const uint16_t CW_SHIFT2[32] __attribute__((aligned(64))) = {
    CW_8(CW_SH2, 0), CW_8(CW_SH2, 8), CW_8(CW_SH2, 16), CW_8(CW_SH2, 24)};
static const uint16_t CW_SHIFT3[2][32] __attribute__((aligned(64))) = {
    {CW_8(CW_SH3, 0), CW_8(CW_SH3, 8), CW_8(CW_SH3, 16), CW_8(CW_SH3, 24)},
    {CW_8(CW_SH3, 32), CW_8(CW_SH3, 40)}};

#define CW_IDX(t) _mm512_load_si512((const void *)(t))
#define CW_MASK(n) ((__mmask32)((1ull << (n)) - 1))

CW_INLINE __m512 cw_bf16_to_ps(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* f32_to_bf16 of 16 lanes: round to nearest even, NaN kept quiet */
CW_INLINE __m256i cw_ps_to_bf16(__m512 v)
{
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

CW_INLINE __m512 cw_round_bf16(__m512 v) { return cw_bf16_to_ps(cw_ps_to_bf16(v)); }

/* 16 bf16 values at p as fp32 */
CW_INLINE __m512 cw_load_bf16(const void *p)
{
    return cw_bf16_to_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* exp_poly of 16 lanes */
CW_INLINE __m512 cw_exp_poly(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
#define CW_STEP(p, c) _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(c))
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = CW_STEP(p, 1.3981999507e-3f);
    p = CW_STEP(p, 8.3334519073e-3f);
    p = CW_STEP(p, 4.1665795894e-2f);
    p = CW_STEP(p, 1.6666665459e-1f);
    p = CW_STEP(p, 5.0000001201e-1f);
#undef CW_STEP
    const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, f), f), f),
                                   _mm512_set1_ps(1.0f));
    const __m512i two_n = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(two_n));
}

/* silu_poly of 16 lanes (the kernels' SiLU: -0 below -88) */
CW_INLINE __m512 cw_silu(__m512 v)
{
    const __m512 s = _mm512_div_ps(
        v, _mm512_add_ps(_mm512_set1_ps(1.0f), cw_exp_poly(_mm512_sub_ps(_mm512_setzero_ps(), v))));
    const __mmask16 low = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-88.0f), _CMP_LT_OQ);
    return _mm512_mask_mov_ps(s, low, _mm512_set1_ps(-0.0f));
}

/* Channels c .. c + 15 of one request, kernel width K (3 or 4): the window win[0 .. K-1]
 * (the K-1 state values, oldest first, then x) and the weights wv[0 .. K-1] as fp32 vectors;
 * the shifted state (x appended) is written to dst (src itself for an in-place step). src, dst:
 * [C][K-1] pool rows (the state before and after this token), w: the [C][K] weight, x: the
 * request's input row, all bf16. */
CW_INLINE void cw_window16(int64_t c, int K, const uint16_t *x, const uint16_t *src,
                           uint16_t *dst, const uint16_t *w, __m512 win[4], __m512 wv[4])
{
    const int k1 = K - 1;
    const __m256i xh = _mm256_loadu_si256((const __m256i *)(x + c));
    const __m512i x512 = _mm512_castsi256_si512(xh);
    const uint16_t *s = src + c * k1;
    uint16_t *d = dst + c * k1;
    const uint16_t *wc = w + c * K;
    /* weights: 16 K values, one or two vectors of 32 lanes */
    const __m512i w0 = _mm512_loadu_si512((const void *)wc);
    const __m512i w1 = _mm512_maskz_loadu_epi16(CW_MASK(16 * K - 32), wc + 32);
    if (K == 4) {
        const __m512i lo = _mm512_loadu_si512((const void *)s); /* 32 of 48 state lanes */
        const __m512i hi = _mm512_maskz_loadu_epi16(CW_MASK(16), s + 32);
        for (int j = 0; j < 3; j++)
            win[j] = cw_bf16_to_ps(_mm512_castsi512_si256(
                _mm512_permutex2var_epi16(lo, CW_IDX(CW_S3[j]), hi)));
        for (int j = 0; j < 4; j++)
            wv[j] = cw_bf16_to_ps(_mm512_castsi512_si256(
                _mm512_permutex2var_epi16(w0, CW_IDX(CW_S4[j]), w1)));
        const __m512i hx = _mm512_inserti64x4(hi, xh, 1); /* old lanes 32..47, then x */
        _mm512_storeu_si512((void *)d, _mm512_permutex2var_epi16(lo, CW_IDX(CW_SHIFT3[0]), hx));
        _mm512_mask_storeu_epi16(d + 32, CW_MASK(16),
                                 _mm512_permutex2var_epi16(lo, CW_IDX(CW_SHIFT3[1]), hx));
    } else { /* K == 3 */
        const __m512i old = _mm512_loadu_si512((const void *)s); /* 32 lanes */
        for (int j = 0; j < 2; j++)
            win[j] = cw_bf16_to_ps(_mm512_castsi512_si256(
                _mm512_permutexvar_epi16(CW_IDX(CW_S2[j]), old)));
        for (int j = 0; j < 3; j++)
            wv[j] = cw_bf16_to_ps(_mm512_castsi512_si256(
                _mm512_permutex2var_epi16(w0, CW_IDX(CW_S3[j]), w1)));
        _mm512_storeu_si512((void *)d, _mm512_permutex2var_epi16(old, CW_IDX(CW_SHIFT2), x512));
    }
    win[k1] = cw_bf16_to_ps(xh);
}

#else
#define HAVE_CONV_WINDOW 0
#endif

#endif
