/* Decode steps of the conv and of the Mamba2 scan for B requests, in place on the state pools.
 *
 * conv_update: per request b (slot s = slots[b]) and channel c, window = [conv_pool[s][c][0 ..
 *   K-2], x[b][c]]; out[b][c] = act(sum_k w[c][k] window[k] + bias[c]); conv_pool[s][c] <-
 *   window[1 .. K-1]. One read and one write of each state instead of the reference's gather,
 *   stack and scatter. act: SiLU or none.
 * mamba2_step: per request b and head h (group g = h / (H / G)), S = ssm_pool[slots[b]][h]
 *   ([P][N], fp32): S = exp(dt A) S + dt x B^T;  y = S C + D x, all in fp32; y fp32.
 *   x, B and C rows are addressed with their own row strides (views of the conv output).
 * mamba2_decode: the two above as one step from the input projection's xBC and raw dt rows,
 *   with dt's softplus and clamp and A = -exp(A_log) inside (see m2_decode_team).
 *
 * The `_bf16` variants read and write the model's bf16 tensors (x, the conv pool and weights,
 * B, C, D, the conv output) and round where the torch reference holds a bf16 tensor (each
 * window product and the sum, the bias add, the activation). Requests (and heads) run in
 * parallel (OpenMP); two requests must not share a slot.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "conv_window.h"
#include "vec_math.h"

#define CONV_CHUNK 256 /* channels per parallel task */
#define CONV_SERIAL 16384 /* fewer channels than this in a step (B x C) run on one thread */

/* Channels c0 .. c1 - 1 of request b. bf16 with kernel width 3 or 4 runs 16 channels a vector
 * (conv_window.h), the same roundings as the scalar loop, which takes the rest. */
static inline __attribute__((always_inline)) void conv_channels(
    int64_t b, int64_t c0, int64_t c1, const int64_t *slots, const void *x, int64_t x_stride,
    void *conv_pool, const void *weight, const void *bias, void *out, int64_t C, int64_t kernel,
    int silu, const int bf)
{
    const int64_t k1 = kernel - 1;
    int64_t c = c0;
#if HAVE_CONV_WINDOW
    if (bf && (kernel == 3 || kernel == 4)) {
        const uint16_t *xr = (const uint16_t *)x + b * x_stride;
        uint16_t *state = (uint16_t *)conv_pool + slots[b] * C * k1;
        for (; c + 16 <= c1; c += 16) {
            __m512 win[4], wv[4];
            cw_window16(c, (int)kernel, xr, state, (const uint16_t *)weight, win, wv);
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < k1; j++)
                acc = _mm512_add_ps(acc, cw_round_bf16(_mm512_mul_ps(wv[j], win[j])));
            acc = cw_round_bf16(
                _mm512_add_ps(acc, cw_round_bf16(_mm512_mul_ps(wv[k1], win[k1]))));
            if (bias)
                acc = cw_round_bf16(_mm512_add_ps(acc, cw_load_bf16((const uint16_t *)bias + c)));
            if (silu)
                acc = cw_silu(acc);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + b * C + c), cw_ps_to_bf16(acc));
        }
    }
#endif
    for (; c < c1; c++) {
        const int64_t s0 = (slots[b] * C + c) * k1, w = c * kernel;
        const float xc = ld(x, b * x_stride + c, bf);
        float acc = 0.0f;
        for (int64_t j = 0; j < k1; j++)
            acc += rnd(ld(weight, w + j, bf) * ld(conv_pool, s0 + j, bf), bf);
        acc = rnd(acc + rnd(ld(weight, w + k1, bf) * xc, bf), bf);
        for (int64_t j = 0; j + 1 < k1; j++)
            st(conv_pool, s0 + j, ld(conv_pool, s0 + j + 1, bf), bf);
        if (k1 > 0)
            st(conv_pool, s0 + k1 - 1, xc, bf);
        if (bias)
            acc = rnd(acc + ld(bias, c, bf), bf);
        st(out, b * C + c, silu ? acc / (1.0f + exp_poly(-acc)) : acc, bf);
    }
}

