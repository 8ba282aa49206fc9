/* The causal depthwise conv of S varlen prefill segments, carrying each segment's conv state.
 *
 * Segment s is rows cu[s] .. cu[s+1] - 1 of x ([T][C], rows strided, channels dense); its state
 * conv_pool[slots[s]] ([C][K-1]: the last K-1 inputs, oldest first) is the window before its
 * first token and is replaced by the window after its last; snapshot k (of segment snap_seq[k],
 * sorted by segment, then offset) gets the window after snap_off[k] tokens in
 * conv_pool[snap_slot[k]]. out[t][c] = act(bias[c] + sum_j w[c][j] window_t[j]) ([T][C], dense),
 * the sum in fp32 and, in bf16, rounded once before the activation and once after it, as the
 * torch reference (F.conv1d, then F.silu) holds them. act: SiLU or none.
 *
 * One pass over x: the reference concatenates states and inputs, convolves, gathers the rows of
 * each segment and then the states, four copies of the activations. Tasks are (segment, block
 * of 32 channels); with AVX-512 a bf16 block runs as two vectors of 16 channels whose windows
 * stay in registers from token to token.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "conv_window.h"
#include "vec_math.h"

#define CH 32 /* channels a task carries (one 64-byte line of bf16) */
#define KMAX 8 /* widest kernel the vector paths hold in registers */
#define VL CH  /* conv_lanes' widest lane count */

/* Channels c0 .. c1 - 1 of segment s, one channel at a time. */
static inline __attribute__((always_inline)) void conv_scalar(
    int64_t s, int64_t c0, int64_t c1, const int64_t *cu, const int64_t *slots, const void *x,
    int64_t xs, void *pool, const void *w, const void *bias, void *out, int64_t C, int64_t K,
    int silu, int64_t NS, const int64_t *snap_seq, const int64_t *snap_off,
    const int64_t *snap_slot, const int bf)
{
    const int64_t k1 = K - 1;
    for (int64_t c = c0; c < c1; c++) {
        float win[64], wc[64]; /* K <= 64 (checked by the caller) */
        for (int64_t j = 0; j < K; j++)
            wc[j] = ld(w, c * K + j, bf);
        for (int64_t j = 0; j < k1; j++)
            win[j] = ld(pool, (slots[s] * C + c) * k1 + j, bf);
        const float b = bias ? ld(bias, c, bf) : 0.0f;
        int64_t t = cu[s];
        for (int64_t k = 0; k <= NS; k++) {
            const int64_t stop = scan_piece(s, &k, cu, NS, snap_seq, snap_off);
            for (; t < stop; t++) {
                const float xt = ld(x, t * xs + c, bf);
                float acc = b;
                for (int64_t j = 0; j < k1; j++)
                    acc += wc[j] * win[j];
                acc = rnd(acc + wc[k1] * xt, bf);
                for (int64_t j = 0; j + 1 < k1; j++)
                    win[j] = win[j + 1];
                if (k1 > 0)
                    win[k1 - 1] = xt;
                st(out, t * C + c, silu ? acc / (1.0f + exp_poly(-acc)) : acc, bf);
            }
            const int64_t dst = k < NS ? snap_slot[k] : slots[s];
            for (int64_t j = 0; j < k1; j++)
                st(pool, (dst * C + c) * k1 + j, win[j], bf);
        }
    }
}

