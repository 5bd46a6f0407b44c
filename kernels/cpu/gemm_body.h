/* The body of kernels/cpu/gemm.c, included once per element type. The includer defines:
     T            float or double          L      lanes of one vector (AVX-512 or AVX2)
     V            the vector type          MASK   its lane mask type
     FN(name)     name with the type's suffix
     MR           rows of a tile (8, or 6 with AVX2's 16 vector registers)
     K_UNROLL_PRAGMA  a pragma for the tile's k loop (unrolling), or nothing
     VZERO() VSET1(x) VFMA(a, b, c) VADD(a, b) VLOADZ(mask, p) VSTOREM(p, mask, v)
     VLOADA(p) VSTOREA(p, v) VLOADU(p) VSTOREU(p, v) MASK_OF(n) (the first n lanes, 0 <= n <= L)
   and gets them back undefined, ready for the next type. A tile is up to MR rows x 2 vectors
   of columns; see gemm.c for why. */

#define TCOLS (2 * L)

/* R rows x TCOLS columns (fewer where the masks end them): c[r] += a[r, k] * w[k, :] for
   every k, in order. One inlined body per constant R, with the accumulators as named
   variables: gcc keeps an array of them in memory and stores it back on every k.
   FULL (every tile but a narrow w's last): plain loads and stores, no masks. AVX2 has no
   mask registers, and its masked store is microcoded on AMD. The same sums: 32 x 128 @
   128 x 1024 on Zen 3, 2 threads, taking turns with the masked build: 113 -> 99 us;
   32 x 1024 @ 1024 x 128: 115 -> 105 us. */
#define ACC(r) V c0_##r = VZERO(), c1_##r = VZERO();
#define FMA(r)                                                                               \
    if (R > r) {                                                                             \
        V x = VSET1(a[r * lda + k]);                                                         \
        c0_##r = VFMA(x, w0, c0_##r);                                                        \
        c1_##r = VFMA(x, w1, c1_##r);                                                        \
    }
/* A full tile's loads and stores plain, the last tile's masked */
#define LOAD(m, p) (FULL ? VLOADU(p) : VLOADZ(m, p))
#define STORE_ONE(p, m, v)                                                                   \
    do {                                                                                     \
        if (FULL)                                                                            \
            VSTOREU(p, v);                                                                   \
        else                                                                                 \
            VSTOREM(p, m, v);                                                                \
    } while (0)
#define STORE(r)                                                                             \
    if (R > r) {                                                                             \
        T *o = out + r * ldo;                                                                \
        if (add) {                                                                           \
            c0_##r = VADD(LOAD(m0, o), c0_##r);                                              \
            c1_##r = VADD(LOAD(m1, o + L), c1_##r);                                          \
        }                                                                                    \
        STORE_ONE(o, m0, c0_##r);                                                            \
        STORE_ONE(o + L, m1, c1_##r);                                                        \
    }

static inline __attribute__((always_inline)) void
FN(tile)(const int R, const int FULL, const T *a, int64_t lda, const T *w, int64_t ldw, T *out,
         int64_t ldo, int64_t k_len, MASK m0, MASK m1, int add, const T *pf, int pf_lines)
{
    ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7)
    K_UNROLL_PRAGMA
    for (int64_t k = 0; k < k_len; k++) {
        const T *wk = w + k * ldw;
        _mm_prefetch((const char *)(wk + PREFETCH_ROWS * ldw), _MM_HINT_T0);
        if (TCOLS * sizeof(T) > 64)             /* AVX2 fp32: the row is one line */
            _mm_prefetch((const char *)(wk + PREFETCH_ROWS * ldw + L), _MM_HINT_T0);
        if (pf_lines > 0) {
            _mm_prefetch((const char *)(pf + k * TCOLS), _MM_HINT_T0);
            if (pf_lines > 1)
                _mm_prefetch((const char *)(pf + k * TCOLS + L), _MM_HINT_T0);
        }
        V w0 = LOAD(m0, wk);
        V w1 = LOAD(m1, wk + L);
        FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5) FMA(6) FMA(7)
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7)
}

#undef ACC
#undef FMA
#undef STORE
#undef STORE_ONE
#undef LOAD

#define TILE(R)                                                                              \
    static void FN(tile_##R)(const T *a, int64_t lda, const T *w, int64_t ldw, T *out,       \
                             int64_t ldo, int64_t k_len, MASK m0, MASK m1, int add,          \
                             const T *pf, int pf_lines)                                      \
    {                                                                                        \
        FN(tile)(R, 0, a, lda, w, ldw, out, ldo, k_len, m0, m1, add, pf, pf_lines);          \
    }                                                                                        \
    static void FN(full_##R)(const T *a, int64_t lda, const T *w, int64_t ldw, T *out,       \
                             int64_t ldo, int64_t k_len, MASK m0, MASK m1, int add,          \
                             const T *pf, int pf_lines)                                      \
    {                                                                                        \
        FN(tile)(R, 1, a, lda, w, ldw, out, ldo, k_len, m0, m1, add, pf, pf_lines);          \
    }
