/* Prefill attention over pooled bf16 KV with AVX-512 BF16 dot products.
 *
 * Request p has queries at token rows cu[p] .. cu[p+1]-1 of q ([T, Hq, D], row stride
 * q_stride), at absolute positions prefix[p] .. : the query at position t attends the keys at
 * slots[kv_cu[p] .. kv_cu[p] + t] of the K/V pools ([size, Hkv, D] and [size, Hkv, Dv], bf16),
 * causally. Grouped heads: query head g*r + i reads KV head g (r = Hq / Hkv). The result goes
 * to out ([T, Hq, Dv], bf16, row stride Dv * Hq), rounded once.
 *
 * The requests are taken one after another. A request's keys are first gathered from the pools
 * per KV head (every thread a share, into buffers the caller provides: a torch allocation that
 * fails raises, where an abort here would take the server down): the keys as rows, the values interleaved as pairs of rows
 * (v[j][c], v[j+1][c]), so its tasks stream them in order (read in place, the pool rows at
 * random slots left the loads waiting on memory). A task is then one KV head of up to QB query
 * rows (a row: one query head of one token; the r heads of a token are consecutive rows, so
 * they share every key read). Query rows are the vector lanes: the scores of a key block are
 * a [keys, rows] tile, and the online softmax (running maximum, sum, rescale) works lane by
 * lane with no horizontal reduction. Per block of KB keys:
 *   scores:  s[j][i] = sum_d q[i][d] k[j][d], vdpbf16ps on the query packed as (d, d+1) pairs
 *            per row (once per task) and each key's pair broadcast from its row;
 *   softmax: keys past a row's own position masked to -inf, the maximum and sum updated, the
 *            weights e^(s - m) rounded to bf16 and packed as (key j, key j+1) pairs per row;
 *   values:  o[c][i] = o[c][i] * alpha[i] + sum_j p[i][j] v[j][c], vdpbf16ps on those weight
 *            pairs and the value pairs.
 * Scores, maximum and sums are fp32; the weights meet the values in bf16 (as ATen's flash
 * kernel does for bf16 inputs), and the sum that normalises them adds the same rounded weights.
 *
 * Each lane's arithmetic is its own, and the key blocks start at multiples of KB from the
 * request's first key: a query's result depends on its keys and its position alone, never on
 * which other queries share its task, the chunk it came in, the thread count or the schedule
 * (a block a row cannot see changes none of its bits: its weights there are exactly 0 and its
 * rescale factor exactly 1). Cache on or off, a prompt's attention is the same bits.
 *
 * Built only where the compiler targets AVX-512 BF16 (attention_prefill_supported() says
 * whether); elsewhere the caller keeps ATen's flash kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_PREFILL 1
#else
#define HAVE_PREFILL 0
#endif

int attention_prefill_supported(void) { return HAVE_PREFILL; }

#define KB 64 /* keys of a softmax block */

/* KB: the caller's gather buffers hold each request's keys per KV head rounded up to it (the
 * longest request's: Lp), keys [Hkv][Lp][D] bf16 and values [Hkv][Lp/2][Dv] as bf16 pairs */
int attention_prefill_block(void) { return KB; }

#if HAVE_PREFILL

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define QB 64 /* query rows of a task: four vectors of 16 lanes */
#define KT 4  /* keys of a score tile (KT x 4 accumulators) */
#define CT 4  /* value columns of an output tile (CT x 4 accumulators) */

struct task {
    int64_t p, g, row0, rows, cost;
};

struct args {
    const int64_t *cu, *prefix, *kv_cu, *slots;
    int64_t Hq, Hkv, D, Dv, q_stride;
    const uint16_t *q, *k_pool, *v_pool;
    float c; /* scale * log2(e): scores in base 2 */
    uint16_t *out;
    /* the current request's keys gathered per KV head (Lp of them, a multiple of KB, the
     * ones past its last key zero): keys [Hkv][Lp][D], values [Hkv][Lp/2][Dv] as pairs */
    uint16_t *keys;
    uint32_t *vals;
    int64_t Lp;
};

