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
 * A row's own keys are cut into splits of SPLIT keys at fixed places; tasks are (row group,
 * split, KV heads), in parallel, each writing the split's partial softmax (its largest score,
 * the sum of exponentials and the weighted value rows), merged in order per row afterwards, so
 * one long row keeps every thread busy and a row's bits depend on nothing but its keys. Within
 * a task: scores of the r query heads of each row against its keys, then one pass over the
 * value rows, each read once for the r heads of every row. A group is one row, or with
 * group_cu (G groups, rows group_cu[g] .. group_cu[g+1] - 1) the rows of one request in a
 * verify step (its last token and drafts: the same keys up to each one's own, and the same
 * begin), which then read each key once instead of once per row: a 4-row verify had read the
 * KV four times. exp is exp_poly (vec_math.h), which vectorises.
 *
 * attention_decode_bf16: the same with bf16 K/V pools (q, the shared piece and out stay fp32);
 * each key and value row is widened to fp32 as it is read, and everything accumulates in fp32.
 * Where the CPU has AVX-512 BF16 (and the head size is a multiple of 32, the query heads per
 * KV head divide 8), the scores come from its bf16 dot-product instruction on the bf16 query
 * and keys instead, accumulated in fp32: one layer of Qwen3.5-0.8B's shape over 16k keys, 2
 * threads, 3.0-3.1 -> 2.6-2.8 ms (the values' half is unchanged).
 */
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec_math.h"
#if defined(__AVX2__) || defined(__FMA__)
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

/* a * b + c, rounded once where the CPU has FMA (the build's bits: -std=c11 never contracts a
 * multiply and an add on its own), else rounded twice */
static inline v8 fma8(v8 a, v8 b, v8 c)
{
#if defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
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
/* A row's own keys are cut into splits of SPLIT keys at fixed places (multiples of SPLIT from
 * its first own key); each split is attended on its own and the splits merged by their
 * log-sum-exp, in order, so a row's bits depend on its keys alone, never on the thread count,
 * its group or how tasks take the splits. */
#define SPLIT 256
#define VB 8 /* value columns a task keeps in registers: VB vectors of 8 */

static inline const void *pool_at(const void *pool, int64_t idx, const int bf)
{
    return bf ? (const void *)((const uint16_t *)pool + idx) : (const void *)((const float *)pool + idx);
}

/* Every cache line of the next block's rows (up to 8 keys at `next`, `left` of them; KV heads
 * [h0, h0 + nh), contiguous in a slot's row) fetched while this block is computed: with the
 * first line of each key's row alone, the widening loop waited on memory for most of the
 * kernel's time (the reads of a slot row's later lines). */
static inline void prefetch_block(const void *pool, const int64_t *next, int64_t left,
                                  int64_t Hkv, int64_t h0, int64_t nh, int64_t D, const int bf)
{
    const int64_t bytes = nh * D * (bf ? 2 : 4);
    for (int64_t t = 0; t < left && t < 8; t++) {
        const char *row = pool_at(pool, (next[t] * Hkv + h0) * D, bf);
        for (int64_t o = 0; o < bytes; o += 64)
            __builtin_prefetch(row + o);
    }
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
 * longest row: the rows of a request share its KV slots up to their own tokens); row i's Hq
 * query heads at q[i], and where its partial results for the split go: pm[i] and pl[i] ([Hq]:
 * the split's largest scaled score and the sum of e^(score - that)) and pacc[i] ([Hq, Dv]: the
 * value rows weighted by those exponentials, not yet divided). */
struct rows {
    int64_t nrow;
    const int64_t *slots;
    int64_t n[MAX_GROUP];
    const float *q[MAX_GROUP];
    float *pm[MAX_GROUP], *pl[MAX_GROUP], *pacc[MAX_GROUP];
};

/* One (rows, split, KV heads [h0, h1)) task: the keys [lo, hi) of the split, each row's query
 * heads of those KV heads against its own keys among them. Keys go in blocks of 8, every KV
 * head of the task in turn (a task of all KV heads reads each slot's row whole and in order).
 * Where r divides 8, keys and values are widened in registers as they are used: KB = 8 / r keys
 * against the r query heads a pass for the scores, CB = 8 / r vectors of value columns for the
 * r heads' sums, 8 accumulators either way (1.37x faster on one core at Qwen3.5's shape than
 * widening each block into a buffer first, which cost as many instructions as the
 * multiply-adds and left the loop mostly waiting); other ratios widen a block into kbuf once
 * for every query head of every row. Either way a verify step's rows take each block of keys
 * while it is in L1 (from memory once, not once per row), the 8 dot products of a query head
 * are summed lane-wise and folded together (no per-key horizontal sum), and each score and
 * value column takes the same multiply-adds in the same order. A row computes exactly what
 * it computes alone: its scores, softmax and value sums over its own keys of the split, a
 * short last block padded with its own last key at weight 0. Scores go to scratch ([nrow *
 * (h1 - h0) * r, SPLIT]). Inlined with constant head sizes and r (see decode_team), so the
 * loops unroll. D and Dv are multiples of 8. */
static inline __attribute__((always_inline)) void attend_split(
    const int64_t r, const int64_t Hkv, const int64_t h0, const int64_t h1, const int64_t D,
    const int64_t Dv, const struct rows *g, const int64_t lo, const int64_t hi,
    const void *restrict k_pool, const void *restrict v_pool, float scale,
    float *restrict scores, float *restrict kbuf, const uint16_t *restrict qbf, const int bf)
{
    const int64_t *restrict slots = g->slots + lo;
    const int64_t n = hi - lo, nh = h1 - h0;
    int64_t own[MAX_GROUP]; /* each row's keys in this split */
    for (int64_t row = 0; row < g->nrow; row++) {
        const int64_t k = g->n[row] - lo;
        own[row] = k < 0 ? 0 : (k < n ? k : n);
    }
    int64_t rows[8]; /* element index of each key's (or value's) row in its pool */
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const int64_t nb = n - j0 < 8 ? n - j0 : 8;
        prefetch_block(k_pool, slots + j0 + 8, n - j0 - 8, Hkv, h0, nh, D, bf);
        for (int64_t h = h0; h < h1; h++) {
            for (int64_t t = 0; t < 8; t++) /* a short block repeats its last key */
                rows[t] = (slots[j0 + (t < nb ? t : nb - 1)] * Hkv + h) * D;
            if (8 % r == 0) { /* inline: keys widened in registers, KB keys x r heads a pass */
                const int64_t KB = 8 / r;
#if defined(__AVX512BF16__)
                if (bf && D % 32 == 0) {
                    /* bf16 pools where the CPU has AVX-512 BF16: the bf16 query (qbf, exactly
                     * q: a bf16 model's q is bf16) against the bf16 keys by the dot-product
                     * instruction, 32 products a vector summed in pairs into 16 fp32 lanes (no
                     * widening, twice the products an FMA takes), folded to 8 lanes and summed
                     * lane-wise as below. The products are exact either way; the sums go in
                     * another order (and the instruction flushes denormals): fixed by the key's
                     * data alone, as above. */
                    for (int64_t row = 0; row < g->nrow; row++) {
                        const int64_t nr = own[row] - j0 < 8 ? own[row] - j0 : 8;
                        const uint16_t *qh = qbf + (row * Hkv + h) * r * D;
                        for (int64_t t0 = 0; t0 < nr; t0 += KB) {
                            __m512 a16[8];
                            for (int x = 0; x < 8; x++)
                                a16[x] = _mm512_setzero_ps();
                            for (int64_t c = 0; c < D; c += 32)
                                for (int64_t t = 0; t < KB; t++) {
                                    const __m512bh kv = (__m512bh)_mm512_loadu_si512(
                                        (const uint16_t *)k_pool + rows[t0 + t] + c);
                                    for (int64_t i = 0; i < r; i++)
                                        a16[i * KB + t] = _mm512_dpbf16_ps(
                                            a16[i * KB + t],
                                            (__m512bh)_mm512_loadu_si512(qh + i * D + c), kv);
                                }
                            v8 a[8];
                            for (int x = 0; x < 8; x++)
                                a[x] = (v8)_mm256_add_ps(
                                    _mm512_castps512_ps256(a16[x]),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a16[x]), 1)));
                            const v8 sv = sum_lanes8(a) * scale;
                            for (int64_t i = 0; i < r; i++) {
                                float *si = scores + ((row * nh + h - h0) * r + i) * SPLIT + j0 + t0;
                                for (int64_t t = 0; t < KB && t0 + t < nr; t++)
                                    si[t] = sv[i * KB + t];
                            }
                        }
                    }
                    continue;
                }
#endif
                for (int64_t row = 0; row < g->nrow; row++) {
                    const int64_t nr = own[row] - j0 < 8 ? own[row] - j0 : 8;
                    const float *qh = g->q[row] + h * r * D;
                    for (int64_t t0 = 0; t0 < nr; t0 += KB) {
                        v8 a[8] = {0}; /* a[i * KB + t]: head i, key t0 + t */
                        for (int64_t c = 0; c < D; c += 8)
                            for (int64_t t = 0; t < KB; t++) {
                                const v8 kv = pool8(k_pool, rows[t0 + t] + c, bf);
                                for (int64_t i = 0; i < r; i++)
                                    a[i * KB + t] = fma8(load8(qh + i * D + c), kv, a[i * KB + t]);
                            }
                        const v8 sv = sum_lanes8(a) * scale;
                        for (int64_t i = 0; i < r; i++) {
                            float *si = scores + ((row * nh + h - h0) * r + i) * SPLIT + j0 + t0;
                            for (int64_t t = 0; t < KB && t0 + t < nr; t++)
                                si[t] = sv[i * KB + t];
                        }
                    }
                }
                continue;
            }
            /* the block's keys widened once, then dotted with each query head of each row */
            for (int t = 0; t < 8; t++)
                for (int64_t c = 0; c < D; c += 8)
                    *(v8 *)(void *)(kbuf + t * D + c) = pool8(k_pool, rows[t] + c, bf);
            for (int64_t row = 0; row < g->nrow; row++) {
                const int64_t nr = own[row] - j0 < 8 ? own[row] - j0 : 8; /* this row's keys */
                for (int64_t i = 0; i < r && nr > 0; i++) {
                    const float *qi = g->q[row] + (h * r + i) * D;
                    v8 a[8] = {0};
                    for (int64_t c = 0; c < D; c += 8) {
                        const v8 qv = load8(qi + c);
                        for (int t = 0; t < 8; t++)
                            a[t] = fma8(qv, load8(kbuf + t * D + c), a[t]);
                    }
                    const v8 sv = sum_lanes8(a) * scale; /* lane t: key t's score alone */
                    float *si = scores + ((row * nh + h - h0) * r + i) * SPLIT + j0;
                    for (int64_t t = 0; t < nr; t++)
                        si[t] = sv[t];
                }
            }
        }
    }
    for (int64_t row = 0; row < g->nrow; row++)
        for (int64_t x = 0; x < nh * r && own[row] > 0; x++) {
            const int64_t nr = own[row], hq = h0 * r + x;
            float *restrict si = scores + (row * nh * r + x) * SPLIT;
            float m = -INFINITY;
#pragma omp simd reduction(max : m)
            for (int64_t j = 0; j < nr; j++)
                m = si[j] > m ? si[j] : m;
#pragma omp simd
            for (int64_t j = 0; j < nr; j++)
                si[j] = exp_poly(si[j] - m);
            float total = 0.0f; /* summed in order: the same bits however the loop above ran */
            for (int64_t j = 0; j < nr; j++)
                total += si[j];
            g->pm[row][hq] = m;
            g->pl[row][hq] = total;
            float *restrict a = g->pacc[row] + hq * Dv;
            for (int64_t d = 0; d < Dv; d++)
                a[d] = 0.0f;
        }
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const int64_t nb = n - j0 < 8 ? n - j0 : 8;
        prefetch_block(v_pool, slots + j0 + 8, n - j0 - 8, Hkv, h0, nh, Dv, bf);
        for (int64_t h = h0; h < h1; h++) {
            for (int64_t t = 0; t < 8; t++)
                rows[t] = (slots[j0 + (t < nb ? t : nb - 1)] * Hkv + h) * Dv;
            if (8 % r == 0) { /* inline: values widened in registers, CB vectors x r heads */
                const int64_t CB = 8 / r;
                for (int64_t row = 0; row < g->nrow; row++) {
                    const int64_t nr = own[row] - j0 < 8 ? own[row] - j0 : 8;
                    if (nr <= 0)
                        continue;
                    int64_t vrow[8];
                    v8 pb[64]; /* pb[i * 8 + t]: head i's weight of key t, broadcast */
                    for (int t = 0; t < 8; t++)
                        vrow[t] = rows[t < nr ? t : nr - 1];
                    for (int64_t i = 0; i < r; i++) {
                        const float *si = scores + ((row * nh + h - h0) * r + i) * SPLIT + j0;
                        for (int64_t t = 0; t < 8; t++) {
                            const float w = t < nr ? si[t] : 0.0f;
                            pb[i * 8 + t] = (v8){w, w, w, w, w, w, w, w};
                        }
                    }
                    float *acc = g->pacc[row] + h * r * Dv;
                    for (int64_t c0 = 0; c0 < Dv; c0 += 8 * CB) {
                        v8 sv[8] = {0};
                        for (int64_t i = 0; i < r; i++)
                            for (int64_t cb = 0; cb < CB && c0 + 8 * cb < Dv; cb++)
                                sv[i * CB + cb] =
                                    *(const v8 *)(const void *)(acc + i * Dv + c0 + 8 * cb);
                        for (int64_t t = 0; t < 8; t++)
                            for (int64_t cb = 0; cb < CB && c0 + 8 * cb < Dv; cb++) {
                                const v8 vv = pool8(v_pool, vrow[t] + c0 + 8 * cb, bf);
                                for (int64_t i = 0; i < r; i++)
                                    sv[i * CB + cb] = fma8(pb[i * 8 + t], vv, sv[i * CB + cb]);
                            }
                        for (int64_t i = 0; i < r; i++)
                            for (int64_t cb = 0; cb < CB && c0 + 8 * cb < Dv; cb++)
                                *(v8 *)(void *)(acc + i * Dv + c0 + 8 * cb) = sv[i * CB + cb];
                    }
                }
                continue;
            }
            for (int t = 0; t < 8; t++)
                for (int64_t c = 0; c < Dv; c += 8)
                    *(v8 *)(void *)(kbuf + t * Dv + c) = pool8(v_pool, rows[t] + c, bf);
            for (int64_t row = 0; row < g->nrow; row++) {
                const int64_t nr = own[row] - j0 < 8 ? own[row] - j0 : 8;
                if (nr <= 0)
                    continue;
                /* value rows: key t, or this row's last key where its block ends early (weight
                 * 0, as alone: the padding's 0 * v are the same numbers) */
                const float *vt[8];
                for (int t = 0; t < 8; t++)
                    vt[t] = kbuf + (t < nr ? t : nr - 1) * Dv;
                for (int64_t i = 0; i < r; i++) {
                    const int64_t x = (h - h0) * r + i;
                    float p[8] = {0}; /* a short block's repeated keys weigh 0 */
                    for (int64_t t = 0; t < nr; t++)
                        p[t] = scores[(row * nh * r + x) * SPLIT + j0 + t];
                    float *acc = g->pacc[row] + (h * r + i) * Dv; /* 32-byte aligned */
                    /* VB vectors of columns at a time, held in registers: their chains over the
                     * 8 keys are independent (one column's chain alone waited on each FMA) */
                    for (int64_t c0 = 0; c0 < Dv; c0 += 8 * VB) {
                        v8 sv[VB] = {0};
                        for (int j = 0; j < VB && c0 + 8 * j < Dv; j++)
                            sv[j] = *(const v8 *)(const void *)(acc + c0 + 8 * j);
                        for (int t = 0; t < 8; t++)
                            for (int j = 0; j < VB && c0 + 8 * j < Dv; j++)
                                sv[j] = fma8((v8){p[t], p[t], p[t], p[t], p[t], p[t], p[t], p[t]},
                                             load8(vt[t] + c0 + 8 * j), sv[j]);
                        for (int j = 0; j < VB && c0 + 8 * j < Dv; j++)
                            *(v8 *)(void *)(acc + c0 + 8 * j) = sv[j];
                    }
                }
            }
        }
    }
}

