"""Vectorized compressor feeding: every sequence of a step in a few tensor ops per layer.

For each work, rows at positions >= cmp_from of its chunk are fed to the layer's
compressor. A group of m positions that completes in this chunk is pooled into one
entry (and, for CSA, one indexer key) written to the block rows its table points at;
the open group's tail stays in the slot's compression ring (m + B rows, position % R).

All works' completed groups are laid out as one stream: for work i, positions
g0_i .. gend_i - 1 with g0_i = floor(s0_i / m) * m (s0_i: first fed position) and
gend_i = floor(end_i / m) * m. A stream row comes from the ring (the stored tail,
positions < s0_i) or from this chunk's new rows; every m consecutive rows are one
group, so pooling is a single call. The ring is read before it is written. The index
side of all this is the same for every layer with the same m (FeedPlan, once per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_pool
from kernels.ring_rows import RingAt, put_at, take_at
from services.engine.cache.block_store import BlockStore
from services.engine.cache.state_pool import StatePool
from services.engine.config import ModelConfig
from services.engine.model import ops
from services.engine.model.batch import Segments, StepBatch
from services.engine.model.weights import Weights


@dataclass(frozen=True)
class FeedPlan:
    """The layer-independent part of feeding (same for every layer with this m and tail ring
    length): which rows are fed, the completed-group stream and where its entries go."""

    rows: torch.Tensor | None      # fed rows of the segment (None: all)
    put: torch.Tensor | None       # fed rows kept in the tail ring (the last R; None: all fed)
    put_at: RingAt                 # ... and where they go in it
    groups: int                    # completed groups (0: nothing to pool)
    tail_at: RingAt | None         # [k] the stream rows stored in the tail ring (an open
                                   # group's first rows; None: none)
    pick: torch.Tensor | None      # [G * m] stream row i = cat(fed rows, tail rows)[pick[i]]
                                   # (None: the stream is the fed rows, in order)
    gwid: torch.Tensor             # [G] work and group index of each completed group
    gid: torch.Tensor


def feed(cfg: ModelConfig, w: Weights, states: StatePool, blocks: BlockStore, layer: int,
         step: StepBatch, seg: Segments, u: torch.Tensor) -> None:
    """u: [seg.rows, hidden] compressor input of the rows `seg` describes."""
    m = cfg.compress_ratio(layer)
    r = states.cmp[layer].shape[1]
    plan = feed_plan(step, seg, m, r)
    if plan is None:
        return
    uk = u if plan.rows is None else u[plan.rows]
    streams = [(states.cmp[layer], *ops.compressor_inputs(w, layer, uk), False)]
    if cfg.layers[layer] == "csa":
        streams.append((states.idx[layer], *ops.indexer_inputs(w, layer, uk), True))
    dtype = streams[0][1].dtype
    for ring, v, z, is_index in streams:
        if plan.groups:
            angles = None if is_index else step.once(
                ("feed-rope", m, r), lambda: ops.rope_angles(plan.gid * m, cfg, dtype))
            dst, at = _destination(blocks, step, plan, (m, r), layer, is_index)
            p = f"layers.{layer}."
            # on the CPU one C call reads the group rows where they are, pools, norms, ropes
            # and writes the entries (kernels/cpu_pool.py); else the torch path below
            if not cpu_pool.pool_into(
                    dst.view(-1, dst.shape[-1]), at.flat, v, z, ring, plan.tail_at, plan.pick,
                    m, w[p + ("idx_bias" if is_index else "cmp_bias")],
                    None if is_index else w[p + "cmp_norm"], cfg.norm_eps, angles):
                sv, sz = _stream(plan, ring, v, z)
                out = ops.pool_index_keys(w, layer, sv, sz, m) if is_index else \
                    ops.pool_entries_at(w, layer, sv, sz, plan.gid, m, cfg, angles)
                put_at(dst, at, out)
        # only the kept rows are paired up for the ring (the last R of each work: a few per
        # work against a long chunk's every row)
        kv, kz = (v, z) if plan.put is None else (v[plan.put], z[plan.put])
        # v and z each into its half of the ring's rows: no stacked copy of the pair first
        put_at(ring[:, :, 0], plan.put_at, kv)
        put_at(ring[:, :, 1], plan.put_at, kz)


def _stream(plan: FeedPlan, ring, v, z):
    """The completed groups' rows (v, z) [G * m, dim] each: the fed rows themselves when the
    stream is exactly them in order (FeedPlan.pick is None: chunks that end on a group
    boundary with no stored tail, e.g. prefill-only steps), else gathered by one index from
    the fed rows and the few stored tail rows. The ring is read before it is written."""
    if plan.pick is None:
        return v, z
    if plan.tail_at is not None:
        tail = take_at(ring, plan.tail_at).to(v.dtype)                         # [k, 2, dim]
        v, z = torch.cat([v, tail[:, 0]]), torch.cat([z, tail[:, 1]])
    # index_select: about 4x faster on CPU than advanced indexing for 512 rows of 4 KB
    return v.index_select(0, plan.pick), z.index_select(0, plan.pick)


def _host_facts(step: StepBatch, seg: Segments, m: int, ring_len: int):
    """From the host ints of the works, what the plan would otherwise read back from the
    device (on CUDA a nonzero, a bincount or a boolean index is a sync each): the fed rows
    (None: all), fed rows per work, the stream length, which fed rows are kept in the tail
    ring (the last R of each work; None: all of them), and the slots and positions of the
    stream rows that come from the tail ring (positions g0 .. s0 - 1 of a work whose stream
    is not empty, in stream order)."""
    # a row per work, none of its entries cached ahead of it
    if ring_len >= 1 and seg.counts.count(1) == len(seg.counts) and \
            all(c <= f for c, f in zip(step.cmp_ids, seg.first_ids, strict=True)):
        return _decode_facts(step, seg, m)
    return _chunk_facts(step, seg, m, ring_len)


def _chunk_facts(step: StepBatch, seg: Segments, m: int, ring_len: int):
    """_host_facts for any works, one pass over them."""
    rows, per_work, put, total, cu, tail_slots, tail_pos = [], [], [], 0, 0, [], []
    for first, n, cmp, slot in zip(seg.first_ids, seg.counts, step.cmp_ids, step.slot_ids,
                                   strict=True):
        end, s0 = first + n, max(first, cmp)
        fed = max(0, end - s0)
        per_work.append(fed)
        if fed:
            put.extend(range(len(rows) + max(0, fed - ring_len), len(rows) + fed))
            rows.extend(range(cu + n - fed, cu + n))
            total += max(0, end // m * m - s0 // m * m)
            if end // m * m > s0 // m * m:
                tail_pos.extend(range(s0 // m * m, s0))
                tail_slots.extend([slot] * (s0 - s0 // m * m))
        cu += n
    return (None if len(rows) == cu else rows, per_work, total,
            None if len(put) == len(rows) else put, (tail_slots, tail_pos) if tail_pos else None)


def _decode_facts(step: StepBatch, seg: Segments, m: int):
    """_host_facts of a step whose works are one fed row each (decodes): every row fed and
    kept, and a work whose new row ends a group streams it after its m - 1 stored rows. The
    general loop's answer in a quarter of its time at 32 works (a decode step asks twice)."""
    done = [(slot, first + 1) for slot, first in zip(step.slot_ids, seg.first_ids, strict=True)
            if (first + 1) % m == 0]
    tail_pos = [p for _, end in done for p in range(end - m, end - 1)]
    tail_slots = [slot for slot, _ in done for _ in range(m - 1)]
    return (None, [1] * len(seg.counts), m * len(done), None,
            (tail_slots, tail_pos) if tail_pos else None)


