"""The full-sequence forward of DeepSeek V4.1: no cache, every mask from positions.

No implementation of V4.1 runs offline, so this file is the reference the engine's cached
path is tested against, written from the public descriptions of DeepSeek's release (see
v41_config.py for the layer roles). One sequence per call, starting at position 0. What it
shares with V4 (norms, RoPE, the attention softmax with its sink, the grouped output, the
hyper-connection weights, the routed experts) comes from V4's modules, which are pinned to
transformers; what is V4.1's own is here:

- attention: q is not normed per head; a layer that reads a compressed cache attends its
  window rows plus the entries of its KV source that its index source chose;
- compressors (KV sources only): ratio 1 is one entry per token, norm(wkv x); ratio m > 1
  pools m consecutive tokens under a per-channel softmax gate (no overlap, no position bias);
  entry g is rotated at position g * m and is visible to the query at i iff g < (i + 1) // m;
- the indexer (v41_index.py): keys norm(wk(entry before RoPE)), owned by the KV source;
  scores as V4's; a candidate source keeps its best blocks first (the block holding the
  newest visible entry always), and later index sources choose only inside them;
- hyper-connections are staggered: the `pre` weights a sub-block computes from its input
  streams collapse the *next* sub-block's input (the first attention takes stream 0, the
  last MoE's `pre` collapses the streams for the head; there is no hc_head);
- MoE: every layer routes by score, sqrtsoftplus(gate(x) / gate_temp) + bias choosing;
- Engram (v41_engram.py): an Engram layer first adds its gated n-gram memory to the streams,
  which its attention sub-block then mixes and collapses as any layer's.

The caches' activation rounding of the release (FP8 window rows, FP4 entries and index
keys) is not modelled: the engine keeps these rows exactly as computed, as it does for V4.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4 import hyper, v41_engram, window_rows
from kvmesh.services.engine.model.deepseek_v4.attention import (
    attend,
    grouped_output,
    window_visible,
)
from kvmesh.services.engine.model.deepseek_v4.compressor import visible
from kvmesh.services.engine.model.deepseek_v4.forward import RopeTables
from kvmesh.services.engine.model.deepseek_v4.moe import moe_v41
from kvmesh.services.engine.model.deepseek_v4.numerics import apply_rope, rms_norm, wide
from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config
from kvmesh.services.engine.model.deepseek_v4.v41_index import (
    candidate_blocks,
    index_query,
    index_scores,
    select,
)

# spans of at most this many rows after a prior (decode rows; verify spans: a token and its
# drafts) attend together (v41_decode.py); longer ones, prefill chunks, one by one
BATCHED_SPAN = 8


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps, wide(x.dtype))


class SourceState(NamedTuple):
    """A KV source's compressed cache so far, and the tokens of its open group."""
    layer: int
    entries: torch.Tensor        # [T, d] normed and rotated: what attention reads
    keys: torch.Tensor           # [T, c_I] rotated index keys
    open_kv: torch.Tensor        # [< m, d] raw projections of the open group's tokens (wide)
    open_gate: torch.Tensor      # [< m, d] and their gate logits
    # this call's raw projections, one row per token it compressed (what a tail ring keeps
    # for rollback; ratio 1 has none)
    new_kv: torch.Tensor | None = None
    new_gate: torch.Tensor | None = None


class Shared(NamedTuple):
    """What attention layers hand down the stack (the most recent of each), for this call's
    rows."""
    source: SourceState | None = None
    chosen: torch.Tensor | None = None       # [S, T] bool: the most recent selection
    candidates: torch.Tensor | None = None   # [S, T] bool: the candidate source's blocks

    def rows(self, keep: slice) -> Shared:
        """The same, for a subset of the rows (decoder-side truncation drops the others)."""
        return Shared(self.source, None if self.chosen is None else self.chosen[keep],
                      None if self.candidates is None else self.candidates[keep])


class Span(NamedTuple):
    """One sequence's run of rows in a layer call (`V41Model.layer_spans`)."""
    positions: torch.Tensor
    shared: Shared = Shared()
    prior: LayerState | None = None
    floor: int = 0
    rows: torch.Tensor | slice | None = None
    grams: torch.Tensor | None = None     # [rows, Engram layers, columns]: `V41Model.grams`


class LayerState(NamedTuple):
    """What one layer keeps of the tokens so far (the whole-sequence run keeps all)."""
    window: torch.Tensor                 # [K, d] rotated K = V rows of the last K positions
    source: SourceState | None = None    # a KV source's compressor


