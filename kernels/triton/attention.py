"""SWA + compressed-entry attention in one Triton kernel (see kernels.attention.ring_attention).

One program = one query row (n, t) and BH heads. K = V is shared by all heads (MQA), so a
key tile is read once per program and used for every head of the block. Keys stream in
tiles of BK through one online softmax that starts from the head's sink (m = sink, l = 1,
acc = 0: the sink joins the denominator and adds nothing to the output):

    window     positions [max(lo, i - W + 1, 0), i]: MXFP8 bytes dequantized in registers,
               from ring row p % R for p < chunk start, else from the chunk's own bytes
    compressed entries keys[idx[n, t, k]] (CSA top-k gather) or keys[k] (HCA) where ok

Scores and the weighted sum use fp32 IEEE dot products (no TF32), so the kernel matches
the fp32 torch reference to rounding noise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.mxfp8 import _e4m3_value, _e8m0_scale

BH = 16      # heads per program
BK = 16      # keys per tile


@triton.jit
def _update(q, k, kmask, m_i, l_i, acc, scale):
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale            # [BH, BK]
    s = tl.where(kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, k, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _ring_attention_kernel(
        q_ptr, out_ptr, ring_ptr, slots_ptr, chunk_ptr, qpos_ptr, valid_ptr, lo_ptr, sink_ptr,
        ckeys_ptr, cok_ptr, cidx_ptr,
        T, H, R, ring_s0, ring_s1, K, KC, window, scale,
        D: tl.constexpr, NB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
        HAS_CMP: tl.constexpr, HAS_IDX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                 # n * T + t
    n = row // T
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    d = tl.arange(0, D)
    TB: tl.constexpr = D + NB

    q = tl.load(q_ptr + (row * H + heads)[:, None] * D + d[None, :], mask=hmask[:, None],
                other=0.0).to(tl.float32)
    m_i = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
    l_i = tl.full([BH], 1.0, tl.float32)
    acc = tl.zeros([BH, D], tl.float32)

    is_valid = tl.load(valid_ptr + row) != 0
    p = tl.load(qpos_ptr + row)
    p0 = tl.load(qpos_ptr + n * T)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    start = tl.maximum(tl.maximum(tl.load(lo_ptr + n), p - window + 1), 0)
    stop = tl.where(is_valid, p + 1, start)             # padding rows see no keys
    for kb in range(start, stop, BK):
        kpos = kb + tl.arange(0, BK)
        kmask = kpos <= p
        in_ring = kpos < p0
        src = tl.where(in_ring, ring_ptr + slot * ring_s0 + (kpos % R) * ring_s1,
                       chunk_ptr + (n * T + (kpos - p0)) * TB)
        code = tl.load(src[:, None] + d[None, :], mask=kmask[:, None], other=0)
        sc = tl.load(src[:, None] + D + d[None, :] // 32, mask=kmask[:, None], other=127)
        k = _e4m3_value(code.to(tl.int32)) * _e8m0_scale(sc.to(tl.int32))
        m_i, l_i, acc = _update(q, k, kmask, m_i, l_i, acc, scale)

    if HAS_CMP:
        for j in range(0, K, BK):
            jj = j + tl.arange(0, BK)
            jmask = jj < K
            ok = tl.load(cok_ptr + row * K + jj, mask=jmask, other=0) != 0
            if HAS_IDX:
                e = tl.load(cidx_ptr + row * K + jj, mask=jmask, other=0).to(tl.int64)
            else:
                e = jj.to(tl.int64)
            k = tl.load(ckeys_ptr + (n * KC + e)[:, None] * D + d[None, :], mask=ok[:, None],
                        other=0.0).to(tl.float32)
            m_i, l_i, acc = _update(q, k, ok, m_i, l_i, acc, scale)

    out = acc / l_i[:, None]
    tl.store(out_ptr + (row * H + heads)[:, None] * D + d[None, :], out, mask=hmask[:, None])


def ring_attention(q, ring, slots, chunk, qpos, valid, lo, window: int, sink, scale: float,
                   cmp=None):
    n, t, h, d = q.shape
    if d % 32 or d & (d - 1):
        raise ValueError(f"Triton ring attention needs a power-of-two head dim (multiple of 32), not {d}")
    if ring.shape[-1] != d + d // 32 or chunk.shape[-1] != d + d // 32:
        raise ValueError(f"MXFP8 rows of {d}-d keys are {d + d // 32} bytes, got ring "
                         f"{tuple(ring.shape)} and chunk {tuple(chunk.shape)}")
    dev = q.device
    # small per-sequence index tensors may come from the host; bring them along
    slots, qpos, valid, lo = (x.to(dev, non_blocking=True) for x in (slots, qpos, valid, lo))
    qc = q.contiguous()
    out = torch.empty(n, t, h, d, dtype=torch.float32, device=dev)
    args = dict(K=0, KC=0)
    ckeys = cok = cidx = qc                            # unused placeholders when absent
    if cmp is not None:
        ckeys, cok, cidx = cmp
        ckeys = ckeys.contiguous()
        cok = cok.contiguous()
        args = dict(K=cok.shape[-1], KC=ckeys.shape[1])
        cidx = cidx.contiguous() if cidx is not None else qc
    if ring.stride(-1) != 1:
        raise ValueError("ring rows must be contiguous bytes")
    if n * t:
        grid = (n * t, triton.cdiv(h, BH))
        _ring_attention_kernel[grid](
            qc, out, ring, slots.contiguous(), chunk.contiguous(),
            qpos.contiguous(), valid.contiguous(), lo.contiguous(), sink.contiguous(),
            ckeys, cok, cidx, t, h, ring.shape[1], ring.stride(0), ring.stride(1), args["K"], args["KC"], window, scale,
            D=d, NB=d // 32, BH=BH, BK=BK, HAS_CMP=cmp is not None and args["K"] > 0,
            HAS_IDX=cmp is not None and cmp[2] is not None)
    return out.to(q.dtype)
