/* Row pieces of the RMSNorms that the norm kernels (rms_norm.c) and the decode steps that end
 * in their mixer's output norm (ssm_decode.c, gated_delta_decode.c) share (header-only). */
#ifndef MAMBARADIX_GATED_NORM_H
#define MAMBARADIX_GATED_NORM_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vec_math.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#define SS_LANES 16

/* The sum of squares in an order fixed by the length alone: feature i into lane i % 16, the
 * lanes summed pairwise. A reduction left to the vectoriser (`omp simd reduction`) may peel
 * for alignment or pick another width where the function is inlined, so the same row gave
 * another last bit in another caller (a verify step's rows against one-position steps). */
ALWAYS_INLINE float sum_squares(const void *x, int64_t off, const float *mul, int64_t dim,
                                const int bf)
{
    float lane[SS_LANES] = {0};
    int64_t i = 0;
    for (; i + SS_LANES <= dim; i += SS_LANES)
#pragma omp simd
        for (int l = 0; l < SS_LANES; l++) {
            const float v = mul ? ld(x, off + i + l, bf) * mul[i + l] : ld(x, off + i + l, bf);
            lane[l] += v * v;
        }
    for (int l = 0; i + l < dim; l++) {
        const float v = mul ? ld(x, off + i + l, bf) * mul[i + l] : ld(x, off + i + l, bf);
        lane[l] += v * v;
    }
    for (int w = SS_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            lane[l] += lane[l + w];
    return lane[0];
}

ALWAYS_INLINE float inv_rms(const void *x, int64_t off, int64_t dim, float eps, const int bf)
{
    return 1.0f / sqrtf(sum_squares(x, off, NULL, dim, bf) / (float)dim + eps);
}

/* gr = silu(z) in fp32 for n features of a gate row (z in the model's dtype), as the torch
 * reference's F.silu(gate.float()) (exp_poly: relative error ~1e-7 where torch's vectorised exp
 * has ~1 ulp). */
ALWAYS_INLINE void silu_row(float *gr, const void *z, int64_t zo, int64_t n, const int bf)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float g = ld(z, zo + i, bf);
        gr[i] = silu_poly(g);
    }
}

/* Gated DeltaNet's norm of one row: out = weight * norm(x) * gate (gr: the silu'd gate, fp32),
 * rounded where the reference holds bf16 (the normalised row, its product with the weight, the
 * output). */
ALWAYS_INLINE void norm_gated(
    int64_t dim, const void *x, int64_t xo, const float *gr, const void *weight, float eps,
    void *out, int64_t oo, const int bf)
{
    const float inv = inv_rms(x, xo, dim, eps, bf);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) {
        const float y = rnd(ld(weight, i, bf) * rnd(ld(x, xo + i, bf) * inv, bf), bf);
        st(out, oo + i, y * gr[i], bf);
    }
}

/* Mamba2's gate-first norm of one group: v = x * silu(gate) in fp32, out = weight *
 * round(v / rms(v)) (the reference normalises in fp32, rounds, then multiplies by the weight in
 * the model's dtype). */
ALWAYS_INLINE void norm_gate_first(
    int64_t dim, const void *x, int64_t xo, const float *gr, const void *weight, int64_t wo,
    float eps, void *out, int64_t oo, const int bf)
{
    const float inv = 1.0f / sqrtf(sum_squares(x, xo, gr, dim, bf) / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++)
        st(out, oo + i, ld(weight, wo + i, bf) * rnd(ld(x, xo + i, bf) * gr[i] * inv, bf), bf);
}

/* A Mamba2 mixer without its norm (Falcon-H1's default): out = x * silu(gate) in fp32, rounded
 * once (gr: the silu'd gate). */
ALWAYS_INLINE void gate_only(int64_t dim, const void *x, int64_t xo, const float *gr, void *out,
                             int64_t oo, const int bf)
{
#pragma omp simd
    for (int64_t i = 0; i < dim; i++)
        st(out, oo + i, ld(x, xo + i, bf) * gr[i], bf);
}

#endif