/* per-thread scratch, 64-byte aligned */
struct scratch {
    uint32_t *qp; /* [D/2][QB]: each row's (d, d+1) pairs, rows as lanes */
    float *s;     /* [KB][QB] scores (base 2, scaled) */
    uint32_t *pp; /* [KB/2][QB]: weights as (key j, key j+1) bf16 pairs */
    float *o;     /* [Dv][QB] output accumulators */
    uint16_t *ob; /* [Dv][QB] the finished rows in bf16, before they are transposed out */
};

/* 2^t for t <= 0 (or -inf: 0): 2^n 2^f, n = round(t), |f| <= 1/2, 2^f by its Taylor series to
 * degree 7 (relative error ~1e-9, below fp32 rounding); below -200 the result is 0. */
ALWAYS_INLINE __m512 exp2_16(__m512 t)
{
    t = _mm512_max_ps(t, _mm512_set1_ps(-200.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5252733804e-5f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393e-4f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#define BH(x) ((__m512bh)(x))
/* keep a loaded vector in a register: GCC otherwise reloads it for each multiply-add that
 * uses it (16 loads for the 16 of a tile instead of 4, the loads then bounding the loop) */
#define PIN(x) __asm__("" : "+v"(x))

#define BH(x) ((__m512bh)(x))
/* keep a loaded vector in a register: GCC otherwise reloads it for each multiply-add that
 * uses it (16 loads for the 16 of a tile instead of 4, the loads then bounding the loop) */
#define PIN(x) __asm__("" : "+v"(x))

/* scores of KT keys (rows of Dp 32-bit pairs from k) against nv vectors of query rows */
ALWAYS_INLINE void score_tile(const uint32_t *qp, const uint32_t *k, int64_t Dp, float c,
                              float *s, const int nv)
{
    __m512 acc[KT][4];
#pragma GCC unroll 4
    for (int j = 0; j < KT; j++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++)
            acc[j][v] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < Dp; dp++) {
        __m512i qv[4];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) {
            qv[v] = _mm512_load_si512((const void *)(qp + dp * QB + v * 16));
            PIN(qv[v]);
        }
#pragma GCC unroll 4
        for (int j = 0; j < KT; j++) {
            const __m512i kb = _mm512_set1_epi32((int)k[j * Dp + dp]);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++)
                acc[j][v] = _mm512_dpbf16_ps(acc[j][v], BH(qv[v]), BH(kb));
        }
    }
    const __m512 cv = _mm512_set1_ps(c);
#pragma GCC unroll 4
    for (int j = 0; j < KT; j++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++)
            _mm512_store_ps(s + j * QB + v * 16, _mm512_mul_ps(acc[j][v], cv));
}

/* o[c .. c+CT][rows] = o * alpha + sum over np key pairs of weight pair . value pair */
ALWAYS_INLINE void value_tile(float *o, const uint32_t *vp, int64_t Dv, const uint32_t *pp,
                              int64_t np, const __m512 *alpha, const int nv)
{
    __m512 acc[CT][4];
#pragma GCC unroll 4
    for (int t = 0; t < CT; t++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++)
            acc[t][v] = _mm512_mul_ps(_mm512_load_ps(o + t * QB + v * 16), alpha[v]);
    for (int64_t jp = 0; jp < np; jp++) {
        __m512i pv[4];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) {
            pv[v] = _mm512_load_si512((const void *)(pp + jp * QB + v * 16));
            PIN(pv[v]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < CT; t++) {
            const __m512i vb = _mm512_set1_epi32((int)vp[jp * Dv + t]);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++)
                acc[t][v] = _mm512_dpbf16_ps(acc[t][v], BH(pv[v]), BH(vb));
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < CT; t++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++)
            _mm512_store_ps(o + t * QB + v * 16, acc[t][v]);
}

/* value rows a and b (Dv bf16 each, Dv a multiple of 16) as Dv (a[c], b[c]) pairs: lanes 2i
 * and 2i+1 of the first half of a 32-column step are a[i], b[i], of the second a[16+i], b[16+i] */
