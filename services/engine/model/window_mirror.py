"""WindowMirror: dequantized copies of SWA ring rows, so a decode step does not dequantize
its sequences' whole windows (W - 1 MXFP8 rows per sequence per layer) again every step.

Owned by the ModelRunner, which is the only writer of ring rows during a sequence's
life. The ring bytes stay the source of truth; the mirror is a cache of
`dequantize(ring row)` that is only trusted when both hold:

  * the row's recorded position equals the one asked for (`pos[layer][slot, p % R] == p`),
    which also covers rollback (rows past the new end are rewritten before they are read);
  * the slot still belongs to the same owner, continuing where its last chunk ended. A
    slot taken by another sequence, a re-admission, a snapshot restore (written into the
    ring by prefix.py at admission) or a rollback all break that, and the slot's mirror is
    dropped. Works without an owner never use it.

A missed row is dequantized from the ring bytes (the same numbers, bit for bit) and kept.

`scratch_rows` more rows follow each layer's mirror rows in one table, where a prefill chunk's
own keys are staged (`stage`): the compiled CPU kernel then reads a chunk's window keys by
index, its W - 1 older ones where they are in the mirror and its own from the scratch,
instead of a copy of both in one pool per layer (`key_rows` names them in the pool's order).

Ring-path rows (windows.py) attend to a slot's mirror rows in place, without asking
for each row: that is sound because a slot that continues holds every row its next chunk
needs (each forward reads or writes all of them), and a slot whose mirror was just dropped
gets its W - 1 older rows `fill`ed before the first such read.
"""

from __future__ import annotations

import torch

from kernels import host_memory
from kernels.ring_rows import RingAt, dequantize_rows, put_at, take_rows

NOWHERE = -(1 << 62)     # no real or masked (negative) position ever equals this


class WindowMirror:
    def __init__(self, swa: dict[int, torch.Tensor], head_dim: int, dtype: torch.dtype,
                 scratch_rows: int = 0):
        self.swa = swa
        slots, ring = next(iter(swa.values())).shape[:2]
        dev = next(iter(swa.values())).device
        # per layer one table: the slots' ring rows (slot * R + ring row), then the scratch
        self._table = {layer: host_memory.zeros((slots * ring + scratch_rows, head_dim), dtype, dev)
                       for layer in swa}
        self.values = {layer: t[: slots * ring].view(slots, ring, head_dim)
                       for layer, t in self._table.items()}
        self.scratch_rows = scratch_rows
        self._slots, self._ring = slots, ring
        self.pos = {layer: torch.full((slots, ring), NOWHERE, dtype=torch.long, device=dev)
                    for layer in swa}
        self.dtype = dtype
        self._owner: dict[int, tuple[object, int]] = {}     # slot -> (owner, next position)

    def begin(self, works, uploads=None) -> list[int]:
        """Before a forward: drop the mirror of every slot whose owner or continuity changed.
        Returns the indices (into works) of the dropped ones. `uploads`: the step's
        (device.Uploads), through which the dropped slots' index goes up."""
        stale, dropped = [], []
        for i, w in enumerate(works):
            owner = getattr(w, "owner", None)
            if owner is None or self._owner.get(w.slot) != (owner, w.start):
                stale.append(w.slot)
                dropped.append(i)
            if owner is None:
                self._owner.pop(w.slot, None)
            else:
                self._owner[w.slot] = (owner, w.end)
        if stale:
            idx = uploads.longs(stale) if uploads is not None else torch.tensor(
                stale, dtype=torch.long, device=next(iter(self.pos.values())).device)
            for p in self.pos.values():
                p[idx] = NOWHERE
        return dropped

    def fill(self, layer: int, slots, pos) -> None:
        """Dequantize ring rows at (slots, pos) into the mirror unconditionally (a dropped
        slot's older window rows, before ring-path rows read them in place)."""
        ri = pos.remainder(self.swa[layer].shape[1])
        self.values[layer][slots, ri] = dequantize_rows(self.swa[layer][slots, ri], self.dtype)
        self.pos[layer][slots, ri] = pos

    def rewind(self, slot: int, owner: object, end: int) -> None:
        """The owner continues at `end` < the end of its last chunk (a verify step's rejected
        rows): their mirror rows keep their own positions, never read before rewritten."""
        if owner is not None and self._owner.get(slot, (None,))[0] == owner:
            self._owner[slot] = (owner, end)

    def read(self, layer: int, slots, pos, dtype) -> torch.Tensor:
        """Dequantized ring rows at (slots, pos) (same-shape long tensors) -> [*shape, D]."""
        if dtype != self.dtype:
            return dequantize_rows(self.swa[layer][slots, pos.remainder(self.swa[layer].shape[1])], dtype)
        r = self.swa[layer].shape[1]
        ri = pos.remainder(r)
        # every asked row is dequantized and the mirror's kept where it holds the position:
        # picking out only the missed rows would read their count back (a sync on a GPU).
        # Only gather/pool works read this way (prefill chunks: W - 1 rows per work and
        # layer, small beside the chunk's own attention); decodes read the mirror in place.
        hit = (self.pos[layer][slots, ri] == pos).unsqueeze(-1)
        rows = torch.where(hit, self.values[layer][slots, ri],
                           dequantize_rows(self.swa[layer][slots, ri], dtype))
        self.values[layer][slots, ri] = rows
        self.pos[layer][slots, ri] = pos
        return rows

    def take(self, layer: int, slots, pos) -> torch.Tensor:
        """Mirror rows at (slots, pos) as they are: for works that continue in the mirror
        (windows.py PoolPlan.in_mirror), whose every asked row it holds, or a row masked out
        (a position below the window's bound, whose value is never weighted: finite, as every
        value the mirror holds is a dequantized ring row, a written row or a zero)."""
        # one index into the flat rows: index_select gathers 2 KB rows several times faster on
        # the CPU than indexing by (slot, row) pairs (127 rows, 1 thread: ~60 against ~20 us)
        return take_rows(self._table[layer], self._flat_rows(slots, pos))

    def _flat_rows(self, slots, pos) -> torch.Tensor:
        """Rows of a layer's table that hold (slot, position): slot * R + position mod R."""
        return slots * self._ring + pos.remainder(self._ring)

    def stage(self, layer: int, at: int, rows: torch.Tensor) -> torch.Tensor:
        """Copy rows [n, D] into the layer's scratch rows at .. at + n - 1 (the caller keeps
        them within scratch_rows); returns the layer's table, mirror rows then scratch rows."""
        table, base = self._table[layer], self._slots * self._ring
        if at < 0 or at + rows.shape[0] > self.scratch_rows:
            raise ValueError(f"{rows.shape[0]} rows at {at} do not fit {self.scratch_rows} "
                             "scratch rows")
        table[base + at : base + at + rows.shape[0]] = rows
        return table

    def key_rows(self, slots, pos, at: int, n: int) -> torch.Tensor:
        """Table rows of cat(mirror rows at (slots, pos), the n rows staged at `at`), in that
        order: what `take` and the staged rows would give, named instead of copied."""
        return torch.cat([self._flat_rows(slots, pos),
                          self._slots * self._ring + at + torch.arange(n, device=slots.device)])

    def write(self, layer: int, at: RingAt, pos, values) -> None:
        """Rows the runner just wrote to the ring at `at` (the step's places for this ring
        length; values = what a reader of them sees)."""
        if values.dtype != self.dtype:
            return
        put_at(self.values[layer], at, values)
        put_at(self.pos[layer], at, pos)
