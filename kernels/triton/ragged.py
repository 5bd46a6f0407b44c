"""Ragged union attention in Triton (see kernels.ragged.ragged_union_attention).

One program = one query row t of the flattened step (a decode row or a row of a prefill
chunk: the kernel does not care which) and BH heads. K = V is shared by all heads (MQA), so
a key tile is loaded once per program and used by every head of the block. Up to two key
groups (the window, and the compressed entries) stream in tiles of BK through one online
softmax that starts from the head's sink (m = sink, l = 1, acc = 0: the sink joins the
denominator and adds nothing to the output). Each group is read where it lies, by index:

    KIND_RING    key r of row t at keys[slots[t], r]: a slot's ring read in place, either
                 the window mirror's fp32 rows or, MX, the MXFP8 ring bytes themselves
                 (E4M3 codes and E8M0 scales dequantized in registers, so a decode step
                 reads 528 B per key instead of 2 KiB)
    KIND_ROW     keys[t, k]: the row's own gathered keys (window by index, CSA picks)
    KIND_SHARED  keys[k]: one pool every row masks (a long chunk's window, HCA entries)

and key k of row t joins only where ok[t, k]; keys outside the mask are not even loaded,
which is how truncated windows [max(s, i - W + 1), i] cost nothing beyond their keys.
Scores and the weighted sum are fp32-grade: bf16 tensor-core products of hi/lo halves
(`precision="split"`, the default when compiled; MXFP8 keys are exact in bf16, so they need
no lo half), or
fp32 IEEE products (`"ieee"`, no TF32); both match the fp32 torch reference to ~1e-5.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.mxfp8 import _e4m3_value, _e8m0_scale

BH = 16      # heads per program (tl.dot needs tiles of at least 16)
BK = 16      # keys per tile
KIND_NONE, KIND_RING, KIND_ROW, KIND_SHARED = 0, 1, 2, 3
# Compiled, products run on bf16 tensor cores with hi/lo splitting (fp32-grade results, see
# _dot): a decode row does 2 x H x D flops per key for every 528 bytes it reads, far more than
# fp32 FMA units keep up with at HBM speed, so IEEE fp32 products would make the kernel
# compute-bound. Under the CPU interpreter the default is "ieee": there the split path is
# only emulated in fp32 and costs several times the interpreter time (the kernel tests run
# both; the engine test with "split" passed too, in 9.6 min instead of ~2 on a busy machine).
SPLIT, IEEE = "split", "ieee"


@triton.jit
def _split(x):
    """fp32 x -> (hi, lo) bf16 with hi + lo = x to about 2**-16 relative."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _mma(a, b, BF16_DOT: tl.constexpr):
    """bf16 x bf16 -> fp32. Triton's CPU interpreter multiplies bf16 tiles wrongly, so there
    (BF16_DOT off) the halves are widened first: bf16 products are exact in fp32, so this is
    the tensor cores' arithmetic up to the order of the fp32 sums."""
    if BF16_DOT:
        return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _dot(a_hi, a_lo, b_hi, b_lo, EXACT_B: tl.constexpr, SPLIT: tl.constexpr,
         BF16_DOT: tl.constexpr):
    """a @ b in fp32 from split operands (_split; without SPLIT the hi halves are the fp32
    tiles themselves and one IEEE product is taken, no TF32). SPLIT: a_hi b_hi + a_lo b_hi +
    a_hi b_lo on bf16 tensor cores (lo x lo is below fp32's own rounding); two products when
    b is exactly bf16 already (EXACT_B: dequantized MXFP8 keys, whose 4 significant bits and
    power-of-two scale fit bf16)."""
    if SPLIT:
        out = _mma(a_hi, b_hi, BF16_DOT) + _mma(a_lo, b_hi, BF16_DOT)
        if not EXACT_B:
            out += _mma(a_hi, b_lo, BF16_DOT)
        return out
    else:
        return tl.dot(a_hi, b_hi, input_precision="ieee")


@triton.jit
def _update(q_hi, q_lo, k, kmask, m_i, l_i, acc, scale, EXACT_K: tl.constexpr,
            SPLIT: tl.constexpr, BF16_DOT: tl.constexpr):
    if SPLIT:
        k_hi, k_lo = _split(k)
    else:
        k_hi, k_lo = k, k
    s = _dot(q_hi, q_lo, tl.trans(k_hi), tl.trans(k_lo), EXACT_K, SPLIT, BF16_DOT) * scale
    s = tl.where(kmask[None, :], s, float("-inf"))                     # [BH, BK]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if SPLIT:
        p_hi, p_lo = _split(p)
    else:
        p_hi, p_lo = p, p
    acc = acc * alpha[:, None] + _dot(p_hi, p_lo, k_hi, k_lo, EXACT_K, SPLIT, BF16_DOT)
    return m_new, l_i, acc


