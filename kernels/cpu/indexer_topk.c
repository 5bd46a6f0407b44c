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
#include <stddef.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
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
#elif defined(__AVX2__) && defined(__FMA__)
    /* lanes 0-7 and 8-15 in two registers, then the same tree: i + 8 (the two added), i + 4
       (the halves), i + 2, i + 1 (gcc left the array loop below scalar here) */
    if (n % 16 == 0) {
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        for (int64_t d = 0; d < n; d += 16) {
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), lo);
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), hi);
        }
        __m256 s8 = _mm256_add_ps(lo, hi);
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
        __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
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
        s = fmaf(w[h], x > 0 ? x : 0, s);        /* one rounding, as the blocks below */
    }
    return s;
}

/* keep candidate j among the best k so far: best_* sorted by score descending, ties by j
   ascending (j arrives in ascending order, so a new j enters only past a strictly smaller
   score); NaN never (torch sorts it first) */
static inline void offer(float s, int64_t j, float *best_s, int64_t *best_j, int64_t *n,
                         int64_t k)
{
    if (s != s || (*n == k && !(s > best_s[*n - 1])))
        return;
    int64_t at = *n < k ? (*n)++ : *n - 1;
    while (at > 0 && s > best_s[at - 1]) {
        best_s[at] = best_s[at - 1];
        best_j[at] = best_j[at - 1];
        at--;
    }
    best_s[at] = s;
    best_j[at] = j;
}

#ifdef __AVX512F__
/* 16 vectors -> one: lane c of the result is a[c]'s lanes summed by _mm512_reduce_add_ps's
   tree (i + 8, then i + 4, i + 2, i + 1), so each candidate's dot product is bit for bit
   dot()'s; four rounds of shuffles and adds for 16 candidates instead of a reduction each. */
static inline __m512 sum16(const __m512 *a)
{
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)        /* 256-bit halves: a[i] low, a[i + 8] high */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44),
                             _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)        /* 128-bit quarters */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88),
                             _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)        /* pairs within a quarter */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x44),
                             _mm512_shuffle_ps(c[i], c[i + 2], 0xEE));
    __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88),
                             _mm512_shuffle_ps(d[0], d[1], 0xDD));
    /* e holds candidates 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15: a permutation that is its
       own inverse, so the same index puts them in order */
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    return _mm512_permutexvar_ps(order, e);
}

/* Candidates j0 .. j0 + 15 scored at once (di a multiple of 16, at most 128), offered in
   order of j: only those that could enter (visible, ordered, above the k-th best so far). */
static void score_block(const float *q, const float *w, const float *table, int64_t stride,
                        const int64_t *flat, const uint8_t *visible, int64_t j0, int64_t hi,
                        int64_t di, int64_t k, float *best_s, int64_t *best_j, int64_t *n)
{
    __mmask16 live = 0xFFFF;
    if (visible) {                  /* bytewise: AVX-512F alone has no byte compares */
        live = 0;
        for (int c = 0; c < 16; c++)
            live |= (__mmask16)((visible[j0 + c] != 0) << c);
        if (!live)
            return;
    }
    const float *key[16];
    for (int c = 0; c < 16; c++)
        key[c] = table + flat[j0 + c] * stride;
    __m512 s = _mm512_setzero_ps();
    for (int64_t h = 0; h < hi; h++) {
        const float *qh = q + h * di;
        __m512 acc[16];
        for (int c = 0; c < 16; c++) {
            acc[c] = _mm512_setzero_ps();
            for (int64_t d = 0; d < di; d += 16)
                acc[c] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), _mm512_loadu_ps(key[c] + d),
                                         acc[c]);
        }
        __m512 x = _mm512_max_ps(sum16(acc), _mm512_setzero_ps());   /* relu (x > 0 ? x : 0) */
        s = _mm512_fmadd_ps(_mm512_set1_ps(w[h]), x, s);
    }
    live &= *n < k ? _mm512_cmp_ps_mask(s, s, _CMP_ORD_Q)
                   : _mm512_cmp_ps_mask(s, _mm512_set1_ps(best_s[*n - 1]), _CMP_GT_OQ);
    float sv[16];
    _mm512_storeu_ps(sv, s);
    for (; live; live &= live - 1) {
        int c = __builtin_ctz(live);
        offer(sv[c], j0 + c, best_s, best_j, n, k);
    }
}
#endif

/* visible NULL: the candidates visible are j < n_vis (a prefix), none scored past it */
static void pick_row(const float *q, const float *w, const float *table, int64_t stride,
                     const int64_t *flat, const uint8_t *visible, int64_t n_vis, int64_t hi,
                     int64_t di, int64_t kc, int64_t k, int64_t *rows, uint8_t *ok)
{
    float best_s[MAX_K];
    int64_t best_j[MAX_K], n = 0;
    const int64_t scan = visible || n_vis > kc ? kc : n_vis < 0 ? 0 : n_vis;
    for (int64_t j = 0; j < scan && j < 16; j++)
        for (int64_t at = 0; at < di; at += 16)
            __builtin_prefetch(table + flat[j] * stride + at);
    int64_t j = 0;
#ifdef __AVX512F__
    if (di % 16 == 0 && di <= 128)
        for (; j + 16 <= scan; j += 16) {
            for (int64_t p = j + 16; p < j + 32 && p < scan; p++)    /* the next block's keys */
                for (int64_t at = 0; at < di; at += 16)
                    __builtin_prefetch(table + flat[p] * stride + at);
            score_block(q, w, table, stride, flat, visible, j, hi, di, k, best_s, best_j, &n);
        }
#endif
    for (; j < scan; j++) {
        if (j + 8 < scan)                    /* keys lie scattered over the store: every */
            for (int64_t at = 0; at < di; at += 16)               /* line, 8 candidates ahead */
                __builtin_prefetch(table + flat[j + 8] * stride + at);
        if (visible && !visible[j])
            continue;
        offer(score(q, w, table + flat[j] * stride, hi, di), j, best_s, best_j, &n, k);
    }
    /* the visible picks by j (an insertion sort of at most k) */
    for (int64_t a = 1; a < n; a++) {
        int64_t pick = best_j[a], b = a;
        for (; b > 0 && best_j[b - 1] > pick; b--)
            best_j[b] = best_j[b - 1];
        best_j[b] = pick;
    }
    for (int64_t i = 0; i < n; i++) {
        rows[i] = flat[best_j[i]];
        ok[i] = 1;
    }
    /* fewer than k visible: the lowest invisible j, as a stable sort leaves them */
    for (int64_t u = visible ? 0 : scan, i = n; i < k && u < kc; u++) {
        if (!visible || !visible[u]) {
            rows[i] = flat[u];
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
