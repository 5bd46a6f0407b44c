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

from kernels import dispatch, mxfp8
from kernels.ring import ring_window


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


def ring_attention(q, ring, slots, chunk, qpos, valid, lo, window: int, sink, scale: float,
                   cmp=None):
    """SWA over MXFP8 ring rows + this chunk's own keys, and compressed entries, one softmax.

        q      [N, T, H, D]   queries of a chunk; row t of sequence n is position qpos[n, t]
        ring   [S, R, B]      uint8 MXFP8 rows of this layer; row p % R of slot slots[n]
                              holds position p for the positions before qpos[n, 0]
        slots  [N]            long
        chunk  [N, T, B]      uint8 MXFP8 keys of the chunk itself (written to the ring after)
        qpos   [N, T]         long, consecutive per row
        valid  [N, T]         bool (rows past a sequence's end are padding; their output is 0)
        lo     [N]            long: keys before lo are never seen (bounded replay, truncation)
        cmp    None or (keys [N, Kc, D], ok [N, T, K], idx [N, T, K] long or None):
               query t sees keys[idx[n, t, k]] (CSA picks) or keys[k] (HCA) where ok

    Query at position i sees window keys [max(lo, i - W + 1, 0), i]."""
    if dispatch.use_triton(q):
        from kernels.triton import attention as tri

        return tri.ring_attention(q, ring, slots, chunk, qpos, valid, lo, window, sink, scale,
                                  cmp)
    return ring_attention_torch(q, ring, slots, chunk, qpos, valid, lo, window, sink, scale, cmp)


def ring_attention_torch(q, ring, slots, chunk, qpos, valid, lo, window: int, sink,
                         scale: float, cmp=None):
    """The reference: read W - 1 ring rows before the chunk, dequantize, build the masks
    from positions and hand everything to union_attention."""
    width = window - 1
    first = qpos[:, 0] - width
    old = mxfp8.dequantize_torch(ring_window(ring, slots, first, width), q.dtype)
    old_pos = first.unsqueeze(1) + torch.arange(width, device=q.device).unsqueeze(0)
    keys = torch.cat([old, mxfp8.dequantize_torch(chunk, q.dtype)], dim=1)
    kpos = torch.cat([old_pos, qpos], dim=1)
    kvalid = torch.cat([old_pos >= 0, valid], dim=1)
    qp = qpos.unsqueeze(2)
    low = torch.maximum(qp - window + 1, lo.view(-1, 1, 1))
    k = kpos.unsqueeze(1)
    ok = kvalid.unsqueeze(1) & valid.unsqueeze(2) & (k <= qp) & (k >= low)
    groups = [(keys, ok)]
    if cmp is not None:
        ckeys, cok, idx = cmp
        if idx is not None:
            n, t, kk = idx.shape
            ckeys = torch.gather(ckeys.unsqueeze(1).expand(n, t, *ckeys.shape[1:]), 2,
                                 idx.unsqueeze(-1).expand(n, t, kk, ckeys.shape[-1]))
        groups.append((ckeys, cok))
    return union_attention(q, groups, sink, scale)
