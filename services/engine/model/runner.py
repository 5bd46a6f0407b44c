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
from dataclasses import dataclass, field

import torch

from kernels.indexer import indexer_scores, select_topk, selected_indices
from kernels.ragged import (
    ragged_indexer_scores,
    ragged_union_attention,
    ring_put,
)
from services.engine.cache.block_store import BlockStore
from services.engine.cache.state_pool import StatePool
from services.engine.config import ModelConfig
from services.engine.model import compressor, ops
from services.engine.model.batch import Segments, StepBatch
from services.engine.model.weights import Weights
from services.engine.model.window_mirror import WindowMirror

# Works with at most this many rows gather each row's W window keys by index; longer
# chunks share one key pool (their ring rows + chunk rows) with a mask, which is cheaper
# than W keys per row once a chunk is longer than a few rows.
GATHER_MAX_ROWS = 16


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
    n_logits: int = 1          # logit rows of the chunk's last positions (verify: 1 + drafts)
    owner: object = None       # identifies one admission of a sequence (window mirror); None: no mirror


@dataclass
class ForwardResult:
    logits: dict[int, torch.Tensor] = field(default_factory=dict)     # work index -> [V] ([n, V]: n_logits > 1)
    captures: dict[int, torch.Tensor] = field(default_factory=dict)   # work index -> [E, R_inf, 528]
    rows: dict[str, int] = field(default_factory=dict)                # query rows computed per layer


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: Weights, states: StatePool, blocks: BlockStore,
                 dec_mode: str = "compact"):
        if dec_mode not in ("compact", "mask"):
            raise ValueError(f"dec_mode must be compact or mask, not {dec_mode!r}")
        self.cfg, self.w, self.states, self.blocks = cfg, weights, states, blocks
        self.dec_mode = dec_mode
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.inference_ring = states.block.inference_ring
        self.mirror = WindowMirror(states.swa, cfg.head_dim, weights["embed"].dtype)

    @torch.no_grad()
    def forward(self, works: list[Work]) -> ForwardResult:
        cfg, result = self.cfg, ForwardResult()
        if not works:
            return result
        step = StepBatch.build(works, compact=self.dec_mode == "compact")
        self.mirror.begin(works)
        toks = [t for w in works for t in w.tokens[w.start : w.end]]
        x = self.w["embed"][torch.tensor(toks, dtype=torch.long)]
        for layer in range(cfg.n_encoder_layers):
            x = self._layer(layer, x, step, step.enc, None, works, result)
        h_enc = ops.encoder_output(self.w, x, cfg)
        if step.dec_rows is not None:
            x = x[step.dec_rows]
        for layer in range(cfg.n_encoder_layers, cfg.n_layers):
            x = self._layer(layer, x, step, step.dec, h_enc, works, result)
        result.rows = {"encoder": step.enc.rows, "decoder": step.dec.rows}

        want = [i for i, w in enumerate(works) if w.want_logits]
        if want:
            counts = torch.tensor([works[i].n_logits for i in want], dtype=torch.long)
            wi = torch.repeat_interleave(torch.tensor(want, dtype=torch.long), counts)
            back = torch.cat([torch.arange(n - 1, -1, -1) for n in counts.tolist()])
            logits = ops.logits(self.w, x[step.dec.rows_at(wi, step.ends[wi] - 1 - back)], cfg)
            at = 0
            for i, n in zip(want, counts.tolist(), strict=True):
                result.logits[i] = logits[at] if n == 1 else logits[at : at + n]
                at += n
        return result

    def rewind(self, slot: int, owner: object, end: int) -> None:
        """The slot's sequence continues at `end`, before the end of its last chunk (rejected
        draft rows): the window mirror stays valid (rows past `end` carry their positions and
        are rewritten before any read), so it is kept instead of dropped."""
        self.mirror.rewind(slot, owner, end)

    # --- one layer ----------------------------------------------------------
    def _layer(self, layer, x, step: StepBatch, seg: Segments, h_enc, works, result):
        cfg, w = self.cfg, self.w
        p = f"layers.{layer}."
        m = cfg.compress_ratio(layer)
        if seg.rows == 0:          # compact decoder with every row before dec_lo: only compress
            if m is not None:
                compressor.feed(cfg, w, self.states, self.blocks, layer, step, step.enc, h_enc)
            return x
        h = ops.rms_norm(x, w[p + "attn_norm"], cfg.norm_eps)
        q, kv = ops.query_and_kv(w, layer, h, seg.pos, cfg)
        kv_bytes, kv = ops.quantize_kv(kv)
        short = (seg.n <= GATHER_MAX_ROWS)[seg.wid]
        windows = self._windows(layer, seg, step, kv, short)
        if cfg.is_encoder(layer):
            self._capture(layer, seg, step, kv_bytes, works, result)
        ring = self.states.swa[layer]
        last = seg.pos >= seg.end[seg.wid] - ring.shape[1]     # older rows would be overwritten
        ring_put(ring, step.slots[seg.wid[last]], seg.pos[last], kv_bytes[last])
        self.mirror.write(layer, step.slots[seg.wid[last]], seg.pos[last], kv[last])

        if m is not None:
            compressor.feed(cfg, w, self.states, self.blocks, layer, step, step.enc,
                            h if h_enc is None else h_enc)

        sink = w[p + "sink"]
        o = torch.empty_like(q)
        for rows, win in windows:
            groups = [win]
            if m is not None:
                groups.append(self._compressed(layer, seg, step, h, m, rows, bool(short[rows[0]])))
            o[rows] = ragged_union_attention(q[rows], groups, sink, self.scale)
        x = x + ops.attn_output(w, layer, o)
        return x + ops.ffn(w, layer, x, cfg)

    def _windows(self, layer, seg: Segments, step: StepBatch, kv, short):
        """[(rows, (keys, ok))]: window keys of positions max(lo, p - W + 1) .. p per row.
        Short works' rows gather their own W keys; long works' rows share one pool of their
        W - 1 ring rows and chunk rows, masked per row. Keys older than the chunk come from
        the ring (read before this chunk writes it), through the window mirror."""
        out = []
        big_w = self.cfg.window
        for rows in (torch.nonzero(short).squeeze(1), torch.nonzero(~short).squeeze(1)):
            if not len(rows):
                continue
            wid, pos = seg.wid[rows], seg.pos[rows]
            lo = torch.clamp(seg.lo[wid], min=0)
            kpos = pos.unsqueeze(1) - big_w + 1 + torch.arange(big_w)            # [t, W]
            if bool((seg.n[wid] == 1).all()) and kv.dtype == self.mirror.dtype and \
                    self.states.swa[layer].shape[1] >= big_w:
                # decode rows: put the new row in the mirror first (the ring holds W + B
                # rows, so it cannot displace one of this window), then one gather
                self.mirror.write(layer, step.slots[wid], pos, kv[rows])
                keys = self.mirror.read(layer, step.slots[wid].unsqueeze(1).expand_as(kpos), kpos, kv.dtype)
                out.append((rows, (keys, kpos >= lo.unsqueeze(1))))
                continue
            # key pool: W - 1 ring rows before each work's first row, then the chunk rows
            works, local = torch.unique(wid, return_inverse=True)
            opos = seg.first[works].unsqueeze(1) - big_w + 1 + torch.arange(big_w - 1)
            owid = works.unsqueeze(1).expand_as(opos)
            old = self.mirror.read(layer, step.slots[owid.flatten()], opos.flatten(), kv.dtype)
            keys = torch.cat([old, kv[rows]])
            if bool(short[rows[0]]):
                # each row gathers its own W keys from the pool (positions p - W + 1 .. p)
                first = seg.first[wid].unsqueeze(1)
                in_chunk = kpos >= first
                ring_i = local.unsqueeze(1) * (big_w - 1) + kpos - first + big_w - 1
                row_i = len(old) + torch.arange(len(rows)).unsqueeze(1) + kpos - pos.unsqueeze(1)
                idx = torch.where(in_chunk, row_i, torch.clamp(ring_i, min=0))
                out.append((rows, (keys[idx], kpos >= lo.unsqueeze(1))))
                continue
            kpos = torch.cat([opos.flatten(), pos])
            kwid = torch.cat([owid.flatten(), wid])
            qp = pos.unsqueeze(1)
            ok = (kwid.unsqueeze(0) == wid.unsqueeze(1)) & (kpos <= qp) & \
                (kpos >= torch.maximum(qp - big_w + 1, lo.unsqueeze(1)))
            out.append((rows, (keys, ok)))
        return out

    def _capture(self, layer, seg: Segments, step: StepBatch, kv_bytes, works, result):
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
            first = int(seg.first[i])
            positions = torch.arange(wk.capture - r_inf, wk.capture)
            positions = positions[positions >= 0]
            new = positions >= first
            src = torch.empty(len(positions), ring.shape[2], dtype=torch.uint8)
            src[new] = kv_bytes[int(seg.cu[i]) + positions[new] - first]
            src[~new] = ring[wk.slot, positions[~new].remainder(ring.shape[1])]
            out[layer, positions.remainder(r_inf)] = src

    # --- compressed entries ------------------------------------------------------
    def _compressed(self, layer, seg: Segments, step: StepBatch, h, m, rows, short: bool):
        """(keys, ok) of the entries visible to `rows` (j < (p + 1) // m). HCA: all of them;
        CSA: the indexer's top-k, so attention never touches the rest. Entry rows come
        straight from the block store through a per-step index. Short works' rows get their
        own candidates ([t, K]); long chunks' rows share one pool of their works' entries,
        masked per row (a chunk's rows see nearly the same entries)."""
        cfg = self.cfg
        entries = self.blocks.entries[layer]
        per = entries.shape[1]
        count = int((step.ends // m).max())
        index = step.entry_index(per, count)                                 # [N, K]
        wid, n_vis = seg.wid[rows], (seg.pos[rows] + 1) // m
        if short:
            flat = index[wid]                                                # [t, K]
            visible = torch.arange(count).unsqueeze(0) < n_vis.unsqueeze(1)
        else:
            works = torch.unique(wid)
            counts = step.ends[works] // m
            pwid = torch.repeat_interleave(works, counts)
            pj = torch.arange(len(pwid)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
            flat = index[pwid, pj]                                           # [L]
            visible = (pwid.unsqueeze(0) == wid.unsqueeze(1)) & (pj.unsqueeze(0) < n_vis.unsqueeze(1))
        table = entries.view(-1, entries.shape[-1])
        if cfg.layers[layer] != "csa":
            return table[flat].to(h.dtype), visible
        ikeys = self.blocks.index_keys[layer]
        ikeys = ikeys.view(-1, ikeys.shape[-1])[flat].to(h.dtype)           # [t, K, Di] / [L, Di]
        iq, iw = ops.index_query(self.w, layer, h[rows], cfg)
        if short:
            scores = ragged_indexer_scores(iq, iw, ikeys)
        else:
            scores = indexer_scores(iq[None], iw[None], ikeys[None])[0]
        chosen = select_topk(scores, visible, cfg.csa_topk)
        idx, ok = selected_indices(chosen, cfg.csa_topk)                     # [t, k]
        picked = flat.gather(1, idx) if short else flat[idx]
        return table[picked].to(h.dtype), ok
