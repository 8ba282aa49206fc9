/* Gated DeltaNet decode tokens for B requests, on the state pools.
 *
 * Per request b and new token (pool slot s = slots[b]) it fuses what the torch reference does
 * in five passes:
 *   conv:  window = [conv_pool[s][c][0 .. K-2], x[b][c]];  y[c] = act(sum_k w[c][k] window[k] + bias[c])
 *          conv_pool[s][c] <- window[1 .. K-1]
 *   q, k:  the first 2 * Hk * Dk channels of y (Hk key heads), L2-normalised (optional), q * Dk^-1/2
 *   gates: g = -exp(A_log[h]) softplus(a[b][h] + dt_bias[h]),  beta = beta_scale sigmoid(b[b][h])
 *          (beta_scale 2: OLMo-Hybrid's negative eigenvalues; 1 elsewhere)
 *   step:  for value head h (key head h / (Hv / Hk)), S = ssm_pool[s][h]  ([Dk][Dv]):
 *          S *= exp(g);  u = beta (v - S^T k);  S += k u^T;  out[b][h] = S^T q
 * reading and writing each state once. All tensors contiguous, except that x, a and b rows are
 * addressed with their own row strides. The conv's channel chunks and then the value heads run
 * in parallel (OpenMP), so one request uses every thread (parallel over requests only, a
 * batch-1 step ran on one core: 260 us a Qwen3.5-0.8B layer); two requests must not share a
 * slot.
 *
 * Positions (decode.h): with cu NULL each request has one token (row b) and its states are
 * updated in place; otherwise request b has rows cu[b] .. cu[b+1] - 1 (a verify step), stepped
 * in order, the state after row r written into slot row_slots[r] (read back by row r + 1), so
 * every position's state lands in its own slot and the working slot is read, never written,
 * unless it is a row's slot. A request's conv chunk and value head stay with one thread across
 * its rows, its state in cache from one row to the next.
 *
 * gated_delta_decode: every tensor fp32. gated_delta_decode_bf16: the model's tensors (x, the
 * conv pool, conv weight and bias, a, b, A_log, dt_bias, out) bf16, the delta-rule state fp32;
 * everything is computed in fp32, and rounded to bf16 where the torch reference holds a bf16
 * tensor (the conv output, beta, the output).
 *
 * Given the output norm's weight (norm_w), each head's output goes on through the layer's
 * gated norm in the same task: out[b][h] = weight * norm(o) * silu(z[b][h]) (z: the
 * projection's gate rows, row-strided, Dv features a head), the output rounded first where the
 * reference holds it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "conv_window.h"
#include "decode.h"
#include "gated_norm.h"
#include "vec_math.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define GDN_CHUNK 256 /* conv channels per parallel task */
#define GQ 32         /* value columns of a state a pass keeps in registers */

/* The conv of row r over channels c0 .. c1 - 1 into y (fp32; held in bf16 where the
 * reference holds it): acc = bias + sum_k w[k] window[k] in fp32, SiLU, one rounding; the
 * state read from slot src, the shifted one written to slot dst (in place when equal). bf16
 * with width 3 or 4 runs 16 channels a vector (conv_window.h). */
