/* Decode steps of the conv and of the Mamba2 scan for B requests, and the Mamba2 prefill scan,
 * in place on the state pools.
 *
 * conv_update: per request b (slot s = slots[b]) and channel c, window = [conv_pool[s][c][0 ..
 *   K-2], x[b][c]]; out[b][c] = act(sum_k w[c][k] window[k] + bias[c]); conv_pool[s][c] <-
 *   window[1 .. K-1]. One read and one write of each state instead of the reference's gather,
 *   stack and scatter. act: SiLU or none.
 * mamba2_step: per request b and head h (group g = h / (H / G)), S = ssm_pool[slots[b]][h]
 *   ([P][N], fp32): S = exp(dt A) S + dt x B^T;  y = S C + D x, all in fp32; y fp32.
 *   x, B and C rows are addressed with their own row strides (views of the conv output).
 * mamba2_decode: the two above as one step from the input projection's xBC and raw dt rows,
 *   with dt's softplus and clamp and A = -exp(A_log) inside (see m2_decode_team); given the
 *   projection's gate rows, also the mixer's output: the gate-first norm of y with them (out =
 *   weight * norm(y * silu(z)) per group) or, without a norm weight, y * silu(z); so y never
 *   leaves the call.
 * mamba2_scan: the prefill scan of S varlen segments, token after token with the step above
 *   (see m2_scan_task); the state after any token is there for a snapshot. Returns 0, or -1
 *   (nothing done) when its scratch cannot be had.
 *
 * Positions (decode.h): conv1d_update, mamba2_step and mamba2_decode take B requests of one
 * row each, updated in place (cu NULL), or of several rows (a verify step: cu, row_slots),
 * stepped in order inside each (request, channel chunk) and (request, head) task, the state
 * after each row written into its own slot.
 *
 * The `_bf16` variants read and write the model's bf16 tensors (x, the conv pool and weights,
 * B, C, D, the conv output) and round where the torch reference holds a bf16 tensor (each
 * window product and the sum, the bias add, the activation). Requests (and heads) run in
 * parallel (OpenMP); two requests must not share a slot.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "conv_window.h"
#include "decode.h"
#include "gated_norm.h"
#include "vec_math.h"

#define CONV_CHUNK 256 /* channels per parallel task */
#define CONV_SERIAL 16384 /* fewer channels than this in a step (B x C) run on one thread */
/* State floats prefetched ahead of the decode step's loads (4 KB): the step reads and writes
 * each state once, and the hardware alone kept too few lines in flight (Granite-4.0-H-350M's
 * 786 KB a layer out of cache: 13-15% faster over 16 alternated rounds; 2 or 8 KB no better). */
#define M2_PF 1024

/* Channels c0 .. c1 - 1 of row b, the state read from slot src and written to slot dst (in
 * place when equal). bf16 with kernel width 3 or 4 runs 16 channels a vector (conv_window.h),
 * the same roundings as the scalar loop, which takes the rest. */
static inline __attribute__((always_inline)) void conv_channels_k(
    int64_t b, int64_t src, int64_t dst, int64_t c0, int64_t c1, const void *x,
    int64_t x_stride, void *conv_pool, const void *weight, const void *bias, void *out, int64_t C,
    int64_t kernel, int silu, const int bf)
{
    const int64_t k1 = kernel - 1;
    int64_t c = c0;
#if HAVE_CONV_WINDOW
    if (bf && (kernel == 3 || kernel == 4)) {
        const uint16_t *xr = (const uint16_t *)x + b * x_stride;
        const uint16_t *state = (const uint16_t *)conv_pool + src * C * k1;
        uint16_t *next = (uint16_t *)conv_pool + dst * C * k1;
        for (; c + 16 <= c1; c += 16) {
            __m512 win[4], wv[4];
            cw_window16(c, (int)kernel, xr, state, next, (const uint16_t *)weight, win, wv);
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < k1; j++)
                acc = _mm512_add_ps(acc, cw_round_bf16(_mm512_mul_ps(wv[j], win[j])));
            acc = cw_round_bf16(
                _mm512_add_ps(acc, cw_round_bf16(_mm512_mul_ps(wv[k1], win[k1]))));
            if (bias)
                acc = cw_round_bf16(_mm512_add_ps(acc, cw_load_bf16((const uint16_t *)bias + c)));
            if (silu)
                acc = cw_silu(acc);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + b * C + c), cw_ps_to_bf16(acc));
        }
    }
