/* Decode attention over MXFP8 ring rows, for the CPU (kernels/cpu_ring.py builds and loads it).

   A decode row reads its slot's whole window every layer: R rows of D values. Kept as fp32
   copies those are 4 D bytes a row and a batched decode step is bound by reading them
   (2,048 B a row at D = 512); the MXFP8 bytes are D + D / 32 (528 B). This kernel reads the
   bytes and expands BLOCK rows at a time into a buffer that stays in L1, then scores them
   against every head, updates an online softmax once per block and adds the block's rows
   into the heads' sums with the partial sums held in registers.

   For each query row t (its slot slots[t]; R ring rows; ok[t, r] = row t may see ring row r):
       s_h(r)  = scale * <q[t, h], v(r)>                     for the seen rows r
       out[t, h] = sum_r e^(s_h(r) - lse) v(r),   lse[t, h] = log sum_r e^s_h(r)
   A row that sees nothing gets out 0 and lse -inf (the caller joins the other key groups and
   the sink by lse). v(r) is the row's exact dequantized value: E4M3 codes times the block's
   power of two are exact in fp32.

   ring_attention_f32 is the fast path (fp32 q, out, lse; GCC/Clang vector extensions, so
   the compiler emits the machine's widest SIMD); ring_attention_f64 is the same math in
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
    const void *q; const uint8_t *codes; const int64_t *slots; const uint8_t *ok;
    void *out, *lse;
    int64_t first, last, heads, d, ring, row_bytes, slot_stride;
    double scale;
} Part;

/* Rows [first, last): q [rows, heads, d]; slot s's ring row r starts at
   codes + s * slot_stride + r * row_bytes; ok [rows, ring] bytes (0/1). d % 32 == 0,
   d <= MAX_D (the caller checks). */
