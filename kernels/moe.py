"""Grouped expert products: each expert's weight applied to its own run of rows.

    x        [N, K]  rows sorted by expert: expert e owns rows offsets[e] .. offsets[e+1]-1
    w        [E, M, K]
    returns  [N, M]  out[r] = x[r] @ w[e(r)].T

An MoE step sorts its (token, expert) pairs by expert once and runs the gate/up product and
the down product as one grouped call each, instead of one call (or one kernel launch) per
expert. `offsets` are host ints (the step builds them from counts it already has).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.kernels import dispatch


def grouped_linear(x: torch.Tensor, offsets: list[int], w: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and w.dim() == 3 and x.shape[1] == w.shape[2], (x.shape, w.shape)
    assert len(offsets) == w.shape[0] + 1 and offsets[0] == 0 and offsets[-1] == x.shape[0]
    if dispatch.use_triton(x):
        from kvmesh.kernels.triton import moe as tri

        return tri.grouped_linear(x, offsets, w)
    return grouped_linear_torch(x, offsets, w)


def grouped_linear_torch(x: torch.Tensor, offsets: list[int], w: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], w.shape[1])
    for e in range(w.shape[0]):
        a, b = offsets[e], offsets[e + 1]
        if b > a:
            out[a:b] = F.linear(x[a:b], w[e])
    return out