#endif
    float pre[CONV_CHUNK]; /* the sums before the activation (c1 - c0 <= CONV_CHUNK) */
    const int64_t first = c;
    for (; c < c1; c++) {
        const int64_t s0 = (src * C + c) * k1, d0 = (dst * C + c) * k1, w = c * kernel;
        const float xc = ld(x, b * x_stride + c, bf);
        float acc = 0.0f;
        for (int64_t j = 0; j < k1; j++)
            acc += rnd(ld(weight, w + j, bf) * ld(conv_pool, s0 + j, bf), bf);
        acc = rnd(acc + rnd(ld(weight, w + k1, bf) * xc, bf), bf);
        for (int64_t j = 0; j + 1 < k1; j++)
            st(conv_pool, d0 + j, ld(conv_pool, s0 + j + 1, bf), bf);
        if (k1 > 0)
            st(conv_pool, d0 + k1 - 1, xc, bf);
        if (bias)
            acc = rnd(acc + ld(bias, c, bf), bf);
        pre[c - first] = acc;
    }
    /* the activation in a loop of its own, which vectorises (the window's loads do not) */
    if (silu) {
#pragma omp simd
        for (int64_t i = first; i < c1; i++)
            st(out, b * C + i, silu_poly(pre[i - first]), bf);
    } else {
#pragma omp simd
        for (int64_t i = first; i < c1; i++)
            st(out, b * C + i, pre[i - first], bf);
    }
}

/* conv_channels_k with the published models' width (4) as a constant: its loops unrolled */
static inline __attribute__((always_inline)) void conv_channels(
    int64_t b, int64_t src, int64_t dst, int64_t c0, int64_t c1, const void *x,
    int64_t x_stride, void *conv_pool, const void *weight, const void *bias, void *out, int64_t C,
    int64_t kernel, int silu, const int bf)
{
    if (kernel == 4)
        conv_channels_k(b, src, dst, c0, c1, x, x_stride, conv_pool, weight, bias, out, C, 4,
                        silu, bf);
    else
        conv_channels_k(b, src, dst, c0, c1, x, x_stride, conv_pool, weight, bias, out, C,
                        kernel, silu, bf);
}

/* The parallel loop sits in each exported function, so that `bf` is a constant inside its
 * outlined region (vec_math.h). */
#define CONV_UPDATE(bf)                                                                  \
    do {                                                                                 \
        const int64_t chunks = (C + CONV_CHUNK - 1) / CONV_CHUNK;                        \
        const int64_t work = dec_rows(B, cu) * C;                                        \
        _Pragma("omp parallel for collapse(2) schedule(static) if (work >= CONV_SERIAL)") \
        for (int64_t b = 0; b < B; b++)                                                  \
            for (int64_t ch = 0; ch < chunks; ch++) {                                    \
                const int64_t c0 = ch * CONV_CHUNK;                                      \
                const int64_t c1 = c0 + CONV_CHUNK < C ? c0 + CONV_CHUNK : C;            \
                for (int64_t r = dec_first(b, cu); r < dec_first(b + 1, cu); r++)        \
                    conv_channels(r, dec_src(b, r, slots, cu, row_slots),                \
                                  dec_dst(b, r, slots, row_slots), c0, c1, x, x_stride,  \
                                  conv_pool, weight, bias, out, C, kernel, silu, bf);    \
            }                                                                            \
    } while (0)