#if HAVE_CONV_WINDOW
/* 16 bf16 channels c .. c + 15 of segment s, the window in registers. */
static inline __attribute__((always_inline)) void conv_vec16(
    int64_t s, int64_t c, const int64_t *cu, const int64_t *slots, const uint16_t *x,
    int64_t xs, uint16_t *pool, const uint16_t *w, const uint16_t *bias, uint16_t *out,
    int64_t C, int64_t K, int silu, int64_t NS, const int64_t *snap_seq,
    const int64_t *snap_off, const int64_t *snap_slot)
{
    const int64_t k1 = K - 1;
    float tmp[16];
    __m512 win[KMAX], wv[KMAX];
    for (int64_t j = 0; j < K; j++) {
        for (int i = 0; i < 16; i++)
            tmp[i] = bf16_to_f32(w[(c + i) * K + j]);
        wv[j] = _mm512_loadu_ps(tmp);
    }
    for (int64_t j = 0; j < k1; j++) {
        for (int i = 0; i < 16; i++)
            tmp[i] = bf16_to_f32(pool[(slots[s] * C + c + i) * k1 + j]);
        win[j] = _mm512_loadu_ps(tmp);
    }
    const __m512 b = bias ? cw_load_bf16(bias + c) : _mm512_setzero_ps();
    int64_t t = cu[s];
    for (int64_t k = 0; k <= NS; k++) {
        const int64_t stop = scan_piece(s, &k, cu, NS, snap_seq, snap_off);
        for (; t < stop; t++) {
            const __m512 xt = cw_load_bf16(x + t * xs + c);
            __m512 acc = b;
            for (int64_t j = 0; j < k1; j++)
                acc = _mm512_add_ps(acc, _mm512_mul_ps(wv[j], win[j]));
            acc = cw_round_bf16(_mm512_add_ps(acc, _mm512_mul_ps(wv[k1], xt)));
            for (int64_t j = 0; j + 1 < k1; j++)
                win[j] = win[j + 1];
            if (k1 > 0)
                win[k1 - 1] = xt;
            if (silu)
                acc = cw_silu(acc);
            _mm256_storeu_si256((__m256i *)(out + t * C + c), cw_ps_to_bf16(acc));
        }
        const int64_t dst = k < NS ? snap_slot[k] : slots[s];
        for (int64_t j = 0; j < k1; j++) {
            _mm512_storeu_ps(tmp, win[j]);
            for (int i = 0; i < 16; i++)
                pool[(dst * C + c + i) * k1 + j] = f32_to_bf16(tmp[i]);
        }
    }
}
#endif

/* N channels c .. c + N - 1 of segment s (N a constant <= VL; any dtype, any CPU), each step's
 * arithmetic in loops over the N lanes, which vectorise, and a token's N inputs read together:
 * conv_scalar goes one channel at a time down the tokens, a cache line (C apart) for every
 * token of every channel. On an AVX2 EPYC a Qwen3.5-0.8B-shaped Gated DeltaNet layer's conv
 * over 2,048 bf16 tokens took 533 ms that way, 127 ms at 8 lanes, 56 ms at 32 (a line of
 * bf16). The same operations in the same order as conv_scalar: the same bits. */
