"""Lightning indexer (CSA): score compressed entries, keep the top k visible ones.

    I(t, j) = sum_h w_h(t) * relu(q_h(t) . k_j)

    q        [N, T, Hi, Di]   indexer queries
    w        [N, T, Hi]       per-head weights
    k        [N, Kc, Di]      indexer keys, one per compressed entry
    visible  [N, T, Kc]       bool
    returns  [N, T, Kc] bool: the selected entries (all visible ones when fewer than k)

Ties (ReLU makes exact zeros common) go to the lower entry index: a stable sort
makes the choice independent of how many entries the caller padded in, so a
chunked prefill selects exactly what a one-shot pass selects.
"""

from __future__ import annotations

import torch


def indexer_scores(q, w, k):
    return torch.einsum("nthe,nke->nthk", q, k).relu().mul(w.unsqueeze(-1)).sum(2)


def select_topk(scores, visible, k: int):
    n, t, kc = scores.shape
    selected = torch.zeros_like(visible)
    if kc == 0:
        return selected
    masked = scores.masked_fill(~visible, float("-inf"))
    kk = min(k, kc)
    idx = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :kk]
    selected.scatter_(-1, idx, True)
    return selected & visible                                     # -inf picks are not visible
