/* exp_lanes: e^x in float32 in a form gcc vectorizes (libm's expf is one call per value).
   Included by union_attention.c (a block's
   softmax weights). */
#ifndef KVMESH_EXP_LANES_H
#define KVMESH_EXP_LANES_H

#include <stdint.h>

/* e^x = 2^n e^r, n = x / ln 2 rounded to nearest (the 1.5 * 2^23 addition: the rounding the
   FPU does, not a call), r = x - n ln 2 with ln 2 in two parts (r good to an ulp), e^r by
   Cephes' degree-6 polynomial on |r| <= ln 2 / 2, 2^n put in the exponent bits. Within 1.01
   ulp of exp on [-87, 88] (checked over the floats there in steps); x is clamped to
   [-87.3, 88.7] (below it fp32 would be subnormal: e^x <= 1.2e-38 reads as that). The
   callers' weights are e^(x - max) <= 1. */
static inline float exp_lanes(float x)
{
    x = x < -87.3f ? -87.3f : x > 88.7f ? 88.7f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two = { ((int32_t)n + 127) << 23 };
    return p * two.f;
}

#endif