def compress(cfg: V41Config, w: dict, x: torch.Tensor, tables: RopeTables, layer: int,
             prior: SourceState | None = None, start: int = 0) -> SourceState:
    """KV source `layer`'s entries and keys after the tokens x [S, D] (its normed input) at
    positions start.. (prior: the state after the earlier tokens; None: x starts the
    sequence). Rows the prior already covers are skipped: a bounded replay re-runs tokens
    whose entries are cached. w: the layer's weights under `attn.`."""
    m, d = cfg.ratio(layer), cfg.head_dim
    cw = _sub(w, "compressor.")
    first = prior.entries.shape[0] if prior is not None else 0
    if prior is not None:
        covered = first * m + prior.open_kv.shape[0]
        x = x[max(covered - start, 0):]
    if m == 1:
        latent = norm(F.linear(x, cw["wkv.weight"]), cw["norm.weight"], cfg.rms_eps)
        open_kv = open_gate = new_kv = new_gate = x.new_zeros((0, d), dtype=wide(x.dtype))
    else:
        work = wide(x.dtype)                                   # the gate runs in at least fp32
        kv = new_kv = F.linear(x.to(work), cw["wkv.weight"].to(work))
        gate = new_gate = F.linear(x.to(work), cw["wgate.weight"].to(work))
        if prior is not None:
            kv, gate = torch.cat([prior.open_kv, kv]), torch.cat([prior.open_gate, gate])
        n = kv.shape[0] // m
        pooled = (kv[:n * m].view(n, m, d) * gate[:n * m].view(n, m, d).softmax(dim=1)).sum(dim=1)
        latent = norm(pooled.to(x.dtype), cw["norm.weight"], cfg.rms_eps)
        open_kv, open_gate = kv[n * m:], gate[n * m:]
    iw = _sub(w, "indexer.")
    keys = norm(F.linear(latent, iw["wk.weight"]), iw["k_norm.weight"], cfg.rms_eps)
    cos, sin = tables.at(cfg.compress_rope,
                         (torch.arange(latent.shape[0], device=latent.device) + first) * m)
    entries, keys = apply_rope(latent, cos, sin), apply_rope(keys, cos, sin)
    if prior is not None:
        entries, keys = torch.cat([prior.entries, entries]), torch.cat([prior.keys, keys])
    return SourceState(layer, entries, keys, open_kv, open_gate, new_kv, new_gate)


class Projected(NamedTuple):
    """What attention computes of each row alone (`project`), before rows meet."""
    q_res: torch.Tensor                  # [S, q_lora] normed: the indexer's query input
    q: torch.Tensor                      # [S, H, d] rotated
    kv: torch.Tensor                     # [S, d] rotated K = V rows, in the ring's rounding
    cos: torch.Tensor                    # [S, r / 2] the layer's RoPE at the rows' positions
    sin: torch.Tensor
    index: tuple[torch.Tensor, torch.Tensor] | None = None   # `index_query`, index sources

    def rows(self, at: torch.Tensor | slice) -> Projected:
        index = None if self.index is None else (self.index[0][at], self.index[1][at])
        return Projected(*(t[at] for t in self[:5]), index)


def project(cfg: V41Config, layer: int, w: dict, x: torch.Tensor, positions: torch.Tensor,
            tables: RopeTables, rows: str | None = None) -> Projected:
    """The per-row projections of an attention sub-block (x [S, D] its normed input; any rows,
    of any sequences: nothing here mixes rows). rows: see `attention`."""
    s = x.shape[0]
    cos, sin = tables.at(cfg.rope(layer), positions)
    q_res = norm(F.linear(x, w["wq_a.weight"]), w["q_norm.weight"], cfg.rms_eps)
    q = apply_rope(F.linear(q_res, w["wq_b.weight"]).view(s, cfg.num_heads, cfg.head_dim), cos, sin)
    kv = apply_rope(norm(F.linear(x, w["wkv.weight"]), w["kv_norm.weight"], cfg.rms_eps),
                    cos, sin)
    if rows is not None:
        kv = window_rows.round_like_stored(rows, kv)
    index = index_query(cfg, _sub(w, "indexer."), x, q_res, positions, tables) \
        if layer in cfg.index_sources else None
    return Projected(q_res, q, kv, cos, sin, index)


def output(cfg: V41Config, w: dict, o: torch.Tensor, p: Projected) -> torch.Tensor:
    """Attention's result o [S, H, d] (any rows) -> the sub-block's output [S, D]."""
    return grouped_output(apply_rope(o, p.cos, -p.sin), w["wo_a.weight"], w["wo_b.weight"],
                          cfg.o_groups)


