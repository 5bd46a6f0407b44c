/* Matrix products for the CPU engine, fp32 and fp64: out[M, N] = a[M, K] @ w[K, N], all
   row-major (w a weight as the engine stores it, [in, out]). The body is gemm_body.h,
   included once per type.

   Why not torch's: its fp32 mm is MKL's sgemm, which on AMD CPUs takes an AVX2 path (~100
   GFLOP/s a core at large M, ~70 at a decode step's 32 rows x K 128) and at 32 rows barely
   splits over threads. A register tile of up to 8 rows x 32 columns (16 AVX-512
   accumulators; each k: two loads of w, one broadcast of a per row, two FMAs per row) runs
   near the FMA ports' rate, and the column tiles split over the threads.

   Each output is an FMA chain over k in order from 0, in pieces of K_CHUNK added in order
   (a chain of 1024 products lost 3x MKL's accuracy): the same bits for a row whichever
   rows share the call and however many threads run it. MKL's are not (on the development
   machine a row alone and the same row among six differ, fp32 and fp64), which broke the
   promise that a speculative run stores the bytes a plain one does. A CPU with neither
   AVX-512 nor AVX2 + FMA gets rc -1 and the caller keeps torch's mm.

   gemm_packed_*: the same products over a weight packed once into column panels (each
   tile's k rows one contiguous stream; kernels/cpu_gemm.py). As stored, a tile reads 128
   bytes out of every row of w, a row apart: the prefetch below helps, but the 73 products
   of a decode step (17 MB of fp32 weights, cycling through L3) took 1.67 ms at 32 rows and
   0.96 ms at one row against 1.28 and 0.76 packed, the same bits. */

#include <stdint.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

/* Products per thread below which the work stays on one thread, and one row always does.
   A second thread saves at most a few us there (one row of 128 x 1024: 6.1 us on one, 5.2 on
   two) and can cost a scheduler time slice: with another process busy on the cores, the
   OpenMP barrier waits for a worker that is not running (that row took 7.8 ms). */
#define MIN_THREAD_WORK 262144
#define ROW_COLS 1024            /* row_stream's partial sums: 4 or 8 KB */
#define ROW_BLOCK 64
#define K_CHUNK 256
/* A tile reads w's rows 128 bytes at a time, one row (N elements) apart: a stride the
   hardware prefetchers do not follow across pages, so a weight not in cache cost each row
   a full miss (fp32 32 x 128 @ 128 x 1024 cold from memory: 88 us, hot 34). Asking for the
   row this many ahead: 50-60 us cold, the same hot. Past the last row it asks for bytes it
   never reads, which a prefetch may do (it never faults). */
#define PREFETCH_ROWS 24

#ifdef __AVX512F__
#define VECTOR_BYTES 64
#define MR 8
#define K_UNROLL_PRAGMA     /* unrolled only where it was measured: AVX2, below */
#define T float
#define V __m512
#define L 16
#define MASK __mmask16
#define FN(name) name##_f32
#define MASK_OF(n) ((MASK)((1u << (n)) - 1))
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VLOADZ(mask, p) _mm512_maskz_loadu_ps(mask, p)
#define VSTOREM(p, mask, v) _mm512_mask_storeu_ps(p, mask, v)
#define VLOADA(p) _mm512_load_ps(p)
#define VLOADU(p) _mm512_loadu_ps(p)
#define VSTOREU(p, v) _mm512_storeu_ps(p, v)
#define VSTOREA(p, v) _mm512_store_ps(p, v)
#include "gemm_body.h"

#define T double
#define V __m512d
#define L 8
#define MASK __mmask8
#define FN(name) name##_f64
#define MASK_OF(n) ((MASK)((1u << (n)) - 1))
#define VZERO() _mm512_setzero_pd()
#define VSET1(x) _mm512_set1_pd(x)
#define VFMA(a, b, c) _mm512_fmadd_pd(a, b, c)
#define VADD(a, b) _mm512_add_pd(a, b)
#define VLOADZ(mask, p) _mm512_maskz_loadu_pd(mask, p)
#define VSTOREM(p, mask, v) _mm512_mask_storeu_pd(p, mask, v)
#define VLOADA(p) _mm512_load_pd(p)
#define VLOADU(p) _mm512_loadu_pd(p)
#define VSTOREU(p, v) _mm512_storeu_pd(p, v)
#define VSTOREA(p, v) _mm512_store_pd(p, v)
#include "gemm_body.h"