TILE(1)
TILE(2)
TILE(3)
TILE(4)
TILE(5)
TILE(6)
TILE(7)
TILE(8)
#undef TILE

typedef void (*FN(tile_fn))(const T *, int64_t, const T *, int64_t, T *, int64_t, int64_t,
                            MASK, MASK, int, const T *, int);
static const FN(tile_fn) FN(tiles)[2][9] = {   /* [full][rows] */
    {0, FN(tile_1), FN(tile_2), FN(tile_3), FN(tile_4), FN(tile_5), FN(tile_6), FN(tile_7),
     FN(tile_8)},
    {0, FN(full_1), FN(full_2), FN(full_3), FN(full_4), FN(full_5), FN(full_6), FN(full_7),
     FN(full_8)}};

static inline MASK FN(mask_of)(int64_t n)
{
    return MASK_OF(n >= L ? L : n <= 0 ? 0 : (int)n);
}

/* One row (a batch-1 decode step) over columns [j0, j1), up to ROW_COLS at a time: each k
   streams w's row once, contiguously (the prefetchers follow that; a tile's stride they
   do not), into partial sums kept in L1. Each output's chain is the tiles' (k in order
   from 0 within a piece of K_CHUNK, the pieces added in order): the same bits. */
static void FN(row_stream)(const T *a, const T *w, int64_t ldw, T *out, int64_t k_len,
                           int64_t j0, int64_t j1)
{
    T part[ROW_COLS] __attribute__((aligned(64)));
    for (int64_t c0 = j0; c0 < j1; c0 += ROW_COLS) {
        int64_t cols = j1 - c0 < ROW_COLS ? j1 - c0 : ROW_COLS;
        for (int64_t k0 = 0; k0 < k_len; k0 += K_CHUNK) {
            int64_t k1 = k0 + K_CHUNK < k_len ? k0 + K_CHUNK : k_len;
            for (int64_t j = 0; j < cols; j += L)
                VSTOREA(part + j, VZERO());
            for (int64_t k = k0; k < k1; k++) {
                V x = VSET1(a[k]);
                const T *wk = w + k * ldw + c0;
                for (int64_t j = 0; j < cols; j += L)
                    VSTOREA(part + j, VFMA(x, VLOADZ(FN(mask_of)(cols - j), wk + j),
                                           VLOADA(part + j)));
            }
            for (int64_t j = 0; j < cols; j += L) {
                MASK mk = FN(mask_of)(cols - j);
                V v = VLOADA(part + j);
                if (k0 > 0)
                    v = VADD(VLOADZ(mk, out + c0 + j), v);
                VSTOREM(out + c0 + j, mk, v);
            }
        }
    }
}

/* Rows [r0, r1) x column tiles [t0, t1), ROW_BLOCK rows at a time: a tile's w panel is read
   from memory once and from L1/L2 for the next rows, and the block's rows of a stay near
   while every tile passes over them. Tile t's weights start at w + t * tstride, one k row
   every ldw elements: tstride = TCOLS and ldw = n's row length for w as stored ([k, n]),
   tstride = k * TCOLS and ldw = TCOLS for packed panels (FN(gemm_packed)). */
