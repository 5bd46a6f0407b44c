"""ModelRunner: one cached forward over a ragged batch of sequence chunks.

Each `Work` asks for tokens [start, end) of one sequence whose cache holds
[0, start). The runner reads and writes only that sequence's slot (SWA rings,
compression tails) and the block rows its table points at; it never allocates:
the scheduler has already sized the block table for `end` tokens.

Per layer, for every query position i of a chunk:

    window keys   positions max(lo, i - W + 1) .. i      old ones from the ring, new ones
                  from this chunk (ring is written after it is read)
    compressed    entries j < floor((i + 1) / m) from the block table; CSA keeps the
                  indexer's top-k of those
    one softmax over both, plus the head's sink

Encoder layers compress their own normed input; decoder layers compress H_enc
(the normed encoder output) of the whole chunk, while their queries are limited
to positions >= dec_lo (YOCO prefill truncation; `compact` gathers only those
rows, `mask` runs every row with earlier keys masked).

The batch is ragged (batch.py): all works' rows form one [T, hidden] tensor, every
per-row quantity (window keys, visible entries, top-k picks) is gathered by index from
per-step index tensors, and ring writes, compressor feeding (compressor.py) and block
scatters/gathers run for all works at once. Only snapshot capture loops, over the
(rare) works that ask for one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kernels import cpu_gemm, cpu_indexer, cpu_ring
from kernels.indexer import indexer_scores, select_topk, selected_indices, topk_indices
from kernels.ragged import RingKeys, TableKeys, ragged_indexer_scores, ragged_union_attention
from kernels.ring_rows import put_at, take_rows
from services.engine.cache.block_store import BlockStore
from services.engine.cache.state_pool import StatePool
from services.engine.config import ModelConfig
from services.engine.model import compressor, ops, windows
from services.engine.model.batch import Segments, StepBatch
from services.engine.model.weights import Weights
from services.engine.model.window_mirror import WindowMirror

# A long chunk's CSA picks attend as the chunk's pool of entries masked to each row's picks
# while the pool has at most this many times top-k entries: scoring every row against a small
# pool costs less than gathering top-k entry rows for each row (256 rows, top-k 16, a pool of
# 69: 5.6 against 7.0 ms per layer; even at ~200, 1 thread); past it, the picks are gathered.
POOL_PICKS = 8
# On the CPU a chunk of fp32 rows takes its compressed entries per row, as decode rows do:
# the indexer's picks in one C call (kernels/cpu_indexer.py), and its attention is one call
# of the compiled kernel (kernels/cpu_ring.py) over its window keys by index and its entries
# in place, where the shared pool path is a dozen torch calls a layer (gathers, einsum, topk,
# masks, two products and a softmax per block). Measured beside 16 decodes through a 4K
# prompt, median step: chunks of 16 / 64 / 128 / 512 rows 12.8 / 17.8 / 28.7 / 77.2 ->
# 11.3 / 14.0 / 21.0 / 50.1 ms (2 threads). Bounded so the per-row candidate index stays
# small: at most PER_ROW_CHUNK rows and PER_ROW_ENTRIES rows x candidates (past them, as on
# other devices and in float64, the shared pool).
PER_ROW_CHUNK = 512
PER_ROW_ENTRIES = 1 << 21


class _Group(NamedTuple):
    """One attention call's rows and keys within a layer."""
    rows: Any                      # rows of the segment (None: all; a slice: a pool chunk)
    keys: Any                      # (keys, ok), a RingKeys, or (table, None) when staged
    per_row: bool                  # keys per row (ring, gather), not a shared pool
    path: Any                      # "ring", "gather" or ("pool", i): memo keys of the step
    pool: Any = None               # the PoolPlan of gather and pool paths
    by_index: bool = False         # a pool chunk whose window keys the CPU kernel reads by index
    bands: tuple | None = None     # a staged pool: per block its keys as table rows


