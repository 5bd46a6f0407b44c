"""Union attention: one softmax over window keys and compressed entries, plus a sink.

K = V (a single shared latent per key). The sink is a learned per-head logit that
joins the softmax denominator only, so a head may attend to "nothing".

    q        [N, T, H, D]   queries
    k_win    [N, Kw, D]     window keys (dequantized SWA KV), per sequence
    win_ok   [N, T, Kw]     bool: query t may see window key k
    k_cmp    [N, Kc, D]     compressed entries (may be Kc = 0)
    cmp_ok   [N, T, Kc]     bool
    sink     [H]
    returns  [N, T, H, D]
"""

from __future__ import annotations

import torch


def union_attention(q, k_win, win_ok, k_cmp, cmp_ok, sink, scale: float):
    keys = torch.cat([k_win, k_cmp], dim=1)                       # [N, K, D]
    ok = torch.cat([win_ok, cmp_ok], dim=2)                       # [N, T, K]
    scores = torch.einsum("nthd,nkd->nthk", q, keys) * scale      # [N, T, H, K]
    scores = scores.masked_fill(~ok.unsqueeze(2), float("-inf"))
    n, t, h, _ = scores.shape
    sink_col = sink.view(1, 1, h, 1).expand(n, t, h, 1).to(scores.dtype)
    probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("nthk,nkd->nthd", probs, keys)
