/* The Gated DeltaNet prefill scan of S varlen segments, in place on the delta-state pool.
 *
 * Per value head h (key head h / (Hv / Hk)) and token t, with state S ([Dk][Dv], fp32):
 *   S *= exp(g_t);  u = beta_t (v_t - S^T k_t);  S += k_t u^T;  out_t = S^T q_t
 * q and k L2-normalised (optional) and q scaled by Dk^-1/2, as the decode step
 * (gated_delta_decode.c) and the torch reference (kernels/gated_delta.py) do. Token after token,
 * so the state after any token is there for a snapshot, exactly.
 *
 * Work: first q and k of every token normalised into fp32 scratch (every value head of a key
 * head reads them); then one task per (segment, value head, block of 32 value columns): the
 * columns of S are independent (u and out of column j read column j only), and a block's
 * [Dk][32] slice (16 KB at Dk = 128) stays in L1 for the whole segment, copied out of the pool
 * at the start, into a snapshot slot at its offset, and back at the end. A whole 128 x 128
 * head (64 KB) would stream from L2 twice a token.
 *
 * q, k and v are addressed by a token and a channel stride (views of the prefill conv's
 * output, which is channel-major); g (fp32) and beta [T][Hv] dense; out [T][Hv][Dv] in the
 * model dtype. `_bf16`: bf16 q, k, v, beta and out; the state fp32. Snapshots sorted by
 * segment, then offset (cpu.ScanSegments). Returns 0, or -1 (nothing done) when the scratch
 * cannot be had.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#define COLS 32 /* value columns a task carries */

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_GDN_VEC 1

/* S^T k over a [Dk][32] block (S before the token's decay): row i's products on chain i & 3
 * (the rows past the last multiple of 4 on chain 0, after the others), eight chains in all so
 * the FMAs' latency is hidden; the chains summed as (0 + 1) + (2 + 3). */
static inline __attribute__((always_inline)) void gdn_kv_vec(const float *st, const float *k,
                                                             int64_t dk, __m512 kv[2])
{
    __m512 a[4][2];
    for (int r = 0; r < 4; r++)
        a[r][0] = a[r][1] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 4 <= dk; i += 4)
        for (int r = 0; r < 4; r++) {
            const __m512 ki = _mm512_set1_ps(k[i + r]);
            const float *row = st + (i + r) * COLS;
            a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(row), ki, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(row + 16), ki, a[r][1]);
        }
    for (; i < dk; i++) {
        const __m512 ki = _mm512_set1_ps(k[i]);
        a[0][0] = _mm512_fmadd_ps(_mm512_loadu_ps(st + i * COLS), ki, a[0][0]);
        a[0][1] = _mm512_fmadd_ps(_mm512_loadu_ps(st + i * COLS + 16), ki, a[0][1]);
    }
    for (int c = 0; c < 2; c++)
        kv[c] = _mm512_add_ps(_mm512_add_ps(a[0][c], a[1][c]), _mm512_add_ps(a[2][c], a[3][c]));
}

/* Row i of one token's update: s = decay S_i + k_i u, stored; out's chain r += s q_i and, with
 * `next`, the next token's S^T k chain rn += s kn_i (its rows as gdn_kv_vec takes them). */
#define GDN_ROW(i, r, rn)                                                                    \
    do {                                                                                     \
        const __m512 ki_ = _mm512_set1_ps(k[i]), qi_ = _mm512_set1_ps(q[i]);                 \
        float *row_ = st + (i) * COLS;                                                       \
        for (int c = 0; c < 2; c++) {                                                        \
            const __m512 s_ =                                                                \
                _mm512_fmadd_ps(_mm512_loadu_ps(row_ + 16 * c), dec, _mm512_mul_ps(ki_, u[c])); \
            _mm512_storeu_ps(row_ + 16 * c, s_);                                             \
            ao[r][c] = _mm512_fmadd_ps(s_, qi_, ao[r][c]);                                   \
            if (next)                                                                        \
                an[rn][c] = _mm512_fmadd_ps(s_, _mm512_set1_ps(kn[i]), an[rn][c]);           \
        }                                                                                    \
    } while (0)

/* One token on a [Dk][32] block, given kv = S^T k (gdn_kv_vec): u = beta (v - decay kv), then
 * one pass over the rows updating S, summing out = S^T q and, with `next`, the next token's
 * S^T kn into kv: the same products in the same order as a separate gdn_kv_vec pass over the
 * updated block, so the bits do not depend on whether a token was fused into the one before.
 * Every array index is a constant (the chains stay in registers). */