@dataclass
class Work:
    slot: int
    table: list[int]
    tokens: Sequence[int]      # tokens[start:end] are computed (a list or a TokenView)
    start: int
    end: int
    enc_lo: int = 0            # encoder SWA lower bound (bounded replay start)
    dec_lo: int = 0            # decoder SWA lower bound (truncation start)
    cmp_from: int = 0          # entries for positions < cmp_from exist and must not be rewritten
    capture: int | None = None # snapshot the encoder window ending at this position (in (start, end])
    want_logits: bool = True
    n_logits: int = 1          # logit rows of the chunk's last positions (verify: 1 + drafts)
    owner: object = None       # identifies one admission of a sequence (window mirror); None: no mirror
    want_hidden: int = 0       # return the last residual rows of up to this many final positions (MTP)


@dataclass
class ForwardResult:
    logits: dict[int, torch.Tensor] = field(default_factory=dict)     # work index -> [V] ([n, V]: n_logits > 1)
    captures: dict[int, torch.Tensor] = field(default_factory=dict)   # work index -> [E, R_inf, 528]
    rows: dict[str, int] = field(default_factory=dict)                # query rows computed per layer
    # work index -> (first position, [n, hidden] last residual stream before the final norm)
    # of positions >= dec_lo (the only ones whose decoder rows are the model's): MTP input
    hidden: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: Weights, states: StatePool, blocks: BlockStore,
                 dec_mode: str = "compact"):
        if dec_mode not in ("compact", "mask"):
            raise ValueError(f"dec_mode must be compact or mask, not {dec_mode!r}")
        self.cfg, self.w, self.states, self.blocks = cfg, weights, states, blocks
        self.dec_mode = dec_mode
        # the products read the weights as column panels (kernels/cpu_gemm.py: same bits,
        # contiguous streams), packed here (17 MB for tiny, ~4 ms) and not in the first
        # request; the embedding is a lookup table, never a product's weight
        cpu_gemm.pack_weights(t for name, t in weights.items() if name != "embed")
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.inference_ring = states.block.inference_ring
        self.device = weights["embed"].device      # where the pools live too (EngineCore)
        # scratch rows for chunks whose window keys the compiled kernel reads by index (fp32
        # on the CPU): their own keys are staged there beside their older ones (2 MB a layer
        # at head size 512), where a copy of both per layer cost ~0.4 ms a step beside decodes
        embed = weights["embed"]
        by_index = embed.dtype == torch.float32 and cpu_ring.available(
            embed.new_empty(1, cfg.head_dim))
        self.mirror = WindowMirror(states.swa, cfg.head_dim, embed.dtype,
                                   PER_ROW_CHUNK if by_index else 0)

    @torch.no_grad()
    def forward(self, works: list[Work]) -> ForwardResult:
        cfg, result = self.cfg, ForwardResult()
        if not works:
            return result
        step = StepBatch.build(works, compact=self.dec_mode == "compact", device=self.device)
        stale = frozenset(self.mirror.begin(works, step.uploads))
        toks = [t for w in works for t in w.tokens[w.start : w.end]]
        x = self.w["embed"][step.uploads.longs(toks)]
        logit_rows = self._prepare(step, works, stale)
        step.uploads.seal()        # from here on an upload would wait behind queued layers
        for layer in range(cfg.n_encoder_layers):
            x = self._layer(layer, x, step, "enc", None, works, result, stale)
        h_enc = ops.encoder_output(self.w, x, cfg)
        if step.dec_rows is not None:
            x = x[step.dec_rows]
        for layer in range(cfg.n_encoder_layers, cfg.n_layers):
            x = self._layer(layer, x, step, "dec", h_enc, works, result, stale)
        result.rows = {"encoder": step.enc.rows, "decoder": step.dec.rows}
        dec_cu = step.dec.cu_ids
        for i, wk in enumerate(works):
            if not wk.want_hidden:
                continue
            first = max(wk.start, wk.dec_lo, wk.end - wk.want_hidden)
            if first < wk.end:
                at = dec_cu[i] + first - step.dec.first_ids[i]          # host ints: no sync
                result.hidden[i] = (first, x[at : at + wk.end - first])

        if logit_rows is not None:
            logits = ops.logits(self.w, x[logit_rows], cfg)
            rows = logits.unbind(0)            # every row's view in one call, not one each
            at = 0
            for i, wk in enumerate(works):
                if wk.want_logits:
                    n = wk.n_logits
                    result.logits[i] = rows[at] if n == 1 else logits[at : at + n]
                    at += n
        return result

    def _prepare(self, step: StepBatch, works: list[Work], stale) -> torch.Tensor | None:
        """Every index tensor the step's layers will use, built (and uploaded) before the
        first layer: on CUDA a copy of host ints waits for the stream, so one made after
        layers were queued would stall behind them. The window plans and compressor plans
        are memoized in the step (the layers find them built); returns the decoder rows the
        logits are read from (the last n_logits positions of each work that wants them; all
        of them, as a slice, when that is every row)."""
        cfg = self.cfg
        kinds = (("enc", step.enc, range(cfg.n_encoder_layers)),
                 ("dec", step.dec, range(cfg.n_encoder_layers, cfg.n_layers)))
        for kind, seg, layers in kinds:
            for layer in layers if seg.rows else ():
                self._window_plan(step, seg, kind, layer, stale)
        for layer in range(cfg.n_layers):
            if cfg.compress_ratio(layer) is not None:
                compressor.feed_plan(step, step.enc, cfg.compress_ratio(layer),
                                     self.states.cmp[layer].shape[1])
        enc_rings = {self.states.swa[layer].shape[1] for layer in range(cfg.n_encoder_layers)}
        for i, wk in enumerate(works):
            for r in enc_rings if wk.capture is not None else ():
                self._capture_index(step.enc, step, i, wk, r)
        cu, firsts, rows = step.dec.cu_ids, step.dec.first_ids, []
        for i, wk in enumerate(works):
            if wk.want_logits:         # the last n_logits positions, in order
                last = cu[i] + wk.end - 1 - firsts[i]
                rows.extend(range(last - wk.n_logits + 1, last + 1))
        if not rows:
            return None
        # every decoder row, in order (a decode step): x itself, no gathered copy
        return slice(None) if len(rows) == step.dec.rows else step.uploads.longs(rows)

    def _window_plan(self, step: StepBatch, seg: Segments, kind: str, layer: int, stale):
        """The window plan of `layer`'s ring length (memoized per step: kind, R)."""
        r = self.states.swa[layer].shape[1]
        # the mirror holds the weights' dtype, which the layer's keys have too
        in_place = r >= self.cfg.window
        return step.once(("window", kind, r), lambda: windows.plan(
            step, seg, r, self.cfg.window, in_place, stale))

    def rewind(self, slot: int, owner: object, end: int) -> None:
        """The slot's sequence continues at `end`, before the end of its last chunk (rejected
        draft rows): the window mirror stays valid (rows past `end` carry their positions and
        are rewritten before any read), so it is kept instead of dropped."""
        self.mirror.rewind(slot, owner, end)

    # --- one layer ----------------------------------------------------------
    def _layer(self, layer, x, step: StepBatch, kind: str, h_enc, works, result, stale):
        cfg, w = self.cfg, self.w
        seg = step.enc if kind == "enc" else step.dec
        p = f"layers.{layer}."
        m = cfg.compress_ratio(layer)
        if seg.rows == 0:          # compact decoder with every row before dec_lo: only compress
            if m is not None:
                compressor.feed(cfg, w, self.states, self.blocks, layer, step, step.enc, h_enc)
            return x
        h = ops.rms_norm(x, w[p + "attn_norm"], cfg.norm_eps)
        angles = step.once(("rope", kind), lambda: ops.rope_angles(seg.pos, cfg, h.dtype))
        q, kv = ops.query_and_kv(w, layer, h, seg.pos, cfg, angles)
        kv_bytes, kv = ops.quantize_kv(kv)
        ring = self.states.swa[layer]
        plan = self._window_plan(step, seg, kind, layer, stale)
        # read every older key this layer needs before it writes the ring
        groups, staged_groups = [], []
        pools = [(plan.gather, "gather")] if plan.gather is not None else []
        pools += [(pool, ("pool", i)) for i, pool in enumerate(plan.pools)]
        staged = 0
        for pool, path in pools:
            new = kv[pool.rows]
            # a chunk on the CPU: entries per row and window keys by index, so its attention is
            # one call of the compiled kernel (see PER_ROW_CHUNK); gather rows have their own
            by_index = pool.idx is None and _by_index(pool.rows, q, kv, step, m)
            if by_index and pool.in_mirror and staged + new.shape[0] <= self.mirror.scratch_rows:
                # the kernel reads the older keys where they are in the mirror and the
                # chunk's own from its scratch: the pool below, named row by row instead of
                # copied (same keys, same order), attended before this layer's writes
                table = self.mirror.stage(layer, staged, new)
                bands = step.once(("pool-rows", kind, ring.shape[1], path, staged),
                                  lambda pool=pool, at=staged, n=new.shape[0]:
                                  self._named_bands(step, pool, at, n))
                staged += new.shape[0]
                staged_groups.append(_Group(pool.rows, (table, None), False, path, pool, True,
                                            bands))
                continue
            old = (self.mirror.take(layer, pool.old_slots, pool.old_pos) if pool.in_mirror
                   else self.mirror.read(layer, pool.old_slots, pool.old_pos, kv.dtype))
            keys = torch.cat([old, new])
            groups.append(_Group(pool.rows, (keys if pool.idx is None else keys[pool.idx],
                                             pool.ok), path == "gather", path, pool, by_index))
        if plan.ring is not None and plan.ring.fill_slots is not None:
            self.mirror.fill(layer, plan.ring.fill_slots, plan.ring.fill_pos)
        if cfg.is_encoder(layer):
            self._capture(layer, seg, step, kv_bytes, works, result)
        # entries first (they touch no window row): a chunk's rows see the groups it completes
        if m is not None:
            compressor.feed(cfg, w, self.states, self.blocks, layer, step, step.enc,
                            h if h_enc is None else h_enc)

        sink = w[p + "sink"]
        whole = not pools and plan.ring is not None and plan.ring.rows is None
        o = None if whole else torch.empty_like(q)
        for group in staged_groups:      # their older keys are read in place: before the writes
            self._attend(layer, seg, step, kind, h, m, q, sink, o, plan, group)
        put = slice(None) if plan.put_rows is None else plan.put_rows
        put_at(ring, plan.put_at, kv_bytes[put])
        self.mirror.write(layer, plan.put_at, plan.put_pos, kv[put])
        if plan.ring is not None:
            rows = plan.ring.rows
            # the ring bytes too: a Triton kernel dequantizes them in registers (kernels/ragged.py)
            groups.append(_Group(rows, RingKeys(self.mirror.values[layer], plan.ring.where,
                                                plan.ring.ok, ring), True, "ring"))
        for group in groups:
            o = self._attend(layer, seg, step, kind, h, m, q, sink, o, plan, group)
        x = x + ops.attn_output(w, layer, o)
        return x + ops.ffn(w, layer, x, cfg)

    def _named_bands(self, step: StepBatch, pool, at: int, n: int) -> tuple[torch.Tensor, ...]:
        """Per block of a staged pool, its rows' keys ([rows, keys], as _band) as rows of the
        mirror's table: the pool's older rows where the mirror holds them, its own n rows
        staged at `at` (the same for every layer of the step with this ring length)."""
        key_rows = self.mirror.key_rows(pool.old_slots, pool.old_pos, at, n)
        return tuple(key_rows[_band(step, b)] for b in pool.blocks)

    def _attend(self, layer, seg: Segments, step: StepBatch, kind: str, h, m, q, sink, o, plan,
                group: _Group):
        """One group's attention into o[rows] (o None: the group is every row; returns its
        output as o)."""
        rows, win, per_row, path, pool, by_index, bands = group
        # the works of these rows (their candidates stop at the last of their ends)
        ids = pool.work_ids if pool is not None else plan.ring.work_ids
        cmp = None if m is None else self._compressed(layer, seg, step, h, m, rows,
                                                      per_row or by_index, (kind, path), ids,
                                                      pool)
        if pool is not None and pool.blocks:
            # a pool chunk's rows block by block, each to the keys it can see; the compressed
            # part was chosen for the whole chunk and is cut to the block's rows
            for i, b in enumerate(pool.blocks):
                at = slice(rows.start + b.rows.start, rows.start + b.rows.stop)
                if bands is not None:          # a staged pool: its keys as the table's rows
                    keys = TableKeys(win[0], bands[i], b.ok)
                else:
                    keys = (TableKeys(win[0], _band(step, b), b.ok) if by_index
                            else (win[0][b.keys], b.ok))
                parts = [keys] + ([] if cmp is None else [_block_rows(cmp, b.rows)])
                o[at] = ragged_union_attention(q[at], parts, sink, self.scale)
            return o
        parts = [win] + ([] if cmp is None else [cmp])
        out = ragged_union_attention(q if rows is None else q[rows], parts, sink, self.scale)
        if o is None:
            return out
        o[slice(None) if rows is None else rows] = out
        return o

    def _capture(self, layer, seg: Segments, step: StepBatch, kv_bytes, works, result):
        """Copy the window ending at `capture` into canonical inference-ring order
        (row p % R_inf holds position p), before this chunk overwrites the ring."""
        ring = self.states.swa[layer]
        for i, wk in enumerate(works):
            if wk.capture is None:
                continue
            out = result.captures.setdefault(i, torch.zeros(
                self.cfg.n_encoder_layers, self.inference_ring, ring.shape[2], dtype=torch.uint8,
                device=self.device))
            new_dst, new_src, old_dst, old_src = self._capture_index(seg, step, i, wk, ring.shape[1])
            out[layer, new_dst] = kv_bytes[new_src]
            out[layer, old_dst] = ring[wk.slot, old_src]

    def _capture_index(self, seg: Segments, step: StepBatch, i: int, wk: Work, r: int):
        """Where work i's captured positions come from (this chunk's rows, or ring rows of
        an R-row ring) and go (p % R_inf): from host ints, memoized per step (`_prepare`
        builds it before the first layer)."""
        def make():
            first, cu, r_inf = seg.first_ids[i], seg.cu_ids[i], self.inference_ring
            positions = range(max(0, wk.capture - r_inf), wk.capture)
            new = [p for p in positions if p >= first]
            old = [p for p in positions if p < first]
            return step.uploads.many([p % r_inf for p in new], [cu + p - first for p in new],
                                     [p % r_inf for p in old], [p % r for p in old])
        return step.once(("capture", i, r), make)

    # --- compressed entries ------------------------------------------------------
    def _compressed(self, layer, seg: Segments, step: StepBatch, h, m, rows, per_row: bool, key,
                    work_ids: tuple[int, ...], pool=None):
        """(keys, ok) of the entries visible to `rows` (j < (p + 1) // m). HCA: all of them;
        CSA: the indexer's top-k, so attention never touches the rest. Entry rows come
        straight from the block store through a per-step index. Per-row paths get their
        own candidates ([t, K]; the CPU picks read each row's work's list); long chunks' rows
        share one pool of their works' entries,
        masked per row (a chunk's rows see nearly the same entries; CSA picks too, as that
        pool masked to each row's top-k, while the pool is small: POOL_PICKS)."""
        cfg = self.cfg
        entries = self.blocks.entries[layer]
        per = entries.shape[1]
        cands = step.once(("candidates", key, m, per),
                          lambda: _candidates(seg, step, m, per, rows, work_ids))

        def visible_entries():
            return step.once(("entries", key, m, per),
                             lambda: _visible_entries(cands, step, m, per_row, pool))
        table = entries.view(-1, entries.shape[-1])
        # no row of these works sees more than top-k entries (the candidates' width): the
        # indexer would keep every visible one (select_topk's rule), so it is not run at all
        if cfg.layers[layer] != "csa" or cands[0].shape[1] <= cfg.csa_topk:
            flat, visible = visible_entries()
            if per_row:                 # read in place where a kernel can, else gathered
                return TableKeys(table, flat, visible)
            return take_rows(table, flat).to(h.dtype), visible
        itable = self.blocks.index_keys[layer]
        itable = itable.view(-1, itable.shape[-1])
        iq, iw = ops.index_query(self.w, layer, h if rows is None else h[rows], cfg)
        if per_row:
            # on the CPU one C call scores the candidates' keys in place and picks, each row
            # from its work's list (no [t, K] copy of the lists, no mask)
            picked = cpu_indexer.pick_rows_of_works(iq, iw, itable, *cands, cfg.csa_topk)
            if picked is not None:
                return TableKeys(table, *picked)
            flat, visible = visible_entries()
            ikeys = take_rows(itable, flat).to(h.dtype)                               # [t, K, Di]
            idx, ok = topk_indices(ragged_indexer_scores(iq, iw, ikeys), visible, cfg.csa_topk)
            return TableKeys(table, flat.gather(1, idx), ok)                 # [t, k]
        flat, visible = visible_entries()
        ikeys = take_rows(itable, flat).to(h.dtype)                                   # [L, Di]
        scores = indexer_scores(iq[None], iw[None], ikeys[None])[0]
        chosen = select_topk(scores, visible, cfg.csa_topk)
        if flat.shape[0] <= POOL_PICKS * cfg.csa_topk:
            return take_rows(table, flat).to(h.dtype), chosen                # [L, D], [t, L]
        idx, ok = selected_indices(chosen, cfg.csa_topk)                     # [t, k]
        return take_rows(table, flat[idx]).to(h.dtype), ok


