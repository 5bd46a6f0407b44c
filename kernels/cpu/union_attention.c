/* Decode attention over MXFP8 ring rows and rows picked from a table, for the CPU
   (kernels/cpu_ring.py builds and loads it).

   A decode row reads its slot's whole window every layer: R rows of D values. Kept as fp32
   copies those are 4 D bytes a row and a batched decode step is bound by reading them
   (2,048 B a row at D = 512); the MXFP8 bytes are D + D / 32 (528 B). This kernel reads the
   bytes and expands BLOCK rows at a time into a buffer that stays in L1, then scores them
   against the heads, updates an online softmax once per block and adds the block's rows
   into the heads' sums with the partial sums held in registers. Heads go in pairs and keys
   four at a time, so each expanded vector loaded serves two heads and eight sums are in
   flight (one head at a time with one key left the FMA units waiting on their own latency:
   at 32 rows x 128 ring rows x 2 heads of 512, 1 thread, 0.70 -> 0.49 ms with the rest
   below; 8-row blocks instead of 16 keep the buffer well inside L1, and with AVX2 4 rows).

   The other groups are rows of fp32 tables named per query row by an index (at most two):
   a decode row's compressed entries (the block store's, fp32 whatever the engine's dtype),
   read in place where the torch path would gather them into a [T, K, D] copy first and then
   read that twice; and a prefill chunk's window keys (its pool of older and new rows,
   each row's W of them named by index), so such a chunk's attention is one call too.

   For each query row t, its keys are the ring rows r of slot slots[t] with ring_ok[t, r] and
   the table rows idx[t, k] with idx_ok[t, k]; with v(j) a key's value (= the key: MQA)
       s_h(j)  = scale * <q[t, h], v(j)>
       out[t, h] = sum_j e^(s_h(j) - lse) v(j),   lse[t, h] = log sum_j e^s_h(j)
   A row that sees nothing gets out 0 and lse -inf. With a sink (a logit per head whose
   value is 0: one more softmax column) the sums include it: out is then the attention's
   whole output and lse counts the sink too. Without one the caller joins it, and any other
   key group, by lse. A ring row's value is its exact dequantized value: E4M3 codes times
   the block's power of two are exact in fp32.

   union_attention_f32 is the fast path (fp32 q, out, lse; GCC/Clang vector extensions, so
   the compiler emits the machine's widest SIMD); union_attention_f64 is the same math in
   float64 with plain loops (union_attention_f64.h), for the engine's float64 exactness tests. Rows are split over
   torch's own OpenMP threads (see run). Built without -ffast-math: every sum is split into
   lanes by hand, and nothing may be reassociated. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_lanes.h"

/* Lanes of the vector type: a 64-byte vector is one AVX-512 register, but two AVX2 ones,
   and with AVX2's 16 registers the eight sums of `scores` and `accumulate` then do not fit.
   32 rows x (128 ring + 20 table keys) x 2 heads of 512 on an AVX2 machine (Zen 3), one
   thread: 1.25 ms with 8 lanes, 4.04 with 16 (with the AVX2 expand_row below; lane sums
   through memory), 4.25 with 16 and the generic expand_row. */
#ifdef __AVX512F__
enum { VL = 16 };
#else
enum { VL = 8 };
#endif
/* Key rows expanded and fed at a time. With AVX2 4: under perf a block's expansion waited
   mostly on its stores, and 4 rows (8.6 KB of buffer instead of 17) were 0.93-0.98x a call
   (32 rows x 128 ring + 20 table keys, taking turns, one and two threads, four runs; the
   online softmax then rescales at other points: the same math, not the same bits). */
enum { MAX_D = 1024, BLOCK = VL == 16 ? 8 : 4 };

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vf_unaligned __attribute__((vector_size(VL * 4), aligned(4)));

/* One E4M3 code per value, then one E8M0 scale byte per 32 values. The code's 7 magnitude
   bits placed at fp32 bit 20 (its sign at bit 31) make the fp32 number (E4M3 value) *
   2^-120, subnormals included: E4M3 exponent 0 lands on fp32's subnormals, whose spacing
   matches. Times 2^120 and the block's 2^(e - 127): one multiply by 2^(e - 7) while that
   is a normal fp32 number (e <= 134, every realistic scale), else two. Both exact. */