static const uint16_t PAIR_LO[32] __attribute__((aligned(64))) = {
    0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t PAIR_HI[32] __attribute__((aligned(64))) = {
    16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

ALWAYS_INLINE void pair_rows(const uint16_t *a, const uint16_t *b, int64_t Dv, uint32_t *dst)
{
    const __m512i lo = _mm512_load_si512((const void *)PAIR_LO);
    const __m512i hi = _mm512_load_si512((const void *)PAIR_HI);
    int64_t c = 0;
    for (; c + 32 <= Dv; c += 32) {
        const __m512i x = _mm512_loadu_si512((const void *)(a + c));
        const __m512i y = _mm512_loadu_si512((const void *)(b + c));
        _mm512_store_si512((void *)(dst + c), _mm512_permutex2var_epi16(x, lo, y));
        _mm512_store_si512((void *)(dst + c + 16), _mm512_permutex2var_epi16(x, hi, y));
    }
    if (c < Dv) { /* 16 columns left */
        const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + c)));
        const __m512i y = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + c)));
        _mm512_store_si512((void *)(dst + c), _mm512_permutex2var_epi16(x, lo, y));
    }
}

/* request p's keys and values into a->keys / a->vals (every thread takes a share) */
static void gather_keys(const struct args *a, int64_t p, const uint16_t *zeros)
{
    const int64_t D = a->D, Dv = a->Dv, Hkv = a->Hkv, Lp = a->Lp;
    const int64_t L = a->prefix[p] + a->cu[p + 1] - a->cu[p];
    const int64_t *slots = a->slots + a->kv_cu[p];
    const int64_t nb = (L + KB - 1) / KB;
#pragma omp for schedule(static)
    for (int64_t x = 0; x < Hkv * nb; x++) {
        const int64_t g = x / nb, j0 = x % nb * KB;
        for (int64_t j = j0; j < j0 + KB; j += 2) {
            const uint16_t *k0 = j < L ? a->k_pool + (slots[j] * Hkv + g) * D : zeros;
            const uint16_t *k1 = j + 1 < L ? a->k_pool + (slots[j + 1] * Hkv + g) * D : zeros;
            const uint16_t *v0 = j < L ? a->v_pool + (slots[j] * Hkv + g) * Dv : zeros;
            const uint16_t *v1 = j + 1 < L ? a->v_pool + (slots[j + 1] * Hkv + g) * Dv : zeros;
            memcpy(a->keys + (g * Lp + j) * D, k0, sizeof(uint16_t) * D);
            memcpy(a->keys + (g * Lp + j + 1) * D, k1, sizeof(uint16_t) * D);
            pair_rows(v0, v1, Dv, a->vals + (g * Lp + j) / 2 * Dv);
        }
    }
}