def _by_index(rows, q, keys, step: StepBatch, m: int | None) -> bool:
    """A pool chunk within PER_ROW_CHUNK rows and PER_ROW_ENTRIES rows x candidates whose
    fp32 keys the compiled CPU kernel can read by index."""
    n = rows.stop - rows.start if isinstance(rows, slice) else PER_ROW_CHUNK + 1
    candidates = 0 if m is None else max(step.end_ids) // m                # host ints
    return n <= PER_ROW_CHUNK and n * candidates <= PER_ROW_ENTRIES and \
        keys.dtype == torch.float32 and keys.dim() == 2 and cpu_ring.available(q)


def _band(step: StepBatch, b) -> torch.Tensor:
    """[rows, keys] pool indices of a pool block's keys (b.keys) for each of its rows (b.ok
    masks them): the same for every layer, so built once per step."""
    n = b.ok.shape[0]
    return step.once(("band", b.keys.start, b.keys.stop, n), lambda: torch.arange(
        b.keys.start, b.keys.stop, device=b.ok.device).expand(n, -1).contiguous())


def _block_rows(group, rows: slice):
    """A compressed (keys, ok) group of a chunk's rows cut to some of them: per-row keys
    [t, K, D] (or table indices) and masks [t, ...] are sliced, a shared pool [L, D] is kept."""
    if isinstance(group, TableKeys):
        return TableKeys(group.rows, group.idx[rows], group.ok[rows])
    keys, ok = group
    return (keys[rows] if keys.dim() == 3 else keys), ok[rows]


