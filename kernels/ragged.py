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

Row gathers and ring reads and writes (`take_rows`, `RingAt`, `put_at`, ...) are in
kernels/ring_rows.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels import cpu_ring, dispatch
from kernels.cpu_gemm import matmul as mm
from kernels.ring_rows import take_rows


@dataclass(frozen=True)
class SlotRows:
    """Where each query row's slot sits, for reading per-slot rings in place (rows of one
    sequence share its slot). Built once per step from host ints, shared by every layer.

    The torch path attends a slot's queries to that slot's whole ring over a slot range: a
    view of `values` when the rows' slots are dense in [base, base + count) (no copy at
    all), else an index_select of the distinct slots. `memo` keeps what every layer of the
    step derives alike from the rows and their mask (the flash kernel's additive mask)."""

    slots: torch.Tensor            # [T] slot of each row
    base: int                      # first slot of the range (view), or -1 (pick)
    pick: torch.Tensor | None      # [U] distinct slots to gather when not a view
    count: int                     # U: slots in the range / picked
    rel: torch.Tensor              # [T] index of each row's slot among the U
    j: torch.Tensor                # [T] rank of the row among its slot's rows
    width: int                     # most rows of one slot
    direct: bool                   # rows are exactly the U slots in order, one each
    host: tuple[int, ...] = ()     # slots as host ints
    _memo: dict = field(default_factory=dict, compare=False, repr=False)
    # host int list -> long tensor on the device: the caller's upload path (an engine step
    # sends every index tensor up before its first layer)
    upload: Callable[[list[int]], torch.Tensor] | None = field(default=None, compare=False,
                                                               repr=False)

    @staticmethod
    def build(row_slots: list[int], device=None,
              upload: Callable[[list[int]], torch.Tensor] | None = None) -> SlotRows:
        distinct = sorted(set(row_slots))
        lo, hi = distinct[0], distinct[-1]
        dense = hi - lo + 1 <= 2 * len(distinct)           # at most half the range unused
        where = {s: (s - lo if dense else i) for i, s in enumerate(distinct)}
        rel = [where[s] for s in row_slots]
        if len(distinct) == len(row_slots):        # a row per slot (decodes): rank 0 each
            j, width = [0] * len(row_slots), 1
        else:
            j, seen = [], {}
            for s in row_slots:
                j.append(seen.get(s, 0))
                seen[s] = j[-1] + 1
            width = max(seen.values())
        count = hi - lo + 1 if dense else len(distinct)
        direct = width == 1 and rel == list(range(count))
        as_t = upload or (lambda v: torch.tensor(v, dtype=torch.long, device=device))
        return SlotRows(as_t(row_slots), lo if dense else -1,
                        None if dense else as_t(distinct), count, as_t(rel), as_t(j),
                        width, direct, tuple(row_slots), upload=upload)

    def memo(self, key, of: torch.Tensor, make):
        """make() once per (key, tensor `of`) for these rows: `of` is held, so its id
        cannot be reused by another tensor while the entry lives (the step's lifetime)."""
        hit = self._memo.get((key, id(of)))
        if hit is None or hit[0] is not of:
            hit = self._memo[(key, id(of))] = (of, make())
        return hit[1]

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


@dataclass(frozen=True)
class TableKeys:
    """Per-row keys named by index into a table (a decode row's compressed entries in the
    block store): row t sees rows[idx[t, k]] where ok[t, k]. The compiled CPU kernel reads
    them in place; every other path gathers them first (`gathered`)."""

    rows: torch.Tensor             # [N, D]
    idx: torch.Tensor              # [T, K] long
    ok: torch.Tensor               # [T, K] bool

    def gathered(self, dtype=None):
        keys = take_rows(self.rows, self.idx)
        return (keys if dtype is None else keys.to(dtype)), self.ok


