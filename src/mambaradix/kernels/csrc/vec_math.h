/* Small math helpers shared by the C kernels (header-only, static inline). */
#ifndef MAMBARADIX_VEC_MATH_H
#define MAMBARADIX_VEC_MATH_H

#include <math.h>
#include <stdint.h>

/* e^x as a polynomial that vectorises inside `omp simd` loops (glibc's expf does not without
 * -ffast-math): e^x = 2^n e^f, n = round(x / ln 2), |f| <= ln2 / 2, Cephes expf coefficients;
 * relative error ~1e-7. x is clamped to [-87, 88], NaN to -87 as fmaxf(x, -87) would clamp it;
 * written as comparisons because GCC calls libm for fmaxf and fminf in ISO C (they order
 * signed zeros and NaNs), and a loop with a call does not vectorise: every loop over exp_poly
 * ran one element at a time, ~8 ns each on an AVX2 EPYC. */
#pragma omp declare simd notinbranch
static inline float exp_poly(float x)
{
    x = !(x >= -87.0f) ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float f = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    const float y = p * f * f + f + 1.0f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return y * two_n.f;
}

/* SiLU, x / (1 + e^-x), with exp_poly. Below -88, where e^-x leaves exp_poly's range, it is
 * -0: exp_poly's clamp would give x / e^88 there, -0.6 at x = -1e38 where SiLU is ~0 (torch's
 * fp32 SiLU gives -0 from -88.7 on and ~-5e-37 between, NaN at -inf). */
#pragma omp declare simd notinbranch
static inline float silu_poly(float x)
{
    return x < -88.0f ? -0.0f : x / (1.0f + exp_poly(-x));
}

/* bf16 <-> fp32. bf16 is the top half of an fp32; a store rounds to nearest even (NaN kept
 * quiet), as torch's conversion does. */
#pragma omp declare simd notinbranch
static inline float bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

#pragma omp declare simd notinbranch
static inline uint16_t f32_to_bf16(float f)
{
    union { float f; uint32_t u; } v = {.f = f};
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The fp32 value of f rounded to bf16 (what a bf16 tensor would hold). */
#pragma omp declare simd notinbranch
static inline float round_bf16(float f)
{
    return bf16_to_f32(f32_to_bf16(f));
}

/* One body for both dtypes: a kernel written once as an always-inline function of `bf`
 * (0: fp32 tensors, 1: bf16), each exported variant calling it with a constant, so these
 * branches fold away; except inside an OpenMP parallel region of the shared body, which is
 * outlined once for both (put the parallel loop in the exported functions where it matters,
 * as rms_norm.c does). ld / st: element i of a tensor of that dtype (a store rounds to bf16);
 * rnd: v rounded where a bf16 tensor would hold it (nothing in fp32). */
static inline float ld(const void *p, int64_t i, int bf)
{
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, int64_t i, float v, int bf)
{
    if (bf)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline float rnd(float v, int bf)
{
    return bf ? round_bf16(v) : v;
}

/* dst = src * scale, scale divided by the L2 norm sqrt(sum src^2 + 1e-6) when l2norm: the q and
 * k heads of the Gated DeltaNet kernels. dst may be src. */
static inline void scale_l2(float *dst, const float *src, int64_t n, float scale, int l2norm)
{
    if (l2norm) {
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++)
            ss += src[i] * src[i];
        scale /= sqrtf(ss + 1e-6f);
    }
    for (int64_t i = 0; i < n; i++)
        dst[i] = src[i] * scale;
}

/* The prefill scans' inputs: views of a conv output, token- or channel-major. */
#define SCAN_BLOCK 32 /* tokens whose inputs are gathered at a time */

/* A prefill segment s runs in pieces: up to each of its snapshots' offsets (the snapshots
 * sorted by segment, then offset), then to its end. Moves *k to the next snapshot of s (K: none
 * left) and returns the row where that piece stops; the caller then writes the state into
 * snapshot *k's slot, or (*k == K) the segment's own. Loop: for (k = 0; k <= K; k++). */
static inline int64_t scan_piece(int64_t s, int64_t *k, const int64_t *cu, int64_t K,
                                 const int64_t *snap_seq, const int64_t *snap_off)
{
    while (*k < K && snap_seq[*k] != s)
        ++*k;
    return *k < K ? cu[s] + snap_off[*k] : cu[s + 1];
}

/* out[j][i] = src[(t0 + j) * ts + c0 + i * cs] in fp32 for j < nb, i < width, reading along
 * whichever stride is 1: channel-major rows at a power-of-two stride (T = 2,048 bf16 tokens is
 * 4 KB) all fall in one L1 set, so a token at a time would reload each line for every token. */
static inline __attribute__((always_inline)) void scan_gather(
    float *out, const void *src, int64_t t0, int64_t nb, int64_t ts, int64_t c0, int64_t cs,
    int64_t width, const int bf)
{
    if (ts == 1) {
        for (int64_t i = 0; i < width; i++)
            for (int64_t j = 0; j < nb; j++)
                out[j * width + i] = ld(src, t0 + j + c0 + i * cs, bf);
    } else {
        for (int64_t j = 0; j < nb; j++)
            for (int64_t i = 0; i < width; i++)
                out[j * width + i] = ld(src, (t0 + j) * ts + c0 + i * cs, bf);
    }
}

#endif
