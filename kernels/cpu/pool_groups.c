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
   the norm's sum and RoPE round like any other implementation of them (float64: ~1e-16).

   Groups are independent, so `threads` OpenMP threads (torch's pool: see union_attention.c's
   run) take a share each once a call holds enough of them. That matters when every sequence
   of a batch completes a group on the same step, as sequences admitted together do every m
   tokens: a layer's 16 HCA groups of 128 rows took 1.4-1.8 ms in one thread, 32 groups
   4.4-5.5 ms, with every group's 127 stored rows first copied out of the ring into one
   buffer (16 MB for 32 groups, fresh pages each call). fp32 rows are now read where they
   are in the ring (float64 still converts them, a group at a time), and the groups split
   over the threads: 0.5-0.9 and 1.1-3.1 ms on 2 threads, rings cold. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "exp_lanes.h"

enum { MAX_POOL_D = 1024, MAX_M = 256 };

/* Below this many values (groups x m x d) a call stays on one thread: a parallel region's
   start costs a few us. A batch-32 decode step's CSA groups (8 x 4 x 512) take it: 25 -> 19
   us a call on 2 threads; batch 1's one group (2,048) does not. */
#define MIN_PARALLEL_VALUES 8192

/* One group: its m rows' v and z, where they are (rv, rz), pooled into dst. `weight` is the
   calling thread's scratch (m * d values). */
#define POOL_ONE(NAME, T, EXP, SQRT)                                                           \
static void NAME(const T *const *rv, const T *const *rz, int64_t m, int64_t d, const T *bias,  \
                 const T *norm_w, double eps, const T *cos_g, const T *sin_g,                  \
                 int64_t rope_dim, T *weight, float *dst)                                      \
{                                                                                              \
    T pooled[MAX_POOL_D], top[MAX_POOL_D], den[MAX_POOL_D];                                    \
    /* softmax over r per channel: the max, the weights' sum, then the weighted rows */       \
    for (int64_t c = 0; c < d; c++) {                                                          \
        top[c] = -INFINITY;                                                                    \
        den[c] = 0;                                                                            \
        pooled[c] = 0;                                                                         \
    }                                                                                          \
    for (int64_t r = 0; r < m; r++)                                                            \
        for (int64_t c = 0; c < d; c++) {                                                      \
            T x = rz[r][c] + bias[r * d + c];                                                  \
            top[c] = x > top[c] ? x : top[c];                                                  \
        }                                                                                      \
    for (int64_t r = 0; r < m; r++)            /* each weight once (exp is the cost here) */  \
        for (int64_t c = 0; c < d; c++) {                                                      \
            weight[r * d + c] = EXP(rz[r][c] + bias[r * d + c] - top[c]);                      \
            den[c] += weight[r * d + c];                                                       \
        }                                                                                      \
    for (int64_t r = 0; r < m; r++)                                                            \
        for (int64_t c = 0; c < d; c++)                                                        \
            pooled[c] += weight[r * d + c] / den[c] * rv[r][c];                                \
    if (norm_w) {                                                                              \
        T sq = 0;                                                                              \
        for (int64_t c = 0; c < d; c++)                                                        \
            sq += pooled[c] * pooled[c];                                                       \
        T inv = 1 / SQRT(sq / d + (T)eps);                                                     \
        for (int64_t c = 0; c < d; c++)                                                        \
            pooled[c] = pooled[c] * inv * norm_w[c];                                           \
    }                                                                                          \
    if (cos_g) {               /* halves layout: pairs (k, k + rope_dim / 2) of the last dims */ \
        int64_t h = rope_dim / 2, at = d - rope_dim;                                           \
        for (int64_t k = 0; k < h; k++) {                                                      \
            T a = pooled[at + k], b = pooled[at + h + k];                                      \
            T c = cos_g[k], s = sin_g[k];                                                      \
            pooled[at + k] = a * c - b * s;                                                    \
            pooled[at + h + k] = a * s + b * c;                                                \
        }                                                                                      \
    }                                                                                          \
    for (int64_t c = 0; c < d; c++)                                                            \
        dst[c] = (float)pooled[c];                                                             \
}

POOL_ONE(pool_one_f32, float, exp_lanes, sqrtf)
POOL_ONE(pool_one_f64, double, exp, sqrt)

/* Groups [g0, g1) on one thread, with its own scratch. DIRECT: T is the ring's fp32, so a
   stored row is read in place; else it is converted into conv first. Returns 0 or -2. */
