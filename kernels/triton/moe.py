"""Grouped expert products in Triton (see kvmesh.kernels.moe.grouped_linear).

One program = one expert, BM of its rows and BN output columns; it walks K in BK steps
with fp32 accumulation. Experts with fewer rows than the longest leave their extra
programs idle (they return at once); one launch covers every expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, out_ptr, offs_ptr, K, M,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(0)
    start = tl.load(offs_ptr + e)
    end = tl.load(offs_ptr + e + 1)
    row0 = start + tl.program_id(1) * BM
    if row0 >= end:
        return
    rows = row0 + tl.arange(0, BM)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    row_ok = rows < end
    col_ok = cols < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    w_base = w_ptr + e.to(tl.int64) * M * K
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wt = tl.load(w_base + cols[None, :].to(tl.int64) * K + ks[:, None],
                     mask=col_ok[None, :] & k_ok[:, None], other=0.0).to(tl.float32)
        acc += tl.dot(xt, wt, input_precision="ieee")  # fp32 products, not TF32
    tl.store(out_ptr + rows[:, None].to(tl.int64) * M + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


def grouped_linear(x: torch.Tensor, offsets: list[int], w: torch.Tensor) -> torch.Tensor:
    n, k = x.shape
    e, m, _ = w.shape
    out = torch.empty(n, m, dtype=torch.float32, device=x.device)
    longest = max(b - a for a, b in zip(offsets, offsets[1:], strict=False))
    if n and longest:
        bm, bn, bk = 16, min(64, max(16, triton.next_power_of_2(m))), 32
        offs = torch.tensor(offsets, dtype=torch.int64, device=x.device)
        grid = (e, triton.cdiv(longest, bm), triton.cdiv(m, bn))
        _grouped_kernel[grid](x.contiguous(), w.contiguous(), out, offs, k, m, BM=bm, BN=bn, BK=bk)
    return out.to(x.dtype)