/* One head of one row: S' = exp(dt A) S + dt x B^T, y = S' C + D x (fp32; S read from S,
 * S' written to Sout, which may be S); x, B and C read as `bf` data at their element offsets,
 * y stored as `ybf` data. */
static inline __attribute__((always_inline)) void m2_head(
    const float *S, float *Sout, const void *x, int64_t xo, const void *Bm, int64_t bo,
    const void *Cm, int64_t co,
    float d, float a, float skip, void *y, int64_t yo, int64_t P, int64_t N, const int bf,
    const int ybf)
{
    const float decay = expf(d * a);
    float bv[N], cv[N]; /* the group's B and C in fp32, so the loop below vectorises */
    for (int64_t n = 0; n < N; n++) {
        bv[n] = ld(Bm, bo + n, bf);
        cv[n] = ld(Cm, co + n, bf);
    }
    for (int64_t p = 0; p < P; p++) {
        const float xv = ld(x, xo + p, bf);
        const float xdt = xv * d;
        const float *row = S + p * N;
        float *out_row = Sout + p * N;
        for (int64_t j = 0; j < N; j += 16) /* a hint: past the pool it never faults */
            __builtin_prefetch(row + M2_PF + j, 1, 3);
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; n++) {
            const float s = row[n] * decay + xdt * bv[n];
            out_row[n] = s;
            acc += s * cv[n];
        }
        st(y, yo + p, acc + skip * xv, ybf);
    }
}

/* Row b, head h of a scan step on the conv output's views (m2_head's addressing), the state
 * read from slot src and written to slot dst. */
static inline __attribute__((always_inline)) void m2_step_head(
    int64_t b, int64_t h, int64_t src, int64_t dst, float *ssm_pool, const void *x,
    int64_t x_stride, const float *dt, const float *A, const void *Bm, const void *Cm,
    int64_t bc_stride, const void *D, float *y, int64_t H, int64_t P, int64_t G, int64_t N,
    const int bf)
{
    const int64_t bc = b * bc_stride + (h / (H / G)) * N;
    m2_head(ssm_pool + (src * H + h) * P * N, ssm_pool + (dst * H + h) * P * N, x,
            b * x_stride + h * P, Bm, bc, Cm, bc, dt[b * H + h], A[h], D ? ld(D, h, bf) : 0.0f, y,
            (b * H + h) * P, P, N, bf, 0);
}

/* A whole Mamba2 decode step from the input projection's xBC and raw dt rows (row-strided
 * views of it, same stride): conv (+ activation) into `conv_out` ([B][C] scratch, model dtype,
 * as the reference holds it), then per head dt = clamp(softplus(dt_raw + dt_bias)),
 * A = -exp(A_log) and the scan step; y [B][H][P] in the model dtype. One call where the
 * composed step took ten torch operations between the two kernels. With the gate rows z
 * (row-strided as xBC), then the gate-first norm of each group of `group` features of y with
 * them (`norm_w`), or without `norm_w` the bare gate y * silu(z), into `out` [B][H * P] (y is
 * scratch then). Called by every thread of the exported functions' parallel regions. */
