"""MXFP8 (OCP microscaling) for SWA KV: 32 values share one power-of-two scale.

Byte layout of one token (D = 512 values, block 32):

    offset 0                               D            D + D/32
    | E4M3 value bytes, in channel order    | E8M0 scales, one per block |
    |<------------- 512 B --------------->|<--------- 16 B ---------->|   = 528 B

E8M0 scale byte e encodes 2**(e - 127). The scale of a block is the smallest power
of two that brings the block's max |x| to <= 448 (E4M3's largest finite value),
so no value saturates. Values round to nearest E4M3.

Error bound per element: |x - deq(q(x))| <= 2**-4 * |x| + 2**-10 * scale
(3 mantissa bits -> half an ulp is 2**-4 relative for normal values; E4M3's
subnormal step is 2**-9 * scale, half of it 2**-10 * scale).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
BLOCK = 32


def token_bytes(dim: int) -> int:
    return dim + dim // BLOCK


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x: [..., D] float -> [..., D + D/32] uint8."""
    assert x.is_floating_point() and x.shape[-1] % BLOCK == 0, x.shape
    d = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], d // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # exponent of the smallest power of two with amax / 2**e <= 448
    exp = torch.ceil(torch.log2(torch.clamp(amax, min=2.0**-120) / E4M3_MAX))
    exp = torch.clamp(exp, -127, 127)
    scaled = blocks / torch.exp2(exp)
    values = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(*x.shape[:-1], d)
    scales = (exp.squeeze(-1) + 127).to(torch.uint8)
    return torch.cat([values, scales], dim=-1)


def dequantize(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q: [..., D + D/32] uint8 -> [..., D] dtype."""
    assert q.dtype == torch.uint8, q.dtype
    d = (q.shape[-1] * BLOCK) // (BLOCK + 1)
    assert token_bytes(d) == q.shape[-1], q.shape
    values = q[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    exp = q[..., d:].float() - 127.0
    blocks = values.reshape(*q.shape[:-1], d // BLOCK, BLOCK) * torch.exp2(exp).unsqueeze(-1)
    return blocks.reshape(*q.shape[:-1], d).to(dtype)


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """The values a reader of the MXFP8 cache sees: dequantize(quantize(x))."""
    return dequantize(quantize(x), x.dtype)