def attention(cfg: V41Config, layer: int, w: dict, x: torch.Tensor, positions: torch.Tensor,
              tables: RopeTables, shared_in: Shared, prior: LayerState | None = None,
              floor: int = 0, compressed: SourceState | None = None, rows: str | None = None,
              ) -> tuple[torch.Tensor, Shared, LayerState]:
    """One attention sub-block over consecutive tokens at `positions`; x [S, D] is its normed
    input. prior: what this layer kept of the earlier tokens (None: the sequence starts here).
    floor: window rows at positions below it are not attended (decoder-side truncation's
    mask form). compressed: a KV source's state already run over more rows than these (the
    first decoder layer compresses every row, then attends the kept ones). rows: the ring
    format the engine keeps window rows in (window_rows.py): this call's rows are rounded to
    it before any row attends them, so a row sees its neighbours as a later step reads them
    back, whatever the chunking (None: unrounded, the reference). Returns the output [S, D],
    what later layers read, and what this layer keeps (its window rows: the prior's followed
    by this call's)."""
    p = project(cfg, layer, w, x, positions, tables, rows)
    o, out_shared, state = attend_span(cfg, layer, w, x, positions, tables, shared_in, p, prior,
                                       floor, compressed)
    return output(cfg, w, o, p), out_shared, state


def attend_span(cfg: V41Config, layer: int, w: dict, x: torch.Tensor, positions: torch.Tensor,
                tables: RopeTables, shared_in: Shared, p: Projected,
                prior: LayerState | None = None, floor: int = 0,
                compressed: SourceState | None = None) -> tuple[torch.Tensor, Shared, LayerState]:
    """`attention` after `project` (p: these rows'), before `output`: o [S, H, d]."""
    kv = p.kv if prior is None else torch.cat([prior.window, p.kv])
    end = int(positions[-1]) + 1
    key_pos = torch.arange(end - kv.shape[0], end, device=kv.device)
    keys = kv
    allowed = window_visible(positions, key_pos, cfg.window) & (key_pos >= floor).view(1, -1)
    out_shared, own = shared_in, None
    if cfg.ratio(layer):
        source = shared_in.source
        if compressed is not None:
            source = own = compressed
        elif layer in cfg.kv_sources:
            source = own = compress(cfg, w, x, tables, layer,
                                    prior.source if prior is not None else None,
                                    int(positions[0]))
        chosen, candidates = shared_in.chosen, shared_in.candidates
        if layer in cfg.index_sources:
            seen = visible(positions, source.entries.shape[0], cfg.ratio(layer))
            scores = index_scores(p.index, source.keys)
            if layer == cfg.candidate_source:
                candidates = candidate_blocks(scores, seen, cfg.candidate_topk_blocks,
                                              cfg.candidate_block_size)
            limit = seen & candidates if cfg.uses_candidates(layer) else seen
            chosen = select(scores, limit, cfg.index_topk)
        out_shared = Shared(source, chosen, candidates)
        keys = torch.cat([kv, source.entries])
        allowed = torch.cat([allowed, chosen], dim=1)
    o = attend(p.q, keys, allowed, w["attn_sink"], cfg.head_dim ** -0.5)
    return o, out_shared, LayerState(kv, own)