# torch's CPU flash attention (the kernel behind scaled_dot_product_attention on CPU) with
# its log-sum-exp: it streams the keys once in blocks, scores, softmax and weighted sum
# together, where two batched matmuls read them twice and write a score tensor in between
# (measured, 1 thread, 8 layers x 32 decode rows over their rings: 8.3 ms against 20.4 ms).
# A private op, so it is looked up, not assumed: without it (another torch build) or off the
# CPU (where it does not run) every group takes the plain math in _union.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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
    (at most one).

    Runs the Triton kernel (kernels/triton/ragged.py) when kernels/dispatch.py says so for
    q (CUDA, or KVMESH_KERNELS=triton) and there are at most two groups (window + entries,
    all the engine asks for); this torch code is its reference. On CPU the largest group
    (the ring, else the one with most keys per row) goes through torch's flash attention and
    joins the other groups and the sink by its log-sum-exp (_flash). When the compiled CPU
    kernel is built (kernels/cpu_ring.py), a ring group that brings its MXFP8 bytes (decode
    rows: it reads the 528-byte rows, not the fp32 mirror) and a TableKeys group (entries read
    in place, not gathered) go through it instead. A TableKeys group is gathered for every
    other path."""
    if cpu_ring.available(q):
        picked = [i for i, g in enumerate(groups) if _c_group(g)]
        if picked:
            return _c_kernel(q, [groups[i] for i in picked],
                             [g for i, g in enumerate(groups) if i not in picked], sink, scale)
    groups = [g.gathered(q.dtype) if isinstance(g, TableKeys) else g for g in groups]
    if len(groups) <= 2 and dispatch.use_triton(q):
        from kernels.triton import ragged as tri

        return tri.union_attention(q, groups, sink, scale)
    if _FLASH is not None and q.device.type == "cpu":
        # the ring, else the per-row group with most keys; a shared pool never: there the
        # keys are one matrix every row multiplies, which one batched matmul does faster
        # than the kernel's blocks (256 rows x 383 keys: 4.4 ms against 5.5 ms)
        sizes = [(isinstance(g, RingKeys), _keys(g)) for g in groups]
        at = max(range(len(groups)), key=lambda i: sizes[i], default=None)
        if at is not None and sizes[at][1]:
            return _flash(q, at, groups, sink, scale)
    return _union(q, groups, sink, scale)


def _c_group(g) -> bool:
    """A group the compiled CPU kernel reads in place: a ring with its MXFP8 bytes, or fp32
    table rows (at most one ring and two tables are asked for; the engine never passes more)."""
    if isinstance(g, RingKeys):
        return g.codes is not None
    return isinstance(g, TableKeys) and g.rows.dtype == torch.float32


def _c_kernel(q, mine, rest, sink, scale: float):
    """The ring and table groups by kernels/cpu_ring.py in one softmax; the rest of the
    groups (if any) and the sink joined to it by its log-sum-exp."""
    ring = next((g for g in mine if isinstance(g, RingKeys)), None)
    tables = [(g.rows, g.idx, g.ok) for g in mine if isinstance(g, TableKeys)]
    if len(tables) > 2 or len(mine) > (ring is not None) + len(tables):
        raise ValueError("the CPU kernel takes one ring and two table groups")
    tables += [None] * (2 - len(tables))
    if ring is not None and max(ring.rows.host, default=-1) >= ring.codes.shape[0]:
        raise IndexError(f"a row's slot is outside the ring's {ring.codes.shape[0]} slots")
    # alone, the kernel takes the sink too: the join below (a concat, a softmax over two
    # columns and a rescale of the whole output) cost ~0.1 ms a layer at 32 rows, 1 thread
    o, lse = cpu_ring.union_attention(
        q, scale, ring=None if ring is None else (ring.codes, ring.rows.slots, ring.ok),
        table=tables[0], table2=tables[1], sink=None if rest else sink)
    if not rest:
        return o
    return _join(q, [g.gathered(q.dtype) if isinstance(g, TableKeys) else g for g in rest], sink,
                 scale, o, lse.unsqueeze(-1))


def _keys(g) -> int:
    """Keys per row a flash group would have (0: not one for the flash kernel)."""
    if isinstance(g, RingKeys):
        return g.ok.shape[-1]
    return g[0].shape[-2] if g[0].dim() == 3 else 0


def _flash(q, at, groups, sink, scale: float):
    """Group `at` by the flash kernel, giving o_g and lse_g per row and head; it then joins
    the other groups and the sink as one more softmax column: logit lse_g, value o_g, which
    is exact (the sum over the group of e^s v is e^lse_g o_g)."""
    g = groups[at]
    o, lse, dead = _flash_ring(q, g, scale) if isinstance(g, RingKeys) else _flash_keys(q, g, scale)
    lse = lse.masked_fill(dead, float("-inf"))     # the kernel says 0 for a row seeing no key
    return _join(q, [g for i, g in enumerate(groups) if i != at], sink, scale, o, lse)


def _join(q, rest, sink, scale: float, o, lse):
    """Groups done by a kernel as (o [T, H, D], lse [T, H, 1], -inf for a row that saw none
    of their keys): join the `rest` of the groups and the sink to them by one softmax."""
    t, h, d = q.shape
    s = torch.cat([*(_scores(q, g, scale) for g in rest),
                   sink.view(1, h, 1).expand(t, h, 1).to(q.dtype), lse], -1)
    p = torch.softmax(s, dim=-1)
    out = o * p[..., -1:]
    start = 0
    for keys, _ in rest:
        k = keys.shape[-2]
        if k:
            out += _mix(p[..., start : start + k], keys)
        start += k
    return out


def _flash_ring(q, ring: RingKeys, scale: float):
    """One batch entry per slot, the slot's rows' heads as its query rows (q [U, 1,
    width * H, D]), keys = values = the slot's ring [U, 1, R, D] (a view when dense)."""
    t, h, d = q.shape
    rows = ring.rows
    bias, dead = rows.memo(("flash", q.dtype, h), ring.ok, lambda: _ring_bias(ring.ok, rows, h, q.dtype))
    keys = rows.take(ring.values).unsqueeze(1)
    qs = rows.spread(q).reshape(rows.count, 1, rows.width * h, d)
    o, lse = _FLASH(qs, keys, keys, attn_mask=bias, scale=scale)[:2]
    return (rows.gather(o.view(rows.count, rows.width, h, d)),
            rows.gather(lse.view(rows.count, rows.width, h, 1)), dead)