static inline __attribute__((always_inline)) void m2_decode_team(
    int64_t B, const int64_t *slots, const int64_t *cu, const int64_t *row_slots,
    const void *xbc, const void *dt_raw, int64_t in_stride,
    void *conv_pool, const void *conv_w, const void *conv_b, int64_t kernel, int silu,
    float *ssm_pool, const void *A_log, const void *dt_bias, float dt_lo, float dt_hi,
    const void *D, void *y, int64_t H, int64_t P, int64_t G, int64_t N, const void *z,
    const void *norm_w, float eps, int64_t group, void *out, void *conv_out, const int bf)
{
    const int64_t C = H * P + 2 * G * N, hpg = H / G;
    const int64_t chunks = (C + CONV_CHUNK - 1) / CONV_CHUNK;
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t ch = 0; ch < chunks; ch++) {
            const int64_t c0 = ch * CONV_CHUNK, c1 = c0 + CONV_CHUNK < C ? c0 + CONV_CHUNK : C;
            for (int64_t r = dec_first(b, cu); r < dec_first(b + 1, cu); r++)
                conv_channels(r, dec_src(b, r, slots, cu, row_slots),
                              dec_dst(b, r, slots, row_slots), c0, c1, xbc, in_stride, conv_pool,
                              conv_w, conv_b, conv_out, C, kernel, silu, bf);
        }
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t r = dec_first(b, cu); r < dec_first(b + 1, cu); r++) {
                /* softplus as torch computes it: linear above 20 */
                const float raw = ld(dt_raw, r * in_stride + h, bf) + ld(dt_bias, h, bf);
                const float sp = raw > 20.0f ? raw : log1pf(expf(raw));
                const float d = fminf(fmaxf(sp, dt_lo), dt_hi);
                const int64_t row = r * C, bc = row + H * P + (h / hpg) * N;
                const int64_t src = dec_src(b, r, slots, cu, row_slots);
                const int64_t dst = dec_dst(b, r, slots, row_slots);
                m2_head(ssm_pool + (src * H + h) * P * N, ssm_pool + (dst * H + h) * P * N,
                        conv_out, row + h * P, conv_out, bc, conv_out, bc + G * N, d,
                        -expf(ld(A_log, h, bf)), D ? ld(D, h, bf) : 0.0f, y, (r * H + h) * P, P,
                        N, bf, bf);
            }
    if (!z)
        return;
    const int64_t groups = H * P / group; /* (the loop above ends with a barrier) */
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < dec_rows(B, cu); b++)
        for (int64_t g = 0; g < groups; g++) {
            float gr[group];
            silu_row(gr, z, b * in_stride + g * group, group, bf);
            if (norm_w)
                norm_gate_first(group, y, b * H * P + g * group, gr, norm_w, g * group, eps, out,
                                b * H * P + g * group, bf);
            else
                gate_only(group, y, b * H * P + g * group, gr, out, b * H * P + g * group, bf);
        }
}

#define CONV_ARGS                                                                        \
    int64_t B, const int64_t *slots, const int64_t *cu, const int64_t *row_slots,        \
        const void *x, int64_t x_stride, void *conv_pool,   \
        const void *weight, const void *bias, void *out, int64_t C, int64_t kernel, int silu
#define STEP_ARGS                                                                        \
    int64_t B, const int64_t *slots, const int64_t *cu, const int64_t *row_slots,        \
        float *ssm_pool, const void *x, int64_t x_stride,   \
        const float *dt, const float *A, const void *Bm, const void *Cm, int64_t bc_stride, \
        const void *D, float *y, int64_t H, int64_t P, int64_t G, int64_t N
#define STEP_PASS ssm_pool, x, x_stride, dt, A, Bm, Cm, bc_stride, D, y, H, P, G, N

void conv1d_update(CONV_ARGS) { CONV_UPDATE(0); }

void conv1d_update_bf16(CONV_ARGS) { CONV_UPDATE(1); }

#define M2_STEP(bf)                                                                      \
    _Pragma("omp parallel for collapse(2) schedule(static)")                             \
    for (int64_t b = 0; b < B; b++)                                                      \
        for (int64_t h = 0; h < H; h++)                                                  \
            for (int64_t r = dec_first(b, cu); r < dec_first(b + 1, cu); r++)            \
                m2_step_head(r, h, dec_src(b, r, slots, cu, row_slots),                  \
                             dec_dst(b, r, slots, row_slots), STEP_PASS, bf)

void mamba2_step(STEP_ARGS) { M2_STEP(0); }

void mamba2_step_bf16(STEP_ARGS) { M2_STEP(1); }

