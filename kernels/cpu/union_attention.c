/* Decode attention over MXFP8 ring rows and rows picked from a table, for the CPU
   (kernels/cpu_ring.py builds and loads it).

   A decode row reads its slot's whole window every layer: R rows of D values. Kept as fp32
   copies those are 4 D bytes a row and a batched decode step is bound by reading them
   (2,048 B a row at D = 512); the MXFP8 bytes are D + D / 32 (528 B). This kernel reads the
   bytes and expands BLOCK rows at a time into a buffer that stays in L1, then scores them
   against every head, updates an online softmax once per block and adds the block's rows
   into the heads' sums with the partial sums held in registers.

   The second group is a decode row's compressed entries: rows of an fp32 table (the block
   store's entries, fp32 whatever the engine's dtype) named per query row by an index, read in place where the torch
   path would gather them into a [T, K, D] copy first and then read that twice.

   For each query row t, its keys are the ring rows r of slot slots[t] with ring_ok[t, r] and
   the table rows idx[t, k] with idx_ok[t, k]; with v(j) a key's value (= the key: MQA)
       s_h(j)  = scale * <q[t, h], v(j)>
       out[t, h] = sum_j e^(s_h(j) - lse) v(j),   lse[t, h] = log sum_j e^s_h(j)
   A row that sees nothing gets out 0 and lse -inf (the caller joins the sink, and any other
   key group, by lse). A ring row's value is its exact dequantized value: E4M3 codes times
   the block's power of two are exact in fp32.

   union_attention_f32 is the fast path (fp32 q, out, lse; GCC/Clang vector extensions, so
   the compiler emits the machine's widest SIMD); union_attention_f64 is the same math in
   float64 with plain loops, for the engine's float64 exactness tests. Rows are split over
   torch's own OpenMP threads (see run). Built without -ffast-math: every sum is split into
   lanes by hand, and nothing may be reassociated. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { VL = 16, MAX_D = 1024, BLOCK = 16 };

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
/* With AVX-512 a block is two 16-lane widenings and a bit select (the generic loops below
   compile to a chain of narrower widenings and a second pass over the row). */
static void expand_row(const uint8_t *restrict row, int d, float *restrict out)
{
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u), mag = _mm512_set1_epi32(0x07f00000);
    for (int b = 0; b < d / 32; b++) {
        float k, rest;
        block_factors(row[d + b], &k, &rest);
        __m512 kv = _mm512_set1_ps(k);
        for (int half = 0; half < 2; half++) {
            __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b * 32 + half * 16)));
            /* (c << 24) & sign | (c << 20) & mag */
            __m512i bits = _mm512_ternarylogic_epi32(_mm512_slli_epi32(c, 24), sign,
                                                     _mm512_and_si512(_mm512_slli_epi32(c, 20), mag), 0xEA);
            __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(bits), kv);
            if (rest != 1.0f)
                v = _mm512_mul_ps(v, _mm512_set1_ps(rest));
            _mm512_storeu_ps(out + b * 32 + half * 16, v);
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
    float t[VL];
    memcpy(t, &a, sizeof t);
    for (int w = VL / 2; w > 0; w /= 2)        /* a tree: 4 dependent adds, not 15 */
        for (int i = 0; i < w; i++)
            t[i] += t[i + w];
    return t[0];
}

typedef struct {
    const void *q;
    const uint8_t *codes; const int64_t *slots; const uint8_t *ring_ok;   /* codes: NULL = none */
    int64_t ring, row_bytes, slot_stride;
    const void *table; const int64_t *idx; const uint8_t *idx_ok;       /* table: NULL = none */
    int64_t picks, table_stride;
    void *out, *lse;
    int64_t first, last, heads, d;
    double scale;
} Part;

/* One query row's running softmax over the blocks of keys fed to it. */
typedef struct {
    vf acc[MAX_D / VL];
    float mx, den;
} Head32;

/* A block of nb key rows (pointers to d floats each) for query row qt: scores against every
   head, one rescale per block when the running max moves, then the rows added in. */
static void feed_f32(Head32 *hs, const float *qt, int64_t heads, int64_t d, float scale,
                     const float *const *rows, int nb)
{
    typedef float vf_unaligned __attribute__((vector_size(VL * 4), aligned(4)));
    const int64_t nv = d / VL;
    float p[BLOCK];
    for (int64_t h = 0; h < heads; h++) {
        const vf_unaligned *qh = (const vf_unaligned *)(qt + h * d);
        Head32 *st = &hs[h];
        float top = -INFINITY;
        for (int k = 0; k < nb; k++) {               /* four chains: the adds overlap */
            const vf_unaligned *v = (const vf_unaligned *)rows[k];
            vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            for (int64_t c = 0; c < nv; c += 4) {
                s0 += qh[c] * v[c];
                s1 += qh[c + 1] * v[c + 1];
                s2 += qh[c + 2] * v[c + 2];
                s3 += qh[c + 3] * v[c + 3];
            }
            p[k] = hsum((s0 + s1) + (s2 + s3)) * scale;
            top = p[k] > top ? p[k] : top;
        }
        if (top > st->mx) {                          /* a new running max: rescale the sums */
            float shrink = expf(st->mx - top);
            st->den *= shrink;
            for (int64_t c = 0; c < nv; c++)
                st->acc[c] *= shrink;
            st->mx = top;
        }
        for (int k = 0; k < nb; k++) {
            p[k] = expf(p[k] - st->mx);
            st->den += p[k];
        }
        for (int64_t c = 0; c < nv; c += 4) {        /* 64 columns' sums stay in registers */
            vf o0 = st->acc[c], o1 = st->acc[c + 1], o2 = st->acc[c + 2], o3 = st->acc[c + 3];
            for (int k = 0; k < nb; k++) {
                const vf_unaligned *v = (const vf_unaligned *)rows[k];
                o0 += p[k] * v[c];
                o1 += p[k] * v[c + 1];
                o2 += p[k] * v[c + 2];
                o3 += p[k] * v[c + 3];
            }
            st->acc[c] = o0;
            st->acc[c + 1] = o1;
            st->acc[c + 2] = o2;
            st->acc[c + 3] = o3;
        }
    }
}

