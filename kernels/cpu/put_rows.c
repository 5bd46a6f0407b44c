/* Ring row writes for the CPU (kernels/cpu_ring.py builds and loads it; kernels/ragged.put_at
   calls it): n rows of `row_bytes` bytes each into a ring [S, R, ...] at (slots[i], rows[i]).

   torch's index_put_ (a ring that is a strided view: the state pool's rings live in per-slot
   slabs) and index_copy_ (a contiguous one) both walk the rows element by element through
   their generic indexing loop: a decode step of 32 sequences writes 17 rings a step that
   way, 19-34 us a call, growing with the batch. Here a row is one memcpy. */

#include <stdint.h>
#include <string.h>

/* dst: the ring's first byte; stride0 / stride1: bytes between slots / rows; rows of the
   source back to back. Every (slot, row) is checked against [0, S) x [0, R) before anything
   is written: returns 0, or 1 + the first bad i (nothing written then). */
int64_t put_rows(uint8_t *dst, int64_t slots_n, int64_t ring_n, int64_t stride0,
                 int64_t stride1, const int64_t *slots, const int64_t *rows,
                 const uint8_t *src, int64_t row_bytes, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= slots_n || rows[i] < 0 || rows[i] >= ring_n)
            return i + 1;
    for (int64_t i = 0; i < n; i++)
        memcpy(dst + slots[i] * stride0 + rows[i] * stride1, src + i * row_bytes,
               (size_t)row_bytes);
    return 0;
}