#define DECODE_ARGS                                                                        \
    int64_t B, const int64_t *slots, const int64_t *cu, const int64_t *row_slots,          \
        const void *xbc, const void *dt_raw, int64_t in_stride, \
        void *conv_pool, const void *conv_w, const void *conv_b, int64_t kernel, int silu,   \
        float *ssm_pool, const void *A_log, const void *dt_bias, float dt_lo, float dt_hi,   \
        const void *D, void *y, int64_t H, int64_t P, int64_t G, int64_t N, const void *z,    \
        const void *norm_w, float eps, int64_t group, void *out
/* conv_out and (with the norm) y: scratch in the model dtype, as the reference holds them */
#define DECODE_STEP(bf, T)                                                                  \
    do {                                                                                    \
        T *conv_out = malloc(sizeof(T) * (size_t)(dec_rows(B, cu) * (H * P + 2 * G * N)));  \
        _Pragma("omp parallel") m2_decode_team(                                             \
            B, slots, cu, row_slots, xbc, dt_raw, in_stride, conv_pool, conv_w, conv_b,      \
            kernel, silu, ssm_pool, A_log, dt_bias, dt_lo, dt_hi, D, y, H, P, G, N, z,       \
            norm_w, eps, group, out, conv_out, bf);                                          \
        free(conv_out);                                                                     \
    } while (0)

void mamba2_decode(DECODE_ARGS) { DECODE_STEP(0, float); }

void mamba2_decode_bf16(DECODE_ARGS) { DECODE_STEP(1, uint16_t); }

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_SCAN_VEC 1

/* One token of a head's scan on its state held transposed, st [N][P] (fp32, in L1): 16 values
 * of p at a time, so that y needs no horizontal sums: for each n, h[n][p] = decay h[n][p] +
 * (x[p] dt) B[n] and y[p] += h[n][p] C[n], three vector operations (fused multiply-adds) per 16
 * state values, y in registers; two accumulator sets shorten the dependency chains. NV = P / 16
 * is a constant at each call site, so the loops over it unroll into registers. */
static inline __attribute__((always_inline)) void m2_token_vec(
    float *st, const float *xt, const float *bt, const float *ct, float d, float decay,
    float skip, float *yout, int64_t N, const int NV)
{
    __m512 xdt[NV], y0[NV], y1[NV];
    const __m512 dv = _mm512_set1_ps(d), dec = _mm512_set1_ps(decay);
    for (int i = 0; i < NV; i++) {
        xdt[i] = _mm512_mul_ps(_mm512_loadu_ps(xt + 16 * i), dv);
        y0[i] = _mm512_setzero_ps();
        y1[i] = _mm512_setzero_ps();
    }
    const int64_t P = 16 * NV;
    int64_t n = 0;
    for (; n + 2 <= N; n += 2) {
        const __m512 b0 = _mm512_set1_ps(bt[n]), c0 = _mm512_set1_ps(ct[n]);
        const __m512 b1 = _mm512_set1_ps(bt[n + 1]), c1 = _mm512_set1_ps(ct[n + 1]);
        float *r0 = st + n * P, *r1 = r0 + P;
        for (int i = 0; i < NV; i++) {
            const __m512 h0 =
                _mm512_fmadd_ps(_mm512_loadu_ps(r0 + 16 * i), dec, _mm512_mul_ps(xdt[i], b0));
            _mm512_storeu_ps(r0 + 16 * i, h0);
            y0[i] = _mm512_fmadd_ps(h0, c0, y0[i]);
            const __m512 h1 =
                _mm512_fmadd_ps(_mm512_loadu_ps(r1 + 16 * i), dec, _mm512_mul_ps(xdt[i], b1));
            _mm512_storeu_ps(r1 + 16 * i, h1);
            y1[i] = _mm512_fmadd_ps(h1, c1, y1[i]);
        }
    }
    for (; n < N; n++) {
        const __m512 b0 = _mm512_set1_ps(bt[n]), c0 = _mm512_set1_ps(ct[n]);
        float *r0 = st + n * P;
        for (int i = 0; i < NV; i++) {
            const __m512 h0 =
                _mm512_fmadd_ps(_mm512_loadu_ps(r0 + 16 * i), dec, _mm512_mul_ps(xdt[i], b0));
            _mm512_storeu_ps(r0 + 16 * i, h0);
            y0[i] = _mm512_fmadd_ps(h0, c0, y0[i]);
        }
    }
    const __m512 sk = _mm512_set1_ps(skip);
    for (int i = 0; i < NV; i++)
        _mm512_storeu_ps(yout + 16 * i, _mm512_fmadd_ps(sk, _mm512_loadu_ps(xt + 16 * i),
                                                        _mm512_add_ps(y0[i], y1[i])));
}
#endif