static inline __attribute__((always_inline)) void gdn_token_vec(
    float *st, const float *q, const float *k, const float *v, float decay, float beta,
    float *o, int64_t dk, __m512 kv[2], const float *kn, const int next)
{
    const __m512 dec = _mm512_set1_ps(decay), bt = _mm512_set1_ps(beta);
    __m512 u[2], ao[4][2], an[4][2];
    for (int c = 0; c < 2; c++)
        u[c] = _mm512_mul_ps(bt, _mm512_fnmadd_ps(dec, kv[c], _mm512_loadu_ps(v + 16 * c)));
    for (int r = 0; r < 4; r++)
        ao[r][0] = ao[r][1] = an[r][0] = an[r][1] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 4 <= dk; i += 4) {
        GDN_ROW(i, 0, 0);
        GDN_ROW(i + 1, 1, 1);
        GDN_ROW(i + 2, 2, 2);
        GDN_ROW(i + 3, 3, 3);
    }
    if (i < dk)
        GDN_ROW(i, 0, 0);
    if (i + 1 < dk)
        GDN_ROW(i + 1, 1, 0);
    if (i + 2 < dk)
        GDN_ROW(i + 2, 2, 0);
    for (int c = 0; c < 2; c++) {
        _mm512_storeu_ps(o + 16 * c, _mm512_add_ps(_mm512_add_ps(ao[0][c], ao[1][c]),
                                                   _mm512_add_ps(ao[2][c], ao[3][c])));
        if (next)
            kv[c] = _mm512_add_ps(_mm512_add_ps(an[0][c], an[1][c]),
                                  _mm512_add_ps(an[2][c], an[3][c]));
    }
}
#undef GDN_ROW
#endif

/* The same on a [Dk][w] block (w <= COLS, any width), scalar. */
static inline void gdn_token(float *st, const float *q, const float *k, const float *v,
                             float decay, float beta, float *o, int64_t dk, int64_t w)
{
    float u[COLS];
    for (int64_t j = 0; j < w; j++)
        u[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++)
        for (int64_t j = 0; j < w; j++)
            u[j] += st[i * COLS + j] * k[i];
    for (int64_t j = 0; j < w; j++) {
        u[j] = beta * (v[j] - decay * u[j]);
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++)
        for (int64_t j = 0; j < w; j++) {
            const float s = decay * st[i * COLS + j] + k[i] * u[j];
            st[i * COLS + j] = s;
            o[j] += s * q[i];
        }
}

/* Columns c0 .. c0 + w - 1 of head h's state between the pool ([Dk][Dv]) and a block. */
static inline void block_copy(float *block, float *head, int64_t dk, int64_t dv, int64_t c0,
                              int64_t w, int to_block)
{
    for (int64_t i = 0; i < dk; i++) {
        if (to_block)
            memcpy(block + i * COLS, head + i * dv + c0, sizeof(float) * (size_t)w);
        else
            memcpy(head + i * dv + c0, block + i * COLS, sizeof(float) * (size_t)w);
    }
}

/* q and k of tokens t0 .. t0 + nb - 1 (SCAN_BLOCK at most) into qk32 [Hk][T][2][Dk], fp32,
 * normalised and q scaled: a key head's tokens one after another, so a scan task reads its q
 * and k as one sequential stream (read across heads, 16 KB apart a token at Hk = 16, they
 * came from L3 at the pace of a miss a token: 1.7x a task's time). */
static inline __attribute__((always_inline)) void gdn_prepare_qk(
    float *qk32, int64_t T, int64_t t0, int64_t nb, const void *q, const void *k, int64_t ts,
    int64_t cs,
    int64_t hk, int64_t dk, int l2norm, const int bf)
{
    const float q_scale = 1.0f / sqrtf((float)dk);
    float buf[SCAN_BLOCK * dk];
    for (int m = 0; m < 2; m++)
        for (int64_t h = 0; h < hk; h++) {
            scan_gather(buf, m ? k : q, t0, nb, ts, h * dk * cs, cs, dk, bf);
            for (int64_t j = 0; j < nb; j++)
                scale_l2(qk32 + ((h * T + t0 + j) * 2 + m) * dk, buf + j * dk, dk,
                         m ? 1.0f : q_scale, l2norm);
        }
}