#define POOL_RANGE(NAME, ONE, T, DIRECT)                                                       \
static int NAME(const T *v, const T *z, int64_t n_fed, const float *ring,                      \
                const int64_t *tail_slots, const int64_t *tail_rows, int64_t slot_stride,      \
                int64_t row_stride, int64_t half, const int64_t *pick, int64_t g0, int64_t g1, \
                int64_t m, int64_t d, const T *bias, const T *norm_w, double eps,              \
                const T *cos_, const T *sin_, int64_t rope_dim, float *out,                    \
                const int64_t *out_rows)                                                       \
{                                                                                              \
    T *weight = malloc(sizeof(T) * (size_t)(m * d) * (DIRECT ? 1 : 3));                        \
    if (!weight)                                                                               \
        return -2;                                                                             \
    T *conv = weight + m * d;                  /* DIRECT: unused; else m rows of v, of z */    \
    const T *rv[MAX_M], *rz[MAX_M];                                                            \
    for (int64_t g = g0; g < g1; g++) {                                                        \
        for (int64_t r = 0; r < m; r++) {                                                      \
            int64_t i = pick ? pick[g * m + r] : g * m + r;                                    \
            if (i < n_fed) {                                                                   \
                rv[r] = v + i * d;                                                             \
                rz[r] = z + i * d;                                                             \
                continue;                                                                      \
            }                                                                                  \
            const float *row = ring + tail_slots[i - n_fed] * slot_stride +                    \
                               tail_rows[i - n_fed] * row_stride;                              \
            if (DIRECT) {                                                                      \
                rv[r] = (const T *)row;                                                        \
                rz[r] = (const T *)(row + half);                                               \
            } else {                                                                           \
                T *cv = conv + r * d, *cz = conv + (m + r) * d;                                \
                for (int64_t c = 0; c < d; c++) {                                              \
                    cv[c] = row[c];                                                            \
                    cz[c] = row[half + c];                                                     \
                }                                                                              \
                rv[r] = cv;                                                                    \
                rz[r] = cz;                                                                    \
            }                                                                                  \
        }                                                                                      \
        int64_t h = rope_dim / 2;                                                              \
        ONE(rv, rz, m, d, bias, norm_w, eps, cos_ ? cos_ + g * h : NULL,                       \
            sin_ ? sin_ + g * h : NULL, rope_dim, weight, out + out_rows[g] * d);              \
    }                                                                                          \
    free(weight);                                                                              \
    return 0;                                                                                  \
}

POOL_RANGE(pool_range_f32, pool_one_f32, float, 1)
POOL_RANGE(pool_range_f64, pool_one_f64, double, 0)

/* The exported calls: every group, split over up to `threads` threads. A stored row is
   found through pick (pick[i] - n_fed indexes tail_slots / tail_rows). */
#define POOL_GROUPS(NAME, RANGE, T)                                                            \
int NAME(const T *v, const T *z, int64_t n_fed, const float *ring, const int64_t *tail_slots,  \
         const int64_t *tail_rows, int64_t slot_stride, int64_t row_stride, int64_t half,      \
         const int64_t *pick, int64_t groups, int64_t m, int64_t d, const T *bias,             \
         const T *norm_w, double eps, const T *cos_, const T *sin_, int64_t rope_dim,          \
         float *out, const int64_t *out_rows, int threads)                                     \
{                                                                                              \
    if (d > MAX_POOL_D || m > MAX_M || rope_dim > d || rope_dim % 2)                           \
        return -1;                                                                             \
    if (groups * m * d < MIN_PARALLEL_VALUES)                                                  \
        threads = 1;                                                                           \
    if (threads > groups)                                                                      \
        threads = (int)groups;                                                                 \
    if (threads < 1)                                                                           \
        threads = 1;                                                                           \
    int rc = 0;                                                                                \
    /* iteration i pools the i-th share of the groups, whichever thread runs it */            \
    _Pragma("omp parallel for num_threads(threads) if (threads > 1) reduction(min: rc)")       \
    for (int i = 0; i < threads; i++) {                                                        \
        int got = RANGE(v, z, n_fed, ring, tail_slots, tail_rows, slot_stride, row_stride,     \
                        half, pick, groups * i / threads, groups * (i + 1) / threads, m, d,    \
                        bias, norm_w, eps, cos_, sin_, rope_dim, out, out_rows);               \
        rc = got < rc ? got : rc;                                                              \
    }                                                                                          \
    return rc;                                                                                 \
}

POOL_GROUPS(pool_groups_f32, pool_range_f32, float)
POOL_GROUPS(pool_groups_f64, pool_range_f64, double)
