"""ModelRunner: one cached forward over a batch of sequence chunks.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kernels import mxfp8
from kernels.attention import ring_attention
from kernels.indexer import indexer_scores, select_topk, selected_indices
from kernels.ring import ring_write
from services.engine.cache.block_store import BlockStore
from services.engine.cache.state_pool import StatePool
from services.engine.config import ModelConfig
from services.engine.model import ops
from services.engine.model.weights import Weights


@dataclass
class Work:
    slot: int
    table: list[int]
    tokens: list[int]          # tokens[start:end] are computed
    start: int
    end: int
    enc_lo: int = 0            # encoder SWA lower bound (bounded replay start)
    dec_lo: int = 0            # decoder SWA lower bound (truncation start)
    cmp_from: int = 0          # entries for positions < cmp_from exist and must not be rewritten
    capture: int | None = None # snapshot the encoder window ending at this position (in (start, end])
    want_logits: bool = True


@dataclass
class ForwardResult:
    logits: dict[int, torch.Tensor] = field(default_factory=dict)     # work index -> [V]
    captures: dict[int, torch.Tensor] = field(default_factory=dict)   # work index -> [E, R_inf, 528]


@dataclass
class _Rows:
    """A padded batch of query rows: x [N, T, hidden], pos [N, T], valid [N, T]."""
    x: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: Weights, states: StatePool, blocks: BlockStore,
                 dec_mode: str = "compact"):
        if dec_mode not in ("compact", "mask"):
            raise ValueError(f"dec_mode must be compact or mask, not {dec_mode!r}")
        self.cfg, self.w, self.states, self.blocks = cfg, weights, states, blocks
        self.dec_mode = dec_mode
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.inference_ring = states.block.inference_ring

    @torch.no_grad()
    def forward(self, works: list[Work]) -> ForwardResult:
        cfg, result = self.cfg, ForwardResult()
        rows = self._rows(works, [w.start for w in works])
        x = self.w["embed"][rows.x]
        rows = _Rows(x, rows.pos, rows.valid)
        for layer in range(cfg.n_encoder_layers):
            rows.x = self._layer(layer, rows, works, [w.enc_lo for w in works], None, result)
        chunk = _Rows(ops.encoder_output(self.w, rows.x, cfg), rows.pos, rows.valid)

        if self.dec_mode == "compact":
            firsts = [max(w.start, w.dec_lo) for w in works]
            drows = self._rows(works, firsts, source=rows)
        else:
            drows = rows
        for layer in range(cfg.n_encoder_layers, cfg.n_layers):
            drows.x = self._layer(layer, drows, works, [w.dec_lo for w in works], chunk, result)

        for n, w in enumerate(works):
            if w.want_logits:
                last = int(torch.nonzero(drows.pos[n] == w.end - 1)[0, 0])
                result.logits[n] = ops.logits(self.w, drows.x[n, last], cfg)
        return result

    # --- batching ---------------------------------------------------------
    def _rows(self, works, firsts, source: _Rows | None = None) -> _Rows:
        """Pad per-work rows [first, end) into one batch: token ids, or with `source` hidden
        rows cut out of an existing batch (decoder rows of a compact run)."""
        lens = [max(0, w.end - f) for w, f in zip(works, firsts, strict=True)]
        t = max(1, max(lens))
        n = len(works)
        pos = torch.tensor(firsts).unsqueeze(1) + torch.arange(t).unsqueeze(0)
        valid = torch.arange(t).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
        if source is None:
            toks = torch.zeros(n, t, dtype=torch.long)
            for i, w in enumerate(works):
                toks[i, : lens[i]] = torch.tensor(w.tokens[w.start : w.end])
            return _Rows(toks, pos, valid)
        x = source.x.new_zeros(n, t, source.x.shape[-1])
        for i, (w, f) in enumerate(zip(works, firsts, strict=True)):
            off = f - w.start
            x[i, : lens[i]] = source.x[i, off : off + lens[i]]
        return _Rows(x, pos, valid)

    # --- one layer ----------------------------------------------------------
    def _layer(self, layer, rows: _Rows, works, los, chunk: _Rows | None, result) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        p = f"layers.{layer}."
        h = ops.rms_norm(rows.x, w[p + "attn_norm"], cfg.norm_eps)
        q, kv = ops.query_and_kv(w, layer, h, rows.pos, cfg)
        kv_bytes = mxfp8.quantize(kv)
        if cfg.is_encoder(layer):
            self._capture(layer, rows, kv_bytes, works, result)

        cmp = None
        m = cfg.compress_ratio(layer)
        if m is not None:
            src = _Rows(h, rows.pos, rows.valid) if chunk is None else chunk
            for i, wk in enumerate(works):
                self._compress(layer, wk, src.x[i], int(src.pos[i, 0]), int(src.valid[i].sum()))
            cmp = self._compressed(layer, rows, h, works, m)

        # window keys: W - 1 ring rows before each work's first row + its new rows (the
        # ring is written after it is read)
        o = ring_attention(q, self.states.swa[layer], torch.tensor([wk.slot for wk in works]),
                           kv_bytes, rows.pos, rows.valid, torch.tensor(los), cfg.window,
                           w[p + "sink"], self.scale, cmp)
        self._write_ring(layer, rows, kv_bytes, works)
        x = rows.x + ops.attn_output(w, layer, o)
        return x + ops.ffn(w, layer, x, cfg)

    def _write_ring(self, layer, rows: _Rows, kv_bytes, works):
        for i, wk in enumerate(works):
            n = int(rows.valid[i].sum())
            if n:
                ring_write(self.states.swa[layer], wk.slot, int(rows.pos[i, 0]), kv_bytes[i, :n])

    def _capture(self, layer, rows: _Rows, kv_bytes, works, result):
        """Copy the window ending at `capture` into canonical inference-ring order
        (row p % R_inf holds position p), before this chunk overwrites the ring."""
        e = self.cfg.n_encoder_layers
        r_inf = self.inference_ring
        ring = self.states.swa[layer]
        for i, wk in enumerate(works):
            if wk.capture is None:
                continue
            out = result.captures.setdefault(
                i, torch.zeros(e, r_inf, ring.shape[2], dtype=torch.uint8))
            first = int(rows.pos[i, 0])
            positions = torch.arange(wk.capture - r_inf, wk.capture)
            positions = positions[positions >= 0]
            new = positions >= first
            src = torch.empty(len(positions), ring.shape[2], dtype=torch.uint8)
            src[new] = kv_bytes[i, positions[new] - first]
            src[~new] = ring[wk.slot, positions[~new].remainder(ring.shape[1])]
            out[layer, positions.remainder(r_inf)] = src

    # --- compressed entries ------------------------------------------------------
    def _compress(self, layer, wk: Work, u, first: int, n: int):
        """Feed rows u[:n] (positions first..first+n-1) to this layer's compressor: emit the
        entries of groups that complete, keep the open group's tail in the compression ring."""
        cfg, m = self.cfg, self.cfg.compress_ratio(layer)
        skip = max(0, wk.cmp_from - first)
        if skip >= n:
            return
        s0, end = first + skip, first + n
        u = u[skip:n]
        g0, gend = (s0 // m) * m, (end // m) * m
        streams = [(self.states.cmp[layer], *ops.compressor_inputs(self.w, layer, u), False)]
        if cfg.layers[layer] == "csa":
            streams.append((self.states.idx[layer], *ops.indexer_inputs(self.w, layer, u), True))
        for ring, v, z, is_index in streams:
            r = ring.shape[1]
            tail = ring[wk.slot, torch.arange(g0, s0).remainder(r)].to(v.dtype)  # [s0-g0, 2, dim]
            if gend > g0:
                fv = torch.cat([tail[:, 0], v])[: gend - g0]
                fz = torch.cat([tail[:, 1], z])[: gend - g0]
                if is_index:
                    rows = ops.pool_index_keys(self.w, layer, fv, fz, m)
                else:
                    rows = ops.pool_entries(self.w, layer, fv, fz, g0 // m, m, cfg)
                self.blocks.scatter(wk.table, layer, g0 // m, rows, keys=is_index)
            ring_write(ring, wk.slot, s0, torch.stack([v, z], dim=1))

    def _compressed(self, layer, rows: _Rows, h, works, m):
        """Entries visible to each query row, as (keys [N, Kc, D], ok, idx). HCA: all of
        them (idx None). CSA: each row's top-k picks as indices [N, T, k] into keys, so
        attention gathers only the entries it picked."""
        counts = [wk.end // m for wk in works]
        kc = max(counts)
        n = rows.pos.shape[0]
        keys = h.new_zeros(n, kc, self.cfg.head_dim)
        for i, wk in enumerate(works):
            keys[i, : counts[i]] = self.blocks.gather(wk.table, layer, counts[i])
        visible = torch.arange(kc).view(1, 1, kc) < ((rows.pos + 1) // m).unsqueeze(2)
        visible &= rows.valid.unsqueeze(2)
        if self.cfg.layers[layer] != "csa":
            return keys, visible, None
        ikeys = h.new_zeros(n, kc, self.cfg.index_dim)
        for i, wk in enumerate(works):
            ikeys[i, : counts[i]] = self.blocks.gather(wk.table, layer, counts[i], keys=True)
        iq, iw = ops.index_query(self.w, layer, h, self.cfg)
        chosen = select_topk(indexer_scores(iq, iw, ikeys), visible, self.cfg.csa_topk)
        idx, ok = selected_indices(chosen, self.cfg.csa_topk)                 # [N, T, k]
        return keys, ok, idx
