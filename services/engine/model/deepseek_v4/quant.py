"""Dequantizing DeepSeek V4's stored formats at load.

FP8: e4m3 weights with one scale per `block` x `block` tile (128 x 128 in DeepSeek's release),
or per 1 x 32 run of a row (V4.1's Engram tables);
w = q * s (the scale multiplies, whatever its name says). FP4 (V4-Flash's routed experts): e2m1
values, two per byte with the low nibble the even column, one scale per 1 x 32 run. Scales are
float32, or UE8M0 (`float8_e8m0fnu`, 2^(byte - 127)).
"""

from __future__ import annotations

import torch

# e2m1 codes 0..15: sign bit 3, then 2 exponent bits and 1 mantissa bit
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP4_RUN = 32


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32 (UE8M0 bytes stored as uint8 are read as 2^(b - 127))."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127)
    return scale.float()


def dequant_fp8(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """q [out, in] e4m3, scale [ceil(out / block), ceil(in / block)] -> float32 [out, in]."""
    out, inp = q.shape
    s = scale_values(scale)
    s = s.repeat_interleave(block, dim=0)[:out].repeat_interleave(block, dim=1)[:, :inp]
    return q.float() * s


def dequant_fp8_runs(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [out, in] e4m3, scale [out, in / 32]: one scale per 1 x 32 run (V4.1's Engram tables)
    -> float32 [out, in]."""
    return q.float() * scale_values(scale).repeat_interleave(FP4_RUN, dim=1)


def fp4_shape_ok(packed: torch.Size, scale: torch.Size) -> bool:
    return (len(packed) == 2 and len(scale) == 2 and packed[0] == scale[0]
            and packed[1] * 2 == scale[1] * FP4_RUN)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed [out, in / 2] bytes, scale [out, in / 32] -> float32 [out, in]."""
    codes = packed.contiguous().view(torch.uint8)
    low, high = codes & 0x0F, codes >> 4
    values = FP4_VALUES[torch.stack([low, high], dim=-1).flatten(-2).long()]
    return values * scale_values(scale).repeat_interleave(FP4_RUN, dim=1)
