"""Norms and RoPE with DeepSeek V4's precision: the steps the reference computes in fp32.

In a float64 (or bfloat16) model these steps still run in fp32 ("islands"); doing the same
is what makes the forward match transformers bit for bit instead of to ~1e-7:
- weighted RMSNorm: normalize in fp32, multiply by the weight in the weight's dtype;
- unweighted RMSNorm: the rsqrt factor in fp32, the product in the input's dtype;
- RoPE: inverse frequencies, angles, cos and sin in fp32; the rotated slice rounded to fp32
  before it meets cos and sin.
"""

from __future__ import annotations

import math

import torch

from kvmesh.services.engine.model.deepseek_v4.config import Rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             work: torch.dtype = torch.float32) -> torch.Tensor:
    """`work`: the dtype the normalization runs in (V4.1's float64 models pass float64)."""
    xf = x.to(work)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed).to(x.dtype)


def unit_rms_norm(x: torch.Tensor, eps: float, work: torch.dtype = torch.float32) -> torch.Tensor:
    """RMSNorm without a weight (q's per-head norm, the hyper-connections' input norm)."""
    return x * torch.rsqrt(x.to(work).square().mean(-1, keepdim=True) + eps).to(x.dtype)


def inv_freq(rope: Rope) -> torch.Tensor:
    """[rope.dim / 2] fp32 on the host: one frequency per interleaved channel pair
    (YaRN-corrected; callers move it where it is used)."""
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    if rope.yarn is None:
        return 1.0 / pos_freqs
    y = rope.yarn

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    span = (high - low) if high != low else 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / span,
                       0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return (1.0 / (y.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_tables(rope: Rope, positions: torch.Tensor, dtype: torch.dtype,
                freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [len(positions), rope.dim / 2] in `dtype` (computed in fp32)."""
    # (RopeTables keeps its frequencies on the model's device: nothing moves per call)
    freqs = inv_freq(rope).to(positions.device) if freqs is None else freqs
    angles = positions.reshape(-1, 1).float() * freqs.float()
    return (angles.cos() * rope.scaling).to(dtype), (angles.sin() * rope.scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x, pairs (2i, 2i + 1) interleaved.

    x: [S, ..., d] (a position per leading row); cos, sin: [S, r / 2]. Pass -sin to undo.
    """
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    cos = cos.repeat_interleave(2, dim=-1).reshape(shape)
    sin = sin.repeat_interleave(2, dim=-1).reshape(shape)
    keep, rot = x[..., :-r], x[..., -r:]
    swapped = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rot.float() * cos + swapped.float() * sin).to(x.dtype)
    return torch.cat([keep, rotated], dim=-1)


def wide(dtype: torch.dtype) -> torch.dtype:
    """Where reductions run: fp32 for narrower models, the model's own dtype above it. (V4's
    reference rounds some to fp32 even in a float64 model, to match transformers; V4.1 has no
    such oracle, and a float64 model kept float64 makes cached and whole-sequence runs agree
    to ~1e-12 whatever the batch shapes.)"""
    return torch.promote_types(dtype, torch.float32)