/* The parallel loop sits in each exported function, so that `bf` is a constant inside its
 * outlined region (vec_math.h). */
#define CONV_UPDATE(bf)                                                                  \
    do {                                                                                 \
        const int64_t chunks = (C + CONV_CHUNK - 1) / CONV_CHUNK;                        \
        _Pragma("omp parallel for collapse(2) schedule(static) if (B * C >= CONV_SERIAL)") \
        for (int64_t b = 0; b < B; b++)                                                  \
            for (int64_t ch = 0; ch < chunks; ch++) {                                    \
                const int64_t c0 = ch * CONV_CHUNK;                                      \
                const int64_t c1 = c0 + CONV_CHUNK < C ? c0 + CONV_CHUNK : C;            \
                conv_channels(b, c0, c1, slots, x, x_stride, conv_pool, weight, bias, out, \
                              C, kernel, silu, bf);                                      \
            }                                                                            \
    } while (0)

/* Head h of request b: S = exp(dt A) S + dt x B^T, y = S C + D x (S fp32, in place); x, B and
 * C read as `bf` data at their element offsets, y stored as `ybf` data. */
static inline __attribute__((always_inline)) void m2_head(
    float *S, const void *x, int64_t xo, const void *Bm, int64_t bo, const void *Cm, int64_t co,
    float d, float a, float skip, void *y, int64_t yo, int64_t P, int64_t N, const int bf,
    const int ybf)
{
    const float decay = expf(d * a);
    float bv[N], cv[N]; /* the group's B and C in fp32, so the loop below vectorises */
    for (int64_t n = 0; n < N; n++) {
        bv[n] = ld(Bm, bo + n, bf);
        cv[n] = ld(Cm, co + n, bf);
    }
    for (int64_t p = 0; p < P; p++) {
        const float xv = ld(x, xo + p, bf);
        const float xdt = xv * d;
        float *row = S + p * N;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; n++) {
            const float s = row[n] * decay + xdt * bv[n];
            row[n] = s;
            acc += s * cv[n];
        }
        st(y, yo + p, acc + skip * xv, ybf);
    }
}

/* Request b, head h of a scan step on the conv output's views (m2_head's addressing). */
static inline __attribute__((always_inline)) void m2_step_head(
    int64_t b, int64_t h, const int64_t *slots, float *ssm_pool, const void *x,
    int64_t x_stride, const float *dt, const float *A, const void *Bm, const void *Cm,
    int64_t bc_stride, const void *D, float *y, int64_t H, int64_t P, int64_t G, int64_t N,
    const int bf)
{
    const int64_t bc = b * bc_stride + (h / (H / G)) * N;
    m2_head(ssm_pool + (slots[b] * H + h) * P * N, x, b * x_stride + h * P, Bm, bc, Cm, bc,
            dt[b * H + h], A[h], D ? ld(D, h, bf) : 0.0f, y, (b * H + h) * P, P, N, bf, 0);
}

/* A whole Mamba2 decode step from the input projection's xBC and raw dt rows (row-strided
 * views of it, same stride): conv (+ activation) into `conv_out` ([B][C] scratch, model dtype,
 * as the reference holds it), then per head dt = clamp(softplus(dt_raw + dt_bias)),
 * A = -exp(A_log) and the scan step; y [B][H][P] in the model dtype. One call where the
 * composed step took ten torch operations between the two kernels. Called by every thread of
 * the exported functions' parallel regions. */
