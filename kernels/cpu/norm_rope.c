/* A layer's row-wise pieces for the CPU (kernels/cpu_rows.py calls them): RMS norm and the
   rotary embedding, each one call over all of a step's rows.

   Why: in torch an RMS norm is six calls (pow, mean, add, rsqrt, two multiplies) and a
   rotary embedding a dozen (slices, four multiplies, add, subtract, cat, copy), each ~1-2 us
   of dispatch around a few hundred values; a decode step of the tiny preset makes 26 norms
   and 16 rotations, ~0.5 ms of a 3.6 ms batch-1 step (10.5 us a norm, 15-17 us a rotation,
   measured). Here each is one loop over the rows.

   Numbers: the rotation is torch's, bit for bit: out = a * cos - b * sin and a * sin + b *
   cos, every product rounded before the sum (contraction into FMAs is off for this file,
   which would round once). The norm's sum of squares is summed in lanes here and in torch's
   own order there: the mean may differ in its last bit, so a normed value may too (tested
   within a few ulps); each row's result depends on that row alone. */

/* gcc contracts a * b - c * d into an FMA by default (-ffp-contract=fast: 45 of them in
   this file without the pragma); the STDC pragma is clang's way to say the same. */
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

#include <math.h>
#include <stdint.h>

enum { LANES = 16 };

/* out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w, as torch's x * rsqrt(ms + eps) * w
   (x times the factor, rounded, then times w). Rows r0 .. r1 of d values. */
#define RMS_NORM(NAME, T)                                                                     \
    int NAME(const T *x, int64_t ldx, const T *w, T *out, int64_t ldo, int64_t rows,          \
             int64_t d, double eps)                                                           \
    {                                                                                         \
        if (rows < 0 || d <= 0)                                                               \
            return 2;                                                                         \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            const T *xr = x + r * ldx;                                                        \
            T *o = out + r * ldo;                                                             \
            T lane[LANES] = {0};                                                              \
            int64_t i = 0;                                                                    \
            for (; i + LANES <= d; i += LANES)                                                \
                for (int l = 0; l < LANES; l++)                                               \
                    lane[l] += xr[i + l] * xr[i + l];                                         \
            for (; i < d; i++)                                                                \
                lane[0] += xr[i] * xr[i];                                                     \
            for (int width = LANES / 2; width > 0; width /= 2)                                \
                for (int l = 0; l < width; l++)                                               \
                    lane[l] += lane[l + width];                                               \
            T inv = (T)1 / (T)sqrt((double)(lane[0] / (T)d + (T)eps));                        \
            for (i = 0; i < d; i++)                                                           \
                o[i] = (xr[i] * inv) * w[i];                                                  \
        }                                                                                     \
        return 0;                                                                             \
    }

/* The square root is taken in double and rounded to T: for float that is the correctly
   rounded float square root (a double holds every product of two floats' worth of bits),
   what torch's sqrt gives; for double it is sqrt itself. */
RMS_NORM(rms_norm_f32, float)
RMS_NORM(rms_norm_f64, double)

/* In place on the last `rot` of each head's d values (halves layout: pairs (i, i + rot/2)):
   x [rows, heads, d] with rows ld_row apart and heads ld_head apart; cos, sin
   [rows, rot / 2], one row per x row, shared by its heads. */
#define ROPE(NAME, T)                                                                         \
    int NAME(T *x, int64_t ld_row, int64_t ld_head, int64_t rows, int64_t heads, int64_t d,   \
             int64_t rot, const T *cos_, const T *sin_)                                       \
    {                                                                                         \
        if (rows < 0 || heads < 0 || rot <= 0 || rot % 2 || rot > d)                          \
            return 2;                                                                         \
        const int64_t half = rot / 2;                                                         \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            const T *c = cos_ + r * half, *s = sin_ + r * half;                               \
            for (int64_t h = 0; h < heads; h++) {                                             \
                T *a = x + r * ld_row + h * ld_head + (d - rot), *b = a + half;               \
                for (int64_t i = 0; i < half; i++) {                                          \
                    T ai = a[i], bi = b[i];                                                   \
                    a[i] = ai * c[i] - bi * s[i];                                             \
                    b[i] = ai * s[i] + bi * c[i];                                             \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        return 0;                                                                             \
    }

ROPE(rope_f32, float)
ROPE(rope_f64, double)