static void part_f32(const Part *a)
{
    const int64_t heads = a->heads, d = a->d, nv = d / VL;
    const float scale = (float)a->scale;
    vf vals[BLOCK][MAX_D / VL];
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
        if (a->table) {
            const int64_t *pick = a->idx + t * a->picks;
            const uint8_t *seen = a->idx_ok + t * a->picks;
            for (int64_t k = 0; k < a->picks;) {
                int nb = 0;
                for (; k < a->picks && nb < BLOCK; k++)
                    if (seen[k])
                        rows[nb++] = (const float *)a->table + pick[k] * a->table_stride;
                if (nb)
                    feed_f32(hs, qt, heads, d, scale, rows, nb);
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            float *o = (float *)a->out + (t * heads + h) * d;
            float inv = hs[h].den > 0 ? 1 / hs[h].den : 0;
            for (int64_t c = 0; c < nv; c++) {
                vf x = hs[h].acc[c] * inv;
                memcpy(o + c * VL, &x, sizeof x);
            }
            ((float *)a->lse)[t * heads + h] =
                hs[h].den > 0 ? hs[h].mx + logf(hs[h].den) : -INFINITY;
        }
    }
    free(hs);
}

/* One key row v for query row qt, float64, plain loops: the reference-grade path. */
static void feed_f64(double *acc, double *mx, double *den, const double *qt, int64_t heads,
                     int64_t d, double scale, const double *v)
{
    for (int64_t h = 0; h < heads; h++) {
        double dot = 0, *o = acc + h * d;
        for (int64_t i = 0; i < d; i++)
            dot += qt[h * d + i] * v[i];
        double s = dot * scale;
        if (s > mx[h]) {
            double shrink = exp(mx[h] - s);
            den[h] *= shrink;
            for (int64_t i = 0; i < d; i++)
                o[i] *= shrink;
            mx[h] = s;
        }
        double w = exp(s - mx[h]);
        den[h] += w;
        for (int64_t i = 0; i < d; i++)
            o[i] += w * v[i];
    }
}

static void part_f64(const Part *a)
{
    const int64_t heads = a->heads, d = a->d;
    float v32[MAX_D];
    double v[MAX_D];
    double *acc = malloc(sizeof(double) * (size_t)(heads * d + 2 * heads));
    if (!acc)
        abort();
    double *mx = acc + heads * d, *den = mx + heads;
    for (int64_t t = a->first; t < a->last; t++) {
        const double *qt = (const double *)a->q + t * heads * d;
        for (int64_t h = 0; h < heads; h++) {
            mx[h] = -INFINITY;
            den[h] = 0;
        }
        memset(acc, 0, sizeof(double) * (size_t)(heads * d));
        for (int64_t r = 0; a->codes && r < a->ring; r++) {
            if (!a->ring_ok[t * a->ring + r])
                continue;
            expand_row(a->codes + a->slots[t] * a->slot_stride + r * a->row_bytes, (int)d, v32);
            for (int64_t i = 0; i < d; i++)
                v[i] = v32[i];
            feed_f64(acc, mx, den, qt, heads, d, a->scale, v);
        }
        for (int64_t k = 0; a->table && k < a->picks; k++) {
            if (!a->idx_ok[t * a->picks + k])
                continue;
            const float *row = (const float *)a->table + a->idx[t * a->picks + k] * a->table_stride;
            for (int64_t i = 0; i < d; i++)
                v[i] = row[i];
            feed_f64(acc, mx, den, qt, heads, d, a->scale, v);
        }
        for (int64_t h = 0; h < heads; h++) {
            double *o = (double *)a->out + (t * heads + h) * d;
            double inv = den[h] > 0 ? 1 / den[h] : 0;
            for (int64_t i = 0; i < d; i++)
                o[i] = acc[h * d + i] * inv;
            ((double *)a->lse)[t * heads + h] = den[h] > 0 ? mx[h] + log(den[h]) : -INFINITY;
        }
    }
    free(acc);
}

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
   idx and idx_ok [rows, picks]. out [rows, heads, d], lse [rows, heads]. */
#define UNION_ATTENTION(NAME, PART)                                                           \
int NAME(const void *q, const uint8_t *codes, const int64_t *slots, const uint8_t *ring_ok,  \
         int64_t ring, int64_t row_bytes, int64_t slot_stride, const void *table,             \
         const int64_t *idx, const uint8_t *idx_ok, int64_t picks, int64_t table_stride,      \
         void *out, void *lse, int64_t rows, int64_t heads, int64_t d, double scale,          \
         int threads)                                                                         \
{                                                                                             \
    Part base = {q, codes, slots, ring_ok, ring, row_bytes, slot_stride, table, idx, idx_ok,  \
                 picks, table_stride, out, lse, 0, 0, heads, d, scale};                       \
    return run(PART, base, rows, threads);                                                    \
}

UNION_ATTENTION(union_attention_f32, part_f32)
UNION_ATTENTION(union_attention_f64, part_f64)