static inline __attribute__((always_inline)) void gdn_conv_k(
    int64_t r, int64_t src, int64_t dst, int64_t c0, int64_t c1, const void *x,
    int64_t x_stride, void *conv_pool, const void *weight, const void *bias, float *y,
    int64_t conv_dim, int64_t kernel, int silu, const int bf)
{
    const int64_t k1 = kernel - 1;
    const int64_t xb = r * x_stride, cs = src * conv_dim * k1, cd = dst * conv_dim * k1;
    int64_t c = c0;
#if HAVE_CONV_WINDOW
    if (bf && (kernel == 3 || kernel == 4)) {
        for (; c + 16 <= c1; c += 16) {
            __m512 win[4], wv[4];
            cw_window16(c, (int)kernel, (const uint16_t *)x + xb, (const uint16_t *)conv_pool + cs,
                        (uint16_t *)conv_pool + cd, (const uint16_t *)weight, win, wv);
            __m512 acc = bias ? cw_load_bf16((const uint16_t *)bias + c) : _mm512_setzero_ps();
            for (int64_t j = 0; j <= k1; j++)
                acc = _mm512_add_ps(acc, _mm512_mul_ps(wv[j], win[j]));
            if (silu)
                acc = cw_silu(acc);
            _mm512_storeu_ps(y + c, cw_round_bf16(acc));
        }
    }
#endif
    const int64_t first = c; /* the channels the scalar loop takes */
    for (; c < c1; c++) {
        const int64_t w = c * kernel, s0 = cs + c * k1, d0 = cd + c * k1;
        const float xc = ld(x, xb + c, bf);
        float acc = bias ? ld(bias, c, bf) : 0.0f;
        for (int64_t j = 0; j < k1; j++)
            acc += ld(weight, w + j, bf) * ld(conv_pool, s0 + j, bf);
        acc += ld(weight, w + k1, bf) * xc;
        for (int64_t j = 0; j + 1 < k1; j++)
            st(conv_pool, d0 + j, ld(conv_pool, s0 + j + 1, bf), bf);
        if (k1 > 0)
            st(conv_pool, d0 + k1 - 1, xc, bf);
        y[c] = acc;
    }
    /* the activation in a loop of its own, which vectorises (the window's interleaved loads
     * above do not), with exp_poly as the other conv paths (it was glibc's expf here): on an
     * AVX2 EPYC this and the width-4 unrolling took the conv of a Qwen3.5-0.8B step's 18
     * layers (6,144 channels each) from ~1.5 to ~0.9 ms */
    if (silu) {
#pragma omp simd
        for (int64_t i = first; i < c1; i++)
            y[i] = rnd(silu_poly(y[i]), bf);
    } else {
#pragma omp simd
        for (int64_t i = first; i < c1; i++)
            y[i] = rnd(y[i], bf);
    }
}

/* gdn_conv_k with the published models' width (4) as a constant: its loops unrolled */
static inline __attribute__((always_inline)) void gdn_conv(
    int64_t r, int64_t src, int64_t dst, int64_t c0, int64_t c1, const void *x,
    int64_t x_stride, void *conv_pool, const void *weight, const void *bias, float *y,
    int64_t conv_dim, int64_t kernel, int silu, const int bf)
{
    if (kernel == 4)
        gdn_conv_k(r, src, dst, c0, c1, x, x_stride, conv_pool, weight, bias, y, conv_dim, 4,
                   silu, bf);
    else
        gdn_conv_k(r, src, dst, c0, c1, x, x_stride, conv_pool, weight, bias, y, conv_dim,
                   kernel, silu, bf);
}

/* row (dv floats) to dst with non-temporal stores where dst is aligned */
static inline __attribute__((always_inline)) void stream_row(float *dst, const float *row,
                                                             int64_t dv)
{
    int64_t j = 0;
#if defined(__AVX512F__)
    if (((uintptr_t)dst & 63) == 0)
        for (; j + 16 <= dv; j += 16)
            _mm512_stream_ps(dst + j, _mm512_loadu_ps(row + j));
#elif defined(__AVX2__)
    if (((uintptr_t)dst & 31) == 0)
        for (; j + 8 <= dv; j += 8)
            _mm256_stream_ps(dst + j, _mm256_loadu_ps(row + j));
#endif
    for (; j < dv; j++)
        dst[j] = row[j];
}

/* One value head h of row b: gates, then the delta rule on its [dk][dv] state S, written to
 * Sout (in place when equal; two passes over each block of columns: S^T k needs the block's
 * whole decayed columns before the update; the second pass finds them in L1), and copied to
 * `keep` when given (non-temporal stores: a verify step's state for after the step, read by no
 * later row). */
