/* MXFP8 quantization of rows on the CPU (kernels/mxfp8.py calls it; kernels/cpu_ring.py
   builds every C file here into one library): the bytes and the values of
   mxfp8.quantize_values, bit for bit, in one pass over each row.

   Every new SWA row of every layer is quantized (a decode step: one row per sequence and
   layer), and in torch that is some twenty calls on [rows, D / 32, 32] tensors: ~0.2 ms a
   layer whatever the batch. Per block of 32 values (kernels/mxfp8.py has the format):

       e      = the smallest e with amax <= 448 * 2^e, from frexp (rceil_exponent), in [-127, 127]
       code   = E4M3(x / 2^e), round to nearest even (torch's float8_e4m3fn conversion)
       value  = E4M3 value of code * 2^e            (both fp32 operations: exact or the same
                                                     rounding as torch's)
       bytes  = D codes, then D / 32 bytes e + 127 */

#include <math.h>
#include <stdint.h>
#include <string.h>

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> E4M3 (fn: no infinities, 0x7f / 0xff NaN), round to nearest even, as c10's
   fp8e4m3fn_from_fp32_value: at or past 480 NaN; below 2^-6 the E4M3 subnormals, rounded by
   adding 2^14 (whose ulp is their step, 2^-9); else the mantissa rounded from 23 bits to 3. */
static uint8_t e4m3(float f)
{
    uint32_t u = bits_of(f), sign = u & 0x80000000u;
    uint8_t out;
    u ^= sign;
    if (u >= (1087u << 20))
        out = 0x7f;
    else if (u < (121u << 23))
        out = (uint8_t)(bits_of(float_of(u) + float_of(141u << 23)) - (141u << 23));
    else {
        uint32_t odd = (u >> 20) & 1;
        u += ((uint32_t)(7 - 127) << 23) + 0x7ffff + odd;
        out = (uint8_t)(u >> 20);
    }
    return out | (uint8_t)(sign >> 24);
}

/* An E4M3 code's value in fp32, exact: its 7 magnitude bits placed at fp32 bit 20 (sign at
   31) are the value * 2^-120, subnormals included (union_attention.c, block_factors). */
static float e4m3_value(uint8_t c)
{
    return float_of(((uint32_t)(c & 0x80) << 24) | ((uint32_t)(c & 0x7f) << 20)) * 0x1p120f;
}

/* x [rows, d] fp32 -> out [rows, d + d / 32] bytes and values [rows, d] fp32 (NULL: none).
   Rows split over `threads` (torch's OpenMP pool, as in union_attention.c) from 8 rows up:
   a decode step's 32 rows of 512 took ~55 us a layer more than one row on one thread. */
int mxfp8_quantize(const float *x, int64_t rows, int64_t d, uint8_t *out, float *values,
                   int threads)
{
    if (d % 32)
        return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows >= 8)
    for (int64_t t = 0; t < rows; t++) {
        const float *row = x + t * d;
        uint8_t *codes = out + t * (d + d / 32);
        for (int64_t b = 0; b < d / 32; b++) {
            float amax = 0;
            for (int i = 0; i < 32; i++) {
                float a = fabsf(row[b * 32 + i]);
                amax = a > amax ? a : amax;
            }
            int k;
            float f = frexpf(amax < 0x1p-120f ? 0x1p-120f : amax, &k);
            int e = k - 9 + (f > 0.875f);
            e = e < -127 ? -127 : e > 127 ? 127 : e;
            /* x / 2^e and x * 2^-e are the same fp32 number: one exact scaling, one rounding */
            float scale = ldexpf(1.0f, e), inv = ldexpf(1.0f, -e);
            for (int i = 0; i < 32; i++) {
                uint8_t c = e4m3(row[b * 32 + i] * inv);
                codes[b * 32 + i] = c;
                if (values)
                    values[t * d + b * 32 + i] = e4m3_value(c) * scale;
            }
            codes[d + b] = (uint8_t)(e + 127);
        }
    }
    return 0;
}