static void part_f32(const Part *a)
{
    const int64_t heads = a->heads, d = a->d, nv = d / VL;
    const float scale = (float)a->scale;
    vf vals[BLOCK][MAX_D / VL];
    vf acc[heads][MAX_D / VL];
    float mx[heads], den[heads], p[BLOCK];
    int64_t picked[BLOCK];
    for (int64_t t = a->first; t < a->last; t++) {
        const float *qt = (const float *)a->q + t * heads * d;
        const uint8_t *slot = a->codes + a->slots[t] * a->slot_stride;
        const uint8_t *seen = a->ok + t * a->ring;
        for (int64_t h = 0; h < heads; h++) {
            mx[h] = -INFINITY;
            den[h] = 0;
            for (int64_t c = 0; c < nv; c++)
                acc[h][c] = (vf){0};
        }
        for (int64_t r = 0; r < a->ring;) {
            int nb = 0;
            for (; r < a->ring && nb < BLOCK; r++)
                if (seen[r])
                    picked[nb++] = r;
            /* ask for the next block's bytes now, so they arrive while this one is worked */
            const uint8_t *next = r < a->ring ? slot + r * a->row_bytes
                                : t + 1 < a->last ? a->codes + a->slots[t + 1] * a->slot_stride
                                : NULL;
            for (int64_t at = 0; next && at < BLOCK * a->row_bytes; at += 64)
                __builtin_prefetch(next + at);
            for (int k = 0; k < nb; k++)
                expand_row(slot + picked[k] * a->row_bytes, (int)d, (float *)vals[k]);
            for (int64_t h = 0; nb && h < heads; h++) {
                const vf_unaligned *qh = (const vf_unaligned *)(qt + h * d);
                float top = -INFINITY;
                for (int k = 0; k < nb; k++) {       /* four chains: the adds overlap */
                    vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
                    for (int64_t c = 0; c < nv; c += 4) {
                        s0 += qh[c] * vals[k][c];
                        s1 += qh[c + 1] * vals[k][c + 1];
                        s2 += qh[c + 2] * vals[k][c + 2];
                        s3 += qh[c + 3] * vals[k][c + 3];
                    }
                    p[k] = hsum((s0 + s1) + (s2 + s3)) * scale;
                    top = p[k] > top ? p[k] : top;
                }
                if (top > mx[h]) {                   /* a new running max: rescale the sums */
                    float shrink = expf(mx[h] - top);
                    den[h] *= shrink;
                    for (int64_t c = 0; c < nv; c++)
                        acc[h][c] *= shrink;
                    mx[h] = top;
                }
                for (int k = 0; k < nb; k++) {
                    p[k] = expf(p[k] - mx[h]);
                    den[h] += p[k];
                }
                for (int64_t c = 0; c < nv; c += 4) {  /* 64 columns' sums stay in registers */
                    vf o0 = acc[h][c], o1 = acc[h][c + 1], o2 = acc[h][c + 2], o3 = acc[h][c + 3];
                    for (int k = 0; k < nb; k++) {
                        o0 += p[k] * vals[k][c];
                        o1 += p[k] * vals[k][c + 1];
                        o2 += p[k] * vals[k][c + 2];
                        o3 += p[k] * vals[k][c + 3];
                    }
                    acc[h][c] = o0;
                    acc[h][c + 1] = o1;
                    acc[h][c + 2] = o2;
                    acc[h][c + 3] = o3;
                }
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            float *o = (float *)a->out + (t * heads + h) * d;
            float inv = den[h] > 0 ? 1 / den[h] : 0;
            for (int64_t c = 0; c < nv; c++) {
                vf x = acc[h][c] * inv;
                memcpy(o + c * VL, &x, sizeof x);
            }
            ((float *)a->lse)[t * heads + h] = den[h] > 0 ? mx[h] + logf(den[h]) : -INFINITY;
        }
    }
}

/* The same attention in float64, one ring row at a time: the reference-grade path. */
static void part_f64(const Part *a)
{
    const int64_t heads = a->heads, d = a->d;
    float v[MAX_D];
    double acc[heads * d], mx[heads], den[heads];
    for (int64_t t = a->first; t < a->last; t++) {
        const double *qt = (const double *)a->q + t * heads * d;
        const uint8_t *slot = a->codes + a->slots[t] * a->slot_stride;
        const uint8_t *seen = a->ok + t * a->ring;
        for (int64_t h = 0; h < heads; h++) {
            mx[h] = -INFINITY;
            den[h] = 0;
        }
        memset(acc, 0, sizeof acc);
        for (int64_t r = 0; r < a->ring; r++) {
            if (!seen[r])
                continue;
            expand_row(slot + r * a->row_bytes, (int)d, v);
            for (int64_t h = 0; h < heads; h++) {
                double dot = 0, *o = acc + h * d;
                for (int64_t i = 0; i < d; i++)
                    dot += qt[h * d + i] * (double)v[i];
                double s = dot * a->scale;
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
                    o[i] += w * (double)v[i];
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            double *o = (double *)a->out + (t * heads + h) * d;
            double inv = den[h] > 0 ? 1 / den[h] : 0;
            for (int64_t i = 0; i < d; i++)
                o[i] = acc[h * d + i] * inv;
            ((double *)a->lse)[t * heads + h] = den[h] > 0 ? mx[h] + log(den[h]) : -INFINITY;
        }
    }
}

/* All `rows`, split over `threads` OpenMP threads. The library is loaded into a process that
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

int ring_attention_f32(const float *q, const uint8_t *codes, const int64_t *slots,
                       const uint8_t *ok, float *out, float *lse, int64_t rows, int64_t heads,
                       int64_t d, int64_t ring, int64_t row_bytes, int64_t slot_stride,
                       double scale, int threads)
{
    Part base = {q, codes, slots, ok, out, lse, 0, 0, heads, d, ring, row_bytes, slot_stride,
                 scale};
    return run(part_f32, base, rows, threads);
}

int ring_attention_f64(const double *q, const uint8_t *codes, const int64_t *slots,
                       const uint8_t *ok, double *out, double *lse, int64_t rows,
                       int64_t heads, int64_t d, int64_t ring, int64_t row_bytes,
                       int64_t slot_stride, double scale, int threads)
{
    Part base = {q, codes, slots, ok, out, lse, 0, 0, heads, d, ring, row_bytes, slot_stride,
                 scale};
    return run(part_f64, base, rows, threads);
}
