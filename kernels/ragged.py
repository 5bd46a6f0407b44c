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

from kernels.attention import union_attention


def ragged_union_attention(q, groups, sink, scale: float):
    """`attention.union_attention` for one flattened batch: q [T, H, D]; each group is
    (keys [L, D] shared by every row, or [T, K, D] per row; ok [T, L or K]). The same
    math as the batched version with a batch of one, so it is that call."""
    batched = [(keys.unsqueeze(0), ok.unsqueeze(0)) for keys, ok in groups]
    return union_attention(q.unsqueeze(0), batched, sink, scale)[0]


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
