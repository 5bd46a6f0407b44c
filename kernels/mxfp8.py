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

from kvmesh.kernels import cpu_library, dispatch

E4M3_MAX = 448.0
BLOCK = 32


_E4M3 = {torch.device("cpu"): torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()}


def e4m3_table(device) -> torch.Tensor:
    """The 256 E4M3 values as fp32 on `device` (one copy per device, made on first use)."""
    if device not in _E4M3:
        _E4M3[device] = _E4M3[torch.device("cpu")].to(device)
    return _E4M3[device]


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 codes -> fp32, through the table: each code's value is exact in fp32, so
    this is `codes.view(float8_e4m3fn).float()` bit for bit, ~3x faster on CPU (torch converts
    float8 element by element there)."""
    flat = codes.reshape(-1).to(torch.int32)
    return e4m3_table(codes.device).index_select(0, flat).view(codes.shape)


def token_bytes(dim: int) -> int:
    return dim + dim // BLOCK


def rceil_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest e with amax <= 448 * 2**e, exactly (E8M0 RCEIL), clamped to [-127, 127].

    Exact from frexp: amax = f * 2**k with f in [0.5, 1), 448 = 0.875 * 2**9, so
    amax <= 448 * 2**e  <=>  e >= k - 9 + (f > 0.875). (ceil(log2(amax / 448)) would be
    the same number if log2 were exact; it is not just above powers of two.)"""
    f, k = torch.frexp(torch.clamp(amax, min=2.0**-120))
    return torch.clamp(k - 9 + (f > 0.875).to(k.dtype), -127, 127).float()


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x: [..., D] float -> [..., D + D/32] uint8."""
    assert x.is_floating_point() and x.shape[-1] % BLOCK == 0, x.shape
    if dispatch.use_triton(x):
        from kvmesh.kernels.triton import mxfp8 as tri

        return tri.quantize(x)
    return quantize_torch(x)


def quantize_torch(x: torch.Tensor) -> torch.Tensor:
    """The reference (and CPU) quantizer; the Triton kernel must give the same bytes."""
    d = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], d // BLOCK, BLOCK)
    exp = rceil_exponent(blocks.abs().amax(-1, keepdim=True))
    scaled = blocks / torch.exp2(exp)
    values = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(*x.shape[:-1], d)
    scales = (exp.squeeze(-1) + 127).to(torch.uint8)
    return torch.cat([values, scales], dim=-1)


def dequantize(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q: [..., D + D/32] uint8 -> [..., D] dtype."""
    assert q.dtype == torch.uint8, q.dtype
    if dispatch.use_triton(q):
        from kvmesh.kernels.triton import mxfp8 as tri

        return tri.dequantize(q, dtype)
    return dequantize_torch(q, dtype)


def dequantize_torch(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    d = (q.shape[-1] * BLOCK) // (BLOCK + 1)
    assert token_bytes(d) == q.shape[-1], q.shape
    values = q[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    exp = q[..., d:].float() - 127.0
    blocks = values.reshape(*q.shape[:-1], d // BLOCK, BLOCK) * torch.exp2(exp).unsqueeze(-1)
    return blocks.reshape(*q.shape[:-1], d).to(dtype)


def quantize_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantize(x), dequantize(quantize(x), x.dtype)) in one pass: the values come from the
    E4M3 codes before they are packed (the same numbers bit for bit; the cached forward
    needs both for every new SWA row, and the round trip through bytes cost as much again)."""
    assert x.is_floating_point() and x.shape[-1] % BLOCK == 0, x.shape
    if dispatch.use_triton(x):
        q = quantize(x)
        return q, dequantize(q, x.dtype)
    done = _quantize_values_c(x)
    if done is not None:
        return done
    d = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], d // BLOCK, BLOCK)
    exp = rceil_exponent(blocks.abs().amax(-1, keepdim=True))
    codes = (blocks / torch.exp2(exp)).to(torch.float8_e4m3fn).view(torch.uint8)
    values = (e4m3_values(codes) * torch.exp2(exp)).reshape(x.shape).to(x.dtype)
    q = torch.cat([codes.reshape(*x.shape[:-1], d),
                   (exp.squeeze(-1) + 127).to(torch.uint8)], dim=-1)
    return q, values


def _quantize_values_c(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """quantize_values in one C call on the CPU (kernels/cpu/mxfp8.c: the same bytes and
    values bit for bit, tested), where the torch path is some twenty calls per layer on
    [rows, D / 32, 32] (~0.2 ms a layer at 1 to 32 rows, 1 thread). None: not done here
    (cpu_library.library: no library, KVMESH_KERNELS set, not on the CPU, autograd)."""
    lib = cpu_library.library(x)
    if lib is None:
        return None
    d = x.shape[-1]
    x32 = x.float().contiguous()
    q = torch.empty(*x.shape[:-1], token_bytes(d), dtype=torch.uint8)
    values = torch.empty(x.shape, dtype=torch.float32)
    if lib.mxfp8_quantize(x32.data_ptr(), x32.numel() // d, d, q.data_ptr(), values.data_ptr(),
                          torch.get_num_threads()):
        return None
    return q, values.to(x.dtype)


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """The values a reader of the MXFP8 cache sees: dequantize(quantize(x))."""
    return dequantize(quantize(x), x.dtype)