/* A head's state [P][N] from or to its transposed working copy [N][P]. */
static inline void transpose_state(float *dst, const float *src, int64_t rows, int64_t cols)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            dst[c * rows + r] = src[r * cols + c];
}

/* Segment s, head h of a prefill scan: rows cu[s] .. cu[s+1] - 1 of x, dt, B, C and y, the
 * state ssm_pool[slots[s]][h] carried token after token, and copied into
 * ssm_pool[snap_slot[k]][h] after snap_off[k] tokens for each snapshot k of the segment
 * (snap_seq[k] == s; the caller sorts them by segment, then offset). x is addressed by a token
 * and a channel stride (the prefill conv leaves it channel-major); B and C come as fp32
 * [T][2][G][N] (bc32, see M2_SCAN). A head's state (16-32 KB at the published shapes) stays in
 * L1 for the whole segment, each token reading and writing it once, where the chunked form
 * (kernels/mamba2.py) suits wide matrix units better than two cores. With AVX-512 and P a
 * multiple of 16 up to 128 the state is worked on transposed (m2_token_vec); otherwise in place
 * in the pool by the decode step's m2_head. */
static inline __attribute__((always_inline)) void m2_scan_task(
    int64_t s, int64_t h, const int64_t *cu, const int64_t *slots, float *ssm_pool,
    const void *x, int64_t x_ts, int64_t x_cs, const float *dt, const float *A,
    const float *bc32, const void *D, float *y, int64_t H, int64_t P, int64_t G, int64_t N,
    int64_t K, const int64_t *snap_seq, const int64_t *snap_off, const int64_t *snap_slot,
    const int bf)
{
    const int64_t size = P * N, xc = h * P * x_cs, g = h / (H / G);
    float *state = ssm_pool + (slots[s] * H + h) * size;
    const float a = A[h], skip = D ? ld(D, h, bf) : 0.0f;
    float xt[SCAN_BLOCK][P];
#if HAVE_SCAN_VEC
    const int vec = P % 16 == 0 && P <= 128;
    float *st = vec ? malloc(sizeof(float) * (size_t)size) : NULL;
    if (st)
        transpose_state(st, state, P, N);
#else
    float *st = NULL;
#endif
    int64_t t = cu[s];
    for (int64_t k = 0; k <= K; k++) {
        const int64_t stop = scan_piece(s, &k, cu, K, snap_seq, snap_off);
        while (t < stop) {
            const int64_t nb = stop - t < SCAN_BLOCK ? stop - t : SCAN_BLOCK;
            scan_gather(&xt[0][0], x, t, nb, x_ts, xc, x_cs, P, bf);
            for (int64_t j = 0; j < nb; j++, t++) {
                const float *bt = bc32 + (t * 2 * G + g) * N, *ct = bt + G * N;
                const float d = dt[t * H + h];
                float *yo = y + (t * H + h) * P;
#if HAVE_SCAN_VEC
                if (st) {
                    const float decay = expf(d * a);
                    switch (P / 16) {
                    case 1: m2_token_vec(st, xt[j], bt, ct, d, decay, skip, yo, N, 1); break;
                    case 2: m2_token_vec(st, xt[j], bt, ct, d, decay, skip, yo, N, 2); break;
                    case 3: m2_token_vec(st, xt[j], bt, ct, d, decay, skip, yo, N, 3); break;
                    case 4: m2_token_vec(st, xt[j], bt, ct, d, decay, skip, yo, N, 4); break;
                    case 5: m2_token_vec(st, xt[j], bt, ct, d, decay, skip, yo, N, 5); break;
                    case 6: m2_token_vec(st, xt[j], bt, ct, d, decay, skip, yo, N, 6); break;
                    case 7: m2_token_vec(st, xt[j], bt, ct, d, decay, skip, yo, N, 7); break;
                    default: m2_token_vec(st, xt[j], bt, ct, d, decay, skip, yo, N, 8); break;
                    }
                    continue;
                }
#endif
                m2_head(state, state, xt[j], 0, bt, 0, ct, 0, d, a, skip, yo, 0, P, N, 0, 0);
            }
        }
        float *dst = k < K ? ssm_pool + (snap_slot[k] * H + h) * size : state;
        if (st)
            transpose_state(dst, st, N, P);
        else if (k < K)
            for (int64_t i = 0; i < size; i++)
                dst[i] = state[i];
    }
    free(st);
}