def _flash_keys(q, g, scale: float):
    """Per-row keys [T, K, D]: one batch entry per row (q [T, 1, H, D], keys [T, 1, K, D],
    mask [T, 1, 1, K] shared by the heads)."""
    t, h, d = q.shape
    keys, ok = g
    bias = torch.zeros(t, 1, 1, ok.shape[-1], dtype=q.dtype, device=q.device).masked_fill_(
        ~ok.view(t, 1, 1, -1), float("-inf"))
    o, lse = _FLASH(q.unsqueeze(1), keys.unsqueeze(1), keys.unsqueeze(1), attn_mask=bias, scale=scale)[:2]
    return o.reshape(t, h, d), lse.reshape(t, h, 1), ~ok.any(-1).view(t, 1, 1)


def _ring_bias(ok, rows: SlotRows, h: int, dtype):
    """(additive mask [U, 1, width * H or 1, R]: 0 where seen, -inf elsewhere; [T, 1, 1] rows
    that see no ring key). One slot's rows lie one after another, each row's heads
    together, like the queries; with one row per slot every head shares the row's mask."""
    seen = rows.spread(ok)                          # [U, width, R]; a slot's missing rows: none
    bias = torch.zeros(seen.shape, dtype=dtype, device=ok.device).masked_fill_(~seen, float("-inf"))
    if rows.width > 1:
        bias = bias.unsqueeze(2).expand(-1, -1, h, -1)
    bias = bias.reshape(rows.count, 1, -1, ok.shape[-1])
    # fixed on every row rather than asking whether any needs it: that question is a host
    # read (a sync on a device; tests/engine/core/test_host_reads.py counts them)
    return bias, ~ok.any(-1).view(-1, 1, 1)


def _scores(q, g, scale: float):
    """Per-row keys [T, K, D] or one pool [L, D] -> masked scaled scores [T, H, K]."""
    keys, ok = g
    if keys.dim() == 3:
        s = torch.bmm(q, keys.transpose(1, 2))
    else:
        t, h, d = q.shape
        s = _pool_mm(q.reshape(t * h, d), keys.t()).view(t, h, -1)
    return (s * scale).masked_fill(~ok.unsqueeze(1), float("-inf"))


def _mix(p, keys):
    """p [T, H, K] x keys [T, K, D] or [K, D] -> [T, H, D]."""
    if keys.dim() == 3:
        return torch.bmm(p, keys)
    t, h, k = p.shape
    return _pool_mm(p.reshape(t * h, k), keys).view(t, h, -1)


def _pool_mm(a, b):
    """a @ b for a chunk's rows against its shared pool, on the CPU through cpu_gemm (b made
    contiguous: the kernel reads rows of b), whose rows do not depend on the other rows of
    the call: a chunk's scores are then the same however the scheduler cut the prompt into
    chunks. MKL's are not (on an AMD EPYC, row i of a 6-row product differs from the row
    alone), and a float64 speculative run stored other cache bytes than a plain one."""
    return mm(a, b.contiguous()) if a.is_cpu else a @ b


def _union(q, groups, sink, scale: float):
    """The plain math of a ring group off the CPU: scores against each slot's ring, one
    softmax over every group and the sink, then the weighted sums."""
    t, h, _ = q.shape
    parts, keys = [], {}
    for i, g in enumerate(groups):
        if isinstance(g, RingKeys):
            keys[i] = g.rows.take(g.values)                            # [U, R, D], once
            s, ok = _ring_scores(q, keys[i], g.rows), g.ok
            parts.append((s * scale).masked_fill(~ok.unsqueeze(1), float("-inf")))
        else:
            parts.append(_scores(q, g, scale))
    parts.append(sink.view(1, h, 1).expand(t, h, 1).to(q.dtype))
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    out, start = None, 0
    for i, g in enumerate(groups):
        k = g.ok.shape[-1] if isinstance(g, RingKeys) else g[0].shape[-2]
        if k:
            p = probs[..., start : start + k]
            o = _ring_mix(p, keys[i], g.rows) if isinstance(g, RingKeys) else _mix(p, g[0])
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
