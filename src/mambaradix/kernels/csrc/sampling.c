/* Per row of fp32 logits [B][V] (rows `ld` apart): the index of the first maximum (torch's
 * argmax) and, if asked, the maximum m and log(sum(exp(x - m))), so that a logprob is
 * (x - m) - log_sum as torch's log_softmax computes it (x - logsumexp would lose the small
 * logprobs' low bits to the cancellation).
 *
 * Why: the sampler needs both for every row of every step (the greedy token, the chosen
 * token's logprob). torch's argmax over a 248k vocabulary took ~460 us a
 * row here and log_softmax ~200 us, about 1% of a Qwen3.5-0.8B batch-1 decode step.
 *
 * How: each row is cut into chunks of CHUNK logits, the (row, chunk) pairs spread over the
 * threads. A chunk gives its maximum, the first index reaching it and sum(exp(x - max)); the
 * chunks of a row are then combined in order: log_sum = log(sum_c s_c exp(m_c - M)).
 * The chunking is fixed, so results do not depend on the thread count. exp is vec_math.h's
 * polynomial (relative error ~1e-7; torch's Sleef exp: ~1 ulp). A row holding a NaN gets
 * index -1 (the caller takes torch's answer for it; every row does if the scratch cannot be
 * had); a row of -inf gets index 0, m and log_sum -inf.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "conv_window.h"
#include "vec_math.h"

#define CHUNK 16384

typedef struct {
    float max, sum;
    int64_t idx; /* -1: a NaN in the chunk */
} ChunkStat;

static inline __attribute__((always_inline)) void chunk_max(const float *x, int64_t n,
                                                            ChunkStat *st)
{
    float best = -INFINITY;
    int64_t idx = 0, i = 0;
    int nan = 0;
#if HAVE_CONV_WINDOW
    if (n >= 16) {
        __m512 bv = _mm512_set1_ps(-INFINITY);
        __m512i bi = _mm512_setzero_si512(), cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                      9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 unord = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ); /* strict: first max */
            unord |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            bv = _mm512_mask_blend_ps(gt, bv, v);
            bi = _mm512_mask_blend_epi32(gt, bi, cur);
            cur = _mm512_add_epi32(cur, step);
        }
        nan = unord != 0;
        float lanes[16];
        int32_t ids[16];
        _mm512_storeu_ps(lanes, bv);
        _mm512_storeu_si512(ids, bi);
        for (int l = 0; l < 16; l++) /* the lowest index among the lanes holding the max */
            if (lanes[l] > best || (lanes[l] == best && ids[l] < idx)) {
                best = lanes[l];
                idx = ids[l];
            }
    }
#endif
    for (; i < n; i++) {
        const float v = x[i];
        nan |= v != v;
        if (v > best) {
            best = v;
            idx = i;
        }
    }
    st->max = best;
    st->idx = nan ? -1 : idx;
}

static inline __attribute__((always_inline)) float chunk_sumexp(const float *x, int64_t n,
                                                                float max)
{
    if (max == -INFINITY)
        return 0.0f; /* every logit -inf: nothing to add (x - max would be NaN) */
    /* the sum in fp64 lanes: a first version summing in fp32 was ~1.5e-5 off the float64
     * logsumexp of a 248k row, 50x torch's error; in fp64 it is as close as torch's */
    double s = 0.0;
    int64_t i = 0;
#if HAVE_CONV_WINDOW
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    const __m512 m = _mm512_set1_ps(max);
    for (; i + 16 <= n; i += 16) {
        const __m512 e = cw_exp_poly(_mm512_sub_ps(_mm512_loadu_ps(x + i), m));
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        hi = _mm512_add_pd(hi, _mm512_cvtps_pd(
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    s = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
#else
    /* elsewhere (AVX2): a block's exponentials in a loop that vectorises, then summed into 8
     * fp64 lanes (each lane in order, the lanes in a fixed tree: the same bits for a given
     * row); one running sum took 1.5 ms a 248k-token row on an AVX2 EPYC, this 0.7 */
    double lane[8] = {0};
    float e[64];
    for (; i + 64 <= n; i += 64) {
#pragma omp simd
        for (int j = 0; j < 64; j++)
            e[j] = exp_poly(x[i + j] - max);
        for (int j = 0; j < 64; j += 8)
            for (int l = 0; l < 8; l++)
                lane[l] += (double)e[j + l];
    }
    s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
#endif
    for (; i < n; i++)
        s += (double)exp_poly(x[i] - max);
    return (float)s;
}

void argmax_logsumexp(int64_t B, int64_t V, const float *x, int64_t ld, int64_t *idx,
                      float *maxv, float *log_sum, int want_norm)
{
    const int64_t chunks = (V + CHUNK - 1) / CHUNK;
    ChunkStat *st = malloc(sizeof(ChunkStat) * (size_t)(B * chunks));
    if (st == NULL) { /* no scratch: every row as a NaN row, answered by the caller's torch */
        for (int64_t b = 0; b < B; b++)
            idx[b] = -1;
        return;
    }
#pragma omp parallel for collapse(2) schedule(static) if (B * V > CHUNK)
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t c0 = c * CHUNK, n = V - c0 < CHUNK ? V - c0 : CHUNK;
            ChunkStat *s = st + b * chunks + c;
            chunk_max(x + b * ld + c0, n, s);
            if (s->idx >= 0)
                s->idx += c0;
            s->sum = want_norm ? chunk_sumexp(x + b * ld + c0, n, s->max) : 0.0f;
        }
    for (int64_t b = 0; b < B; b++) {
        const ChunkStat *s = st + b * chunks;
        float m = -INFINITY;
        int64_t at = 0, nan = 0;
        for (int64_t c = 0; c < chunks; c++) {
            nan |= s[c].idx < 0;
            if (s[c].max > m) { /* strict: an earlier chunk keeps a tie */
                m = s[c].max;
                at = s[c].idx;
            }
        }
        idx[b] = nan ? -1 : at;
        if (want_norm) {
            double total = 0.0;
            for (int64_t c = 0; c < chunks; c++)
                if (s[c].sum > 0.0f)
                    total += (double)s[c].sum * exp((double)(s[c].max - m));
            maxv[b] = m;
            log_sum[b] = nan ? NAN : (m == -INFINITY ? -INFINITY : (float)log(total));
        }
    }
    free(st);
}