static void block_factors(uint32_t e, float *k, float *rest)
{
    uint32_t k_bits = e <= 134 ? (e + 120) << 23 : 254u << 23;    /* 2^(e-7), or 2^127 */
    uint32_t r_bits = e <= 134 ? 127u << 23 : (e - 7) << 23;       /* 1, or 2^(e-134) */
    memcpy(k, &k_bits, sizeof *k);
    memcpy(rest, &r_bits, sizeof *rest);
}

#ifdef __AVX512F__
#include <immintrin.h>
/* With AVX-512 a block is two 16-lane sign-extending widenings, a shift and a mask (the
   generic loops below compile to a chain of narrower widenings and a second pass over the
   row). Sign-extended, a code shifted left by 20 has its sign at bit 31, copies of it at
   27-30 (masked off) and its magnitude at 20-26: the layout block_factors describes. */
static void expand_row(const uint8_t *restrict row, int d, float *restrict out)
{
    const __m512i keep = _mm512_set1_epi32((int)0x87f00000u);
    for (int b = 0; b < d / 32; b++) {
        float k, rest;
        block_factors(row[d + b], &k, &rest);
        __m512 kv = _mm512_set1_ps(k);
        for (int half = 0; half < 2; half++) {
            __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + b * 32 + half * 16)));
            __m512i bits = _mm512_and_si512(_mm512_slli_epi32(c, 20), keep);
            __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(bits), kv);
            if (rest != 1.0f)
                v = _mm512_mul_ps(v, _mm512_set1_ps(rest));
            _mm512_storeu_ps(out + b * 32 + half * 16, v);
        }
    }
}
#elif defined(__AVX2__)
#include <immintrin.h>
/* The same with AVX2: four 8-lane widenings a block. A row's block factors 2^(e - 7) are
   made first, eight blocks at a time, and each block then broadcasts its own from memory:
   computed block by block they were a chain of integer ops, a move to a vector register and
   a test per 32 values (32 rows x 128 ring keys x 2 heads of 512 on a Zen 3, taking turns:
   0.89-0.999x a call, 1 and 2 threads). A row with a block past e = 134 (past every
   realistic scale, see block_factors) takes the block-by-block path, whose second factor
   covers it. */
static void expand_row(const uint8_t *restrict row, int d, float *restrict out)
{
    const __m256i keep = _mm256_set1_epi32((int)0x87f00000u);
    const int nb = d / 32;
    float kf[MAX_D / 32];
    int big = 0, b = 0;
    for (; b + 8 <= nb; b += 8) {
        __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + d + b)));
        big |= _mm256_movemask_epi8(_mm256_cmpgt_epi32(e, _mm256_set1_epi32(134)));
        _mm256_storeu_ps(kf + b, _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(120)), 23)));
    }
    for (; b < nb; b++) {
        float rest;
        big |= row[d + b] > 134;
        block_factors(row[d + b], kf + b, &rest);
    }
    if (big) {      /* a loop of its own: one loop testing `big` inside took 1.04-1.15x as long */
        for (b = 0; b < nb; b++) {
            float k, rest;
            block_factors(row[d + b], &k, &rest);
            for (int q = 0; q < 4; q++) {
                __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + b * 32 + q * 8)));
                __m256i bits = _mm256_and_si256(_mm256_slli_epi32(c, 20), keep);
                __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(k));
                _mm256_storeu_ps(out + b * 32 + q * 8, _mm256_mul_ps(v, _mm256_set1_ps(rest)));
            }
        }
        return;
    }
    for (b = 0; b < nb; b++) {
        __m256 kv = _mm256_broadcast_ss(kf + b);
        for (int q = 0; q < 4; q++) {
            __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + b * 32 + q * 8)));
            __m256i bits = _mm256_and_si256(_mm256_slli_epi32(c, 20), keep);
            _mm256_storeu_ps(out + b * 32 + q * 8, _mm256_mul_ps(_mm256_castsi256_ps(bits), kv));
        }
    }
}
#else
typedef uint32_t u32_alias __attribute__((may_alias));
static void expand_row(const uint8_t *restrict row, int d, float *restrict out)
{
    u32_alias *bits = (u32_alias *)out;
    for (int i = 0; i < d; i++) {
        uint32_t c = row[i];
        bits[i] = ((c & 0x80u) << 24) | ((c & 0x7fu) << 20);
    }
    for (int b = 0; b < d / 32; b++) {
        float k, rest;
        block_factors(row[d + b], &k, &rest);
        for (int i = b * 32; i < b * 32 + 32; i++)
            out[i] = out[i] * k * rest;
    }
}
#endif