/* How a call's work is cut: group gi (rows first[gi] .. first[gi + 1] - 1) has splits[gi]
 * splits (its longest row's own keys over SPLIT), tasks cu[gi] .. cu[gi + 1] - 1 of the
 * (group, split) list, whose group is task_group[t]; row b's partials start at split row_off[b]
 * of pm / pl ([splits, Hq]) and pacc ([splits, Hq, Dv]). heads: KV heads a task takes. */
struct plan {
    int64_t G, heads, tasks;
    int64_t *first, *cu, *task_group, *row_off;
    float *pm, *pl, *pacc;
};

/* malloc, or aligned_alloc with `align` (bytes a multiple of it) */
static void *must_alloc(size_t bytes, size_t align)
{
    void *ptr = align ? aligned_alloc(align, bytes) : malloc(bytes);
    if (ptr == NULL) { /* out of memory: said, not hidden behind a wrong result */
        fprintf(stderr, "attention_decode: cannot allocate %zu bytes of scratch\n", bytes);
        abort();
    }
    return ptr;
}

static void make_plan(struct plan *p, int64_t B, int64_t Hq, int64_t Hkv, int64_t Dv,
                     const int64_t *begin, const int64_t *end, const int64_t *group_cu, int64_t G)
{
    p->G = group_cu == NULL ? B : G;
    p->first = must_alloc(sizeof(int64_t) * (p->G + 1), 0);
    p->cu = must_alloc(sizeof(int64_t) * (p->G + 1), 0);
    p->row_off = must_alloc(sizeof(int64_t) * (B + 1), 0);
    p->cu[0] = 0;
    p->row_off[0] = 0;
    for (int64_t gi = 0; gi < p->G; gi++) {
        const int64_t f = group_cu ? group_cu[gi] : gi, l = group_cu ? group_cu[gi + 1] : gi + 1;
        int64_t n = 0;
        for (int64_t b = f; b < l; b++)
            n = end[b] - begin[b] > n ? end[b] - begin[b] : n;
        const int64_t ns = (n + SPLIT - 1) / SPLIT;
        p->first[gi] = f;
        p->cu[gi + 1] = p->cu[gi] + ns;
        for (int64_t b = f; b < l; b++)
            p->row_off[b + 1] = p->row_off[b] + ns;
    }
    p->first[p->G] = group_cu ? group_cu[p->G] : B;
    const int64_t splits = p->cu[p->G], rows = p->row_off[B];
    p->task_group = must_alloc(sizeof(int64_t) * (splits + 1), 0);
    p->pm = must_alloc(sizeof(float) * (rows * Hq + 1), 0);
    p->pl = must_alloc(sizeof(float) * (rows * Hq + 1), 0);
    p->pacc = must_alloc(sizeof(float) * (rows * Hq * Dv + 8), 32);
    for (int64_t gi = 0; gi < p->G; gi++)
        for (int64_t t = p->cu[gi]; t < p->cu[gi + 1]; t++)
            p->task_group[t] = gi;
    /* whole slot rows (every KV head) where the splits alone give the threads enough tasks;
     * else a KV head a task, as short contexts at small batches need to fill the threads */
#ifdef _OPENMP
    const int64_t nt = omp_get_max_threads();
#else
    const int64_t nt = 1;
#endif
    p->heads = splits >= 2 * nt ? Hkv : 1;
    p->tasks = splits * (Hkv / p->heads);
}