@triton.jit
def _group(q_hi, q_lo, m_i, l_i, acc, t, scale, keys_ptr, slot_ptr, s0, s1, ok_ptr, ok0, ok1, K,
           part, chunk, D: tl.constexpr, BK: tl.constexpr, KIND: tl.constexpr,
           MX: tl.constexpr, SPLIT: tl.constexpr, BF16_DOT: tl.constexpr):
    """Fold keys [part * chunk, (part + 1) * chunk) of one key group of row t (chunk: a
    multiple of BK, or K when the keys are not split) into the running softmax state."""
    if KIND == 1:
        base = tl.load(slot_ptr + t).to(tl.int64) * s0
    elif KIND == 2:
        base = t * s0
    else:
        base = t * 0
    d = tl.arange(0, D)
    lo = part * chunk
    hi = tl.minimum(lo + chunk, K)
    for kb in range(lo, hi, BK):
        kk = (kb + tl.arange(0, BK)).to(tl.int64)
        ok = tl.load(ok_ptr + t * ok0 + kk * ok1, mask=kk < hi, other=0) != 0
        src = keys_ptr + base + kk * s1
        if MX:
            code = tl.load(src[:, None] + d[None, :], mask=ok[:, None], other=0)
            sc = tl.load(src[:, None] + D + d[None, :] // 32, mask=ok[:, None], other=127)
            k = _e4m3_value(code.to(tl.int32)) * _e8m0_scale(sc.to(tl.int32))
        else:
            k = tl.load(src[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        m_i, l_i, acc = _update(q_hi, q_lo, k, ok, m_i, l_i, acc, scale, MX, SPLIT, BF16_DOT)
    return m_i, l_i, acc


@triton.jit
def _ragged_kernel(q_ptr, out_ptr, ml_ptr, sink_ptr, T, H, scale,
                   a_keys, a_slot, a_s0, a_s1, a_ok, a_ok0, a_ok1, a_k, a_chunk,
                   b_keys, b_slot, b_s0, b_s1, b_ok, b_ok0, b_ok1, b_k, b_chunk,
                   D: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                   A_KIND: tl.constexpr, A_MX: tl.constexpr,
                   B_KIND: tl.constexpr, B_MX: tl.constexpr, SPLIT: tl.constexpr,
                   BF16_DOT: tl.constexpr, PARTIAL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    part = tl.program_id(2)
    hmask = heads < H
    d = tl.arange(0, D)
    at = (t * H + heads)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + at, mask=hmask[:, None], other=0.0).to(tl.float32)
    # every part starts from the sink's score (a finite running max, so a part whose keys
    # are all masked stays exact); only part 0 counts the sink in the denominator
    m_i = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
    l_i = tl.full([BH], 1.0, tl.float32) * (part == 0).to(tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    if SPLIT:                                           # split once, used by every key tile
        q_hi, q_lo = _split(q)
    else:
        q_hi, q_lo = q, q
    m_i, l_i, acc = _group(q_hi, q_lo, m_i, l_i, acc, t, scale, a_keys, a_slot, a_s0, a_s1,
                           a_ok, a_ok0, a_ok1, a_k, part, a_chunk, D, BK, A_KIND, A_MX, SPLIT,
                           BF16_DOT)
    if B_KIND != 0:
        m_i, l_i, acc = _group(q_hi, q_lo, m_i, l_i, acc, t, scale, b_keys, b_slot, b_s0, b_s1,
                               b_ok, b_ok0, b_ok1, b_k, part, b_chunk, D, BK, B_KIND, B_MX,
                               SPLIT, BF16_DOT)
    if PARTIAL:       # this part's unnormalized state: [parts, T, H, D] and [parts, T, H, 2]
        base = part.to(tl.int64) * T * H
        tl.store(out_ptr + base * D + at, acc, mask=hmask[:, None])
        ml = (base + t * H + heads) * 2
        tl.store(ml_ptr + ml, m_i, mask=hmask)
        tl.store(ml_ptr + ml + 1, l_i, mask=hmask)
    else:
        tl.store(out_ptr + at, acc / l_i[:, None], mask=hmask[:, None])


def _describe(group, d: int, device):
    """A key group (a kernels.ragged.RingKeys or (keys, ok)) -> the kernel's arguments:
    (keys, slots, row stride, key stride, ok, ok strides, K, kind, mx). Index tensors made
    on the host move to the device here (non-blocking, stream-ordered)."""
    ring = getattr(group, "rows", None)
    if ring is not None:
        codes = getattr(group, "codes", None)
        keys, mx = (codes, True) if codes is not None else (group.values, False)
        slots = ring.slots.to(device, non_blocking=True)
        ok, kind = group.ok, KIND_RING
    else:
        keys, ok = group
        mx, slots = keys.dtype == torch.uint8, None
        kind = KIND_SHARED if keys.dim() == 2 else KIND_ROW
    width = d + d // 32 if mx else d
    if keys.shape[-1] != width or keys.stride(-1) != 1:
        raise ValueError(f"key rows must be {width} contiguous {'bytes' if mx else 'values'} "
                         f"for {d}-d queries, got {tuple(keys.shape)}")
    if not mx and keys.dtype != torch.float32:
        keys = keys.float()
    if ok.dtype == torch.bool:
        ok = ok.view(torch.uint8)        # same bytes, no copy; the kernel tests != 0
    s0 = keys.stride(0) if kind != KIND_SHARED else 0
    return (keys, slots if slots is not None else ok, s0, keys.stride(-2), ok,
            ok.stride(0), ok.stride(1), ok.shape[1], kind, mx)


# Split over keys: a step of a few rows has a grid of rows x head blocks programs (a batch-1
# decode with 64 heads: 4), far too few to fill a GPU, each streaming every key. When the grid
# is smaller than FILL programs, each row's keys are cut into parts of at least MIN_PART keys
# (at most MAX_PARTS), one program per part, and the parts' softmax states are combined by
# their log-sum-exp (`_combine`).
FILL, MIN_PART, MAX_PARTS = 256, 4 * BK, 32


def key_parts(rows: int, heads: int, keys: int) -> int:
    """How many parts the keys of a step of `rows` rows are split into (1: not split)."""
    grid = rows * triton.cdiv(heads, BH)
    return max(1, min(MAX_PARTS, FILL // max(grid, 1), keys // MIN_PART))


def _combine(acc, ml):
    """Parts' states (acc [P, T, H, D] unnormalized, ml [P, T, H, 2]: running max and sum,
    each relative to its own max) -> the softmax-weighted output [T, H, D]."""
    m, total = ml[..., 0], ml[..., 1]
    w = torch.exp(m - m.max(0).values)                                  # [P, T, H]
    return (acc * w.unsqueeze(-1)).sum(0) / (total * w).sum(0).unsqueeze(-1)


def union_attention(q, groups, sink, scale: float, precision: str | None = None,
                    parts: int | None = None):
    """q [T, H, D]; groups: one or two of RingKeys / (keys [T, K, D] or [L, D], ok) -> [T, H, D].
    Float keys are read as fp32; uint8 keys (and a RingKeys' `codes`) are MXFP8 rows.
    `precision`: "split" (bf16 tensor-core products of hi/lo halves) or "ieee" (fp32 FMA);
    None: split when compiled, ieee under the interpreter. `parts`: how many parts each
    row's keys are split into (None: `key_parts`, more than one only for small grids)."""
    parts_wanted = parts
    if precision is None:
        precision = IEEE if INTERPRETED else SPLIT
    if precision not in (SPLIT, IEEE):
        raise ValueError(f"precision must be split or ieee, not {precision!r}")
    t, h, d = q.shape
    if d < 16 or d & (d - 1):
        raise ValueError(f"Triton ragged attention needs a power-of-two head dim >= 16, not {d}")
    if not 1 <= len(groups) <= 2:
        raise ValueError(f"Triton ragged attention takes one or two key groups, not {len(groups)}")
    qc = q.float().contiguous()
    out = torch.empty(t, h, d, dtype=torch.float32, device=q.device)
    parts = [_describe(g, d, q.device) for g in groups]
    if any(p[9] for p in parts) and d % 32:
        raise ValueError(f"MXFP8 rows need a head dim that is a multiple of 32, not {d}")
    a = parts[0]
    b = parts[1] if len(parts) > 1 else a
    if not t:
        return out.to(q.dtype)
    n = key_parts(t, h, max(p[7] for p in parts)) if parts_wanted is None else parts_wanted
    if n < 1:
        raise ValueError(f"parts must be >= 1, not {n}")
    # keys per part of each group: whole tiles, so every part but the last is full
    chunk = [triton.cdiv(triton.cdiv(p[7], n), BK) * BK if n > 1 else max(p[7], 1) for p in (a, b)]
    partial = torch.empty(n, t, h, d, dtype=torch.float32, device=q.device) if n > 1 else out
    ml = torch.empty(n, t, h, 2, dtype=torch.float32, device=q.device) if n > 1 else out
    _ragged_kernel[(t, triton.cdiv(h, BH), n)](
        qc, partial, ml, sink.float().contiguous(), t, h, scale,
        *a[:8], chunk[0], *b[:8], chunk[1], D=d, BH=BH, BK=BK, A_KIND=a[8], A_MX=a[9],
        B_KIND=b[8] if len(parts) > 1 else KIND_NONE, B_MX=b[9],
        SPLIT=precision == SPLIT, BF16_DOT=not INTERPRETED, PARTIAL=n > 1)
    return (_combine(partial, ml) if n > 1 else out).to(q.dtype)


# whether this module's kernels were made for Triton's CPU interpreter (fixed at import)
INTERPRETED = type(_ragged_kernel).__name__ == "InterpretedFunction"