static inline __attribute__((always_inline)) void gdn_head(
    int64_t b, int64_t h, const float *S, float *Sout, float *keep, const float *y, const void *a,
    int64_t a_stride, const void *bgate, int64_t b_stride, const void *A_log,
    const void *dt_bias, void *out, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
    int64_t conv_dim, const void *z, int64_t z_stride, const void *norm_w, float eps,
    float beta_scale, const int bf)
{
    const int64_t rep = hv / hk;
    const float *yb = y + b * conv_dim;
    const float *q = yb + (h / rep) * dk;
    const float *k = yb + (hk + h / rep) * dk;
    const float *v = yb + 2 * hk * dk + h * dv;
    /* softplus as torch computes it: linear above 20 */
    const float av = ld(a, b * a_stride + h, bf) + ld(dt_bias, h, bf);
    const float sp = av > 20.0f ? av : log1pf(expf(av));
    const float decay = expf(-expf(ld(A_log, h, bf)) * sp);
    /* rounded where the reference holds bf16: sigmoid's result, then its product */
    const float sig = rnd(1.0f / (1.0f + expf(-ld(bgate, b * b_stride + h, bf))), bf);
    const float bt = beta_scale == 1.0f ? sig : rnd(beta_scale * sig, bf);
    /* Column blocks of GQ: a column's u and output need only that column of S, so each block
     * takes both passes while its 16 KB of S stay in L1, its u and o in registers (the same
     * operations in the same order as a pass over whole rows: the same bits). Over whole rows
     * the second pass read the 64 KB state again from L2 and u and o went through memory for
     * every row of S: 18 Qwen3.5-0.8B layers took 4.3 ms for one token, 3.0 ms so (C harness,
     * 2 threads). */
    float o[dv];
    for (int64_t j0 = 0; j0 < dv; j0 += GQ) {
        const int64_t w = dv - j0 < GQ ? dv - j0 : GQ;
        float u[GQ], ob[GQ];
        for (int64_t j = 0; j < GQ; j++)
            u[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            const float ki = k[i];
            const float *row = S + i * dv + j0;
            for (int64_t j = 0; j < w; j++)
                u[j] += row[j] * ki;
        }
        for (int64_t j = 0; j < GQ; j++) {
            u[j] = bt * (v[j0 + (j < w ? j : 0)] - decay * u[j]);
            ob[j] = 0.0f;
        }
        for (int64_t i = 0; i < dk; i++) {
            const float ki = k[i], qi = q[i];
            const float *row = S + i * dv + j0;
            float *out_row = Sout + i * dv + j0;
            for (int64_t j = 0; j < w; j++) {
                const float s = decay * row[j] + ki * u[j];
                out_row[j] = s;
                ob[j] += s * qi;
            }
            if (keep)
                stream_row(keep + i * dv + j0, out_row, w);
        }
        for (int64_t j = 0; j < w; j++)
            o[j0 + j] = ob[j];
    }
    if (!norm_w) {
        for (int64_t j = 0; j < dv; j++)
            st(out, (b * hv + h) * dv + j, o[j], bf);
        return;
    }
    /* core: the output as the reference holds it (bf16 values in core's bytes) */
    float core[dv], gr[dv];
    for (int64_t j = 0; j < dv; j++)
        st(core, j, o[j], bf);
    silu_row(gr, z, b * z_stride + h * dv, dv, bf);
    norm_gated(dv, core, 0, gr, norm_w, eps, out, (b * hv + h) * dv, bf);
}

/* The work of one thread of the team: the conv in channel chunks, then the q and k heads'
 * scaling, then the value heads, each phase split over (request, piece) so that one request
 * uses every thread; a request's rows run in order inside its task (decode.h). Called inside
 * the exported functions' parallel regions, so `bf` is a constant there (vec_math.h).
 * y: [rows][conv_dim] fp32 scratch. */
