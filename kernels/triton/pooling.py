"""Softmax-gated pooling in Triton (see kernels.pooling.gated_pool).

One program = one group and BD channels: the m gate logits of a channel are softmaxed
over the group (max-subtracted, fp32) and weight the m values of that channel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pool_kernel(v_ptr, z_ptr, b_ptr, out_ptr, M, D, MP: tl.constexpr, BD: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    t = tl.arange(0, MP)
    mask = (t < M)[:, None] & (c < D)[None, :]
    offs = t[:, None] * D + c[None, :]
    z = tl.load(z_ptr + g * M * D + offs, mask=mask, other=-1e30).to(tl.float32)
    z += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + g * M * D + offs, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(z - tl.max(z, axis=0)[None, :])
    e = tl.where(mask, e, 0.0)
    den = tl.sum(e, axis=0)
    out = tl.sum(e * v, axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + g * D + c, out, mask=c < D)


def gated_pool(v, z, bias):
    g, m, d = v.shape
    out = torch.empty(g, d, dtype=torch.float32, device=v.device)
    mp = triton.next_power_of_2(m)
    bd = min(triton.next_power_of_2(d), max(16, 4096 // mp))   # tiles of at most 4096 values
    if g * d:
        _pool_kernel[(g, triton.cdiv(d, bd))](v.contiguous(), z.contiguous(), bias.contiguous(),
                                             out, m, d, MP=mp, BD=bd)
    return out.to(v.dtype)