#define SCAN_ARGS                                                                          \
    int64_t S, const int64_t *cu, const int64_t *slots, float *ssm_pool, const void *x,   \
        int64_t x_ts, int64_t x_cs, const float *dt, const float *A, const void *Bm,       \
        const void *Cm, int64_t bc_ts, int64_t bc_cs, const void *D, float *y, int64_t H,  \
        int64_t P, int64_t G, int64_t N, int64_t K, const int64_t *snap_seq,               \
        const int64_t *snap_off, const int64_t *snap_slot
/* B and C of every token into fp32 [T][2][G][N] once (every head of a group reads them), then
 * the (segment, head) tasks. */
#define M2_SCAN(bf)                                                                          \
    do {                                                                                     \
        const int64_t T = cu[S], GN = G * N;                                                 \
        float *bc32 = malloc(sizeof(float) * (size_t)(T * 2 * GN));                          \
        if (!bc32)                                                                           \
            return -1; /* nothing touched: the caller runs the reference */                 \
        _Pragma("omp parallel")                                                              \
        {                                                                                    \
            _Pragma("omp for schedule(static)")                                              \
            for (int64_t t = 0; t < T; t += SCAN_BLOCK) {                                    \
                const int64_t nb = T - t < SCAN_BLOCK ? T - t : SCAN_BLOCK;                  \
                float blk[SCAN_BLOCK * GN];                                                  \
                for (int64_t m = 0; m < 2; m++) {                                            \
                    scan_gather(blk, m ? Cm : Bm, t, nb, bc_ts, 0, bc_cs, GN, bf);           \
                    for (int64_t j = 0; j < nb; j++)                                         \
                        for (int64_t i = 0; i < GN; i++)                                     \
                            bc32[((t + j) * 2 + m) * GN + i] = blk[j * GN + i];              \
                }                                                                            \
            }                                                                                \
            _Pragma("omp for collapse(2) schedule(dynamic, 1)")                              \
            for (int64_t s = 0; s < S; s++)                                                  \
                for (int64_t h = 0; h < H; h++)                                              \
                    m2_scan_task(s, h, cu, slots, ssm_pool, x, x_ts, x_cs, dt, A, bc32, D, y, H, \
                                 P, G, N, K, snap_seq, snap_off, snap_slot, bf);             \
        }                                                                                    \
        free(bc32);                                                                          \
        return 0;                                                                            \
    } while (0)

int mamba2_scan(SCAN_ARGS) { M2_SCAN(0); }

int mamba2_scan_bf16(SCAN_ARGS) { M2_SCAN(1); }