ALWAYS_INLINE void run_task(const struct args *a, const struct task *t, struct scratch *w,
                            const int nv)
{
    const int64_t D = a->D, Dv = a->Dv, Dp = D / 2, g = t->g;
    const int64_t r = a->Hq / a->Hkv, first = a->cu[t->p], pre = a->prefix[t->p];
    const uint32_t *keys = (const uint32_t *)(a->keys + g * a->Lp * D);
    const uint32_t *vals = a->vals + g * a->Lp / 2 * Dv;
    /* the rows' queries as pairs (zero for the lanes past the last row) and how many keys
     * each row sees; lanes past the last row see what the last row sees */
    int32_t lim[QB];
    for (int64_t i = 0; i < QB; i++) {
        const int64_t row = t->row0 + (i < t->rows ? i : t->rows - 1);
        lim[i] = (int32_t)(pre + row / r + 1);
        if (i >= t->rows) {
            for (int64_t dp = 0; dp < Dp; dp++)
                w->qp[dp * QB + i] = 0;
            continue;
        }
        const uint32_t *src =
            (const uint32_t *)(a->q + (first + row / r) * a->q_stride + (g * r + row % r) * D);
        for (int64_t dp = 0; dp < Dp; dp++)
            w->qp[dp * QB + i] = src[dp];
    }
    const int64_t kend = lim[t->rows - 1], kmin = lim[0];
    __m512i limv[4];
    __m512 m[4], l[4], alpha[4];
    for (int v = 0; v < nv; v++) {
        limv[v] = _mm512_loadu_si512((const void *)(lim + v * 16));
        m[v] = _mm512_set1_ps(-INFINITY);
        l[v] = _mm512_setzero_ps();
    }
    memset(w->o, 0, sizeof(float) * Dv * QB);
    for (int64_t j0 = 0; j0 < kend; j0 += KB) {
        const int64_t kb = kend - j0 < KB ? kend - j0 : KB;
        const int64_t kbr = (kb + KT - 1) / KT * KT; /* keys past kb: zero rows, masked */
        for (int64_t j = 0; j < kbr; j += KT)
            score_tile(w->qp, keys + (j0 + j) * Dp, Dp, a->c, w->s + j * QB, nv);
        if (j0 + kbr > kmin) /* some row does not see every key of the block */
            for (int64_t j = 0; j < kbr; j++) {
                const __m512i jv = _mm512_set1_epi32((int)(j0 + j));
                for (int v = 0; v < nv; v++) {
                    float *sv = w->s + j * QB + v * 16;
                    const __mmask16 seen = _mm512_cmplt_epi32_mask(jv, limv[v]);
                    _mm512_store_ps(sv, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen,
                                                           _mm512_load_ps(sv)));
                }
            }
        for (int v = 0; v < nv; v++) {
            __m512 top = m[v];
            for (int64_t j = 0; j < kbr; j++)
                top = _mm512_max_ps(top, _mm512_load_ps(w->s + j * QB + v * 16));
            alpha[v] = exp2_16(_mm512_sub_ps(m[v], top));
            l[v] = _mm512_mul_ps(l[v], alpha[v]);
            m[v] = top;
        }
        /* weights as bf16 pairs; the sum adds the rounded weights the values will meet */
        for (int64_t jp = 0; jp < kbr / 2; jp++)
            for (int v = 0; v < nv; v++) {
                const __m512 p0 =
                    exp2_16(_mm512_sub_ps(_mm512_load_ps(w->s + 2 * jp * QB + v * 16), m[v]));
                const __m512 p1 = exp2_16(
                    _mm512_sub_ps(_mm512_load_ps(w->s + (2 * jp + 1) * QB + v * 16), m[v]));
                const __m256i b0 = (__m256i)_mm512_cvtneps_pbh(p0);
                const __m256i b1 = (__m256i)_mm512_cvtneps_pbh(p1);
                const __m512i w0 = _mm512_cvtepu16_epi32(b0), w1 = _mm512_cvtepu16_epi32(b1);
                l[v] = _mm512_add_ps(l[v], _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)));
                l[v] = _mm512_add_ps(l[v], _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)));
                _mm512_store_si512((void *)(w->pp + jp * QB + v * 16),
                                   _mm512_or_si512(w0, _mm512_slli_epi32(w1, 16)));
            }
        for (int64_t c = 0; c < Dv; c += CT)
            value_tile(w->o + c * QB, vals + j0 / 2 * Dv + c, Dv, w->pp, kbr / 2, alpha, nv);
    }
    /* normalise, round to bf16 ([Dv][rows]), then each row out */
    for (int v = 0; v < nv; v++) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l[v]);
        for (int64_t c = 0; c < Dv; c++) {
            const __m512 x = _mm512_mul_ps(_mm512_load_ps(w->o + c * QB + v * 16), inv);
            _mm256_store_si256((__m256i *)(w->ob + c * QB + v * 16),
                               (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
    for (int64_t i = 0; i < t->rows; i++) {
        const int64_t row = t->row0 + i;
        uint16_t *dst = a->out + (first + row / r) * a->Hq * Dv + (g * r + row % r) * Dv;
        for (int64_t c = 0; c < Dv; c++)
            dst[c] = w->ob[c * QB + i];
    }
}

static void *alloc64(size_t bytes)
{
    void *ptr = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (ptr == NULL) { /* out of memory: said, not hidden behind a wrong result */
        fprintf(stderr, "attention_prefill: cannot allocate %zu bytes of scratch\n", bytes);
        abort();
    }
    return ptr;
}

/* a request's tasks by KV head, then the largest first (the last ones taken are short): the
 * threads then walk the same head's keys at once, which the cache shares (a 512-token chunk
 * over 16k keys, 8 / 2 heads of 256: 230 -> 193 ms against the largest first alone, where
 * the two threads took the two heads) */
static int by_cost(const void *x, const void *y)
{
    const struct task *a = x, *b = y;
    if (a->g != b->g)
        return a->g < b->g ? -1 : 1;
    return a->cost < b->cost ? 1 : a->cost > b->cost ? -1 : 0;
}

void attention_prefill_bf16(int64_t P, const int64_t *cu, const int64_t *prefix,
                            const int64_t *kv_cu, const int64_t *slots, int64_t Hq, int64_t Hkv,
                            int64_t D, int64_t Dv, const uint16_t *q, int64_t q_stride,
                            const uint16_t *k_pool, const uint16_t *v_pool, float scale,
                            uint16_t *keys, uint32_t *vals, int64_t Lp, uint16_t *out)
{
    const int64_t r = Hq / Hkv;
    /* tasks by request (task_cu), each request's ordered by by_cost */
    int64_t n = 0;
    for (int64_t p = 0; p < P; p++) {
        n += Hkv * ((cu[p + 1] - cu[p]) * r + QB - 1) / QB;
        if (prefix[p] + cu[p + 1] - cu[p] > Lp || Lp % KB) { /* the caller's buffers: too small */
            fprintf(stderr, "attention_prefill_bf16: gather buffers of %lld keys, request %lld "
                    "has %lld\n", (long long)Lp, (long long)p,
                    (long long)(prefix[p] + cu[p + 1] - cu[p]));
            abort();
        }
    }
    struct task *tasks = alloc64(sizeof(struct task) * (size_t)(n + 1));
    int64_t *task_cu = alloc64(sizeof(int64_t) * (size_t)(P + 1));
    n = 0;
    for (int64_t p = 0; p < P; p++) {
        task_cu[p] = n;
        const int64_t rows = (cu[p + 1] - cu[p]) * r;
        for (int64_t g = 0; g < Hkv; g++)
            for (int64_t row0 = 0; row0 < rows; row0 += QB) {
                const int64_t k = rows - row0 < QB ? rows - row0 : QB;
                const int64_t keys = prefix[p] + (row0 + k - 1) / r + 1;
                tasks[n++] = (struct task){p, g, row0, k, k * keys};
            }
        qsort(tasks + task_cu[p], (size_t)(n - task_cu[p]), sizeof *tasks, by_cost);
    }
    task_cu[P] = n;
    uint16_t *zeros = calloc((size_t)(D > Dv ? D : Dv), sizeof(uint16_t));
    const struct args a = {cu, prefix, kv_cu, slots, Hq, Hkv, D, Dv, q_stride, q, k_pool, v_pool,
                           scale * 1.4426950408889634f, out, keys, vals, Lp};
    if (zeros == NULL)
        abort();
#pragma omp parallel
    {
        struct scratch w = {
            alloc64(sizeof(uint32_t) * (size_t)(D / 2 * QB)),
            alloc64(sizeof(float) * KB * QB),
            alloc64(sizeof(uint32_t) * KB / 2 * QB),
            alloc64(sizeof(float) * (size_t)(Dv * QB)),
            alloc64(sizeof(uint16_t) * (size_t)(Dv * QB)),
        };
        for (int64_t p = 0; p < P; p++) { /* every thread walks the requests in step */
            gather_keys(&a, p, zeros);
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = task_cu[p]; i < task_cu[p + 1]; i++) {
                const struct task *t = &tasks[i];
                switch ((t->rows + 15) / 16) { /* row vectors, a constant in each case */
                case 1: run_task(&a, t, &w, 1); break;
                case 2: run_task(&a, t, &w, 2); break;
                case 3: run_task(&a, t, &w, 3); break;
                default: run_task(&a, t, &w, 4); break;
                }
            }
        }
        free(w.qp), free(w.s), free(w.pp), free(w.o), free(w.ob);
    }
    free(zeros), free(task_cu), free(tasks);
}

#else /* no AVX-512 BF16: never called (attention_prefill_supported() is 0) */

void attention_prefill_bf16(int64_t P, const int64_t *cu, const int64_t *prefix,
                            const int64_t *kv_cu, const int64_t *slots, int64_t Hq, int64_t Hkv,
                            int64_t D, int64_t Dv, const uint16_t *q, int64_t q_stride,
                            const uint16_t *k_pool, const uint16_t *v_pool, float scale,
                            uint16_t *keys, uint32_t *vals, int64_t Lp, uint16_t *out)
{
    (void)P, (void)cu, (void)prefix, (void)kv_cu, (void)slots, (void)Hq, (void)Hkv, (void)D;
    (void)Dv, (void)q, (void)q_stride, (void)k_pool, (void)v_pool, (void)scale, (void)out;
    (void)keys, (void)vals, (void)Lp;
    fprintf(stderr, "attention_prefill_bf16: built without AVX-512 BF16\n");
    abort();
}

#endif