static float hsum(vf a)
{
#ifdef __AVX512F__
    /* in registers (halves added by shuffles): through memory it was a store, a reload and
       15 scalar adds for each of a row's 2 x 146 scores per layer */
    return _mm512_reduce_add_ps((__m512)a);
#elif defined(__AVX2__)
    __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
#else
    float t[VL];
    memcpy(t, &a, sizeof t);
    for (int w = VL / 2; w > 0; w /= 2)        /* a tree: 4 dependent adds, not 15 */
        for (int i = 0; i < w; i++)
            t[i] += t[i + w];
    return t[0];
#endif
}

/* A group of keys named per query row by index into an fp32 table: row t sees
   rows + idx[t, k] * stride where ok[t, k], k < picks. */
typedef struct {
    const float *rows; const int64_t *idx; const uint8_t *ok;           /* rows: NULL = none */
    int64_t picks, stride;
} Table;

typedef struct {
    const void *q;
    const uint8_t *codes; const int64_t *slots; const uint8_t *ring_ok;   /* codes: NULL = none */
    int64_t ring, row_bytes, slot_stride;
    Table tab[2];
    void *out, *lse;
    const void *sink;                                                   /* NULL = none */
    int64_t first, last, heads, d;
    double scale;
} Part;

/* One query row's running softmax over the blocks of keys fed to it. */
typedef struct {
    vf acc[MAX_D / VL];
    float mx, den;
} Head32;

#define INLINE static inline __attribute__((always_inline))

/* Scores of nb key rows against one head (hp = 1) or a pair of heads (hp = 2, q1 the second
   head): four keys at a time, so 4 * hp sums are in flight (an FMA's latency is hidden) and
   every key vector loaded serves both heads. */
INLINE void scores(const vf_unaligned *q0, const vf_unaligned *q1, int hp, int64_t nv,
                   float scale, const float *const *rows, int nb, float *p0, float *p1)
{
    int k = 0;
    for (; k + 4 <= nb; k += 4) {
        const vf_unaligned *v[4];
        vf a[4] = {{0}}, b[4] = {{0}};
        for (int j = 0; j < 4; j++)
            v[j] = (const vf_unaligned *)rows[k + j];
        for (int64_t c = 0; c < nv; c++) {
            vf x = q0[c], y = hp == 2 ? q1[c] : x;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                a[j] += x * v[j][c];
                if (hp == 2)
                    b[j] += y * v[j][c];
            }
        }
        for (int j = 0; j < 4; j++) {
            p0[k + j] = hsum(a[j]) * scale;
            if (hp == 2)
                p1[k + j] = hsum(b[j]) * scale;
        }
    }
    for (; k < nb; k++) {                            /* the block's last keys, one by one */
        const vf_unaligned *v = (const vf_unaligned *)rows[k];
        vf a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};
        for (int64_t c = 0; c < nv; c += 2) {
            a0 += q0[c] * v[c];
            a1 += q0[c + 1] * v[c + 1];
            if (hp == 2) {
                b0 += q1[c] * v[c];
                b1 += q1[c + 1] * v[c + 1];
            }
        }
        p0[k] = hsum(a0 + a1) * scale;
        if (hp == 2)
            p1[k] = hsum(b0 + b1) * scale;
    }
}

/* The running softmax of one head takes a block's scores p (turned into weights in place). */
INLINE void weigh(Head32 *st, int64_t nv, float *p, int nb)
{
    float top = -INFINITY;
    for (int k = 0; k < nb; k++)
        top = p[k] > top ? p[k] : top;
    if (top > st->mx) {                              /* a new running max: rescale the sums */
        float shrink = expf(st->mx - top);
        st->den *= shrink;
        for (int64_t c = 0; c < nv; c++)
            st->acc[c] *= shrink;
        st->mx = top;
    }
    for (int k = 0; k < nb; k++)             /* vectorized: a call per key was its cost */
        p[k] = exp_lanes(p[k] - st->mx);
    for (int k = 0; k < nb; k++)
        st->den += p[k];
}

/* The block's rows added into one head's sums, or a pair's: 4 columns of 16 at a time per
   head, so 4 * hp partial sums stay in registers and each key vector is loaded once. */