class V41Model:
    """A loaded DeepSeek V4.1 text model: config, weights (read-only) and RoPE tables.
    rows: the window-row format of the ledgers it serves with (`attention`'s rows); None,
    the default, computes the unrounded reference function."""

    def __init__(self, cfg: V41Config, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 rows: str | None = None):
        self.cfg, self.weights, self.dtype, self.rows = cfg, weights, dtype, rows
        self.whole = cfg          # the whole model's config (a split rank computes with less)
        self.device = next(iter(weights.values())).device     # where every tensor is built
        self.tables = RopeTables(cfg, dtype, self.device)
        layers = [_sub(weights, f"layers.{i}.") for i in range(cfg.num_layers)]
        self.layers = layers
        self.attn = [_sub(w, "attn.") for w in layers]
        self.ffn = [_sub(w, "ffn.") for w in layers]
        self.hasher = None
        if cfg.engram is not None:
            if v41_engram.TOKEN_MAP not in weights:
                raise ValueError(f"an Engram model needs the tokenizer's compressed token map "
                                 f"(weights[{v41_engram.TOKEN_MAP!r}], which "
                                 "load_v41_checkpoint reads)")
            self.hasher = v41_engram.EngramHasher(cfg.engram, weights[v41_engram.TOKEN_MAP])
        self.engram = {i: _sub(layers[i], "engram.") for i in cfg.engram_layers}

    def _mix(self, streams: torch.Tensor, w: dict, name: str):
        cfg = self.cfg
        return hyper.mix_weights(streams, w[f"{name}_fn"], w[f"{name}_base"], w[f"{name}_scale"],
                                 cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_eps, wide(self.dtype))

    def grams(self, ids: torch.Tensor, before: torch.Tensor | list[int]) -> torch.Tensor | None:
        """The Engram table rows of consecutive tokens `ids` [S] of one sequence, `before`
        the tokens preceding them (v41_engram.EngramHasher.rows); None without Engram."""
        return None if self.hasher is None else self.hasher.rows(ids, before)

    def layer(self, i: int, streams: torch.Tensor, pre: torch.Tensor, positions: torch.Tensor,
              shared_in: Shared, prior: LayerState | None = None, floor: int = 0,
              rows: torch.Tensor | slice | None = None, grams: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, Shared, LayerState]:
        """One sequence's rows through layer i (`layer_spans` with one span)."""
        streams, pre, ((shared_out, state),) = self.layer_spans(
            i, streams, pre, [Span(positions, shared_in, prior, floor, rows, grams)])
        return streams, pre, shared_out, state

    def layer_spans(self, i: int, streams: torch.Tensor, pre: torch.Tensor, spans: list[Span],
                    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[Shared, LayerState]]]:
        """Several sequences' rows through layer i: streams [S, n, D] and the `pre` the
        sub-block before computed, spans[k] the k-th run of rows in order. Everything but
        attention runs over all rows at once; attention runs per span, except that short
        spans after a prior (decode rows, verify spans) attend together (v41_decode.py). Returns the streams after
        the layer, its MoE's `pre` (for the next layer), and per span what later layers read
        and what the layer keeps (`attention`). A span's `rows` is decoder-side truncation's
        cut (compact form): the layer's compressor, if it has one, runs on every row of the
        span; the rest of the layer, and what it returns, on these rows only."""
        # (imported here: v41_decode builds on this module)
        from kvmesh.services.engine.model.deepseek_v4.v41_decode import decode_rows

        cfg, w, aw = self.cfg, self.layers[i], self.attn[i]
        if i in self.engram:
            streams = self._engram(i, streams, spans)
        attn_pre, post, comb = self._mix(streams, w, "hc_attn")
        x = norm(hyper.collapse(streams, pre), w["attn_norm.weight"], cfg.rms_eps)
        plans, start = [], 0        # per span: the rows attention runs on and their inputs
        for span in spans:
            end = start + span.positions.shape[0]
            rows = torch.arange(start, end, device=x.device)
            positions, shared_in, compressed = span.positions, span.shared, None
            if span.rows is not None:
                if i in cfg.kv_sources:
                    compressed = compress(cfg, aw, x[rows], self.tables, i,
                                          span.prior.source if span.prior is not None else None,
                                          int(positions[0]))
                rows, positions = rows[span.rows], positions[span.rows]
                shared_in = shared_in.rows(span.rows)
            start = end
            plans.append((rows, positions, shared_in, compressed))
        results: list = [None] * len(spans)
        kept = [k for k, plan in enumerate(plans) if plan[1].numel()]
        for k in set(range(len(spans))) - set(kept):   # nothing kept yet: only the compressor ran
            prior, (_, _, shared_in, compressed) = spans[k].prior, plans[k]
            window = prior.window if prior is not None else x.new_zeros((0, cfg.head_dim))
            source = compressed if compressed is not None else shared_in.source
            results[k] = (shared_in._replace(source=source), LayerState(window, compressed))
        if len(kept) != len(spans) or any(span.rows is not None for span in spans):
            rows = torch.cat([plans[k][0] for k in kept]) if kept else \
                torch.zeros(0, dtype=torch.long, device=x.device)
            streams, attn_pre, post, comb = streams[rows], attn_pre[rows], post[rows], comb[rows]
            x = x[rows]
        if not kept:
            return streams, attn_pre, results
        # every row's own projections at once, then attention: short spans after a prior
        # (BATCHED_SPAN rows at most, no cut) together (v41_decode.py), the others one by one
        positions = torch.cat([plans[k][1] for k in kept])
        p = project(cfg, i, aw, x, positions, self.tables, self.rows)
        o = p.q.new_empty(p.q.shape)
        offsets, at = {}, 0
        for k in kept:
            offsets[k], at = at, at + plans[k][1].shape[0]
        decoding = [k for k in kept if plans[k][1].shape[0] <= BATCHED_SPAN
                    and spans[k].rows is None and spans[k].prior is not None]
        if len(decoding) > 1:
            lengths = [plans[k][1].shape[0] for k in decoding]
            rows = torch.cat([torch.arange(offsets[k], offsets[k] + n, device=x.device)
                              for k, n in zip(decoding, lengths, strict=True)])
            o[rows], outs = decode_rows(cfg, i, aw, x[rows], positions[rows], self.tables,
                                        [plans[k][2] for k in decoding], p.rows(rows),
                                        [spans[k].prior for k in decoding],
                                        [spans[k].floor for k in decoding], lengths)
            for k, res in zip(decoding, outs, strict=True):
                results[k] = res
        for k in kept:
            if results[k] is not None:
                continue
            _, span_pos, shared_in, compressed = plans[k]
            rows = slice(offsets[k], offsets[k] + span_pos.shape[0])
            o[rows], shared_out, state = attend_span(cfg, i, aw, x[rows], span_pos, self.tables,
                                                     shared_in, p.rows(rows), spans[k].prior,
                                                     spans[k].floor, compressed)
            results[k] = (shared_out, state)
        streams = hyper.expand(streams, self.attention_total(output(cfg, aw, o, p)), post, comb)
        ffn_pre, post, comb = self._mix(streams, w, "hc_ffn")
        x = norm(hyper.collapse(streams, attn_pre), w["ffn_norm.weight"], cfg.rms_eps)
        streams = hyper.expand(streams, self.mlp(i, x), post, comb)
        return streams, ffn_pre, results

    def _engram(self, i: int, streams: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        if any(span.grams is None for span in spans):
            raise ValueError(f"layer {i} is an Engram layer: every span needs its grams "
                             "(V41Model.grams)")
        assert self.cfg.engram is not None
        rows = torch.cat([span.grams for span in spans])[:, self.cfg.engram.layers.index(i)]
        return v41_engram.write(streams, rows, self.engram[i], self.cfg.rms_eps, wide(self.dtype))

    # The three points where a model split over ranks (parallel.py) differs from this one.
    def attention_total(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return moe_v41(self.cfg, self.ffn[i], x)

    def vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weights["head.weight"])

    def embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [S] -> n copies of the embedding [S, n, D] and the first `pre` (stream 0)."""
        embedded = F.embedding(ids, self.weights["embed.weight"])
        streams = embedded.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(ids.shape[0], self.cfg.hc_mult, dtype=torch.float32, device=ids.device)
        pre[:, 0] = 1.0
        return streams, pre

    def head(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The last layer's streams and its MoE's `pre` -> logits [S, vocab]."""
        h = norm(hyper.collapse(streams, pre), self.weights["norm.weight"], self.cfg.rms_eps)
        return self.vocab_logits(h)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, keep: int | None = None, mode: str = "compact",
               ) -> torch.Tensor:
        """ids [S] -> logits [S, vocab] in the model's dtype.

        keep: decoder-side truncation. The decoder layers (the last KV source and those after
        it: they own nothing but their window rows, besides that source's compressor, which
        still runs on every row) run on the last `keep` positions only:
        "compact" drops the other rows there and returns logits for the kept ones; "mask"
        runs every row but no kept row attends a window row below them (the dropped rows'
        logits are returned too, and mean nothing)."""
        return self.head(*self._stack(ids, keep, mode))

    def _stack(self, ids: torch.Tensor, keep: int | None = None, mode: str = "compact",
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits` before the head: the last layer's streams and its MoE's `pre`."""
        ids = ids.reshape(-1).long().to(self.device)
        positions = torch.arange(ids.shape[0], device=self.device)
        start = self.cfg.decoder_start
        if keep is not None and start is None:
            raise ValueError("keep: the model has no decoder layers (none follows a KV source)")
        if mode not in ("compact", "mask"):
            raise ValueError(f"mode {mode!r}: expected compact or mask")
        floor = max(ids.shape[0] - keep, 0) if keep is not None else 0
        streams, pre = self.embed(ids)
        grams = self.grams(ids, [])
        shared_state = Shared()
        for i in range(self.cfg.num_layers):
            rows = slice(floor, None) if keep is not None and i == start and mode == "compact" \
                else None
            layer_floor = floor if keep is not None and i >= start else 0
            streams, pre, shared_state, _ = self.layer(i, streams, pre, positions, shared_state,
                                                       floor=layer_floor, rows=rows, grams=grams)
            if rows is not None:
                positions = positions[rows]
                grams = None if grams is None else grams[rows]
        return streams, pre

    @torch.no_grad()
    def final_streams(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [S] -> the last layer's streams [S, n, D] and its MoE's `pre` [S, n] (what
        `head` collapses; the streams are what kvmesh's MTP module reads), nothing cut."""
        return self._stack(ids)


def _sub(w: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}
