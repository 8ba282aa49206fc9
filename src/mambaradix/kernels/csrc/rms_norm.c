/* RMSNorm over the rows of a matrix: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, where
 * w = 1 + weight (zero-centred, Qwen3-Next) or weight. fp32; x rows may be strided, the last
 * dim is dense; out is dense. One pass to sum squares, one to scale, per row; rows in
 * parallel. rms_norm_gated also multiplies by a gate row (silu already applied by the caller,
 * where it vectorises): out[r] = weight * norm(x[r]) * gate[r]. rms_norm_rope normalises each
 * head of x [T, H, D] (rows t*x_stride_t + h*x_stride_h) and rotates its first rd features
 * with cos/sin [T, rd], rotate-half pairs (d, d + rd/2); out is [T, H, D].
 *
 * The *_bf16 variants read and write bf16 (x, weight, out; the gate and cos/sin stay fp32)
 * and compute in fp32: the sum of squares accumulates in fp32, and the result is rounded
 * where the torch reference rounds (the normalised row before a weight that is not
 * zero-centred, as transformers' Llama-style norms do; the output).
 */
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

static inline float inv_rms(const float *x, int64_t dim, float eps)
{
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++)
        ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

void rms_norm(
    int64_t rows, int64_t dim,
    const float *x, int64_t x_stride,
    const float *weight, float eps, int zero_centered,
    float *out)
{
#pragma omp parallel for schedule(static) if (rows * dim > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * dim;
        const float inv = inv_rms(xr, dim, eps);
        if (zero_centered) {
#pragma omp simd
            for (int64_t i = 0; i < dim; i++)
                o[i] = xr[i] * inv * (1.0f + weight[i]);
        } else {
#pragma omp simd
            for (int64_t i = 0; i < dim; i++)
                o[i] = weight[i] * (xr[i] * inv);
        }
    }
}

void rms_norm_gated(
    int64_t rows, int64_t dim,
    const float *x, int64_t x_stride,
    const float *gate, int64_t gate_stride,
    const float *weight, float eps,
    float *out)
{
#pragma omp parallel for schedule(static) if (rows * dim > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        const float *gr = gate + r * gate_stride;
        float *o = out + r * dim;
        const float inv = inv_rms(xr, dim, eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            o[i] = weight[i] * (xr[i] * inv) * gr[i];
    }
}

void rms_norm_rope(
    int64_t T, int64_t H, int64_t D,
    const float *x, int64_t x_stride_t, int64_t x_stride_h,
    const float *weight, float eps, int zero_centered,
    const float *cos, const float *sin, int64_t rd,
    float *out)
{
    const int64_t half = rd / 2;
#pragma omp parallel for schedule(static) if (T * H * D > 16384)
    for (int64_t r = 0; r < T * H; r++) {
        const int64_t t = r / H, h = r % H;
        const float *xr = x + t * x_stride_t + h * x_stride_h;
        const float *c = cos + t * rd, *s = sin + t * rd;
        float *o = out + r * D;
        const float inv = inv_rms(xr, D, eps);
#pragma omp simd
        for (int64_t i = 0; i < D; i++)
            o[i] = zero_centered ? xr[i] * inv * (1.0f + weight[i]) : weight[i] * (xr[i] * inv);
        for (int64_t i = 0; i < half; i++) {
            const float a = o[i], b = o[i + half];
            o[i] = a * c[i] - b * s[i];
            o[i + half] = b * c[i + half] + a * s[i + half];
        }
    }
}

static inline float inv_rms_bf16(const uint16_t *x, int64_t dim, float eps)
{
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) {
        const float v = bf16_to_f32(x[i]);
        ss += v * v;
    }
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

/* One normalised bf16 row into fp32: the reference's rms_norm output, as fp32 values. */
static inline void norm_row_bf16(
    const uint16_t *xr, int64_t dim, const uint16_t *weight, float eps, int zero_centered,
    float *o)
{
    const float inv = inv_rms_bf16(xr, dim, eps);
    if (zero_centered) {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            o[i] = round_bf16(bf16_to_f32(xr[i]) * inv * (1.0f + bf16_to_f32(weight[i])));
    } else {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            o[i] = round_bf16(bf16_to_f32(weight[i]) * round_bf16(bf16_to_f32(xr[i]) * inv));
    }
}

void rms_norm_bf16(
    int64_t rows, int64_t dim,
    const uint16_t *x, int64_t x_stride,
    const uint16_t *weight, float eps, int zero_centered,
    uint16_t *out)
{
#pragma omp parallel for schedule(static) if (rows * dim > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *o = out + r * dim;
        const float inv = inv_rms_bf16(xr, dim, eps);
        if (zero_centered) {
#pragma omp simd
            for (int64_t i = 0; i < dim; i++)
                o[i] = f32_to_bf16(bf16_to_f32(xr[i]) * inv * (1.0f + bf16_to_f32(weight[i])));
        } else {
#pragma omp simd
            for (int64_t i = 0; i < dim; i++)
                o[i] = f32_to_bf16(
                    bf16_to_f32(weight[i]) * round_bf16(bf16_to_f32(xr[i]) * inv));
        }
    }
}

void rms_norm_gated_bf16(
    int64_t rows, int64_t dim,
    const uint16_t *x, int64_t x_stride,
    const float *gate, int64_t gate_stride,
    const uint16_t *weight, float eps,
    uint16_t *out)
{
#pragma omp parallel for schedule(static) if (rows * dim > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        const float *gr = gate + r * gate_stride;
        uint16_t *o = out + r * dim;
        const float inv = inv_rms_bf16(xr, dim, eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) {
            const float y = round_bf16(bf16_to_f32(weight[i]) * round_bf16(bf16_to_f32(xr[i]) * inv));
            o[i] = f32_to_bf16(y * gr[i]);
        }
    }
}

void rms_norm_rope_bf16(
    int64_t T, int64_t H, int64_t D,
    const uint16_t *x, int64_t x_stride_t, int64_t x_stride_h,
    const uint16_t *weight, float eps, int zero_centered,
    const float *cos, const float *sin, int64_t rd,
    uint16_t *out)
{
    const int64_t half = rd / 2;
#pragma omp parallel for schedule(static) if (T * H * D > 16384)
    for (int64_t r = 0; r < T * H; r++) {
        const int64_t t = r / H, h = r % H;
        const uint16_t *xr = x + t * x_stride_t + h * x_stride_h;
        const float *c = cos + t * rd, *s = sin + t * rd;
        uint16_t *o = out + r * D;
        float row[D];
        norm_row_bf16(xr, D, weight, eps, zero_centered, row);
        for (int64_t i = 0; i < half; i++) {
            const float a = row[i], b = row[i + half];
            o[i] = f32_to_bf16(a * c[i] - b * s[i]);
            o[i + half] = f32_to_bf16(b * c[i + half] + a * s[i + half]);
        }
#pragma omp simd
        for (int64_t i = rd; i < D; i++)
            o[i] = f32_to_bf16(row[i]);
    }
}