#else
/* AVX2 + FMA (AMD Zen 1-3, Intel before Skylake-X, and the AVX-512 parts with it turned off):
   8 (fp32) or 4 (fp64) lanes and 16 vector registers, so a tile is 6 rows x 2 vectors (12
   accumulators, two of w, one broadcast), and packed panels are 16 fp32 / 8 fp64 columns
   wide (gemm_panel_cols). Each output is the same FMA chain as with AVX-512: the same bits
   on either kind of CPU. Masks are lane vectors: a lane is on where its index < n. */
#define VECTOR_BYTES 32
#define MR 6
/* The k loop four at a time: its counter, compare and branch and the prefetch's checks were
   a tenth of a 6 x 16 tile's time on Zen 3 (the FMAs are 12 of 28-32 instructions a k).
   Alternating with the rolled loop, 1 thread: 32 x 128 @ 128 x 512 77 -> 70 us, 32 x 1024 @
   1024 x 128 159 -> 146; 2 threads 0.90-0.92x; one row unchanged; unrolling 2 or 8 no better. */
#define K_UNROLL_PRAGMA _Pragma("GCC unroll 4")
#define T float
#define V __m256
#define L 8
#define MASK __m256i
#define FN(name) name##_f32
#define MASK_OF(n) _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VLOADZ(mask, p) _mm256_maskload_ps(p, mask)
#define VSTOREM(p, mask, v) _mm256_maskstore_ps(p, mask, v)
#define VLOADA(p) _mm256_load_ps(p)
#define VLOADU(p) _mm256_loadu_ps(p)
#define VSTOREU(p, v) _mm256_storeu_ps(p, v)
#define VSTOREA(p, v) _mm256_store_ps(p, v)
#include "gemm_body.h"

#define T double
#define V __m256d
#define L 4
#define MASK __m256i
#define FN(name) name##_f64
#define MASK_OF(n) _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3))
#define VZERO() _mm256_setzero_pd()
#define VSET1(x) _mm256_set1_pd(x)
#define VFMA(a, b, c) _mm256_fmadd_pd(a, b, c)
#define VADD(a, b) _mm256_add_pd(a, b)
#define VLOADZ(mask, p) _mm256_maskload_pd(p, mask)
#define VSTOREM(p, mask, v) _mm256_maskstore_pd(p, mask, v)
#define VLOADA(p) _mm256_load_pd(p)
#define VLOADU(p) _mm256_loadu_pd(p)
#define VSTOREU(p, v) _mm256_storeu_pd(p, v)
#define VSTOREA(p, v) _mm256_store_pd(p, v)
#include "gemm_body.h"
#endif

/* The packed panels' width in columns (a tile's two vectors) for elements of `elem_bytes`
   bytes: kernels/cpu_gemm.py packs to it. */
int gemm_panel_cols(int elem_bytes)
{
    return 2 * VECTOR_BYTES / elem_bytes;
}

#else

int gemm_panel_cols(int elem_bytes)
{
    (void)elem_bytes;
    return 0;
}

int gemm_f32(const float *a, int64_t lda, const float *w, int64_t ldw, float *out, int64_t ldo,
             int64_t m, int64_t k, int64_t n, int threads)
{
    (void)a, (void)lda, (void)w, (void)ldw, (void)out, (void)ldo, (void)m, (void)k, (void)n,
        (void)threads;
    return -1;
}

int gemm_f64(const double *a, int64_t lda, const double *w, int64_t ldw, double *out,
             int64_t ldo, int64_t m, int64_t k, int64_t n, int threads)
{
    (void)a, (void)lda, (void)w, (void)ldw, (void)out, (void)ldo, (void)m, (void)k, (void)n,
        (void)threads;
    return -1;
}

int gemm_packed_f32(const float *a, int64_t lda, const float *panels, float *out, int64_t ldo,
                    int64_t m, int64_t k, int64_t n, int threads)
{
    (void)a, (void)lda, (void)panels, (void)out, (void)ldo, (void)m, (void)k, (void)n,
        (void)threads;
    return -1;
}

int gemm_packed_f64(const double *a, int64_t lda, const double *panels, double *out,
                    int64_t ldo, int64_t m, int64_t k, int64_t n, int threads)
{
    (void)a, (void)lda, (void)panels, (void)out, (void)ldo, (void)m, (void)k, (void)n,
        (void)threads;
    return -1;
}

#endif