def feed_plan(step: StepBatch, seg: Segments, m: int, ring_len: int) -> FeedPlan | None:
    """The step's FeedPlan for this m and tail ring (memoized in the step: runner.py builds
    them all before the first layer, so their index uploads never wait behind a layer)."""
    return step.once(("feed", m, ring_len), lambda: _plan(step, seg, m, ring_len))


def _plan(step: StepBatch, seg: Segments, m: int, ring_len: int) -> FeedPlan | None:
    host_rows, per_work, total, host_put, tail = _host_facts(step, seg, m, ring_len)
    if not sum(per_work):
        return None
    dev = seg.pos.device
    # host ints go up with the step's other index tensors (StepBatch.uploads)
    lists = [per_work] + ([] if host_rows is None else [host_rows]) + \
        ([] if host_put is None else [host_put]) + ([] if tail is None else list(tail))
    up = step.uploads.many(*lists)
    n_new = up[0]
    rows = torch.arange(seg.rows, device=dev) if host_rows is None else up[1]
    put = None if host_put is None else up[1 + (host_rows is not None)]
    tail_slots, tail_pos = (None, None) if tail is None else up[-2:]
    wid, pos = seg.wid[rows], seg.pos[rows]
    s0 = torch.maximum(seg.first, step.cmp_from)      # first fed position per work
    end = seg.end
    new_cu = torch.zeros(len(n_new) + 1, dtype=torch.long, device=dev)
    new_cu[1:] = torch.cumsum(n_new, 0)

    # stream of completed groups, per work [g0, gend)
    g0 = torch.div(s0, m, rounding_mode="floor") * m
    gend = torch.div(end, m, rounding_mode="floor") * m
    glen = torch.where(n_new > 0, torch.clamp(gend - g0, min=0), torch.zeros_like(g0))
    g_cu = torch.zeros(len(glen) + 1, dtype=torch.long, device=dev)
    g_cu[1:] = torch.cumsum(glen, 0)
    swid = torch.repeat_interleave(torch.arange(len(glen), device=dev), glen, output_size=total)
    spos = g0[swid] + torch.arange(total, device=dev) - g_cu[swid]
    from_ring = spos < s0[swid]
    # a stored row's index among the tail rows: stream order is work order, then position,
    # the order _host_facts listed them in
    pick = torch.where(from_ring, len(rows) + torch.cumsum(from_ring, 0) - 1,
                       new_cu[swid] + spos - s0[swid])

    # ring rows to write: the last R fed rows of each work (older ones would be overwritten)
    put_wid, put_pos = (wid, pos) if put is None else (wid[put], pos[put])
    # no stored tail and as many stream rows as fed rows: the stream (a subsequence of the
    # fed rows in order when nothing comes from the ring) is every fed row
    identity = tail is None and total == sum(per_work)
    return FeedPlan(None if host_rows is None else rows, put,
                    RingAt.of(step.slots[put_wid], put_pos, ring_len), total // m,
                    None if tail is None else RingAt.of(tail_slots, tail_pos, ring_len),
                    None if identity else pick, swid[::m],
                    torch.div(spos[::m], m, rounding_mode="floor"))


def _destination(blocks: BlockStore, step: StepBatch, plan: FeedPlan, key: tuple, layer: int,
                 keys: bool) -> tuple[torch.Tensor, RingAt]:
    """Where the completed groups' entry rows go: entry j of work i lives in block
    tables[i, j // per] at row j % per (block_store.py), as if each block were a ring of
    `per` rows; -> (the layer's block rows [blocks, per, D], the places), the places once per
    step for every layer with this plan (key: its m and tail ring length) and per."""
    dst = (blocks.index_keys if keys else blocks.entries)[layer]
    per = dst.shape[1]
    return dst, step.once(("scatter", *key, per), lambda: RingAt.of(
        step.tables[plan.gwid, torch.div(plan.gid, per, rounding_mode="floor")], plan.gid, per))