static void free_plan(struct plan *p)
{
    free(p->first);
    free(p->cu);
    free(p->task_group);
    free(p->row_off);
    free(p->pm);
    free(p->pl);
    free(p->pacc);
}

static inline __attribute__((always_inline)) void decode_team(
    int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,
    const float *q,
    const void *k_pool, const void *v_pool,
    const int64_t *table, int64_t table_stride,
    const int64_t *begin, const int64_t *end,
    const float *shared_o, const float *shared_lse, const int64_t *shared_row,
    const struct plan *p, float scale,
    float *out, const int bf)
{
    const int64_t r = Hq / Hkv, per = Hkv / p->heads;
    {
        float *scores = NULL; /* per-thread scratch, grown to the largest group met */
        /* 8 rows widened, 32-byte aligned (rows of a multiple of 8 floats): whole-vector stores */
        float *kbuf = must_alloc(sizeof(float) * 8 * (D > Dv ? D : Dv), 32);
        int64_t cap_rows = 0;
        uint16_t *qbf = NULL; /* the group's queries in bf16 (bf16 pools with AVX-512 BF16) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < p->tasks; task++) {
            const int64_t ts = task / per, h0 = task % per * p->heads, h1 = h0 + p->heads;
            const int64_t gi = p->task_group[ts], split = ts - p->cu[gi];
            const int64_t lo = split * SPLIT;
            for (int64_t b0 = p->first[gi]; b0 < p->first[gi + 1]; b0 += MAX_GROUP) {
                const int64_t left = p->first[gi + 1] - b0;
                struct rows g = {.nrow = left < MAX_GROUP ? left : MAX_GROUP};
                int64_t n = 0, longest = b0;
                for (int64_t i = 0; i < g.nrow; i++) {
                    const int64_t b = b0 + i, off = (p->row_off[b] + split) * Hq;
                    g.n[i] = end[b] - begin[b];
                    if (g.n[i] > n)
                        n = g.n[i], longest = b;
                    g.q[i] = q + b * Hq * D;
                    g.pm[i] = p->pm + off;
                    g.pl[i] = p->pl + off;
                    g.pacc[i] = p->pacc + off * Dv;
                }
                if (n <= lo) /* these rows end before the split (a group longer than MAX_GROUP) */
                    continue;
                const int64_t hi = lo + SPLIT < n ? lo + SPLIT : n;
                g.slots = table + longest * table_stride + begin[longest];
                if (g.nrow > cap_rows) {
                    cap_rows = g.nrow;
                    free(scores);
                    scores = must_alloc(sizeof(float) * cap_rows * p->heads * r * SPLIT, 0);
#if defined(__AVX512BF16__)
                    free(qbf);
                    qbf = bf ? must_alloc(sizeof(uint16_t) * cap_rows * Hq * D, 0) : NULL;
#endif
                }
#if defined(__AVX512BF16__)
                /* q holds bf16 values widened (the caller's q is bf16): the top half of each
                 * float is the bf16 itself */
                if (bf)
                    for (int64_t i = 0; i < g.nrow; i++)
                        for (int64_t k = 0; k < Hq * D; k++) {
                            uint32_t bits;
                            memcpy(&bits, g.q[i] + k, sizeof bits);
                            qbf[i * Hq * D + k] = (uint16_t)(bits >> 16);
                        }
#endif
#define ATTEND(rr, d, dv)                                                                  \
    attend_split(rr, Hkv, h0, h1, d, dv, &g, lo, hi, k_pool, v_pool, scale, scores, kbuf, qbf,   \
                 bf)
/* constant head sizes and query heads per KV head for the presets' shapes (r = 2, 4, 8:
 * LFM2, Qwen3.5, Qwen3-Next, Nemotron-H 8B; the loops unroll; each case is a copy of
 * attend_split, so the list is short: this file builds in ~36 s here, ~10 s with one copy per
 * head size, ~65 s with r = 1 and head size 32 added); other shapes take the generic copy,
 * where r = 3 and 5 (Granite-4.0-H, Nemotron-Nano-9B) go through kbuf: the same arithmetic
 * as the register path, and twice as fast as it is with r unknown at compile time */
#define ATTEND_R(d, dv)                                                                    \
    do {                                                                                   \
        if (r == 4)                                                                        \
            ATTEND(4, d, dv);                                                              \
        else if (r == 8)                                                                   \
            ATTEND(8, d, dv);                                                              \
        else if (r == 2)                                                                   \
            ATTEND(2, d, dv);                                                              \
        else                                                                               \
            ATTEND(r, D, Dv);                                                              \
    } while (0)
                if (D == 64 && Dv == 64)
                    ATTEND_R(64, 64);
                else if (D == 128 && Dv == 128)
                    ATTEND_R(128, 128);
                else if (D == 256 && Dv == 256)
                    ATTEND_R(256, 256);
                else
                    ATTEND(r, D, Dv);
#undef ATTEND_R
#undef ATTEND
            }
        }
        free(scores);
        free(kbuf);
        free(qbf);
        /* (the loop's barrier: every split done) each row and query head's splits merged in
         * order, then its shared piece: out = sum_s e^(m_s - M) acc_s + e^(lse - M) o, over
         * sum_s e^(m_s - M) l_s + e^(lse - M) */