static void FN(block)(const T *a, int64_t lda, const T *w, int64_t ldw, int64_t tstride, T *out,
                      int64_t ldo, int64_t k, int64_t n, int64_t r0, int64_t r1, int64_t t0,
                      int64_t t1)
{
    for (int64_t i0 = r0; i0 < r1; i0 += ROW_BLOCK) {
        int64_t i1 = i0 + ROW_BLOCK < r1 ? i0 + ROW_BLOCK : r1;
        /* A block's first pass over a panel reads it from memory at the FMA rate of 8 rows,
           faster than memory delivers; its later passes read it from L1. Packed, the next
           panel is one stream right after this one, so the later passes ask for it, a line
           per k (the second pass line 0 of each of its k rows, the third line 1; a lone
           second pass both): the next first pass then finds it in cache. The 73 products
           of a tiny decode step at 32 rows, 20 MB swept between calls, 2 threads, the two
           ways taking turns in one process: 1.29 -> 1.23 ms (per-call median ratio 0.95);
           one row has no later pass and is unchanged (0.77 ms). */
        int64_t hot = (i1 - i0 + MR - 1) / MR - 1;   /* passes over a panel after its first */
        for (int64_t t = t0; t < t1; t++) {
            int64_t j = t * TCOLS;
            const T *wt = w + t * tstride;
            const T *next = hot && ldw == TCOLS && t + 1 < t1 ? wt + tstride : 0;
            MASK m0 = FN(mask_of)(n - j), m1 = FN(mask_of)(n - j - L);
            const FN(tile_fn) *tiles = FN(tiles)[n - j >= TCOLS];
            /* The block's rows split evenly over its passes (AVX2, 32 rows: 6 6 5 5 5 5, not
               6 6 6 6 6 2): a tile of r rows keeps 2r FMA chains, and under 4 rows its
               chains wait on their own latency, so a 2-row last pass cost 2/3 of a full
               one for 1/3 of its work (same chains, same bits; 1 thread, taking turns:
               8 x 128 @ 128 x 1024 0.87x, 32 rows 0.94-0.95x; 2 threads 0.97-1.0x). */
            const int64_t passes = hot + 1;
            for (int64_t pass = 0; pass < passes; pass++) {
                int64_t i = i0 + (i1 - i0) * pass / passes;
                int64_t r = i0 + (i1 - i0) * (pass + 1) / passes - i;
                const T *pf = 0;
                int lines = 0;
                if (next && pass == 1) {
                    pf = next, lines = hot == 1 && TCOLS * sizeof(T) > 64 ? 2 : 1;
                } else if (next && pass == 2 && TCOLS * sizeof(T) > 64) {
                    pf = next + L, lines = 1;
                }
                for (int64_t k0 = 0; k0 < k; k0 += K_CHUNK)
                    tiles[r](a + i * lda + k0, lda, wt + k0 * ldw, ldw, out + i * ldo + j, ldo,
                             k - k0 < K_CHUNK ? k - k0 : K_CHUNK, m0, m1, k0 > 0,
                             pf ? pf + k0 * TCOLS : 0, lines);
            }
        }
    }
}

/* The threads split the column tiles, or, where there are fewer tiles than threads (a
   narrow w: the indexer's weights, a prefill chunk's narrow projections), the rows in
   blocks of MR. One row of w as stored streams w's rows (row_stream) on one thread; one row
   of packed panels takes the tiles (each panel is one stream already). */
static int FN(run)(const T *a, int64_t lda, const T *w, int64_t ldw, int packed, T *out,
                   int64_t ldo, int64_t m, int64_t k, int64_t n, int threads)
{
    if (m < 0 || k < 0 || n < 0)
        return 2;
    if (m == 0 || n == 0)
        return 0;
    int stream = m == 1 && !packed;
    int64_t width = stream ? L : TCOLS;
    int64_t tiles = (n + width - 1) / width, row_blocks = (m + MR - 1) / MR;
    int64_t tstride = packed ? k * TCOLS : TCOLS;
    int by_rows = tiles < threads && row_blocks > tiles;
    int64_t parts = by_rows ? row_blocks : tiles;
    if (threads > parts)
        threads = (int)parts;
    if (threads > 1 && (m == 1 || m * k * n < (int64_t)threads * MIN_THREAD_WORK))
        threads = m == 1 ? 1 : (int)(m * k * n / MIN_THREAD_WORK);
    if (threads < 1)
        threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int i = 0; i < threads; i++) {
        int64_t p0 = parts * i / threads, p1 = parts * (i + 1) / threads;
        if (stream) {
            FN(row_stream)(a, w, ldw, out, k, p0 * L, p1 * L < n ? p1 * L : n);
        } else if (by_rows) {
            int64_t r1 = MR * p1 < m ? MR * p1 : m;
            FN(block)(a, lda, w, ldw, tstride, out, ldo, k, n, MR * p0, r1, 0, tiles);
        } else {
            FN(block)(a, lda, w, ldw, tstride, out, ldo, k, n, 0, m, p0, p1);
        }
    }
    return 0;
}

/* out[m, n] = a[m, k] @ w[k, n], w as stored (row-major, ldw elements a row). */
int FN(gemm)(const T *a, int64_t lda, const T *w, int64_t ldw, T *out, int64_t ldo, int64_t m,
             int64_t k, int64_t n, int threads)
{
    return FN(run)(a, lda, w, ldw, 0, out, ldo, m, k, n, threads);
}

/* The same product over w packed as panels [ceil(n / TCOLS)][k][TCOLS] (kernels/cpu_gemm.py
   packs the model's weights once): the same FMA chains, so the same bits, but each tile reads
   one contiguous stream instead of 2 * L elements out of every row of w. */
int FN(gemm_packed)(const T *a, int64_t lda, const T *panels, T *out, int64_t ldo, int64_t m,
                    int64_t k, int64_t n, int threads)
{
    return FN(run)(a, lda, panels, TCOLS, 1, out, ldo, m, k, n, threads);
}

#undef TCOLS
#undef T
#undef V
#undef L
#undef MASK
#undef FN
#undef MASK_OF
#undef VZERO
#undef VSET1
#undef VFMA
#undef VADD
#undef VLOADZ
#undef VSTOREM
#undef VLOADA
#undef VSTOREA
#undef VLOADU
#undef VSTOREU
