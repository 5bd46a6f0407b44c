"""Index tensors of one ragged step, built once per forward and shared by every layer.

A step is a list of works (one sequence chunk each). Its rows are flattened
cu_seqlens-style: work i owns rows cu[i]:cu[i+1] at positions first[i] ..
first[i] + n[i] - 1. No row is padding, so a decode next to a long prefill chunk
adds exactly one row.

Owned by the forward that built it (read-only once built, apart from `memo`: index tensors
that every layer of the same kind shares — rope angles, window masks, entry indices,
compressor stream layout — are derived once, on the first layer that asks, and reused by the
rest of the step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from services.engine.device import Uploads


@dataclass
class Segments:
    first: torch.Tensor        # [N] position of each work's first row
    n: torch.Tensor            # [N] rows per work (0 allowed)
    cu: torch.Tensor           # [N + 1] row offsets
    wid: torch.Tensor          # [T] work of each row
    pos: torch.Tensor          # [T] position of each row
    lo: torch.Tensor           # [N] window lower bound (keys at positions < lo are masked)
    counts: tuple[int, ...] = ()   # n as host ints (decisions without a device sync)
    first_ids: tuple[int, ...] = ()  # first as host ints
    lo_ids: tuple[int, ...] = ()   # lo as host ints
    cu_ids: tuple[int, ...] = field(init=False)   # cu as host ints
    rows: int = field(init=False)  # T, from the host ints: every layer asks, none may sync

    def __post_init__(self) -> None:
        self.cu_ids = (0, *accumulate(self.counts))
        self.rows = self.cu_ids[-1]

    @staticmethod
    def build(firsts: list[int], ends: list[int], los: list[int], device=None,
              uploads: Uploads | None = None) -> Segments:
        """`uploads`: the step's (StepBatch.build); a fresh one for a lone build."""
        up = uploads if uploads is not None else Uploads(device)
        counts = tuple(max(0, e - f) for f, e in zip(firsts, ends, strict=True))
        first, n, lo = up.many(firsts, counts, los)
        dev, total = first.device, sum(counts)
        if counts.count(1) == len(counts):            # a row per work (decodes): no gathers
            cu = torch.arange(total + 1, device=dev)
            return Segments(first, n, cu, cu[:-1], first, lo, counts, tuple(firsts), tuple(los))
        cu = torch.zeros(len(firsts) + 1, dtype=torch.long, device=dev)
        cu[1:] = torch.cumsum(n, 0)
        wid = torch.repeat_interleave(torch.arange(len(firsts), device=dev), n,
                                      output_size=total)
        pos = first[wid] + torch.arange(total, device=dev) - cu[wid]
        return Segments(first, n, cu, wid, pos, lo, counts, tuple(firsts), tuple(los))

    def sees_older(self, i: int) -> bool:
        """Whether a row of work i can see a key before the work's first row: its first row
        sees positions max(lo, first - W + 1) .. first, so none when first <= lo (a chunk that
        starts its sequence, or a bounded replay at its bound)."""
        return self.first_ids[i] > max(0, self.lo_ids[i])

    @property
    def end(self) -> torch.Tensor:
        return self.first + self.n

    def rows_at(self, wid: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Row index of position pos of work wid (caller guarantees it is inside the chunk)."""
        return self.cu[wid] + pos - self.first[wid]


@dataclass
class StepBatch:
    """Per-step facts about the works: slots, block tables, bounds, and the encoder and
    decoder row segments (decoder rows are a subset of encoder rows in compact mode)."""

    slots: torch.Tensor        # [N]
    tables: torch.Tensor       # [N, max table length] block ids, 0-padded (never read past a table)
    ends: torch.Tensor         # [N] end of each chunk
    cmp_from: torch.Tensor     # [N]
    enc: Segments
    dec: Segments
    dec_rows: torch.Tensor | None   # [Td] rows of enc that the decoder runs (None: all of them)
    slot_ids: tuple[int, ...] = ()  # slots as host ints
    end_ids: tuple[int, ...] = ()   # ends as host ints
    cmp_ids: tuple[int, ...] = ()   # cmp_from as host ints
    memo: dict = field(default_factory=dict)
    # every index tensor of the step goes up through this, before the first layer (runner.py)
    uploads: Uploads = field(default_factory=lambda: Uploads(None))

    def once(self, key: tuple, make: Callable[[], Any]) -> Any:
        """make() the first time `key` is asked for in this step, the same object after."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    @staticmethod
    def build(works, compact: bool, device=None) -> StepBatch:
        """`device`: where the index tensors live (the runner's: that of its weights)."""
        up = Uploads(device)
        # one pass over the works for every field (a step reads each work once)
        starts, ends, slots, cmps, enc_lo, dec_lo = [], [], [], [], [], []
        for w in works:
            starts.append(w.start)
            ends.append(w.end)
            slots.append(w.slot)
            cmps.append(w.cmp_from)
            enc_lo.append(w.enc_lo)
            dec_lo.append(w.dec_lo)
        width = max(1, max(len(w.table) for w in works))
        tables, slots_t, ends_t, cmp_t, dec_lo_t = up.many(
            [w.table + [0] * (width - len(w.table)) for w in works], slots, ends, cmps, dec_lo)
        enc = Segments.build(starts, ends, enc_lo, device, up)
        if compact:
            dec = Segments.build([max(s, lo) for s, lo in zip(starts, dec_lo, strict=True)], ends,
                                 dec_lo, device, up)
            dec_rows = enc.rows_at(dec.wid, dec.pos)
            if len(dec_rows) == enc.rows:
                dec_rows = None
        else:
            dec = Segments(enc.first, enc.n, enc.cu, enc.wid, enc.pos, dec_lo_t,
                           enc.counts, enc.first_ids, tuple(dec_lo))
            dec_rows = None
        return StepBatch(slots_t, tables, ends_t, cmp_t, enc, dec, dec_rows, tuple(slots),
                         tuple(ends), tuple(cmps), uploads=up)

    def entry_index(self, per_block: int, count: int) -> torch.Tensor:
        """[N, count] flat row (block * per_block + row) of entries 0..count-1 of each work;
        entries past a work's table point at block 0 and must be masked by the caller."""
        j = torch.arange(count, device=self.tables.device)
        col = torch.clamp(j // per_block, max=self.tables.shape[1] - 1)
        return self.tables[:, col] * per_block + (j % per_block)
