/* The compressor's group path on the CPU: completed groups of m rows pooled into entries and
   written to their block rows, in one pass (kernels/cpu_pool.py calls it; kernels/cpu_ring.py
   builds every C file here into one library).

   At batch 32 some sequence completes a CSA group on every decode step, so every step runs
   the group path of every CSA layer twice (entries and indexer keys), and in torch that is a
   gather of the group rows, a gated softmax, an RMS norm, RoPE and a scatter: some 25 small
   calls per layer and stream. Here each group is read where its rows are and its entry
   written where it goes. Per group g (rows r = 0 .. m-1, channel c):

       pooled[c] = sum_r softmax_r(z[r, c] + bias[r, c]) * v[r, c]
       entry     = rope(rms_norm(pooled) * norm_w, position g_index * m)   (entries)
       entry     = pooled                                                  (indexer keys: no
                                                                             norm_w, no rope)

   stored as fp32 (the block store's dtype: what storage_round gives in any compute dtype).
   Row i of the group stream is fed row pick[i] when pick[i] < n_fed, else tail-ring row
   (tail_slots[j], tail_rows[j]) with j = pick[i] - n_fed, whose v and z sit `half` elements
   apart (the ring stores [2, D] per row); pick NULL: row i is fed row i. The same math as
   ops.pool_entries_at / ops.pool_index_keys in torch, summed in the same order over r; exp,
   the norm's sum and RoPE round like any other implementation of them (float64: ~1e-16). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "exp_lanes.h"

enum { MAX_POOL_D = 1024, MAX_M = 256 };

#define POOL_GROUPS(NAME, T, EXP, SQRT)                                                        \
int NAME(const T *v, const T *z, int64_t n_fed, const float *ring, const int64_t *tail_slots,  \
         const int64_t *tail_rows, int64_t n_tail, int64_t slot_stride, int64_t row_stride,    \
         int64_t half, const int64_t *pick, int64_t groups, int64_t m, int64_t d,              \
         const T *bias, const T *norm_w, double eps, const T *cos_, const T *sin_,             \
         int64_t rope_dim, float *out, const int64_t *out_rows)                                \
{                                                                                              \
    if (d > MAX_POOL_D || m > MAX_M || rope_dim > d || rope_dim % 2)                           \
        return -1;                                                                             \
    /* the tail rows in the compute dtype, v then z, so every row below is two plain rows */  \
    T *tail = n_tail ? malloc(sizeof(T) * (size_t)(n_tail * 2 * d)) : NULL;                    \
    if (n_tail && !tail)                                                                       \
        return -2;                                                                             \
    for (int64_t j = 0; j < n_tail; j++) {                                                     \
        const float *row = ring + tail_slots[j] * slot_stride + tail_rows[j] * row_stride;     \
        for (int64_t c = 0; c < d; c++) {                                                      \
            tail[j * 2 * d + c] = row[c];                                                      \
            tail[j * 2 * d + d + c] = row[half + c];                                           \
        }                                                                                      \
    }                                                                                          \
    T pooled[MAX_POOL_D], top[MAX_POOL_D], den[MAX_POOL_D];                                    \
    T *weight = malloc(sizeof(T) * (size_t)(m * d));                                           \
    if (!weight) {                                                                             \
        free(tail);                                                                            \
        return -2;                                                                             \
    }                                                                                          \
    const T *rv[MAX_M], *rz[MAX_M];                                                            \
    for (int64_t g = 0; g < groups; g++) {                                                     \
        for (int64_t r = 0; r < m; r++) {                                                      \
            int64_t i = pick ? pick[g * m + r] : g * m + r;                                    \
            rv[r] = i < n_fed ? v + i * d : tail + (i - n_fed) * 2 * d;                        \
            rz[r] = i < n_fed ? z + i * d : tail + (i - n_fed) * 2 * d + d;                    \
        }                                                                                      \
        /* softmax over r per channel: the max, the weights' sum, then the weighted rows */   \
        for (int64_t c = 0; c < d; c++) {                                                      \
            top[c] = -INFINITY;                                                                \
            den[c] = 0;                                                                        \
            pooled[c] = 0;                                                                     \
        }                                                                                      \
        for (int64_t r = 0; r < m; r++)                                                        \
            for (int64_t c = 0; c < d; c++) {                                                  \
                T x = rz[r][c] + bias[r * d + c];                                              \
                top[c] = x > top[c] ? x : top[c];                                              \
            }                                                                                  \
        for (int64_t r = 0; r < m; r++)        /* each weight once (exp is the cost here) */  \
            for (int64_t c = 0; c < d; c++) {                                                  \
                weight[r * d + c] = EXP(rz[r][c] + bias[r * d + c] - top[c]);                  \
                den[c] += weight[r * d + c];                                                   \
            }                                                                                  \
        for (int64_t r = 0; r < m; r++)                                                        \
            for (int64_t c = 0; c < d; c++)                                                    \
                pooled[c] += weight[r * d + c] / den[c] * rv[r][c];                            \
        if (norm_w) {                                                                          \
            T sq = 0;                                                                          \
            for (int64_t c = 0; c < d; c++)                                                    \
                sq += pooled[c] * pooled[c];                                                   \
            T inv = 1 / SQRT(sq / d + (T)eps);                                                 \
            for (int64_t c = 0; c < d; c++)                                                    \
                pooled[c] = pooled[c] * inv * norm_w[c];                                       \
        }                                                                                      \
        if (cos_) {            /* halves layout: pairs (k, k + rope_dim / 2) of the last dims */ \
            int64_t h = rope_dim / 2, at = d - rope_dim;                                       \
            for (int64_t k = 0; k < h; k++) {                                                  \
                T a = pooled[at + k], b = pooled[at + h + k];                                  \
                T c = cos_[g * h + k], s = sin_[g * h + k];                                    \
                pooled[at + k] = a * c - b * s;                                                \
                pooled[at + h + k] = a * s + b * c;                                            \
            }                                                                                  \
        }                                                                                      \
        float *dst = out + out_rows[g] * d;                                                    \
        for (int64_t c = 0; c < d; c++)                                                        \
            dst[c] = (float)pooled[c];                                                         \
    }                                                                                          \
    free(tail);                                                                                \
    free(weight);                                                                              \
    return 0;                                                                                  \
}

POOL_GROUPS(pool_groups_f32, float, exp_lanes, sqrtf)
POOL_GROUPS(pool_groups_f64, double, exp, sqrt)