static inline __attribute__((always_inline)) void conv_lanes(
    const int N, int64_t s, int64_t c, const int64_t *cu, const int64_t *slots, const void *x,
    int64_t xs, void *pool, const void *w, const void *bias, void *out, int64_t C, int64_t K,
    int silu, int64_t NS, const int64_t *snap_seq, const int64_t *snap_off,
    const int64_t *snap_slot, const int bf)
{
    const int64_t k1 = K - 1;
    float win[KMAX][VL], wv[KMAX][VL], b[VL];
    for (int64_t j = 0; j < K; j++)
        for (int i = 0; i < N; i++)
            wv[j][i] = ld(w, (c + i) * K + j, bf);
    for (int64_t j = 0; j < k1; j++)
        for (int i = 0; i < N; i++)
            win[j][i] = ld(pool, (slots[s] * C + c + i) * k1 + j, bf);
    for (int i = 0; i < N; i++)
        b[i] = bias ? ld(bias, c + i, bf) : 0.0f;
    int64_t t = cu[s];
    for (int64_t k = 0; k <= NS; k++) {
        const int64_t stop = scan_piece(s, &k, cu, NS, snap_seq, snap_off);
        for (; t < stop; t++) {
            float acc[VL], xt[VL];
#pragma omp simd
            for (int i = 0; i < N; i++) {
                xt[i] = ld(x, t * xs + c + i, bf);
                acc[i] = b[i];
            }
            for (int64_t j = 0; j < k1; j++)
#pragma omp simd
                for (int i = 0; i < N; i++)
                    acc[i] += wv[j][i] * win[j][i];
#pragma omp simd
            for (int i = 0; i < N; i++)
                acc[i] = rnd(acc[i] + wv[k1][i] * xt[i], bf);
            for (int64_t j = 0; j + 1 < k1; j++)
                for (int i = 0; i < N; i++)
                    win[j][i] = win[j + 1][i];
            if (k1 > 0)
                for (int i = 0; i < N; i++)
                    win[k1 - 1][i] = xt[i];
            if (silu) {
#pragma omp simd
                for (int i = 0; i < N; i++)
                    st(out, t * C + c + i, acc[i] / (1.0f + exp_poly(-acc[i])), bf);
            } else {
#pragma omp simd
                for (int i = 0; i < N; i++)
                    st(out, t * C + c + i, acc[i], bf);
            }
        }
        const int64_t dst = k < NS ? snap_slot[k] : slots[s];
        for (int64_t j = 0; j < k1; j++)
            for (int i = 0; i < N; i++)
                st(pool, (dst * C + c + i) * k1 + j, win[j][i], bf);
    }
}

#define CONV_PREFILL_ARGS                                                                    \
    int64_t S, const int64_t *cu, const int64_t *slots, const void *x, int64_t xs,          \
        void *pool, const void *w, const void *bias, void *out, int64_t C, int64_t K,       \
        int silu, int64_t NS, const int64_t *snap_seq, const int64_t *snap_off,             \
        const int64_t *snap_slot
#define CONV_PASS                                                                            \
    cu, slots, x, xs, pool, w, bias, out, C, K, silu, NS, snap_seq, snap_off, snap_slot

/* Returns 0, or -1 (nothing done) for a kernel wider than 64. */
#define CONV_PREFILL(bf)                                                                     \
    do {                                                                                     \
        if (K < 1 || K > 64)                                                                 \
            return -1;                                                                       \
        const int64_t blocks = (C + CH - 1) / CH;                                            \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 4)")                        \
        for (int64_t s = 0; s < S; s++)                                                      \
            for (int64_t blk = 0; blk < blocks; blk++) {                                     \
                const int64_t c1 = (blk + 1) * CH < C ? (blk + 1) * CH : C;                   \
                int64_t c = blk * CH;                                                        \
                VEC_CHANNELS(bf);                                                            \
                conv_scalar(s, c, c1, CONV_PASS, bf);                                        \
            }                                                                                \
        return 0;                                                                            \
    } while (0)

#if HAVE_CONV_WINDOW
#define VEC16_CHANNELS(bf)                                                                   \
    if (bf && K <= KMAX)                                                                     \
        for (; c + 16 <= c1; c += 16)                                                        \
            conv_vec16(s, c, cu, slots, x, xs, pool, w, bias, out, C, K, silu, NS, snap_seq, \
                       snap_off, snap_slot)
#else
#define VEC16_CHANNELS(bf) (void)0
#endif
#define VEC_CHANNELS(bf)                                                                     \
    VEC16_CHANNELS(bf);                                                                      \
    if (K <= KMAX) {                                                                         \
        for (; c + CH <= c1; c += CH) /* a whole block, then 8 channels at a time */         \
            conv_lanes(CH, s, c, CONV_PASS, bf);                                             \
        for (; c + 8 <= c1; c += 8)                                                          \
            conv_lanes(8, s, c, CONV_PASS, bf);                                              \
    }

int conv1d_prefill(CONV_PREFILL_ARGS) { CONV_PREFILL(0); }

int conv1d_prefill_bf16(CONV_PREFILL_ARGS) { CONV_PREFILL(1); }
