"""Softmax-gated pooling: m tokens of a group -> one compressed entry, per channel.

    c_j[d] = sum_t softmax_t(z[t, d] + bias[t, d]) * v[t, d]      t = 0..m-1

    v, z     [G, m, D]   values and gate logits of G complete groups
    bias     [m, D]      learned, by position inside the group
    returns  [G, D]
"""

from __future__ import annotations

import torch

from kernels import dispatch


def gated_pool(v, z, bias):
    assert v.shape == z.shape and v.shape[1:] == bias.shape, (v.shape, z.shape, bias.shape)
    if dispatch.use_triton(v):
        from kernels.triton import pooling as tri

        return tri.gated_pool(v, z, bias)
    return gated_pool_torch(v, z, bias)


def gated_pool_torch(v, z, bias):
    return (torch.softmax(z + bias, dim=1) * v).sum(1)
