"""Dequantizing DeepSeek V4's stored formats at load.

FP8: e4m3 weights with one scale per `block` x `block` tile (128 x 128 in DeepSeek's release);
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


def fp4_shape_ok(packed: torch.Size, scale: torch.Size) -> bool:
    return (len(packed) == 2 and len(scale) == 2 and packed[0] == scale[0]
            and packed[1] * 2 == scale[1] * FP4_RUN)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed [out, in / 2] bytes, scale [out, in / 32] -> float32 [out, in]."""
    codes = packed.contiguous().view(torch.uint8)
    low, high = codes & 0x0F, codes >> 4
    values = FP4_VALUES[torch.stack([low, high], dim=-1).flatten(-2).long()]
    return values * scale_values(scale).repeat_interleave(FP4_RUN, dim=1)


def quant_fp8(w: torch.Tensor, block: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for writing test checkpoints: per-tile scale = amax / 448 (a power of two
    when `ue8m0`), q = e4m3(w / scale)."""
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    padded = w.float().new_zeros(rows * block, cols * block)
    padded[:out, :inp] = w.float()
    tiles = padded.view(rows, block, cols, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (tiles / scale.view(rows, 1, cols, 1)).view(rows * block, cols * block)[:out, :inp]
    q = q.to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For test checkpoints: the nearest e2m1 code per value, UE8M0 scale per 32-run."""
    out, inp = w.shape
    runs = w.float().view(out, inp // FP4_RUN, FP4_RUN)
    amax = runs.abs().amax(dim=-1).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
    scaled = (runs / scale.unsqueeze(-1)).reshape(out, inp)
    codes = (scaled.unsqueeze(-1) - FP4_VALUES).abs().argmin(dim=-1).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)
