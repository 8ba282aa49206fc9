/* One Gated DeltaNet decode token for B requests, in place on the state pools.
 *
 * Per request b (pool slot s = slots[b]) it fuses what the torch reference does in five passes:
 *   conv:  window = [conv_pool[s][c][0 .. K-2], x[b][c]];  y[c] = act(sum_k w[c][k] window[k] + bias[c])
 *          conv_pool[s][c] <- window[1 .. K-1]
 *   q, k:  the first 2 * Hk * Dk channels of y (Hk key heads), L2-normalised (optional), q * Dk^-1/2
 *   gates: g = -exp(A_log[h]) softplus(a[b][h] + dt_bias[h]),  beta = sigmoid(b[b][h])
 *   step:  for value head h (key head h / (Hv / Hk)), S = ssm_pool[s][h]  ([Dk][Dv]):
 *          S *= exp(g);  u = beta (v - S^T k);  S += k u^T;  out[b][h] = S^T q
 * reading and writing each state once. All tensors fp32 and contiguous, except that x, a and b
 * rows are addressed with their own row strides. Requests run in parallel (OpenMP); two requests
 * must not share a slot.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void gated_delta_decode(
    int64_t B, const int64_t *slots,
    const float *x, int64_t x_stride,
    float *conv_pool, float *ssm_pool,
    const float *weight, const float *bias,
    const float *a, int64_t a_stride,
    const float *bgate, int64_t b_stride,
    const float *A_log, const float *dt_bias,
    float *out,
    int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t kernel,
    int silu, int l2norm)
{
    const int64_t conv_dim = 2 * hk * dk + hv * dv;
    const int64_t k1 = kernel - 1;
    const int64_t rep = hv / hk;
    const float q_scale = 1.0f / sqrtf((float)dk);

#pragma omp parallel
    {
        float *y = malloc(sizeof(float) * (size_t)(conv_dim + dv));
        float *u = y + conv_dim;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            const float *xb = x + b * x_stride;
            float *cs = conv_pool + slots[b] * conv_dim * k1;
            for (int64_t c = 0; c < conv_dim; c++) {
                const float *w = weight + c * kernel;
                float *st = cs + c * k1;
                float acc = bias ? bias[c] : 0.0f;
                for (int64_t j = 0; j < k1; j++)
                    acc += w[j] * st[j];
                acc += w[k1] * xb[c];
                for (int64_t j = 0; j + 1 < k1; j++)
                    st[j] = st[j + 1];
                if (k1 > 0)
                    st[k1 - 1] = xb[c];
                y[c] = silu ? acc / (1.0f + expf(-acc)) : acc;
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
                const float av = a[b * a_stride + h] + dt_bias[h];
                const float sp = av > 20.0f ? av : log1pf(expf(av));
                const float decay = expf(-expf(A_log[h]) * sp);
                const float bt = 1.0f / (1.0f + expf(-bgate[b * b_stride + h]));
                float *S = ssm + h * dk * dv;
                float *o = out + (b * hv + h) * dv;
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
            }
        }
        free(y);
    }
}
