/* RMSNorm over the rows of a matrix: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, where
 * w = 1 + weight (zero-centred, Qwen3-Next) or weight. x rows may be strided, the last dim is
 * dense; out is dense. One pass to sum squares, one to scale, per row; rows in parallel.
 * rms_norm_gated also multiplies by a gate row (silu already applied by the caller, where it
 * vectorises): out[r] = weight * norm(x[r]) * gate[r]. rms_norm_rope normalises each head of
 * x [T, H, D] (rows t*x_stride_t + h*x_stride_h) and rotates its first rd features with
 * cos/sin [T, rd], rotate-half pairs (d, d + rd/2); out is [T, H, D]. add_rms_norm first
 * adds a residual (h = residual + x * scale, also written out) and normalises h.
 *
 * Each kernel is written once for both dtypes (vec_math.h: ld / st / rnd with the dtype a
 * constant). The plain variants are fp32; the *_bf16 variants read and write bf16 (x, weight,
 * out; the gate and cos/sin stay fp32) and compute in fp32: the sum of squares accumulates in
 * fp32, and the result is rounded where the torch reference rounds (the normalised row before
 * a weight that is not zero-centred, as transformers' Llama-style norms do; the output).
 */
#include <math.h>
#include <stdint.h>

#include "gated_norm.h"

/* One row (norm, norm_gated) or head (norm_rope) per call; the exported functions below own
 * the parallel loops, so that each OpenMP region is outlined with `bf` a constant. */
ALWAYS_INLINE void norm(
    int64_t dim, const void *x, int64_t xo, const void *weight, float eps, int zero_centered,
    void *out, int64_t oo, const int bf)
{
    const float inv = inv_rms(x, xo, dim, eps, bf);
    if (zero_centered) {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            st(out, oo + i, ld(x, xo + i, bf) * inv * (1.0f + ld(weight, i, bf)), bf);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            st(out, oo + i, ld(weight, i, bf) * rnd(ld(x, xo + i, bf) * inv, bf), bf);
    }
}

ALWAYS_INLINE void norm_rope(
    int64_t D, const void *x, int64_t xo, const void *weight, float eps, int zero_centered,
    const float *c, const float *s, int64_t rd, void *out, int64_t oo, const int bf)
{
    const int64_t half = rd / 2;
    const float inv = inv_rms(x, xo, D, eps, bf);
    float row[D]; /* the normalised head, as the reference holds it */
    if (zero_centered) {
#pragma omp simd
        for (int64_t i = 0; i < D; i++)
            row[i] = rnd(ld(x, xo + i, bf) * inv * (1.0f + ld(weight, i, bf)), bf);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < D; i++)
            row[i] = rnd(ld(weight, i, bf) * rnd(ld(x, xo + i, bf) * inv, bf), bf);
    }
    for (int64_t i = 0; i < half; i++) {
        const float a = row[i], b = row[i + half];
        st(out, oo + i, a * c[i] - b * s[i], bf);
        st(out, oo + i + half, b * c[i + half] + a * s[i + half], bf);
    }
#pragma omp simd
    for (int64_t i = rd; i < D; i++)
        st(out, oo + i, row[i], bf);
}

#define ROWS_PARALLEL _Pragma("omp parallel for schedule(static) if (rows * dim > 16384)")
#define HEADS_PARALLEL _Pragma("omp parallel for schedule(static) if (T * H * D > 16384)")

void rms_norm(int64_t rows, int64_t dim, const float *x, int64_t x_stride, const float *weight,
              float eps, int zero_centered, float *out)
{
    ROWS_PARALLEL
    for (int64_t r = 0; r < rows; r++)
        norm(dim, x, r * x_stride, weight, eps, zero_centered, out, r * dim, 0);
}

void rms_norm_bf16(int64_t rows, int64_t dim, const uint16_t *x, int64_t x_stride,
                   const uint16_t *weight, float eps, int zero_centered, uint16_t *out)
{
    ROWS_PARALLEL
    for (int64_t r = 0; r < rows; r++)
        norm(dim, x, r * x_stride, weight, eps, zero_centered, out, r * dim, 1);
}

/* A residual block's end and the next norm: h = residual + x * scale, rounded as the layer's
 * tensors hold it (the product, then the sum), written to h_out; out = the norm of h. */