static inline __attribute__((always_inline)) void m2_decode_team(
    int64_t B, const int64_t *slots, const void *xbc, const void *dt_raw, int64_t in_stride,
    void *conv_pool, const void *conv_w, const void *conv_b, int64_t kernel, int silu,
    float *ssm_pool, const void *A_log, const void *dt_bias, float dt_lo, float dt_hi,
    const void *D, void *y, int64_t H, int64_t P, int64_t G, int64_t N, void *conv_out,
    const int bf)
{
    const int64_t C = H * P + 2 * G * N, hpg = H / G;
    const int64_t chunks = (C + CONV_CHUNK - 1) / CONV_CHUNK;
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t ch = 0; ch < chunks; ch++) {
            const int64_t c0 = ch * CONV_CHUNK, c1 = c0 + CONV_CHUNK < C ? c0 + CONV_CHUNK : C;
            conv_channels(b, c0, c1, slots, xbc, in_stride, conv_pool, conv_w, conv_b, conv_out,
                          C, kernel, silu, bf);
        }
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            /* softplus as torch computes it: linear above 20 */
            const float raw = ld(dt_raw, b * in_stride + h, bf) + ld(dt_bias, h, bf);
            const float sp = raw > 20.0f ? raw : log1pf(expf(raw));
            const float d = fminf(fmaxf(sp, dt_lo), dt_hi);
            const int64_t row = b * C, bc = row + H * P + (h / hpg) * N;
            m2_head(ssm_pool + (slots[b] * H + h) * P * N, conv_out, row + h * P, conv_out, bc,
                    conv_out, bc + G * N, d, -expf(ld(A_log, h, bf)), D ? ld(D, h, bf) : 0.0f, y,
                    (b * H + h) * P, P, N, bf, bf);
        }
}

#define CONV_ARGS                                                                        \
    int64_t B, const int64_t *slots, const void *x, int64_t x_stride, void *conv_pool,   \
        const void *weight, const void *bias, void *out, int64_t C, int64_t kernel, int silu
#define STEP_ARGS                                                                        \
    int64_t B, const int64_t *slots, float *ssm_pool, const void *x, int64_t x_stride,   \
        const float *dt, const float *A, const void *Bm, const void *Cm, int64_t bc_stride, \
        const void *D, float *y, int64_t H, int64_t P, int64_t G, int64_t N
#define STEP_PASS slots, ssm_pool, x, x_stride, dt, A, Bm, Cm, bc_stride, D, y, H, P, G, N

void conv1d_update(CONV_ARGS) { CONV_UPDATE(0); }

void conv1d_update_bf16(CONV_ARGS) { CONV_UPDATE(1); }

#define M2_STEP(bf)                                                                      \
    _Pragma("omp parallel for collapse(2) schedule(static)")                             \
    for (int64_t b = 0; b < B; b++)                                                      \
        for (int64_t h = 0; h < H; h++)                                                  \
            m2_step_head(b, h, STEP_PASS, bf)

void mamba2_step(STEP_ARGS) { M2_STEP(0); }

void mamba2_step_bf16(STEP_ARGS) { M2_STEP(1); }

#define DECODE_ARGS                                                                        \
    int64_t B, const int64_t *slots, const void *xbc, const void *dt_raw, int64_t in_stride, \
        void *conv_pool, const void *conv_w, const void *conv_b, int64_t kernel, int silu,   \
        float *ssm_pool, const void *A_log, const void *dt_bias, float dt_lo, float dt_hi,   \
        const void *D, void *y, int64_t H, int64_t P, int64_t G, int64_t N
#define DECODE_STEP(bf, T)                                                                  \
    do {                                                                                    \
        T *conv_out = malloc(sizeof(T) * (size_t)(B * (H * P + 2 * G * N)));                \
        _Pragma("omp parallel") m2_decode_team(                                             \
            B, slots, xbc, dt_raw, in_stride, conv_pool, conv_w, conv_b, kernel, silu,       \
            ssm_pool, A_log, dt_bias, dt_lo, dt_hi, D, y, H, P, G, N, conv_out, bf);         \
        free(conv_out);                                                                     \
    } while (0)

void mamba2_decode(DECODE_ARGS) { DECODE_STEP(0, float); }

void mamba2_decode_bf16(DECODE_ARGS) { DECODE_STEP(1, uint16_t); }
