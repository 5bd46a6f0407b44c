/* Whole-row copies into and out of per-slot rings and tables, for the CPU
   (kernels/cpu_rows.py calls them; kernels/cpu_ring.py builds this file into the same library
   as union_attention.c).

   A decode step writes one row per sequence into every layer's rings (the MXFP8 bytes, the
   fp32 mirror, the compressor tails) and reads rows back by index (tails, indexer keys). torch
   has index_copy_, index_put_ and index_select for that, and on the CPU they walk elements:
   32 rows of 528 B into a strided ring cost ~40 us, 2,400 indexer keys of 128 B ~170 us
   (1 thread). Here a row is one memcpy.

   Row i lives at base + slots[i] * slot_stride + rows[i] * row_stride (bytes; rows NULL: a
   flat table, base + slots[i] * slot_stride). Every index is checked against its bound before
   anything is copied: a bad one returns -1 and nothing moves (the caller raises). */

#include <stdint.h>
#include <string.h>

static int in_bounds(const int64_t *slots, const int64_t *rows, int64_t n, int64_t n_slots,
                     int64_t n_rows)
{
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= n_slots)
            return 0;
        if (rows && (rows[i] < 0 || rows[i] >= n_rows))
            return 0;
    }
    return 1;
}

/* ring rows (slots[i], rows[i]) = src row i (src: n contiguous rows of `bytes`) */
int put_rows(uint8_t *ring, int64_t n_slots, int64_t n_rows, int64_t slot_stride,
             int64_t row_stride, const int64_t *slots, const int64_t *rows, const uint8_t *src,
             int64_t n, int64_t bytes)
{
    if (!in_bounds(slots, rows, n, n_slots, n_rows))
        return -1;
    for (int64_t i = 0; i < n; i++)
        memcpy(ring + slots[i] * slot_stride + (rows ? rows[i] * row_stride : 0),
               src + i * bytes, (size_t)bytes);
    return 0;
}

/* out row i (n contiguous rows of `bytes`) = ring row (slots[i], rows[i]) */
int take_rows(const uint8_t *ring, int64_t n_slots, int64_t n_rows, int64_t slot_stride,
              int64_t row_stride, const int64_t *slots, const int64_t *rows, uint8_t *out,
              int64_t n, int64_t bytes)
{
    if (!in_bounds(slots, rows, n, n_slots, n_rows))
        return -1;
    for (int64_t i = 0; i < n; i++)
        memcpy(out + i * bytes,
               ring + slots[i] * slot_stride + (rows ? rows[i] * row_stride : 0), (size_t)bytes);
    return 0;
}
