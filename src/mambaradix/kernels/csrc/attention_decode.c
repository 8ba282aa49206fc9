/* Decode attention over pooled KV, read in place: request b's query heads attend the keys at
 * table[b, begin[b] : end[b]] of the K/V pools ([size, Hkv, D] and [size, Hkv, Dv], fp32),
 * without gathering them first. Grouped heads: query head h*r + i reads KV head h (r = Hq/Hkv).
 *
 * When a request also has a shared piece (the part of its keys that a group of requests shares,
 * attended once per group by the caller), shared_row[b] >= 0 names its row of shared_o
 * [R, Hq, Dv] (that piece's softmax output) and shared_lse [R, Hq] (the log-sum-exp of its
 * scaled scores); the two pieces are merged exactly:
 *   out = (sum_j e^(s_j - m) v_j + e^(lse - m) o) / (sum_j e^(s_j - m) + e^(lse - m)).
 *
 * One task per (row group, KV head), in parallel: scores of the r query heads of each row
 * against its own keys, then one pass over the value rows, each read once for the r heads of
 * every row. A group is one row, or with group_cu (G groups, rows group_cu[g] .. group_cu[g+1]
 * - 1) the rows of one request in a verify step (its last token and drafts: the same keys up to
 * each one's own, and the same begin), which then read each key once instead of once per row:
 * a 4-row verify had read the KV four times. exp is exp_poly (vec_math.h), which vectorises.
 *
 * attention_decode_bf16: the same with bf16 K/V pools (q, the shared piece and out stay fp32);
 * each key and value row is widened to fp32 as it is read, and everything accumulates in fp32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* 8-wide vectors (GCC vector extensions: one AVX register, two SSE ones elsewhere) */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static inline v8 load8(const float *p)
{
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 8 pool elements from element index idx: fp32, or bf16 widened to fp32 (with AVX2 one
 * zero-extending load and a shift: GCC built the generic conversion from two 128-bit halves
 * and an insert, and split the 256-bit stores into kbuf when it could not see them aligned;
 * the two together took ~5% of decode attention at 4,096 keys). decode's OpenMP
 * region is outlined once for both dtypes, so bf is a runtime value there: a predictable
 * branch (a build with it folded ran fp32 decode within 3%, 16 x 1024 keys). */
static inline v8 pool8(const void *pool, int64_t idx, const int bf)
{
    if (bf) {
#if defined(__AVX2__)
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)pool + idx));
        return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
        v8h h;
        memcpy(&h, (const uint16_t *)pool + idx, sizeof h);
        const v8u w = __builtin_convertvector(h, v8u) << 16;
        v8 v;
        memcpy(&v, &w, sizeof v);
        return v;
#endif
    }
    return load8((const float *)pool + idx);
}

#define MAX_GROUP 16 /* rows of a task; a longer group is taken MAX_GROUP rows at a time */

static inline const void *pool_at(const void *pool, int64_t idx, const int bf)
{
    return bf ? (const void *)((const uint16_t *)pool + idx) : (const void *)((const float *)pool + idx);
}

