/* The lightning indexer's picks for decode rows on the CPU (kernels/cpu_indexer.py calls
   it): each row scores its own candidate entries, reading their indexer keys where they are
   in the block store's table, and keeps the top k by kernels/indexer.py's rule, in the
   order kernels/indexer.topk_indices gives.

   Why: torch takes a gather of every candidate's key ([T, K, Di]), an einsum, relu, a
   weighted sum, two sorts and four gathers per CSA layer, ~0.25 ms a layer at batch 1
   (mostly per call) and ~0.45 at batch 32; here one pass per row.

       s_j   = sum_h w[t, h] * relu(q[t, h, :] . key[flat[t, j], :])     (visible j only)
       picks = the visible j with the k largest s_j, ties to the lower j; fewer than k
               visible: all of them, then the lowest invisible j (ok = 0) up to k
       order = the visible picks by j, then the invisible ones by j
   out: rows[t, i] = flat[t, pick i] and ok[t, i], i < k.

   float32 in and float32 sums (dot: 16 lanes, then a tree): the scores equal torch's up to
   rounding, so a pick can differ only where two scores tie to within it (exact ties, the
   relu's zeros among them, fall the same way). */

#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_K 1024               /* picks per row the stack buffers hold */

/* a . b in 16 lanes (one vector FMA per 16 dims; a single chain over d waited on the FMA's
   latency: ~190 us a layer at 32 rows x 71 candidates), then a fixed tree */
static float dot(const float *a, const float *b, int64_t n)
{
#ifdef __AVX512F__
    /* the same sums in one register: lane i's chain in order, then _mm512_reduce_add_ps,
       whose halves (i + 8, i + 4, i + 2, i + 1) are the tree below (the array version did
       not vectorize: 32 rows x 80 candidates of 2 x 32 took 106 us on one thread) */
    if (n % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < n; d += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float acc[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        for (int i = 0; i < 16; i++)
            acc[i] = fmaf(a[d + i], b[d + i], acc[i]);
    for (int i = 0; d < n; d++, i++)
        acc[i] = fmaf(a[d], b[d], acc[i]);
    for (int half = 8; half > 0; half >>= 1)
        for (int i = 0; i < half; i++)
            acc[i] += acc[i + half];
    return acc[0];
}

static float score(const float *q, const float *w, const float *key, int64_t hi, int64_t di)
{
    float s = 0;
    for (int64_t h = 0; h < hi; h++) {
        float x = dot(q + h * di, key, di);
        s += w[h] * (x > 0 ? x : 0);
    }
    return s;
}

/* visible NULL: the candidates visible are j < n_vis (a prefix), none scored past it */
static void pick_row(const float *q, const float *w, const float *table, int64_t stride,
                     const int64_t *flat, const uint8_t *visible, int64_t n_vis, int64_t hi,
                     int64_t di, int64_t kc, int64_t k, int64_t *rows, uint8_t *ok)
{
    float best_s[MAX_K];
    int64_t best_j[MAX_K], n = 0;
    const int64_t scan = visible || n_vis > kc ? kc : n_vis < 0 ? 0 : n_vis;
    /* best_* sorted by score descending, ties by j ascending: j runs upward, so a new j
       enters only past a strictly smaller score */
    for (int64_t j = 0; j < scan && j < 8; j++)
        for (int64_t at = 0; at < di; at += 16)
            __builtin_prefetch(table + flat[j] * stride + at);
    for (int64_t j = 0; j < scan; j++) {
        if (j + 8 < scan)                    /* keys lie scattered over the store: every */
            for (int64_t at = 0; at < di; at += 16)               /* line, 8 candidates ahead */
                __builtin_prefetch(table + flat[j + 8] * stride + at);
        if (visible && !visible[j])
            continue;
        float s = score(q, w, table + flat[j] * stride, hi, di);
        if (s != s)
            continue;                       /* NaN: never picked (torch sorts it first) */
        if (n == k && !(s > best_s[n - 1]))
            continue;
        int64_t at = n < k ? n++ : n - 1;
        while (at > 0 && s > best_s[at - 1]) {
            best_s[at] = best_s[at - 1];
            best_j[at] = best_j[at - 1];
            at--;
        }
        best_s[at] = s;
        best_j[at] = j;
    }
    /* the visible picks by j (an insertion sort of at most k) */
    for (int64_t a = 1; a < n; a++) {
        int64_t j = best_j[a], b = a;
        for (; b > 0 && best_j[b - 1] > j; b--)
            best_j[b] = best_j[b - 1];
        best_j[b] = j;
    }
    for (int64_t i = 0; i < n; i++) {
        rows[i] = flat[best_j[i]];
        ok[i] = 1;
    }
    /* fewer than k visible: the lowest invisible j, as a stable sort leaves them */
    for (int64_t j = visible ? 0 : scan, i = n; i < k && j < kc; j++) {
        if (!visible || !visible[j]) {
            rows[i] = flat[j];
            ok[i++] = 0;
        }
    }
}

/* q [T, hi, di], w [T, hi], table rows `stride` floats apart, flat [T, kc] table rows of
   each row's candidates, visible [T, kc] -> rows [T, k], ok [T, k]. k <= kc, k <= MAX_K.
   row_work non-NULL: flat is [U, kc], one candidate list per work, row t's is row_work[t]'s
   and its first n_vis[t] are visible (visible unused): a chunk's rows share their work's
   list instead of each carrying a copy of it and a mask. */
int indexer_topk_f32(const float *q, const float *w, const float *table, int64_t stride,
                     const int64_t *flat, const uint8_t *visible, int64_t t_rows, int64_t hi,
                     int64_t di, int64_t kc, int64_t k, int64_t *rows, uint8_t *ok,
                     int threads, const int64_t *row_work, const int64_t *n_vis)
{
    if (k > MAX_K || k > kc || k < 0)
        return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && t_rows >= 8)
    for (int64_t t = 0; t < t_rows; t++) {
        const int64_t at = row_work ? row_work[t] : t;
        pick_row(q + t * hi * di, w + t * hi, table, stride, flat + at * kc,
                 row_work ? NULL : visible + t * kc, row_work ? n_vis[t] : 0, hi, di, kc, k,
                 rows + t * k, ok + t * k);
    }
    return 0;
}