ALWAYS_INLINE void add_norm(
    int64_t dim, const void *x, int64_t xo, const void *res, int64_t ro, float scale,
    int scaled, const void *weight, float eps, int zero_centered, void *h_out, void *out,
    int64_t oo, const int bf)
{
    if (scaled) {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            st(h_out, oo + i, ld(res, ro + i, bf) + rnd(ld(x, xo + i, bf) * scale, bf), bf);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            st(h_out, oo + i, ld(res, ro + i, bf) + ld(x, xo + i, bf), bf);
    }
    norm(dim, h_out, oo, weight, eps, zero_centered, out, oo, bf);
}

#define ADD_NORM_ARGS(T)                                                                  \
    int64_t rows, int64_t dim, const T *x, int64_t x_stride, const T *res,               \
        int64_t res_stride, float scale, int scaled, const T *weight, float eps,         \
        int zero_centered, T *h_out, T *out
#define ADD_NORM_LOOP(bf)                                                                 \
    ROWS_PARALLEL                                                                         \
    for (int64_t r = 0; r < rows; r++)                                                    \
        add_norm(dim, x, r * x_stride, res, r * res_stride, scale, scaled, weight, eps,   \
                 zero_centered, h_out, out, r * dim, bf)

void add_rms_norm(ADD_NORM_ARGS(float)) { ADD_NORM_LOOP(0); }

void add_rms_norm_bf16(ADD_NORM_ARGS(uint16_t)) { ADD_NORM_LOOP(1); }

void rms_norm_gated(int64_t rows, int64_t dim, const float *x, int64_t x_stride,
                    const float *gate, int64_t gate_stride, const float *weight, float eps,
                    float *out)
{
    ROWS_PARALLEL
    for (int64_t r = 0; r < rows; r++)
        norm_gated(dim, x, r * x_stride, gate + r * gate_stride, weight, eps, out, r * dim, 0);
}

void rms_norm_gated_bf16(int64_t rows, int64_t dim, const uint16_t *x, int64_t x_stride,
                         const float *gate, int64_t gate_stride, const uint16_t *weight,
                         float eps, uint16_t *out)
{
    ROWS_PARALLEL
    for (int64_t r = 0; r < rows; r++)
        norm_gated(dim, x, r * x_stride, gate + r * gate_stride, weight, eps, out, r * dim, 1);
}

void rms_norm_rope(int64_t T, int64_t H, int64_t D, const float *x, int64_t x_stride_t,
                   int64_t x_stride_h, const float *weight, float eps, int zero_centered,
                   const float *cos, const float *sin, int64_t rd, float *out)
{
    HEADS_PARALLEL
    for (int64_t r = 0; r < T * H; r++)
        norm_rope(D, x, (r / H) * x_stride_t + (r % H) * x_stride_h, weight, eps,
                  zero_centered, cos + (r / H) * rd, sin + (r / H) * rd, rd, out, r * D, 0);
}

void rms_norm_rope_bf16(int64_t T, int64_t H, int64_t D, const uint16_t *x, int64_t x_stride_t,
                        int64_t x_stride_h, const uint16_t *weight, float eps,
                        int zero_centered, const float *cos, const float *sin, int64_t rd,
                        uint16_t *out)
{
    HEADS_PARALLEL
    for (int64_t r = 0; r < T * H; r++)
        norm_rope(D, x, (r / H) * x_stride_t + (r % H) * x_stride_h, weight, eps,
                  zero_centered, cos + (r / H) * rd, sin + (r / H) * rd, rd, out, r * D, 1);
}

/* rows x groups of `dim` (the group size): x and the silu'd gate row-strided, out dense */
#define GATE_FIRST_BODY(bf)                                                                    \
    ROWS_PARALLEL                                                                              \
    for (int64_t r = 0; r < rows * groups; r++) {                                              \
        const int64_t row = r / groups, g = r % groups;                                        \
        norm_gate_first(dim, x, row * x_stride + g * dim, gate + row * gate_stride + g * dim,  \
                        weight, g * dim, eps, out, r * dim, bf);                               \
    }

void rms_norm_gate_first(int64_t rows, int64_t dim, int64_t groups, const float *x,
                         int64_t x_stride, const float *gate, int64_t gate_stride,
                         const float *weight, float eps, float *out)
{
    GATE_FIRST_BODY(0)
}

void rms_norm_gate_first_bf16(int64_t rows, int64_t dim, int64_t groups, const uint16_t *x,
                              int64_t x_stride, const float *gate, int64_t gate_stride,
                              const uint16_t *weight, float eps, uint16_t *out)
{
    GATE_FIRST_BODY(1)
}
