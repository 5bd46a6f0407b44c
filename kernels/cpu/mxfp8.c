/* MXFP8 quantization of rows on the CPU (kernels/mxfp8.py calls it; kernels/cpu_library.py
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
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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
   31) are the value * 2^-120, subnormals included. */
static float e4m3_value(uint8_t c)
{
    return float_of(((uint32_t)(c & 0x80) << 24) | ((uint32_t)(c & 0x7f) << 20)) * 0x1p120f;
}

/* max(0, |x_i|) over a block's 32 values, NaNs skipped (the comparison is false for them),
   as a scalar loop would give it: the maximum of a set does not depend on the order. */
static float block_amax(const float *x)
{
    float amax = 0;
#ifdef __AVX512F__
    __m512 m = _mm512_setzero_ps();
    for (int half = 0; half < 2; half++) {
        __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + half * 16));
        m = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, m, _CMP_GT_OQ), m, a);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, m);
    for (int i = 0; i < 16; i++)
        amax = lanes[i] > amax ? lanes[i] : amax;
#elif defined(__AVX2__)
    /* max_ps(a, m) is m where a is NaN: the comparison's skip */
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int q = 0; q < 4; q++)
        m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + q * 8), magnitude), m);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++)
        amax = lanes[i] > amax ? lanes[i] : amax;
#else
    for (int i = 0; i < 32; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
#endif
    return amax;
}

/* frexp's k - 9 + (its fraction > 0.875): the smallest e with a <= 448 * 2^e (448 = 1.75 *
   2^8), read off the bits of a normal a (the caller's a >= 2^-120); libm's frexpf for the
   rest (infinity, NaN), as before. A libm call per block was half the kernel's time. */
static int rceil_exponent(float a)
{
    uint32_t u = bits_of(a), field = (u >> 23) & 0xff;
    if (field == 0 || field == 0xff) {
        int k;
        float f = frexpf(a, &k);
        return k - 9 + (f > 0.875f);
    }
    return (int)field - 126 - 9 + ((u & 0x7fffff) > 0x600000);
}

/* 2^e for e in [-127, 127], exact (2^-127 is an fp32 subnormal), as ldexpf(1, e). */
static float two_to(int e)
{
    return e >= -126 ? float_of((uint32_t)(e + 127) << 23) : float_of(1u << (e + 149));
}

#ifdef __AVX512F__
/* e4m3 and e4m3_value on 16 lanes: the same integer and fp32 steps, the three cases of e4m3
   computed for every lane and blended (the branches kept gcc from vectorizing the scalar
   loop: 32 rows of 512 took 45 us a layer on two threads). */
static void block16(const float *x, float inv, float scale, uint8_t *codes, float *values)
{
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(inv)));
    __m512i sign = _mm512_andnot_si512(magnitude, u);
    u = _mm512_and_si512(u, magnitude);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(1));
    __m512i normal = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7ffff)), odd)), 20);
    __m512i sub = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(u), _mm512_set1_ps(0x1p14f))),
        _mm512_set1_epi32(141 << 23));
    __m512i c = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(u, _mm512_set1_epi32(121 << 23)), normal, sub);
    c = _mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(u, _mm512_set1_epi32(1087 << 20)), c,
                                _mm512_set1_epi32(0x7f));
    c = _mm512_or_si512(_mm512_and_si512(c, _mm512_set1_epi32(0xff)), _mm512_srli_epi32(sign, 24));
    _mm_storeu_si128((__m128i *)codes, _mm512_cvtepi32_epi8(c));
    if (values) {
        __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24),
                                       _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x7f)), 20));
        __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
        _mm512_storeu_ps(values, _mm512_mul_ps(v, _mm512_set1_ps(scale)));
    }
}
#define LANES 16
#define BLOCK_LANES block16
#elif defined(__AVX2__)
/* The same on 8 lanes with AVX2. It has no unsigned compares and no mask registers: u has
   its sign cleared, so signed compares order it alike, and blends take lane masks. */
static void block8(const float *x, float inv, float scale, uint8_t *codes, float *values)
{
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    __m256i u = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x), _mm256_set1_ps(inv)));
    __m256i sign = _mm256_andnot_si256(magnitude, u);
    u = _mm256_and_si256(u, magnitude);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
    __m256i normal = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7ffff)), odd)), 20);
    __m256i sub = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(u), _mm256_set1_ps(0x1p14f))),
        _mm256_set1_epi32(141 << 23));
    __m256i c = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), u));
    c = _mm256_blendv_epi8(c, _mm256_set1_epi32(0x7f),
                           _mm256_cmpgt_epi32(u, _mm256_set1_epi32((1087 << 20) - 1)));
    c = _mm256_or_si256(_mm256_and_si256(c, _mm256_set1_epi32(0xff)), _mm256_srli_epi32(sign, 24));
    /* each lane's low byte, in order: bytes 0, 4, 8, 12 of both 128-bit halves */
    const __m256i low = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i packed = _mm256_shuffle_epi8(c, low);
    uint32_t lo = (uint32_t)_mm256_extract_epi32(packed, 0), hi = (uint32_t)_mm256_extract_epi32(packed, 4);
    memcpy(codes, &lo, 4);
    memcpy(codes + 4, &hi, 4);
    if (values) {
        __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24),
                                       _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7f)), 20));
        __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
        _mm256_storeu_ps(values, _mm256_mul_ps(v, _mm256_set1_ps(scale)));
    }
}
#define LANES 8
#define BLOCK_LANES block8
#endif

/* x [rows, d] fp32 -> out [rows, d + d / 32] bytes and values [rows, d] fp32 (NULL: none).
   Rows split over `threads` (torch's OpenMP pool) from 8 rows up:
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
            float amax = block_amax(row + b * 32);
            int e = rceil_exponent(amax < 0x1p-120f ? 0x1p-120f : amax);
            e = e < -127 ? -127 : e > 127 ? 127 : e;
            /* x / 2^e and x * 2^-e are the same fp32 number: one exact scaling, one rounding */
            float scale = two_to(e), inv = two_to(-e);
#ifdef LANES
            for (int at = 0; at < 32; at += LANES)
                BLOCK_LANES(row + b * 32 + at, inv, scale, codes + b * 32 + at,
                            values ? values + t * d + b * 32 + at : NULL);
            codes[d + b] = (uint8_t)(e + 127);
            continue;
#endif
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