INLINE void accumulate(Head32 *s0, Head32 *s1, int hp, int64_t nv, const float *const *rows,
                       int nb, const float *p0, const float *p1)
{
    for (int64_t c = 0; c + 4 <= nv; c += 4) {
        vf o[4], u[4] = {{0}};
        for (int j = 0; j < 4; j++) {
            o[j] = s0->acc[c + j];
            if (hp == 2)
                u[j] = s1->acc[c + j];
        }
        for (int k = 0; k < nb; k++) {
            const vf_unaligned *v = (const vf_unaligned *)rows[k] + c;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                o[j] += p0[k] * v[j];
                if (hp == 2)
                    u[j] += p1[k] * v[j];
            }
        }
        for (int j = 0; j < 4; j++) {
            s0->acc[c + j] = o[j];
            if (hp == 2)
                s1->acc[c + j] = u[j];
        }
    }
    for (int64_t c = nv / 4 * 4; c < nv; c++)        /* d not a multiple of 64: the last columns */
        for (int k = 0; k < nb; k++) {
            vf x = ((const vf_unaligned *)rows[k])[c];
            s0->acc[c] += p0[k] * x;
            if (hp == 2)
                s1->acc[c] += p1[k] * x;
        }
}

INLINE void feed_heads(Head32 *hs, const float *qt, int64_t h, int hp, int64_t d, float scale,
                       const float *const *rows, int nb)
{
    const int64_t nv = d / VL;
    float p0[BLOCK], p1[BLOCK];
    const vf_unaligned *q0 = (const vf_unaligned *)(qt + h * d), *q1 = q0 + nv;
    scores(q0, q1, hp, nv, scale, rows, nb, p0, p1);
    weigh(&hs[h], nv, p0, nb);
    if (hp == 2)
        weigh(&hs[h + 1], nv, p1, nb);
    accumulate(&hs[h], &hs[h + 1], hp, nv, rows, nb, p0, p1);
}

/* A block of nb key rows (pointers to d floats each) for query row qt: every head, in pairs
   (an odd last head alone). */
static void feed_f32(Head32 *hs, const float *qt, int64_t heads, int64_t d, float scale,
                     const float *const *rows, int nb)
{
    int64_t h = 0;
    for (; h + 2 <= heads; h += 2)
        feed_heads(hs, qt, h, 2, d, scale, rows, nb);
    if (h < heads)
        feed_heads(hs, qt, h, 1, d, scale, rows, nb);
}

static void prefetch_row(const void *row, int64_t bytes)
{
    for (int64_t at = 0; at < bytes; at += 64)
        __builtin_prefetch((const char *)row + at);
}

