/* Decode steps of one or several positions per request (shared by the decode kernels).
 *
 * A decode kernel takes B requests with their working slots `slots[B]` and, for a verify step
 * (the last token and k drafts in one forward), `cu[B+1]`: request b's rows are cu[b] ..
 * cu[b+1] - 1, stepped in order, and `row_slots[rows]`: the slot that receives the state after
 * each row (the snapshot slot of that position; the working slot after the last). Row r reads
 * the state row r - 1 wrote, or the working slot's for a request's first row. With cu NULL
 * each request has one row (row b) and its state is updated in place (row_slots unused). A
 * kernel stepping row after row computes, per row, what its one-row step computes: the
 * arithmetic is the same, only the slots differ.
 */
#ifndef MAMBARADIX_DECODE_H
#define MAMBARADIX_DECODE_H

#include <stdint.h>

/* the first row of request b (b = B: the row count) */
static inline int64_t dec_first(int64_t b, const int64_t *cu)
{
    return cu ? cu[b] : b;
}

static inline int64_t dec_rows(int64_t B, const int64_t *cu)
{
    return dec_first(B, cu);
}

/* the slot row r (of request b) writes its state to */
static inline int64_t dec_dst(int64_t b, int64_t r, const int64_t *slots,
                              const int64_t *row_slots)
{
    return row_slots ? row_slots[r] : slots[b];
}

/* the slot row r (of request b) reads its state from */
static inline int64_t dec_src(int64_t b, int64_t r, const int64_t *slots, const int64_t *cu,
                              const int64_t *row_slots)
{
    return cu == NULL || r == cu[b] ? slots[b] : row_slots[r - 1];
}

#endif
