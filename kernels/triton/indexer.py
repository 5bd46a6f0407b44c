"""Lightning-indexer scores in Triton (see kernels.indexer.indexer_scores).

One program = one query row (n, t) and BKC compressed entries:
I(t, j) = sum_h w_h(t) * relu(q_h(t) . k_j), with the head dot products as one fp32 IEEE
tile product [Hi, Di] x [Di, BKC]. Top-k selection stays in torch (select_topk), whose
tie rule needs the whole row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BKC = 32


@triton.jit
def _scores_kernel(q_ptr, w_ptr, k_ptr, out_ptr, T, HI, KC,
                   DI: tl.constexpr, HP: tl.constexpr, BKC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = row // T
    j = tl.program_id(1) * BKC + tl.arange(0, BKC)
    jmask = j < KC
    h = tl.arange(0, HP)
    hmask = h < HI
    d = tl.arange(0, DI)
    q = tl.load(q_ptr + (row * HI + h)[:, None] * DI + d[None, :], mask=hmask[:, None], other=0.0)
    w = tl.load(w_ptr + row * HI + h, mask=hmask, other=0.0)
    k = tl.load(k_ptr + (n * KC + j)[:, None] * DI + d[None, :], mask=jmask[:, None], other=0.0)
    s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")  # [HP, BKC]
    s = tl.maximum(s, 0.0) * w.to(tl.float32)[:, None]
    tl.store(out_ptr + row * KC + j, tl.sum(s, axis=0), mask=jmask)


def indexer_scores(q, w, k):
    n, t, hi, di = q.shape
    kc = k.shape[1]
    if di & (di - 1):
        raise ValueError(f"Triton indexer needs a power-of-two index dim, not {di}")
    out = torch.empty(n, t, kc, dtype=torch.float32, device=q.device)
    if n * t * kc:
        grid = (n * t, triton.cdiv(kc, BKC))
        _scores_kernel[grid](q.contiguous(), w.contiguous(), k.contiguous(), out, t, hi, kc,
                             DI=di, HP=max(16, triton.next_power_of_2(hi)), BKC=BKC)
    return out.to(q.dtype)