static void part_f32(const Part *a)
{
    const int64_t heads = a->heads, d = a->d, nv = d / VL;
    const float scale = (float)a->scale;
    /* a block's rows 4 KB + 192 B apart: at 4 KB they share their L1 sets, with q's and the
       heads' sums read beside them (an AVX2 Zen 3, 32 rows x 148 keys, taking turns: 0.93-0.96x
       on one thread and on two, six runs; on the AVX-512 machine a compact buffer was 1.005x) */
    vf vals[BLOCK][MAX_D / VL + 192 / sizeof(vf)];
    Head32 *hs = aligned_alloc(64, sizeof(Head32) * (size_t)heads);
    const float *rows[BLOCK];
    if (!hs)
        abort();                                     /* a few KB: the process is done anyway */
    for (int64_t t = a->first; t < a->last; t++) {
        const float *qt = (const float *)a->q + t * heads * d;
        for (int64_t h = 0; h < heads; h++) {
            hs[h].mx = -INFINITY;
            hs[h].den = 0;
            for (int64_t c = 0; c < nv; c++)
                hs[h].acc[c] = (vf){0};
        }
        const Table *first = &a->tab[0];
        for (int64_t n = 0; first->rows && n < first->picks && n < BLOCK; n++)   /* arrive during the ring */
            if (first->ok[t * first->picks + n])
                prefetch_row(first->rows + first->idx[t * first->picks + n] * first->stride, d * 4);
        if (a->codes) {
            const uint8_t *slot = a->codes + a->slots[t] * a->slot_stride;
            const uint8_t *seen = a->ring_ok + t * a->ring;
            for (int64_t r = 0; r < a->ring;) {
                int nb = 0;
                for (; r < a->ring && nb < BLOCK; r++)
                    if (seen[r]) {
                        expand_row(slot + r * a->row_bytes, (int)d, (float *)vals[nb]);
                        rows[nb] = (const float *)vals[nb];
                        nb++;
                    }
                /* ask for the next block's bytes now, so they arrive while this one is worked */
                for (int64_t at = 0; r < a->ring && at < BLOCK * a->row_bytes; at += 64)
                    __builtin_prefetch(slot + r * a->row_bytes + at);
                if (nb)
                    feed_f32(hs, qt, heads, d, scale, rows, nb);
            }
        }
        for (int g = 0; g < 2; g++) {
            const Table *tb = &a->tab[g];
            if (!tb->rows)
                continue;
            const int64_t *pick = tb->idx + t * tb->picks;
            const uint8_t *seen = tb->ok + t * tb->picks;
            for (int64_t k = 0; k < tb->picks;) {
                int nb = 0;
                for (; k < tb->picks && nb < BLOCK; k++)
                    if (seen[k])
                        rows[nb++] = tb->rows + pick[k] * tb->stride;
                /* the next block's rows (scattered over the store: no streamer finds them) */
                for (int64_t n = k; n < tb->picks && n < k + BLOCK; n++)
                    if (seen[n])
                        prefetch_row(tb->rows + pick[n] * tb->stride, d * 4);
                if (nb)
                    feed_f32(hs, qt, heads, d, scale, rows, nb);
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            float *o = (float *)a->out + (t * heads + h) * d;
            float mx = hs[h].mx, den = hs[h].den, keep = 1;
            if (a->sink) {                           /* one more column, value 0 */
                float s = ((const float *)a->sink)[h], top = s > mx ? s : mx;
                keep = den > 0 ? expf(mx - top) : 0;
                den = den * keep + expf(s - top);
                mx = top;
            }
            float inv = den > 0 ? keep / den : 0;
            for (int64_t c = 0; c < nv; c++) {
                vf x = hs[h].acc[c] * inv;
                memcpy(o + c * VL, &x, sizeof x);
            }
            ((float *)a->lse)[t * heads + h] = den > 0 ? mx + logf(den) : -INFINITY;
        }
    }
    free(hs);
}

#include "union_attention_f64.h"

/* All rows, split over `threads` OpenMP threads. The library is loaded into a process that
   already has torch's OpenMP runtime (libgomp.so.1, shipped in torch/lib), and the dynamic
   loader gives this library that same one: the threads here are torch's intra-op pool, not
   a second pool whose idle workers would spin against torch's on the same cores. Returns 0,
   or -1 for a d the kernel does not take (d % 32 != 0 or d > MAX_D). */
static int run(void (*fn)(const Part *), Part base, int64_t rows, int threads)
{
    if (base.d % 32 || base.d > MAX_D || base.d <= 0)
        return -1;
    if (threads > rows)
        threads = (int)rows;
    if (threads < 1)
        threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int i = 0; i < threads; i++) {
        Part part = base;
        part.first = rows * i / threads;
        part.last = rows * (i + 1) / threads;
        fn(&part);
    }
    return 0;
}

/* q [rows, heads, d]. Ring group (codes NULL: none): slot s's ring row r starts at
   codes + s * slot_stride + r * row_bytes, ring_ok [rows, ring] bytes (0/1). Table group
   (table NULL: none): row i of the fp32 table starts at table + i * table_stride (floats),
   idx and idx_ok [rows, picks]; a second table group likewise (table2 NULL: none), its keys
   after the first's. sink [heads] (q's type; NULL: none). out [rows, heads, d],
   lse [rows, heads]. */
#define UNION_ATTENTION(NAME, PART)                                                           \
int NAME(const void *q, const uint8_t *codes, const int64_t *slots, const uint8_t *ring_ok,  \
         int64_t ring, int64_t row_bytes, int64_t slot_stride, const void *table,             \
         const int64_t *idx, const uint8_t *idx_ok, int64_t picks, int64_t table_stride,      \
         const void *table2, const int64_t *idx2, const uint8_t *idx2_ok, int64_t picks2,     \
         int64_t table2_stride,                                                               \
         const void *sink, void *out, void *lse, int64_t rows, int64_t heads, int64_t d,     \
         double scale, int threads)                                                           \
{                                                                                             \
    Part base = {q, codes, slots, ring_ok, ring, row_bytes, slot_stride,                      \
                 {{table, idx, idx_ok, picks, table_stride},                                  \
                  {table2, idx2, idx2_ok, picks2, table2_stride}},                            \
                 out, lse, sink, 0, 0, heads, d, scale};                                      \
    return run(PART, base, rows, threads);                                                    \
}

UNION_ATTENTION(union_attention_f32, part_f32)
UNION_ATTENTION(union_attention_f64, part_f64)
