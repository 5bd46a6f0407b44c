"""MXFP8 quantize / dequantize in Triton: the same bytes as kvmesh.kernels.mxfp8's torch reference.

Every step is exact integer or power-of-two arithmetic, so the result does not depend on
how a device rounds division, log2 or exp2:

- scale exponent: the smallest e with amax <= 448 * 2**e from amax's fp32 bits
  (amax = M * 2**E, 448 = 1.75 * 2**8: e = E - 8 + (M > 1.75));
- x / 2**e as x * 2**-e (a power of two built from bits: one correctly rounded multiply);
- fp32 -> E4M3 round-to-nearest-even on the bits (3 mantissa bits kept, subnormals in
  steps of 2**-9, saturating at 448 = 0x7E, which RCEIL scaling never exceeds).

A program handles BB blocks of 32 values (blocks are independent); `rows` lets the
quantizer write tokens straight into ring rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 32
BB = 128           # 32-value blocks per program: 8 tokens of 512 values


@triton.jit
def _pow2(k):
    """2.0**k for integer k in [-127, 127], built from bits (2**-127 is subnormal)."""
    normal = ((k + 127) << 23).to(tl.int32)
    sub = (1 << tl.minimum(tl.maximum(k + 149, 0), 22)).to(tl.int32)
    return tl.where(k >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(v):
    """fp32 (|v| <= 448 after scaling) -> E4M3 byte, round to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    e32 = (bits >> 23) & 0xFF
    full = tl.where(e32 > 0, (bits & 0x7FFFFF) | 0x800000, bits & 0x7FFFFF)
    e = tl.where(e32 > 0, e32 - 127, -126)
    # normal E4M3 (e >= -6) keeps 3 of the 23 mantissa bits: drop 20; subnormal: 14 - e
    shift = tl.minimum(tl.where(e >= -6, 20, 14 - e), 30)     # >= 25 already rounds to 0
    q = full >> shift
    rem = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    # normal: q in [8, 16]; 16 carries into the exponent, which (q - 8) + field does for free
    code = tl.where(e >= -6, ((e + 7) << 3) + (q - 8), q)
    code = tl.minimum(code, 0x7E)
    return (code | sign).to(tl.uint8)


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, rows_ptr, n_blocks, x_stride, out_stride,
                     D: tl.constexpr, NB: tl.constexpr, BB: tl.constexpr, HAS_ROWS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB)      # global block ids
    live = b < n_blocks
    tok, blk = b // NB, b % NB
    lane = tl.arange(0, 32)
    x = tl.load(x_ptr + (tok * x_stride + blk * 32)[:, None] + lane[None, :],
                mask=live[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 2.0**-120)
    abits = amax.to(tl.int32, bitcast=True)
    exp = ((abits >> 23) & 0xFF) - 127 - 8 + ((abits & 0x7FFFFF) > 0x600000).to(tl.int32)
    exp = tl.minimum(tl.maximum(exp, -127), 127)
    scaled = x * _pow2(-exp)[:, None]
    if HAS_ROWS:
        row = tl.load(rows_ptr + tok, mask=live, other=0).to(tl.int64)
    else:
        row = tok
    base = out_ptr + row * out_stride
    tl.store((base + blk * 32)[:, None] + lane[None, :], _e4m3_bits(scaled), mask=live[:, None])
    tl.store(base + D + blk, (exp + 127).to(tl.uint8), mask=live)


@triton.jit
def _dequantize_kernel(q_ptr, out_ptr, n_blocks, D: tl.constexpr, NB: tl.constexpr,
                       BB: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB)
    live = b < n_blocks
    tok, blk = b // NB, b % NB
    lane = tl.arange(0, 32)
    base = q_ptr + tok * (D + NB)
    code = tl.load((base + blk * 32)[:, None] + lane[None, :], mask=live[:, None], other=0)
    scale = _e8m0_scale(tl.load(base + D + blk, mask=live, other=127).to(tl.int32))
    tl.store((out_ptr + tok * D + blk * 32)[:, None] + lane[None, :],
             _e4m3_value(code.to(tl.int32)) * scale[:, None], mask=live[:, None])


@triton.jit
def _e4m3_value(code):
    """E4M3 byte (as int32) -> fp32, exact: a normal code's fp32 bits are put together
    directly (exponent field ef - 7 + 127, mantissa bits on top); subnormals are
    mf * 2**-9; 0x7F / 0xFF are NaN."""
    ef = (code >> 3) & 0xF
    mf = code & 0x7
    normal = (((ef + 120) << 23) | (mf << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(ef == 0, mf.to(tl.float32) * (2.0**-9), normal)
    mag = tl.where((ef == 15) & (mf == 7), float("nan"), mag)
    return tl.where((code & 0x80) != 0, -mag, mag)


@triton.jit
def _e8m0_scale(e):
    """E8M0 byte (as int32) -> 2.0**(e - 127); e = 0 is the subnormal 2**-127 (255 unused)."""
    return tl.where(e > 0, e << 23, 1 << 22).to(tl.float32, bitcast=True)


def _check(d: int):
    if d % BLOCK or d & (d - 1):
        raise ValueError(f"Triton MXFP8 needs a power-of-two dim that is a multiple of 32, not {d}")


def quantize(x: torch.Tensor, out: torch.Tensor | None = None,
             rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] -> [..., D + D/32] uint8; with `out` [R, D + D/32] and `rows` [M] the
    M = prod(leading dims) tokens are written into out[rows] instead (a fused ring write)."""
    d = x.shape[-1]
    _check(d)
    flat = x.reshape(-1, d)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    if out is None:
        dest = torch.empty(m, d + d // BLOCK, dtype=torch.uint8, device=x.device)
    else:
        assert out.dtype == torch.uint8 and out.shape[-1] == d + d // BLOCK and out.stride(-1) == 1
        dest = out
    nb = m * (d // BLOCK)
    if nb:
        _quantize_kernel[(triton.cdiv(nb, BB),)](
            flat, dest, rows if rows is not None else flat, nb, flat.stride(0), dest.stride(0),
            D=d, NB=d // BLOCK, BB=BB, HAS_ROWS=rows is not None)
    return dest.view(*x.shape[:-1], d + d // BLOCK) if out is None else out


def dequantize(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    tb = q.shape[-1]
    d = (tb * BLOCK) // (BLOCK + 1)
    _check(d)
    flat = q.reshape(-1, tb).contiguous()
    out = torch.empty(flat.shape[0], d, dtype=torch.float32, device=q.device)
    nb = flat.shape[0] * (d // BLOCK)
    if nb:
        _dequantize_kernel[(triton.cdiv(nb, BB),)](flat, out, nb, D=d, NB=d // BLOCK, BB=BB)
    return out.view(*q.shape[:-1], d).to(dtype)
