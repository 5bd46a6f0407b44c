"""Ragged (flattened) batch operations: every row of a step in one tensor, no padding.

A step's rows are the concatenation of each sequence's chunk (decode rows are chunks of
one); a row's key set is built by index, so a decode row next to a 500-row prefill chunk
costs one row, not 500. These are the signatures GPU kernels implement; the torch code
here is their reference.

    q        [T, H, D]            queries, one row per token of the step
    groups   list of (keys, ok), one softmax across all of them plus the sink:
               keys [T, K, D]     one key set per query (window gathered by index,
                                  compressed entries, CSA's top-k picks), or
               keys [L, D]        one pool shared by the rows (a long chunk's window),
               ok   [T, K] / [T, L]  bool: query t may see key k
             or a RingKeys: every row reads its own slot's ring rows in place,
               values [S, R, D] per-slot rings (dequantized), rows.slots [T], ok [T, R]
    sink     [H]
    returns  [T, H, D]

Ring helpers read and write many slots at once; `ring_rows` is a pure gather, and
`ring_put` requires (slot, position % R) pairs to be distinct (the caller keeps only the
last R rows of each sequence), so the write order cannot matter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels import dispatch
from kernels.attention import union_attention
from kernels.mxfp8 import e4m3_values


@dataclass(frozen=True)
class SlotRows:
    """Where each query row's slot sits, for reading per-slot rings in place (rows of one
    sequence share its slot). Built once per step from host ints, shared by every layer.

    The torch path multiplies the queries of a slot with that slot's whole ring in one
    batched matmul over a slot range: a view of `values` when the rows' slots are dense
    in [base, base + count) (no copy at all), else an index_select of the distinct slots.

    `split(per)` cuts the rows into runs of at most `per` distinct slots (memoized: a step
    builds its SlotRows once, every layer splits it the same way)."""

    slots: torch.Tensor            # [T] slot of each row
    base: int                      # first slot of the range (view), or -1 (pick)
    pick: torch.Tensor | None      # [U] distinct slots to gather when not a view
    count: int                     # U: slots in the range / picked
    rel: torch.Tensor              # [T] index of each row's slot among the U
    j: torch.Tensor                # [T] rank of the row among its slot's rows
    width: int                     # most rows of one slot
    direct: bool                   # rows are exactly the U slots in order, one each
    host: tuple[int, ...] = ()     # slots as host ints (split without a device sync)
    _parts: dict = field(default_factory=dict, compare=False, repr=False)
    # host int list -> long tensor on the device: the caller's upload path (an engine step
    # sends every index tensor up before its first layer), used by split too
    upload: Callable[[list[int]], torch.Tensor] | None = field(default=None, compare=False,
                                                               repr=False)

    @staticmethod
    def build(row_slots: list[int], device=None,
              upload: Callable[[list[int]], torch.Tensor] | None = None) -> SlotRows:
        distinct = sorted(set(row_slots))
        lo, hi = distinct[0], distinct[-1]
        dense = hi - lo + 1 <= 2 * len(distinct)           # at most half the range unused
        where = {s: (s - lo if dense else i) for i, s in enumerate(distinct)}
        rel, j, seen = [], [], {}
        for s in row_slots:
            rel.append(where[s])
            j.append(seen.get(s, 0))
            seen[s] = j[-1] + 1
        count = hi - lo + 1 if dense else len(distinct)
        direct = max(seen.values()) == 1 and rel == list(range(count))
        as_t = upload or (lambda v: torch.tensor(v, dtype=torch.long, device=device))
        return SlotRows(as_t(row_slots), lo if dense else -1,
                        None if dense else as_t(distinct), count, as_t(rel), as_t(j),
                        max(seen.values()), direct, tuple(row_slots), upload=upload)

    def split(self, per: int) -> list[tuple[slice | torch.Tensor, SlotRows]]:
        """[(rows, their SlotRows)] for runs of `per` distinct slots, ascending. A run's rows
        are taken in slot order (so one row per slot makes its SlotRows `direct`); `rows` is
        a slice when they are consecutive rows already (decodes in slot order), else an index."""
        if per not in self._parts:
            distinct = sorted(set(self.host))
            parts = []
            for a in range(0, len(distinct), per):
                run = set(distinct[a : a + per])
                rows = sorted((i for i, s in enumerate(self.host) if s in run),
                              key=lambda i: (self.host[i], i))
                at = (slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1))
                      else self.upload(rows) if self.upload
                      else torch.tensor(rows, dtype=torch.long, device=self.slots.device))
                parts.append((at, SlotRows.build([self.host[i] for i in rows], self.slots.device,
                                                 self.upload)))
            self._parts[per] = parts
        return self._parts[per]

    def take(self, values):
        """values [S, ...] -> [U, ...] (a view when dense)."""
        if self.pick is None:
            return values[self.base : self.base + self.count]
        return values.index_select(0, self.pick)

    def spread(self, x):
        """x [T, ...] -> [U, width, ...], zero where a slot has fewer rows."""
        if self.direct:
            return x.unsqueeze(1)
        out = x.new_zeros(self.count, self.width, *x.shape[1:])
        out[self.rel, self.j] = x
        return out

    def gather(self, y):
        """y [U, width, ...] -> [T, ...] (spread's inverse)."""
        return y[:, 0] if self.direct else y[self.rel, self.j]


@dataclass(frozen=True)
class RingKeys:
    """A key group read in place: row t sees values[rows.slots[t], r] for ring rows r
    where ok[t, r] (the caller masks positions outside the row's window).

    `codes`, when given, is the MXFP8 ring the values were dequantized from (same [S, R]
    rows, 528 B each): the Triton kernel reads those bytes and dequantizes in registers
    (a quarter of the fp32 traffic); the torch path always reads `values`."""

    values: torch.Tensor           # [S, R, D]
    rows: SlotRows
    ok: torch.Tensor               # [T, R] bool
    codes: torch.Tensor | None = None   # [S, R, D + D / 32] uint8


# The torch path reads a slot's ring twice (scores, then the weighted sum). Done for all
# slots at once, the second read comes from memory again (32 slots x 134 rows x 2 KB ~ 9 MB
# per layer, past L2); done for a few slots at a time it comes from L2. Measured on the
# bench machine (1 thread, batch 32, 8 layers, the two matmuls alone, machine idle): 17.6 ms
# at once, 6.7 ms in runs of ~1 MB of rings; in the whole step the gain is smaller and on a
# machine whose L2 is busy with neighbours it vanishes (bench/engine_step_ab.py measures
# both ways side by side). GPU kernels stream the ring once and never split.
RING_PASS_BYTES = 1 << 20


def ring_pass_slots(values: torch.Tensor) -> int:
    """Slots per pass of the CPU torch path over rings `values` [S, R, D] (at least one).
    Index builders that know the ring split its SlotRows ahead (`split` memoizes)."""
    return max(1, RING_PASS_BYTES // (values[0].numel() * values.element_size()))


def _ring_scores(q, keys, rows: SlotRows):
    t, h, d = q.shape
    qs = rows.spread(q).reshape(rows.count, -1, d)                     # [U, width * H, D]
    s = torch.bmm(qs, keys.transpose(1, 2))                            # [U, width * H, R]
    return rows.gather(s.view(rows.count, rows.width, h, -1))          # [T, H, R]


def _ring_mix(p, keys, rows: SlotRows):
    t, h, r = p.shape
    ps = rows.spread(p).reshape(rows.count, -1, r)                     # [U, width * H, R]
    o = torch.bmm(ps, keys)                                            # [U, width * H, D]
    return rows.gather(o.view(rows.count, rows.width, h, -1))          # [T, H, D]


def ragged_union_attention(q, groups, sink, scale: float):
    """`attention.union_attention` for one flattened batch: q [T, H, D]; each group is
    (keys [L, D] shared by every row, or [T, K, D] per row; ok [T, L or K]) or a RingKeys
    (at most one). Without a ring group it is the batched version's math with a batch of one.

    Runs the Triton kernel (kernels/triton/ragged.py) when kernels/dispatch.py says so for
    q (CUDA, or KVMESH_KERNELS=triton) and there are at most two groups (window + entries,
    all the engine asks for); this torch code is its reference. On CPU, a ring group over
    more slots than RING_PASS_BYTES holds is done a few slots per pass (_union_in_passes)."""
    if len(groups) <= 2 and dispatch.use_triton(q):
        from kernels.triton import ragged as tri

        return tri.union_attention(q, groups, sink, scale)
    rings = [i for i, g in enumerate(groups) if isinstance(g, RingKeys)]
    if not rings:
        batched = [(keys.unsqueeze(0), ok.unsqueeze(0)) for keys, ok in groups]
        return union_attention(q.unsqueeze(0), batched, sink, scale)[0]
    ring = groups[rings[0]]
    per = ring_pass_slots(ring.values)
    if q.device.type != "cpu" or ring.rows.count <= per:
        return _union(q, groups, sink, scale)
    return _union_in_passes(q, rings[0], groups, sink, scale, per)


def _union_in_passes(q, at, groups, sink, scale: float, per: int):
    """_union's numbers, with the ring group's two reads done a few slots at a time: the
    other groups' scores and the sink for every row first (columns R.. of one score
    buffer), then per run of slots its ring scores, the rows' softmax and their ring mix,
    then the other groups' mix from the buffer (which by then holds every row's probs)."""
    t, h, d = q.shape
    ring = groups[at]
    r = ring.ok.shape[-1]
    rest = [_scores(q, g, scale) for i, g in enumerate(groups) if i != at]
    s = torch.cat([q.new_empty(t, h, r), *rest, sink.view(1, h, 1).expand(t, h, 1).to(q.dtype)], -1)
    bias = torch.zeros(t, 1, r, dtype=q.dtype, device=q.device).masked_fill_(
        ~ring.ok.unsqueeze(1), float("-inf"))
    out = torch.empty_like(q)
    for rows, sub in ring.rows.split(per):
        keys = sub.take(ring.values)                                   # [u, R, D], ~1 MB
        if sub.direct:            # one row per slot: scale and mask inside the matmul
            s[rows, :, :r] = torch.baddbmm(bias[rows], q[rows], keys.transpose(1, 2), alpha=scale)
        else:
            s[rows, :, :r] = (_ring_scores(q[rows], keys, sub) * scale).masked_fill(
                bias[rows] != 0, float("-inf"))
        p = torch.softmax(s[rows], dim=-1)
        s[rows] = p
        out[rows] = (torch.bmm(p[..., :r], keys) if sub.direct
                     else _ring_mix(p[..., :r].contiguous(), keys, sub))
    start = r
    for i, g in enumerate(groups):
        if i != at and g[0].shape[-2]:
            k = g[0].shape[-2]
            out += torch.einsum("thk,kd->thd" if g[0].dim() == 2 else "thk,tkd->thd",
                                s[..., start : start + k], g[0])
            start += k
    return out


def _scores(q, g, scale: float):
    keys, ok = g
    s = torch.einsum("thd,kd->thk" if keys.dim() == 2 else "thd,tkd->thk", q, keys)
    return (s * scale).masked_fill(~ok.unsqueeze(1), float("-inf"))


def _union(q, groups, sink, scale: float):
    t, h, _ = q.shape
    parts, keys = [], {}
    for i, g in enumerate(groups):
        if isinstance(g, RingKeys):
            keys[i] = g.rows.take(g.values)                            # [U, R, D], once
            s, ok = _ring_scores(q, keys[i], g.rows), g.ok
        else:
            ok = g[1]
            s = torch.einsum("thd,kd->thk" if g[0].dim() == 2 else "thd,tkd->thk", q, g[0])
        parts.append((s * scale).masked_fill(~ok.unsqueeze(1), float("-inf")))
    parts.append(sink.view(1, h, 1).expand(t, h, 1).to(q.dtype))
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    out, start = None, 0
    for i, g in enumerate(groups):
        k = g.ok.shape[-1] if isinstance(g, RingKeys) else g[0].shape[-2]
        if k:
            p = probs[..., start : start + k]
            if isinstance(g, RingKeys):
                o = _ring_mix(p, keys[i], g.rows)
            else:
                o = torch.einsum("thk,kd->thd" if g[0].dim() == 2 else "thk,tkd->thd", p, g[0])
            out = o if out is None else out + o
        start += k
    return out if out is not None else torch.zeros_like(q)


def ragged_indexer_scores(q, w, keys):
    """q [T, Hi, Di], w [T, Hi], keys [T, K, Di] (each row's own candidates) -> [T, K].
    On Triton: the batched kernel with each row as its own sequence of one query."""
    if dispatch.use_triton(q):
        from kernels.triton import indexer as tri

        return tri.indexer_scores(q.unsqueeze(1), w.unsqueeze(1), keys)[:, 0]
    return torch.einsum("the,tke->thk", q, keys).relu().mul(w.unsqueeze(-1)).sum(1)


def dequantize_rows(q, dtype=torch.float32):
    """mxfp8.dequantize through a 256-entry E4M3 table: the same numbers bit for bit
    (each E4M3 code is exact in fp32, then the same power-of-two scaling), about twice
    as fast on CPU as the float8 conversion."""
    d = (q.shape[-1] * 32) // 33
    values = e4m3_values(q[..., :d])
    exp = q[..., d:].float() - 127.0
    blocks = values.reshape(*q.shape[:-1], d // 32, 32) * torch.exp2(exp).unsqueeze(-1)
    return blocks.reshape(*q.shape[:-1], d).to(dtype)


def ring_rows(ring, slots, pos):
    """ring [S, R, ...]; slots, pos: same-shape long tensors -> rows [*shape, ...]."""
    return ring[slots, pos.remainder(ring.shape[1])]


def ring_put(ring, slots, pos, rows) -> None:
    """Write rows at (slot, pos % R); pairs must be distinct."""
    ring[slots, pos.remainder(ring.shape[1])] = rows.to(ring.dtype)
