/* One Gated DeltaNet decode token for B requests, in place on the state pools.
 *
 * Per request b (pool slot s = slots[b]) it fuses what the torch reference does in five passes:
 *   conv:  window = [conv_pool[s][c][0 .. K-2], x[b][c]];  y[c] = act(sum_k w[c][k] window[k] + bias[c])
 *          conv_pool[s][c] <- window[1 .. K-1]
 *   q, k:  the first 2 * Hk * Dk channels of y (Hk key heads), L2-normalised (optional), q * Dk^-1/2
 *   gates: g = -exp(A_log[h]) softplus(a[b][h] + dt_bias[h]),  beta = sigmoid(b[b][h])
 *   step:  for value head h (key head h / (Hv / Hk)), S = ssm_pool[s][h]  ([Dk][Dv]):
 *          S *= exp(g);  u = beta (v - S^T k);  S += k u^T;  out[b][h] = S^T q
 * reading and writing each state once. All tensors contiguous, except that x, a and b rows are
 * addressed with their own row strides. Requests run in parallel (OpenMP); two requests must
 * not share a slot.
 *
 * gated_delta_decode: every tensor fp32. gated_delta_decode_bf16: the model's tensors (x, the
 * conv pool, conv weight and bias, a, b, A_log, dt_bias, out) bf16, the delta-rule state fp32;
 * everything is computed in fp32, and rounded to bf16 where the torch reference holds a bf16
 * tensor (the conv output, beta, the output).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec_math.h"

/* The kernel for both dtypes. Its OpenMP region is outlined once, so `bf` is a runtime value
 * inside it: only the conv and the output store branch on it, not the state update (a build
 * with it folded ran fp32 decode within 3%, batch 16, 32 heads of 128 x 128). */
static inline __attribute__((always_inline)) void gdn_decode(
    int64_t B, const int64_t *slots,
    const void *x, int64_t x_stride,
    void *conv_pool, float *ssm_pool,
    const void *weight, const void *bias,
    const void *a, int64_t a_stride,
    const void *bgate, int64_t b_stride,
    const void *A_log, const void *dt_bias,
    void *out,
    int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t kernel,
    int silu, int l2norm, const int bf)
{
    const int64_t conv_dim = 2 * hk * dk + hv * dv;
    const int64_t k1 = kernel - 1;
    const int64_t rep = hv / hk;
    const float q_scale = 1.0f / sqrtf((float)dk);

#pragma omp parallel
    {
        float *y = malloc(sizeof(float) * (size_t)(conv_dim + 2 * dv));
        float *u = y + conv_dim;
        float *o = u + dv;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            const int64_t xb = b * x_stride;
            const int64_t cs = slots[b] * conv_dim * k1;
            for (int64_t c = 0; c < conv_dim; c++) {
                const int64_t w = c * kernel, s0 = cs + c * k1;
                const float xc = ld(x, xb + c, bf);
                float acc = bias ? ld(bias, c, bf) : 0.0f;
                for (int64_t j = 0; j < k1; j++)
                    acc += ld(weight, w + j, bf) * ld(conv_pool, s0 + j, bf);
                acc += ld(weight, w + k1, bf) * xc;
                for (int64_t j = 0; j + 1 < k1; j++)
                    st(conv_pool, s0 + j, ld(conv_pool, s0 + j + 1, bf), bf);
                if (k1 > 0)
                    st(conv_pool, s0 + k1 - 1, xc, bf);
                y[c] = rnd(silu ? acc / (1.0f + expf(-acc)) : acc, bf);
            }
            for (int64_t h = 0; h < 2 * hk; h++) { /* q heads, then k heads */
                float *vec = y + h * dk;
                float scale = h < hk ? q_scale : 1.0f;
                if (l2norm) {
                    float ss = 0.0f;
                    for (int64_t i = 0; i < dk; i++)
                        ss += vec[i] * vec[i];
                    scale /= sqrtf(ss + 1e-6f);
                }
                for (int64_t i = 0; i < dk; i++)
                    vec[i] *= scale;
            }
            float *ssm = ssm_pool + slots[b] * hv * dk * dv;
            for (int64_t h = 0; h < hv; h++) {
                const float *q = y + (h / rep) * dk;
                const float *k = y + (hk + h / rep) * dk;
                const float *v = y + 2 * hk * dk + h * dv;
                /* softplus as torch computes it: linear above 20 */
                const float av = ld(a, b * a_stride + h, bf) + ld(dt_bias, h, bf);
                const float sp = av > 20.0f ? av : log1pf(expf(av));
                const float decay = expf(-expf(ld(A_log, h, bf)) * sp);
                const float bt = rnd(1.0f / (1.0f + expf(-ld(bgate, b * b_stride + h, bf))), bf);
                float *S = ssm + h * dk * dv;
                for (int64_t j = 0; j < dv; j++)
                    u[j] = 0.0f;
                for (int64_t i = 0; i < dk; i++) {
                    const float ki = k[i];
                    const float *row = S + i * dv;
                    for (int64_t j = 0; j < dv; j++)
                        u[j] += row[j] * ki;
                }
                for (int64_t j = 0; j < dv; j++) {
                    u[j] = bt * (v[j] - decay * u[j]);
                    o[j] = 0.0f;
                }
                for (int64_t i = 0; i < dk; i++) {
                    const float ki = k[i], qi = q[i];
                    float *row = S + i * dv;
                    for (int64_t j = 0; j < dv; j++) {
                        const float s = decay * row[j] + ki * u[j];
                        row[j] = s;
                        o[j] += s * qi;
                    }
                }
                for (int64_t j = 0; j < dv; j++)
                    st(out, (b * hv + h) * dv + j, o[j], bf);
            }
        }
        free(y);
    }
}

#define GDN_ARGS                                                                         \
    int64_t B, const int64_t *slots, const void *x, int64_t x_stride, void *conv_pool,   \
        float *ssm_pool, const void *weight, const void *bias, const void *a,            \
        int64_t a_stride, const void *bgate, int64_t b_stride, const void *A_log,        \
        const void *dt_bias, void *out, int64_t hk, int64_t hv, int64_t dk, int64_t dv,  \
        int64_t kernel, int silu, int l2norm
#define GDN_PASS                                                                          \
    B, slots, x, x_stride, conv_pool, ssm_pool, weight, bias, a, a_stride, bgate,         \
        b_stride, A_log, dt_bias, out, hk, hv, dk, dv, kernel, silu, l2norm

void gated_delta_decode(GDN_ARGS) { gdn_decode(GDN_PASS, 0); }

void gated_delta_decode_bf16(GDN_ARGS) { gdn_decode(GDN_PASS, 1); }
