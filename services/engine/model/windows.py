"""Window keys of one layer's query rows: which path each work's rows take, and the index
tensors behind it. A plan depends on the step and the ring length only, so it is built once
per step (StepBatch.once) and shared by every layer of that kind.

A query at position p sees window keys at positions max(lo, p - W + 1) .. p. Three paths,
by the rows n a work has in this step (R: ring rows = W + B, B >= 0):

    ring    n <= R - W + 1 (decodes, short verification chunks). The chunk's rows are put
            in the window mirror first (they cannot displace a key any row of the chunk
            still needs: a ring of R rows holds the W - 1 older keys plus R - W + 1 new
            ones), then every row attends to its slot's whole mirror ring in place
            (kernels/ragged.RingKeys), masked by the position each ring row holds:

                ring row r of a work ending at e holds  x(r) = e - 1 - ((e - 1 - r) mod R)
                row p sees it when  max(lo, p - W + 1) <= x(r) <= p

            No key is copied: the torch kernel multiplies a slot's queries with its ring.
    gather  n <= GATHER_MAX_ROWS: each row gathers its own W keys from a pool of the
            work's W - 1 older ring rows and its chunk rows. Off the CPU, or where the ring
            cannot serve in place; on the CPU a chunk's own pool costs less even at 8 rows
            (GATHER_ON_CPU).
    pool    longer chunks: a chunk's rows share one pool of its W - 1 older ring rows and
            its rows, masked per row (cheaper than W keys per row). One pool per chunk: a
            pool of several chunks would make every row score every chunk's keys, which grows
            with the square of the prefill rows in a step (4x the work with 4 chunks of 64).
            The pool's keys are consecutive positions, so a chunk's rows attend in blocks of
            POOL_BLOCK rows, each to the slice of the pool its rows can see (W - 1 + block
            keys): a 512-row chunk scores 191 keys per row instead of 639.

Older keys of gather/pool works are read through the mirror before this layer writes the
ring: taken from it as they are when the work continues there (the same reason ring-path
rows may read it in place: a continuing slot's mirror holds every row its next chunk needs),
else dequantized and checked row by row (WindowMirror.read); a ring-path work whose mirror
was dropped (new owner, restore, rollback) has its W - 1 older rows dequantized into the
mirror first (`fill`). A dropped work that can see no older row (its first position at its
bound: a new prompt's first chunk, a replay) needs neither: the older rows its paths name
are all masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.ragged import SlotRows
from kernels.ring_rows import RingAt
from services.engine.model.batch import Segments, StepBatch

# Works with at most this many rows gather each row's W window keys by index; longer
# chunks share one key pool (their ring rows + chunk rows) with a mask, which is cheaper
# than W keys per row once a chunk is longer than a few rows.
GATHER_MAX_ROWS = 16
# On the CPU (torch's kernels) W gathered keys per row cost more than a chunk's own pool of
# W - 1 + n keys for every n the gather path would take: 16 decodes and an 8-row chunk of a
# 4K prompt cost 18 ms over the decodes alone with gathered keys, 11 ms with a pool (16 rows:
# 25 -> 12 ms; 1 thread). Those chunks take a pool there, unless the ring cannot serve in
# place (then decodes gather too). Tests set it to pin the gather path on the CPU.
GATHER_ON_CPU = False

# A pool chunk's rows attend in blocks of this many rows, each to the W - 1 + block keys of
# the pool it can see: per row W - 1 + 64 keys whatever the chunk's length (a 512-row chunk
# with one block: W - 1 + 512), for one more attention call per block and layer.
POOL_BLOCK = 64


@dataclass(frozen=True)
class RingPlan:
    rows: torch.Tensor | None      # [t] rows of the segment on this path (None: all of them)
    work_ids: tuple[int, ...]      # the works of those rows, ascending (host ints)
    where: SlotRows                # each row's slot
    ok: torch.Tensor               # [t, R] row may see ring row r
    fill_slots: torch.Tensor | None  # [k * (W - 1)] older rows of dropped mirrors to restore
    fill_pos: torch.Tensor | None


@dataclass(frozen=True)
class PoolBlock:
    rows: slice                    # rows of the block, counted from the chunk's first row
    keys: slice                    # the keys they can see: a slice of cat(older rows, chunk rows)
    ok: torch.Tensor               # [rows, keys]


@dataclass(frozen=True)
class PoolPlan:
    rows: torch.Tensor | slice     # [t] rows of the segment on this path (pool: a slice)
    work_ids: tuple[int, ...]      # the works of those rows, ascending (host ints) ...
    works: torch.Tensor            # ... and on the device
    old_slots: torch.Tensor        # [u * (W - 1)] the works' older ring rows ...
    old_pos: torch.Tensor          # ... and their positions (negative ones are masked)
    idx: torch.Tensor | None       # gather: [t, W] index into cat(older rows, chunk rows)
    ok: torch.Tensor | None        # gather: [t, W] (pool: its blocks')
    # every work continues in its mirror (none dropped this forward, mirror usable): its older
    # rows are read from the mirror as they are, with no dequantize or hit test (WindowMirror.take)
    in_mirror: bool = False
    blocks: tuple[PoolBlock, ...] = ()    # pool: its rows in blocks of POOL_BLOCK


@dataclass(frozen=True)
class WindowPlan:
    ring: RingPlan | None
    gather: PoolPlan | None
    pools: tuple[PoolPlan, ...]    # one per long chunk: a row never scores another work's keys
    put_rows: torch.Tensor | None  # rows written to the ring (the last R of each work; None: all)
    put_at: RingAt                 # where they go: every layer of this ring length writes there
    put_pos: torch.Tensor          # their positions


def plan(step: StepBatch, seg: Segments, ring_rows: int, window: int, in_place: bool,
         stale: frozenset[int]) -> WindowPlan:
    """`in_place`: the mirror can serve ring-path rows (same dtype, R >= W); `stale`: works
    whose mirror was dropped at the start of this forward.

    Built before the step's first layer (runner.py) from the works' host ints: every index
    tensor goes up through step.uploads, and nothing here reads the device (no nonzero or
    unique, whose result sizes a GPU would have to send back)."""
    counts, cu, up = seg.counts, seg.cu_ids, step.uploads
    # a dropped work none of whose rows sees a key before its first row (a new prompt's first
    # chunk, a replay at its bound) needs no older row restored: the ones its paths name are
    # masked, and any finite mirror value does there (beside 16 decodes, a 4K prompt's first
    # step took 1.5-3.9 ms more than its next one, dequantizing 127 masked rows a layer)
    stale = frozenset(i for i in stale if seg.sees_older(i))
    short = ring_rows - window + 1 if in_place else 0
    gather = GATHER_MAX_ROWS if GATHER_ON_CPU or not in_place or seg.pos.device.type != "cpu" else 0
    by: dict[str, list[int]] = {"ring": [], "gather": [], "pool": []}
    for i, n in enumerate(counts):          # works with rows, by path
        if n:
            by["ring" if n <= short else "gather" if n <= gather else "pool"].append(i)

    def rows_of(ws: list[int]) -> torch.Tensor | None:
        if sum(counts[i] for i in ws) == cu[-1]:
            return None
        return up.longs([r for i in ws for r in range(cu[i], cu[i + 1])])

    # rows written to the ring: the last R of each work (older ones would be overwritten)
    put_rows = None if max(counts, default=0) <= ring_rows else up.longs(
        [r for i, n in enumerate(counts) for r in range(cu[i] + max(0, n - ring_rows), cu[i + 1])])
    put_wid = seg.wid if put_rows is None else seg.wid[put_rows]
    put_pos = seg.pos if put_rows is None else seg.pos[put_rows]
    return WindowPlan(
        _ring(step, seg, by["ring"], rows_of(by["ring"]), ring_rows, window, stale)
        if by["ring"] else None,
        _pool(step, seg, rows_of(by["gather"]), by["gather"], window, gather=True,
              in_mirror=in_place and not stale.intersection(by["gather"]))
        if by["gather"] else None,
        # a chunk's rows are consecutive: a slice, so q, h and the output are views, not copies
        tuple(_pool(step, seg, slice(cu[i], cu[i + 1]), [i], window, gather=False,
                    in_mirror=in_place and i not in stale)
              for i in by["pool"]),
        put_rows, RingAt.of(step.slots[put_wid], put_pos, ring_rows), put_pos)


def _ring(step, seg, works, rows, ring_rows, window, stale) -> RingPlan:
    wid = seg.wid if rows is None else seg.wid[rows]
    pos = seg.pos if rows is None else seg.pos[rows]
    last = (seg.end[wid] - 1).unsqueeze(1)
    dev = pos.device
    held = last - torch.remainder(last - torch.arange(ring_rows, device=dev), ring_rows)  # [t, R]
    low = torch.maximum(torch.clamp(seg.lo[wid], min=0), pos - window + 1).unsqueeze(1)
    ok = (held >= low) & (held <= pos.unsqueeze(1))
    where = SlotRows.build([step.slot_ids[i] for i in works for _ in range(seg.counts[i])], dev,
                           step.uploads.longs)
    dropped = [i for i in works if i in stale]
    fill_slots = fill_pos = None
    if dropped:
        d = step.uploads.longs(dropped)
        fill_pos = (seg.first[d].unsqueeze(1) - window + 1
                    + torch.arange(window - 1, device=dev)).flatten()
        fill_slots = step.slots[d].repeat_interleave(window - 1)
    return RingPlan(rows, tuple(works), where, ok, fill_slots, fill_pos)


def _pool(step, seg, rows, ws: list[int], window, gather: bool, in_mirror: bool) -> PoolPlan:
    dev = seg.pos.device
    if rows is None:
        rows = torch.arange(seg.rows, device=dev)
    wid, pos = seg.wid[rows], seg.pos[rows]
    lo = torch.clamp(seg.lo[wid], min=0)
    # the rows' works (ascending, as rows_of lists them) and each row's index among them
    works, local = step.uploads.many(ws, [j for j, i in enumerate(ws) for _ in range(seg.counts[i])])
    opos = seg.first[works].unsqueeze(1) - window + 1 + torch.arange(window - 1, device=dev)  # [u, W-1]
    owid = works.unsqueeze(1).expand_as(opos)
    old_slots, old_pos = step.slots[owid.flatten()], opos.flatten()
    if gather:
        # each row gathers its own W keys from the pool (positions p - W + 1 .. p)
        kpos = pos.unsqueeze(1) - window + 1 + torch.arange(window, device=dev)      # [t, W]
        first = seg.first[wid].unsqueeze(1)
        ring_i = local.unsqueeze(1) * (window - 1) + kpos - first + window - 1
        row_i = len(old_pos) + torch.arange(len(rows), device=dev).unsqueeze(1) + kpos - pos.unsqueeze(1)
        idx = torch.where(kpos >= first, row_i, torch.clamp(ring_i, min=0))
        return PoolPlan(rows, tuple(ws), works, old_slots, old_pos, idx, kpos >= lo.unsqueeze(1),
                        in_mirror)
    # one work: key k of cat(older rows, chunk rows) holds position first - W + 1 + k, row j of
    # the chunk position first + j; rows j0 .. j1 - 1 see keys j0 .. j1 + W - 2 at most
    (i,) = ws
    n, first = seg.counts[i], seg.first_ids[i]
    low = torch.clamp(seg.lo[i], min=0)
    blocks = []
    for j0 in range(0, n, POOL_BLOCK):
        j1 = min(n, j0 + POOL_BLOCK)
        qp = (first + j0 + torch.arange(j1 - j0, device=dev)).unsqueeze(1)
        kpos = first + j0 - window + 1 + torch.arange(j1 - j0 + window - 1, device=dev)
        ok = (kpos <= qp) & (kpos >= torch.maximum(qp - window + 1, low))
        blocks.append(PoolBlock(slice(j0, j1), slice(j0, j1 + window - 1), ok))
    return PoolPlan(rows, tuple(ws), works, old_slots, old_pos, None, None, in_mirror,
                    tuple(blocks))
