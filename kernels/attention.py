"""Union attention: one softmax over window keys and compressed entries, plus a sink.

K = V (a single shared latent per key). The sink is a learned per-head logit that
joins the softmax denominator only, so a head may attend to "nothing".

    q        [N, T, H, D]    queries
    groups   list of (keys, ok), one softmax across all of them:
               keys [N, K, D]     shared by every query of a sequence (window, HCA), or
               keys [N, T, K, D]  one set per query (CSA's top-k picks)
               ok   [N, T, K]     bool: query t may see key k
    sink     [H]
    returns  [N, T, H, D]
"""

from __future__ import annotations

import torch


def _scores(q, keys):
    if keys.dim() == 3:
        return torch.einsum("nthd,nkd->nthk", q, keys)
    return torch.einsum("nthd,ntkd->nthk", q, keys)


def _mix(p, keys):
    if keys.dim() == 3:
        return torch.einsum("nthk,nkd->nthd", p, keys)
    return torch.einsum("nthk,ntkd->nthd", p, keys)


def union_attention(q, groups, sink, scale: float):
    n, t, h, _ = q.shape
    parts = []
    for keys, ok in groups:
        s = _scores(q, keys) * scale                               # [N, T, H, K]
        parts.append(s.masked_fill(~ok.unsqueeze(2), float("-inf")))
    parts.append(sink.view(1, 1, h, 1).expand(n, t, h, 1).to(q.dtype))
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    out = torch.zeros_like(q)
    start = 0
    for keys, _ in groups:
        k = keys.shape[-2]
        if k:
            out = out + _mix(probs[..., start : start + k], keys)
        start += k
    return out