/* Segment s, value head h, columns c0 .. c0 + w - 1. */
static inline __attribute__((always_inline)) void gdn_scan_task(
    int64_t s, int64_t h, int64_t c0, const int64_t *cu, const int64_t *slots, float *ssm_pool,
    const float *qk32, int64_t T, const void *v, int64_t v_ts, int64_t v_cs, const float *g,
    const void *beta, void *out, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t K,
    const int64_t *snap_seq, const int64_t *snap_off, const int64_t *snap_slot, const int bf)
{
    const int64_t w = dv - c0 < COLS ? dv - c0 : COLS, kh = h / (hv / hk), size = dk * dv;
    float block[dk * COLS], vb[SCAN_BLOCK * COLS], o[COLS];
#if HAVE_GDN_VEC
    __m512 kv[2]; /* S^T k of the token about to run, summed in the pass before it */
#endif
    block_copy(block, ssm_pool + (slots[s] * hv + h) * size, dk, dv, c0, w, 1);
    int64_t t = cu[s];
    for (int64_t k = 0; k <= K; k++) {
        const int64_t stop = scan_piece(s, &k, cu, K, snap_seq, snap_off);
        while (t < stop) {
            const int64_t nb = stop - t < SCAN_BLOCK ? stop - t : SCAN_BLOCK;
            scan_gather(vb, v, t, nb, v_ts, (h * dv + c0) * v_cs, v_cs, w, bf);
            for (int64_t j = 0; j < nb; j++, t++) {
                const float *qt = qk32 + (kh * T + t) * 2 * dk, *kt = qt + dk;
                const float decay = expf(g[t * hv + h]), bt = ld(beta, t * hv + h, bf);
#if HAVE_GDN_VEC
                if (w == COLS) {
                    if (t == cu[s])
                        gdn_kv_vec(block, kt, dk, kv);
                    if (t + 1 < cu[s + 1]) /* the next token's S^T k in the same pass */
                        gdn_token_vec(block, qt, kt, vb + j * w, decay, bt, o, dk, kv,
                                      kt + 2 * dk, 1);
                    else
                        gdn_token_vec(block, qt, kt, vb + j * w, decay, bt, o, dk, kv, NULL, 0);
                } else
#endif
                    gdn_token(block, qt, kt, vb + j * w, decay, bt, o, dk, w);
                for (int64_t c = 0; c < w; c++)
                    st(out, (t * hv + h) * dv + c0 + c, o[c], bf);
            }
        }
        const int64_t dst = k < K ? snap_slot[k] : slots[s];
        block_copy(block, ssm_pool + (dst * hv + h) * size, dk, dv, c0, w, 0);
    }
}

#define GDN_SCAN_ARGS                                                                        \
    int64_t S, const int64_t *cu, const int64_t *slots, float *ssm_pool, const void *q,     \
        const void *k, int64_t qk_ts, int64_t qk_cs, const void *v, int64_t v_ts,           \
        int64_t v_cs, const float *g, const void *beta, void *out, int64_t hk, int64_t hv,  \
        int64_t dk, int64_t dv, int l2norm, int64_t K, const int64_t *snap_seq,             \
        const int64_t *snap_off, const int64_t *snap_slot
#define GDN_SCAN(bf)                                                                         \
    do {                                                                                     \
        const int64_t T = cu[S], blocks = (dv + COLS - 1) / COLS;                            \
        float *qk32 = malloc(sizeof(float) * (size_t)(T * 2 * hk * dk));                     \
        if (!qk32)                                                                           \
            return -1; /* nothing touched: the caller runs the reference */                 \
        _Pragma("omp parallel")                                                              \
        {                                                                                    \
            _Pragma("omp for schedule(static)")                                              \
            for (int64_t t = 0; t < T; t += SCAN_BLOCK)                                      \
                gdn_prepare_qk(qk32, T, t, T - t < SCAN_BLOCK ? T - t : SCAN_BLOCK, q, k, qk_ts, \
                               qk_cs, hk, dk, l2norm, bf);                                   \
            _Pragma("omp for collapse(3) schedule(dynamic, 1)")                              \
            for (int64_t s = 0; s < S; s++)                                                  \
                for (int64_t h = 0; h < hv; h++)                                             \
                    for (int64_t b = 0; b < blocks; b++)                                     \
                        gdn_scan_task(s, h, b * COLS, cu, slots, ssm_pool, qk32, T, v, v_ts, \
                                      v_cs, g, beta, out, hk, hv, dk, dv, K, snap_seq,       \
                                      snap_off, snap_slot, bf);                              \
        }                                                                                    \
        free(qk32);                                                                          \
        return 0;                                                                            \
    } while (0)

int gated_delta_scan(GDN_SCAN_ARGS) { GDN_SCAN(0); }

int gated_delta_scan_bf16(GDN_SCAN_ARGS) { GDN_SCAN(1); }
