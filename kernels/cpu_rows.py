"""RMS norm and the rotary embedding over all of a step's rows in one C call each
(kernels/cpu/norm_rope.c, in the library kernels/cpu_ring.py builds), where torch makes six
and a dozen small calls: 26 norms and 16 rotations a decode step of the tiny preset, ~0.5 ms
of a 3.6 ms batch-1 step in dispatch alone.

Each function returns None / False where it does not run (the library's gate: not a CPU
float32/float64 tensor, autograd, KVMESH_KERNELS set, no compiler; a weight under autograd,
of another dtype or shape; rows that are not contiguous): the caller (model/ops.py) then
computes the same thing in torch. The rotation is torch's bit for bit; the norm's mean of
squares is summed in another order than torch's, so a normed value can differ in its last
bits (tested).
"""

from __future__ import annotations

import torch

from kernels import cpu_ring

_DTYPES = (torch.float32, torch.float64)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., D] * rsqrt(mean(x^2, -1) + eps) * weight [D], or None (not done here)."""
    lib = cpu_ring.library(x, _DTYPES)
    if lib is None or weight.dtype is not x.dtype or weight.requires_grad \
            or not x.is_contiguous() or not weight.is_contiguous():
        return None
    d = x.shape[-1]
    if weight.numel() != d or d == 0:
        return None                        # (torch's broadcasting, or its error)
    out = torch.empty_like(x)
    fn = lib.rms_norm_f32 if x.dtype is torch.float32 else lib.rms_norm_f64
    if fn(x.data_ptr(), d, weight.data_ptr(), out.data_ptr(), d, x.numel() // d, d, eps):
        return None
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> bool:
    """Rotate the last `rot` dims of x [*rows, D] or [*rows, H, D] in place (halves layout)
    by cos, sin [*rows, rot / 2]; False: not done (x untouched)."""
    lib = cpu_ring.library(x, _DTYPES)
    if lib is None or cos.dtype is not x.dtype or sin.dtype is not x.dtype \
            or not x.is_contiguous() or not cos.is_contiguous() or not sin.is_contiguous():
        return False
    d, half = x.shape[-1], rot // 2
    rows = cos.numel() // half if half else 0
    lead = cos.dim() - 1                   # x is [*lead, D] or [*lead, H, D]
    if rot <= 0 or rot % 2 or rot > d or cos.shape != sin.shape or cos.shape[-1] != half \
            or rows == 0 or x.dim() - lead not in (1, 2) or x.shape[:lead] != cos.shape[:-1]:
        return False
    heads = 1 if x.dim() == lead + 1 else x.shape[-2]
    fn = lib.rope_f32 if x.dtype is torch.float32 else lib.rope_f64
    return fn(x.data_ptr(), heads * d, d, rows, heads, d, rot, cos.data_ptr(), sin.data_ptr()) == 0