/* two-input lane shuffle with constant indices (GCC and clang spell it differently) */
#if defined(__clang__)
#define SHUF8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF8(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* lane t of the result = the sum of the lanes of a[t] (three rounds of pairwise folding) */
static inline v8 sum_lanes8(const v8 a[8])
{
    v8 b[4], c[2];
    for (int t = 0; t < 4; t++)
        b[t] = SHUF8(a[2 * t], a[2 * t + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUF8(a[2 * t], a[2 * t + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int t = 0; t < 2; t++)
        c[t] = SHUF8(b[2 * t], b[2 * t + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUF8(b[2 * t], b[2 * t + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF8(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUF8(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* The rows of one task: `nrow` decode rows b0 .. b0 + nrow - 1 (a verify step's positions of
 * one request, or a single row) whose own keys are the first n[i] of `slots` (the group's
 * longest row: the rows of a request share its KV slots up to their own tokens); row i's r
 * query heads at q[i], its output at out[i], its shared piece at so[i] / sl[i] (NULL: none). */
struct rows {
    int64_t nrow;
    const int64_t *slots;
    int64_t n[MAX_GROUP];
    const float *q[MAX_GROUP];
    const float *so[MAX_GROUP], *sl[MAX_GROUP];
    float *out[MAX_GROUP];
};

/* One (row group, KV head) task: each row's r query heads against its own keys. Keys go in
 * blocks of 8, widened once for every query head of every row of the group (a verify step's
 * rows read each key and value once, not once per row): the 8 dot products of a query head are
 * summed lane-wise and folded together (no per-key horizontal sum); values are accumulated 8
 * keys at a time. A row computes exactly what it computes alone: its scores, softmax and value
 * sums over its own keys, a short last block padded with its own last key at weight 0. Scores
 * and partial sums go to scratch (scores [nrow * r, cap], acc [nrow * r, Dv], weight and
 * inv_total [nrow * r]). Inlined with constant head sizes (see attention_decode), so the loops
 * over D and Dv unroll. D and Dv are multiples of 8. */
static inline __attribute__((always_inline)) void attend_own(
    const int64_t r, const int64_t Hkv, const int64_t h, const int64_t D, const int64_t Dv,
    const struct rows *g, const void *restrict k_pool, const void *restrict v_pool,
    float scale, int64_t cap, float *restrict scores, float *restrict acc,
    float *restrict weight, float *restrict inv_total, float *restrict kbuf, const int bf)
{
    const int64_t *restrict slots = g->slots;
    int64_t n = 0;
    for (int64_t row = 0; row < g->nrow; row++)
        n = g->n[row] > n ? g->n[row] : n;
    int64_t rows[8];  /* element index of each key's (or value's) row in its pool */
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const int64_t nb = n - j0 < 8 ? n - j0 : 8;
        for (int64_t t = 0; t < 8; t++)  /* a short block repeats its last key */
            rows[t] = (slots[j0 + (t < nb ? t : nb - 1)] * Hkv + h) * D;
        for (int64_t t = 0; j0 + 8 + t < n && t < 8; t++)
            __builtin_prefetch(pool_at(k_pool, (slots[j0 + 8 + t] * Hkv + h) * D, bf));
        /* the block's keys widened once, then dotted with each query head of each row */
        for (int t = 0; t < 8; t++)
            for (int64_t c = 0; c < D; c += 8) {
                *(v8 *)(void *)(kbuf + t * D + c) = pool8(k_pool, rows[t] + c, bf);
            }
        for (int64_t row = 0; row < g->nrow; row++) {
            const int64_t nr = g->n[row] - j0 < 8 ? g->n[row] - j0 : 8; /* this row's keys */
            for (int64_t i = 0; i < r && nr > 0; i++) {
                const float *qi = g->q[row] + i * D;
                v8 a[8] = {0};
                for (int64_t c = 0; c < D; c += 8) {
                    const v8 qv = load8(qi + c);
                    for (int t = 0; t < 8; t++)
                        a[t] += qv * load8(kbuf + t * D + c);
                }
                const v8 sv = sum_lanes8(a) * scale; /* lane t: key t's score alone */
                float *si = scores + (row * r + i) * cap + j0;
                for (int64_t t = 0; t < nr; t++)
                    si[t] = sv[t];
            }
        }
    }
    for (int64_t row = 0; row < g->nrow; row++)
        for (int64_t i = 0; i < r; i++) {
            const int64_t x = row * r + i, nr = g->n[row];
            float *restrict si = scores + x * cap;
            const float *sl = g->sl[row];
            float m = sl != NULL ? sl[i] : -INFINITY;
#pragma omp simd reduction(max : m)
            for (int64_t j = 0; j < nr; j++)
                m = si[j] > m ? si[j] : m;
#pragma omp simd
            for (int64_t j = 0; j < nr; j++)
                si[j] = exp_poly(si[j] - m);
            float total = 0.0f; /* summed in order: the same bits however the loop above ran */
            for (int64_t j = 0; j < nr; j++)
                total += si[j];
            float w = 0.0f;
            if (sl != NULL) {
                w = exp_poly(sl[i] - m);
                total += w;
            }
            weight[x] = w;
            inv_total[x] = 1.0f / total;
        }
    for (int64_t x = 0; x < g->nrow * r * Dv; x++)
        acc[x] = 0.0f;
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const int64_t nb = n - j0 < 8 ? n - j0 : 8;
        for (int64_t t = 0; t < 8; t++)
            rows[t] = (slots[j0 + (t < nb ? t : nb - 1)] * Hkv + h) * Dv;
        for (int64_t t = 0; j0 + 8 + t < n && t < 8; t++)
            __builtin_prefetch(pool_at(v_pool, (slots[j0 + 8 + t] * Hkv + h) * Dv, bf));
        for (int t = 0; t < 8; t++)
            for (int64_t c = 0; c < Dv; c += 8) {
                *(v8 *)(void *)(kbuf + t * Dv + c) = pool8(v_pool, rows[t] + c, bf);
            }
        for (int64_t row = 0; row < g->nrow; row++) {
            const int64_t nr = g->n[row] - j0 < 8 ? g->n[row] - j0 : 8;
            if (nr <= 0)
                continue;
            /* value rows: key t, or this row's last key where its block ends early (weight 0,
             * as alone: the padding's 0 * v are the same numbers) */
            const float *vt[8];
            for (int t = 0; t < 8; t++)
                vt[t] = kbuf + (t < nr ? t : nr - 1) * Dv;
            for (int64_t i = 0; i < r; i++) {
                const int64_t x = row * r + i;
                float p[8] = {0};  /* a short block's repeated keys weigh 0 */
                for (int64_t t = 0; t < nr; t++)
                    p[t] = scores[x * cap + j0 + t];
                for (int64_t c = 0; c < Dv; c += 8) {
                    v8 s = load8(acc + x * Dv + c);
                    for (int t = 0; t < 8; t++)
                        s += p[t] * load8(vt[t] + c);
                    memcpy(acc + x * Dv + c, &s, sizeof s);
                }
            }
        }
    }
    for (int64_t row = 0; row < g->nrow; row++)
        for (int64_t i = 0; i < r; i++) {
            const int64_t x = row * r + i;
            const float w = weight[x], inv = inv_total[x];
            const float *restrict a = acc + x * Dv;
            float *restrict o = g->out[row] + i * Dv;
            if (g->sl[row] != NULL) {
                const float *restrict s_o = g->so[row] + i * Dv;
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++)
                    o[d] = (a[d] + w * s_o[d]) * inv;
            } else {
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++)
                    o[d] = a[d] * inv;
            }
        }
}

static inline __attribute__((always_inline)) void decode_team(
    int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,
    const float *q,
    const void *k_pool, const void *v_pool,
    const int64_t *table, int64_t table_stride,
    const int64_t *begin, const int64_t *end,
    const float *shared_o, const float *shared_lse, const int64_t *shared_row,
    const int64_t *group_cu, int64_t G,
    float scale,
    float *out, const int bf)
{
    const int64_t r = Hq / Hkv;
    if (group_cu == NULL)
        G = B;
    {
        /* per-thread scratch; scores grow to the longest own span this thread meets, scores
         * and sums to the largest group */
        float *scores = NULL, *acc = NULL, *weight = NULL, *inv_total = NULL;
        /* 8 rows widened, 32-byte aligned (rows of a multiple of 8 floats): whole-vector stores */
        float *kbuf = aligned_alloc(32, sizeof(float) * 8 * (D > Dv ? D : Dv));
        int64_t cap = 0, cap_rows = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < G * Hkv; task++) {
            const int64_t gi = task / Hkv, h = task % Hkv;
            const int64_t first = group_cu ? group_cu[gi] : gi;
            const int64_t last = group_cu ? group_cu[gi + 1] : gi + 1;
            for (int64_t b0 = first; b0 < last; b0 += MAX_GROUP) {
                struct rows g = {.nrow = last - b0 < MAX_GROUP ? last - b0 : MAX_GROUP};
                int64_t n = 0, longest = b0;
                for (int64_t i = 0; i < g.nrow; i++) {
                    const int64_t b = b0 + i, row = shared_row == NULL ? -1 : shared_row[b];
                    g.n[i] = end[b] - begin[b];
                    if (g.n[i] > n)
                        n = g.n[i], longest = b;
                    g.q[i] = q + (b * Hq + h * r) * D;
                    g.out[i] = out + (b * Hq + h * r) * Dv;
                    g.so[i] = row < 0 ? NULL : shared_o + (row * Hq + h * r) * Dv;
                    g.sl[i] = row < 0 ? NULL : shared_lse + row * Hq + h * r;
                }
                g.slots = table + longest * table_stride + begin[longest];
                if (n > cap || g.nrow > cap_rows) {
                    cap = n > cap ? n : cap;
                    cap_rows = g.nrow > cap_rows ? g.nrow : cap_rows;
                    free(scores);
                    free(acc);
                    free(weight);
                    free(inv_total);
                    scores = malloc(sizeof(float) * cap_rows * r * cap);
                    acc = malloc(sizeof(float) * cap_rows * r * Dv);
                    weight = malloc(sizeof(float) * cap_rows * r);
                    inv_total = malloc(sizeof(float) * cap_rows * r);
                }
#define ATTEND(d, dv)                                                                      \
    attend_own(r, Hkv, h, d, dv, &g, k_pool, v_pool, scale, cap, scores, acc, weight, inv_total, \
               kbuf, bf)
                if (D == 32 && Dv == 32)
                    ATTEND(32, 32);
                else if (D == 64 && Dv == 64)
                    ATTEND(64, 64);
                else if (D == 128 && Dv == 128)
                    ATTEND(128, 128);
                else if (D == 256 && Dv == 256)
                    ATTEND(256, 256);
                else
                    ATTEND(D, Dv);
#undef ATTEND
            }
        }
        free(scores);
        free(acc);
        free(weight);
        free(inv_total);
        free(kbuf);
    }
}

#define DECODE_ARGS                                                                          \
    int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, const float *q,               \
        const void *k_pool, const void *v_pool, const int64_t *table, int64_t table_stride,  \
        const int64_t *begin, const int64_t *end, const float *shared_o,                     \
        const float *shared_lse, const int64_t *shared_row, const int64_t *group_cu,         \
        int64_t G, float scale, float *out
#define DECODE_PASS                                                                          \
    B, Hq, Hkv, D, Dv, q, k_pool, v_pool, table, table_stride, begin, end, shared_o,         \
        shared_lse, shared_row, group_cu, G, scale, out

/* The parallel region sits in each exported function, so that `bf` is a constant inside it and
 * pool8's branch folds away (with the region in the shared body, one outlined copy served both
 * dtypes: batch 1, 12 query heads over 200 bf16 keys of 64 took 47 us). */
void attention_decode(DECODE_ARGS)
{
#pragma omp parallel
    decode_team(DECODE_PASS, 0);
}

void attention_decode_bf16(DECODE_ARGS)
{
#pragma omp parallel
    decode_team(DECODE_PASS, 1);
}
