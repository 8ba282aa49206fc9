/* Mixture-of-experts data movement around the padded expert GEMMs (fp32, or bf16: the *_bf16
 * variants; moe_unpad_bf16 reads bf16 expert outputs and fp32 weights, sums in fp32 and writes
 * fp32, or bf16 rounded once when out_bf16 is set).
 *
 * moe_pad: pair p = t*K + k of token t and its k-th expert e = ids[p] goes to row pos[p] of
 * expert e's block in buf ([E, T, H]: room for every token in every block), pos[p] being its
 * rank among e's pairs in pair order. Rows from an expert's count up to cap (the largest count,
 * returned) are zeroed; the caller multiplies buf[:, :cap]. Returns -1 if an id is out of range
 * or an expert gets more than T pairs (a token listing it twice), rather than overrun buf.
 *
 * moe_unpad: out[t] = sum_k weights[t, k] * y[ids[t, k], pos[t*K + k]], y's blocks
 * block_stride floats apart and rows of H.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

/* moe_pad over elements of esize bytes (rows are copied, never computed on) */
static int64_t pad(
    int64_t T, int64_t K, int64_t E, int64_t H, int64_t esize,
    const char *x, int64_t x_stride,
    const int64_t *ids,
    char *buf, int64_t *pos)
{
    int64_t *count = calloc((size_t)E, sizeof(int64_t));
    if (count == NULL)
        return -1;
    for (int64_t p = 0; p < T * K; p++) {
        const int64_t e = ids[p];
        if (e < 0 || e >= E || count[e] == T) { /* a block holds T rows: ids repeat in a row */
            free(count);
            return -1;
        }
        pos[p] = count[e]++;
    }
    int64_t cap = 0;
    for (int64_t e = 0; e < E; e++)
        cap = count[e] > cap ? count[e] : cap;
#pragma omp parallel for schedule(static) if (T * K * H > 65536)
    for (int64_t p = 0; p < T * K; p++)
        memcpy(buf + (ids[p] * T + pos[p]) * H * esize, x + (p / K) * x_stride * esize,
               (size_t)(esize * H));
    for (int64_t e = 0; e < E; e++)
        memset(buf + (e * T + count[e]) * H * esize, 0, (size_t)(esize * H * (cap - count[e])));
    free(count);
    return cap;
}

int64_t moe_pad(
    int64_t T, int64_t K, int64_t E, int64_t H,
    const float *x, int64_t x_stride,
    const int64_t *ids,
    float *buf, int64_t *pos)
{
    return pad(T, K, E, H, sizeof(float), (const char *)x, x_stride, ids, (char *)buf, pos);
}

int64_t moe_pad_bf16(
    int64_t T, int64_t K, int64_t E, int64_t H,
    const uint16_t *x, int64_t x_stride,
    const int64_t *ids,
    uint16_t *buf, int64_t *pos)
{
    return pad(T, K, E, H, sizeof(uint16_t), (const char *)x, x_stride, ids, (char *)buf, pos);
}

/* One token of moe_unpad for expert outputs of either dtype (in_bf) into fp32 or bf16
 * (out_bf): the sum accumulates in fp32 in acc (the output row itself when that is fp32). The
 * exported functions own the parallel loops, so each OpenMP region has the dtypes constant. */
static inline __attribute__((always_inline)) void unpad_token(
    int64_t t, int64_t K, int64_t H, const void *y, int64_t block_stride, const int64_t *ids,
    const int64_t *pos, const float *weights, float *acc, void *out, const int in_bf,
    const int out_bf)
{
    for (int64_t k = 0; k < K; k++) {
        const int64_t p = t * K + k;
        const float w = weights[p];
        const int64_t row = ids[p] * block_stride + pos[p] * H;
        if (k == 0) {
#pragma omp simd
            for (int64_t d = 0; d < H; d++)
                acc[d] = w * ld(y, row + d, in_bf);
        } else {
#pragma omp simd
            for (int64_t d = 0; d < H; d++)
                acc[d] += w * ld(y, row + d, in_bf);
        }
    }
    if (out_bf) {
#pragma omp simd
        for (int64_t d = 0; d < H; d++)
            st(out, t * H + d, acc[d], 1);
    }
}

void moe_unpad(
    int64_t T, int64_t K, int64_t H,
    const float *y, int64_t block_stride,
    const int64_t *ids, const int64_t *pos, const float *weights,
    float *out)
{
#pragma omp parallel for schedule(static) if (T * K * H > 65536)
    for (int64_t t = 0; t < T; t++)
        unpad_token(t, K, H, y, block_stride, ids, pos, weights, out + t * H, out, 0, 0);
}

void moe_unpad_bf16(
    int64_t T, int64_t K, int64_t H,
    const uint16_t *y, int64_t block_stride,
    const int64_t *ids, const int64_t *pos, const float *weights,
    void *out, int out_bf16)
{
    if (!out_bf16) {
#pragma omp parallel for schedule(static) if (T * K * H > 65536)
        for (int64_t t = 0; t < T; t++)
            unpad_token(t, K, H, y, block_stride, ids, pos, weights, (float *)out + t * H, out,
                        1, 0);
        return;
    }
#pragma omp parallel if (T * K * H > 65536)
    {
        float *acc = malloc(sizeof(float) * (size_t)H);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            unpad_token(t, K, H, y, block_stride, ids, pos, weights, acc, out, 1, 1);
        free(acc);
    }
}
