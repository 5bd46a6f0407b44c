"""Rows of tables and rings, many at once: gathers (`take_rows`, `take_at`), MXFP8 rows
dequantized (`dequantize_rows`) and ring writes (`put_at`, `ring_put`).

Ring helpers read and write many slots at once: `take_at` is a pure gather, and `put_at` /
`ring_put` require (slot, position % R) pairs to be distinct (the caller keeps only the
last R rows of each sequence), so the write order cannot matter. A step builds its places
once per ring length (`RingAt`) and every layer's write and read reuses them. On the CPU
`put_at` is one call of kernels/cpu/put_rows.c (a memcpy a row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_ring
from kernels.mxfp8 import e4m3_values


def dequantize_rows(q, dtype=torch.float32):
    """mxfp8.dequantize through a 256-entry E4M3 table: the same numbers bit for bit
    (each E4M3 code is exact in fp32, then the same power-of-two scaling), about twice
    as fast on CPU as the float8 conversion."""
    d = (q.shape[-1] * 32) // 33
    values = e4m3_values(q[..., :d])
    exp = q[..., d:].float() - 127.0
    blocks = values.reshape(*q.shape[:-1], d // 32, 32) * torch.exp2(exp).unsqueeze(-1)
    return blocks.reshape(*q.shape[:-1], d).to(dtype)


def take_rows(table, idx):
    """table [N, ...], idx long [...] -> table[idx] [*idx.shape, ...] through index_select,
    which on CPU gathers rows of a few KB about twice as fast as advanced indexing (32 x 16
    entry rows of 512 fp32: 331 -> 131 us, 1 thread)."""
    return table.index_select(0, idx.reshape(-1)).view(*idx.shape, *table.shape[1:])


@dataclass(frozen=True)
class RingAt:
    """Where rows of rings [S, R, ...] are: (slots[i], rows[i]) and the same as one flat row
    index slots * R + rows. A step builds it once per ring length (every layer with that R
    writes or reads the same rows), so no layer computes a remainder or an index again."""

    slots: torch.Tensor            # [n]
    rows: torch.Tensor             # [n] position % R
    flat: torch.Tensor             # [n] slots * R + rows

    @staticmethod
    def of(slots, pos, ring_len: int) -> RingAt:
        rows = pos.remainder(ring_len)
        return RingAt(slots, rows, slots * ring_len + rows)


def _wide(t):
    """uint8 rows whose width is a multiple of 8 seen as int64 (same bytes): index_copy_ and
    index_put walk elements, and an MXFP8 row (528 B) copies as 66 of them instead of 528
    (32 rows: 15 -> 6 us, 1 thread). Unchanged when an offset or stride forbids the view."""
    if t.dtype == torch.uint8 and t.shape[-1] % 8 == 0:
        try:
            return t.view(torch.int64)
        except RuntimeError:
            pass
    return t


def _row_bytes(ring) -> int:
    """Bytes of one ring row [S, R, ...] when its trailing dims are packed (0 when not)."""
    size, expect = ring.element_size(), 1
    for n, st in zip(reversed(ring.shape[2:]), reversed(ring.stride()[2:]), strict=True):
        if n > 1 and st != expect:
            return 0
        expect *= n
    return expect * size


def put_at(ring, at: RingAt, rows) -> None:
    """ring[at] = rows (distinct places). On the CPU one call of kernels/cpu/put_rows.c (a
    memcpy a row, the places checked first: 32 rows of a step, 17 rings a step at batch
    32); else a contiguous ring takes one index_copy_ of whole rows on its flat [S * R, ...]
    view (32 fp32 rows of 512: 9.3 -> 6.7 us against an index_put with two index tensors)
    and a strided one (the state pool's rings are views into per-slot slabs) an index_put
    on (slots, rows), already reduced mod R."""
    rows = rows.to(ring.dtype).contiguous()
    lib = cpu_ring.library(ring, None)
    width = _row_bytes(ring) if lib is not None else 0
    if width and rows.is_cpu and at.slots.dtype == at.rows.dtype == torch.long \
            and at.slots.is_contiguous() and at.rows.is_contiguous() \
            and rows.numel() * rows.element_size() == at.slots.numel() * width:
        es = ring.element_size()
        bad = lib.put_rows(ring.data_ptr(), ring.shape[0], ring.shape[1], ring.stride(0) * es,
                           ring.stride(1) * es, at.slots.data_ptr(), at.rows.data_ptr(),
                           rows.data_ptr(), width, at.slots.numel())
        if bad:
            i = bad - 1
            raise IndexError(f"ring place ({int(at.slots[i])}, {int(at.rows[i])}) is outside "
                             f"[{ring.shape[0]}, {ring.shape[1]}]")
        return
    dst, src = _wide(ring), _wide(rows)
    if dst.dtype != src.dtype:
        dst, src = ring, rows
    if dst.is_contiguous():
        dst.view(-1, *dst.shape[2:]).index_copy_(0, at.flat, src.view(-1, *dst.shape[2:]))
    else:
        dst.index_put_((at.slots, at.rows), src)


def take_at(ring, at: RingAt):
    """ring[at] -> [n, ...]: one index_select of whole rows on a contiguous ring (several
    times faster on CPU than advanced indexing), advanced indexing on a strided one."""
    if ring.is_contiguous():
        return ring.view(-1, *ring.shape[2:]).index_select(0, at.flat)
    return ring[at.slots, at.rows]


def ring_put(ring, slots, pos, rows) -> None:
    """Write rows at (slot, pos % R); pairs must be distinct."""
    ring[slots, pos.remainder(ring.shape[1])] = rows.to(ring.dtype)
