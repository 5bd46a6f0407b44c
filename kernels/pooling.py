"""Softmax-gated pooling: m tokens of a group -> one compressed entry, per channel.

    c_j[d] = sum_t softmax_t(z[t, d] + bias[t, d]) * v[t, d]      t = 0..m-1

    v, z     [G, m, D]   values and gate logits of G complete groups
    bias     [m, D]      learned, by position inside the group
    returns  [G, D]
"""

from __future__ import annotations

import torch


def gated_pool(v, z, bias):
    assert v.shape == z.shape and v.shape[1:] == bias.shape, (v.shape, z.shape, bias.shape)
    return (torch.softmax(z + bias, dim=1) * v).sum(1)