#pragma omp for schedule(static)
        for (int64_t x = 0; x < B * Hq; x++) {
            const int64_t b = x / Hq, hq = x % Hq;
            const int64_t srow = shared_row == NULL ? -1 : shared_row[b];
            const int64_t ns = (end[b] - begin[b] + SPLIT - 1) / SPLIT; /* splits with its keys */
            const float *pm = p->pm + p->row_off[b] * Hq + hq;
            const float *pl = p->pl + p->row_off[b] * Hq + hq;
            const float *pa = p->pacc + (p->row_off[b] * Hq + hq) * Dv;
            float m = srow < 0 ? -INFINITY : shared_lse[srow * Hq + hq];
            for (int64_t s = 0; s < ns; s++)
                m = pm[s * Hq] > m ? pm[s * Hq] : m;
            float *restrict o = out + x * Dv;
            float total = 0.0f;
            for (int64_t d = 0; d < Dv; d++)
                o[d] = 0.0f;
            for (int64_t s = 0; s < ns; s++) {
                const float f = exp_poly(pm[s * Hq] - m);
                const float *restrict a = pa + s * Hq * Dv;
                total += f * pl[s * Hq];
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++)
                    o[d] += f * a[d];
            }
            if (srow >= 0) {
                const float w = exp_poly(shared_lse[srow * Hq + hq] - m);
                const float *restrict so = shared_o + (srow * Hq + hq) * Dv;
                total += w;
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++)
                    o[d] += w * so[d];
            }
            const float inv = 1.0f / total;
#pragma omp simd
            for (int64_t d = 0; d < Dv; d++)
                o[d] *= inv;
        }
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
        shared_lse, shared_row, &p, scale, out

/* The parallel region sits in each exported function, so that `bf` is a constant inside it and
 * pool8's branch folds away (with the region in the shared body, one outlined copy served both
 * dtypes: batch 1, 12 query heads over 200 bf16 keys of 64 took 47 us). */
void attention_decode(DECODE_ARGS)
{
    struct plan p;
    make_plan(&p, B, Hq, Hkv, Dv, begin, end, group_cu, G);
#pragma omp parallel
    decode_team(DECODE_PASS, 0);
    free_plan(&p);
}

void attention_decode_bf16(DECODE_ARGS)
{
    struct plan p;
    make_plan(&p, B, Hq, Hkv, Dv, begin, end, group_cu, G);
#pragma omp parallel
    decode_team(DECODE_PASS, 1);
    free_plan(&p);
}