def _candidates(seg: Segments, step: StepBatch, m: int, per: int, rows,
                work_ids: tuple[int, ...]):
    """The candidate entries of `rows` (of works `work_ids`): (flat block-store rows of
    entries 0 .. K - 1 of every work of the step [N, K], each row's work [t], how many of its
    work's entries each row sees [t]: j < (p + 1) // m).

    K is the most entries any of these rows' works has, not the step's: beside a 4K prompt's
    chunk, 16 decode rows 400 tokens in would otherwise each carry the prompt's ~1000
    candidates (index, mask, a scan in the picks) where ~100 are theirs."""
    count = max(step.end_ids[i] for i in work_ids) // m                  # host ints: no sync
    wid = seg.wid if rows is None else seg.wid[rows]
    n_vis = ((seg.pos if rows is None else seg.pos[rows]) + 1) // m
    return step.entry_index(per, count), wid, n_vis


def _visible_entries(cands, step: StepBatch, m: int, per_row: bool, pool=None):
    """(flat block-store rows of the candidate entries, visible mask): [t, K] each per row,
    or one pool [L] of the rows' works' entries (`pool`: their PoolPlan, which knows the
    works as host ints, so L needs no read) with a [t, L] mask."""
    index, wid, n_vis = cands
    if per_row:
        return index[wid], torch.arange(index.shape[1], device=wid.device) < n_vis.unsqueeze(1)
    total = sum(step.end_ids[i] // m for i in pool.work_ids)
    counts = step.ends[pool.works] // m
    pwid = torch.repeat_interleave(pool.works, counts, output_size=total)
    pj = torch.arange(total, device=wid.device) - \
        torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts, output_size=total)
    visible = (pwid.unsqueeze(0) == wid.unsqueeze(1)) & (pj.unsqueeze(0) < n_vis.unsqueeze(1))
    return index[pwid, pj], visible