static inline __attribute__((always_inline)) void gdn_team(
    int64_t B, const int64_t *slots, const int64_t *cu, const int64_t *row_slots,
    const void *x, int64_t x_stride, void *conv_pool,
    float *ssm_pool, const void *weight, const void *bias, const void *a, int64_t a_stride,
    const void *bgate, int64_t b_stride, const void *A_log, const void *dt_bias, void *out,
    int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t kernel, int silu, int l2norm,
    const void *z, int64_t z_stride, const void *norm_w, float eps, float beta_scale, float *y,
    const int bf)
{
    const int64_t conv_dim = 2 * hk * dk + hv * dv;
    const int64_t chunks = (conv_dim + GDN_CHUNK - 1) / GDN_CHUNK;
    const int64_t rows = dec_rows(B, cu);
    const float q_scale = 1.0f / sqrtf((float)dk);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t ch = 0; ch < chunks; ch++) {
            const int64_t c0 = ch * GDN_CHUNK;
            const int64_t c1 = c0 + GDN_CHUNK < conv_dim ? c0 + GDN_CHUNK : conv_dim;
            for (int64_t r = dec_first(b, cu); r < dec_first(b + 1, cu); r++)
                gdn_conv(r, dec_src(b, r, slots, cu, row_slots), dec_dst(b, r, slots, row_slots),
                         c0, c1, x, x_stride, conv_pool, weight, bias, y + r * conv_dim,
                         conv_dim, kernel, silu, bf);
        }
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < 2 * hk; h++) { /* q heads, then k heads */
            float *vec = y + r * conv_dim + h * dk;
            scale_l2(vec, vec, dk, h < hk ? q_scale : 1.0f, l2norm);
        }
    /* a request of several rows steps its head's state in `local` (in cache), each row's
     * state streamed out to its slot */
    float *local = cu ? aligned_alloc(64, sizeof(float) * (size_t)(dk * dv)) : NULL;
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < hv; h++) {
            const int64_t r0 = dec_first(b, cu), r1 = dec_first(b + 1, cu);
            for (int64_t r = r0; r < r1; r++) {
                float *src = ssm_pool + (dec_src(b, r, slots, cu, row_slots) * hv + h) * dk * dv;
                float *dst = ssm_pool + (dec_dst(b, r, slots, row_slots) * hv + h) * dk * dv;
                const int several = local && r1 - r0 > 1;
#define GDN_HEAD(DK, DV)                                                                   \
    gdn_head(r, h, several && r > r0 ? local : src, several ? local : dst,                \
             several ? dst : NULL, y, a, a_stride, bgate, b_stride, A_log, dt_bias, out, hk, \
             hv, DK, DV, conv_dim, z, z_stride, norm_w, eps, beta_scale, bf)
                if (dk == 128 && dv == 128) /* Qwen3.5's and Qwen3-Next's heads: unrolled */
                    GDN_HEAD(128, 128);
                else
                    GDN_HEAD(dk, dv);
#undef GDN_HEAD
            }
        }
#if defined(__AVX512F__) || defined(__AVX2__)
    _mm_sfence(); /* the streamed states, before the team's barrier */
#endif
    free(local);
}

#define GDN_ARGS                                                                         \
    int64_t B, const int64_t *slots, const int64_t *cu, const int64_t *row_slots,        \
        const void *x, int64_t x_stride, void *conv_pool, float *ssm_pool,               \
        const void *weight, const void *bias, const void *a, int64_t a_stride,           \
        const void *bgate, int64_t b_stride, const void *A_log,                          \
        const void *dt_bias, void *out, int64_t hk, int64_t hv, int64_t dk, int64_t dv,  \
        int64_t kernel, int silu, int l2norm, const void *z, int64_t z_stride,            \
        const void *norm_w, float eps, float beta_scale
#define GDN_PASS                                                                          \
    B, slots, cu, row_slots, x, x_stride, conv_pool, ssm_pool, weight, bias, a, a_stride, \
        bgate, b_stride, A_log, dt_bias, out, hk, hv, dk, dv, kernel, silu, l2norm, z,     \
        z_stride, norm_w, eps, beta_scale

#define GDN_DECODE(bf)                                                                    \
    do {                                                                                  \
        const int64_t conv_dim = 2 * hk * dk + hv * dv;                                   \
        float *y = malloc(sizeof(float) * (size_t)(dec_rows(B, cu) * conv_dim));          \
        _Pragma("omp parallel") gdn_team(GDN_PASS, y, bf);                                \
        free(y);                                                                          \
    } while (0)

void gated_delta_decode(GDN_ARGS) { GDN_DECODE(0); }

void gated_delta_decode_bf16(GDN_ARGS) { GDN_DECODE(1); }
