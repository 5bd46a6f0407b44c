"""Ragged (flattened) batch operations: every row of a step in one tensor, no padding.

A step's rows are the concatenation of each sequence's chunk (decode rows are chunks of
one); a row's key set is built by index, so a decode row next to a 500-row prefill chunk
costs one row, not 500. These are the signatures GPU kernels implement; the torch code
here is their reference.

    q        [T, H, D]            queries, one row per token of the step
    groups   list of (keys, ok), one softmax across all of them plus the sink:
               keys [T, K, D]     one key set per query (window gathered by index,
                                  compressed entries, CSA's top-k picks), or
               keys [L, D]        one pool shared by the rows (a long chunk's window),
               ok   [T, K] / [T, L]  bool: query t may see key k
    sink     [H]
    returns  [T, H, D]

Ring helpers read and write many slots at once; `ring_rows` is a pure gather, and
`ring_put` requires (slot, position % R) pairs to be distinct (the caller keeps only the
last R rows of each sequence), so the write order cannot matter.
"""

from __future__ import annotations

import torch


def _scores(q, keys):
    if keys.dim() == 2:
        return torch.einsum("thd,ld->thl", q, keys)
    return torch.einsum("thd,tkd->thk", q, keys)


def _mix(p, keys):
    if keys.dim() == 2:
        return torch.einsum("thl,ld->thd", p, keys)
    return torch.einsum("thk,tkd->thd", p, keys)


def ragged_union_attention(q, groups, sink, scale: float):
    t, h, _ = q.shape
    parts = []
    for keys, ok in groups:
        s = _scores(q, keys) * scale                               # [T, H, K]
        parts.append(s.masked_fill(~ok.unsqueeze(1), float("-inf")))
    parts.append(sink.view(1, h, 1).expand(t, h, 1).to(q.dtype))
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    out = torch.zeros_like(q)
    start = 0
    for keys, _ in groups:
        k = keys.shape[-2]
        if k:
            out = out + _mix(probs[..., start : start + k], keys)
        start += k
    return out


def ragged_indexer_scores(q, w, keys):
    """q [T, Hi, Di], w [T, Hi], keys [T, K, Di] (each row's own candidates) -> [T, K]."""
    return torch.einsum("the,tke->thk", q, keys).relu().mul(w.unsqueeze(-1)).sum(1)


_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def dequantize_rows(q, dtype=torch.float32):
    """mxfp8.dequantize through a 256-entry E4M3 table: the same numbers bit for bit
    (each E4M3 code is exact in fp32, then the same power-of-two scaling), about twice
    as fast on CPU as the float8 conversion."""
    d = (q.shape[-1] * 32) // 33
    values = _E4M3[q[..., :d].to(torch.int32)]
    exp = q[..., d:].float() - 127.0
    blocks = values.reshape(*q.shape[:-1], d // 32, 32) * torch.exp2(exp).unsqueeze(-1)
    return blocks.reshape(*q.shape[:-1], d).to(dtype)


def ring_rows(ring, slots, pos):
    """ring [S, R, ...]; slots, pos: same-shape long tensors -> rows [*shape, ...]."""
    return ring[slots, pos.remainder(ring.shape[1])]


def ring_put(ring, slots, pos, rows) -> None:
    """Write rows at (slot, pos % R); pairs must be distinct."""
    ring[slots, pos.remainder(ring.shape[1])] = rows.to(ring.dtype)
