"""Short spans of several sequences through one V4.1 attention sub-block in one batch: decode
rows, and verify spans (a token and its drafts).

`attend_span` (v41_forward.py) runs one sequence's rows against that sequence's keys, so a
step of 32 decoding sequences makes 32 sets of small tensor calls per layer, and the step's
time grows with the batch nearly as if the sequences ran one after another. A row after a
prior is one query against its sequence's window rows (the prior's and its span's earlier
rows) and compressed entries: here the keys of each sequence are padded to the longest, every
row takes its sequence's, and the rows attend, score and choose together:

    keys  [R, K + T, d]   the row's sequence's window (K: the longest) then its entries
    allowed [R, K + T]    causality within the span, window visibility, the floor, and the
                          indexer's choice (its entries closed before the row); padding False

Padding never changes a real row's result: padded window keys and entries are masked out of
the softmax, padded entries score -inf in both levels of the top-k (`candidate_blocks`,
`select` keep only values above -inf) and sort after every real one. What stays per sequence
is a verify span's compressor run (decode rows' compressors run together) and nothing else:
the ledgers read and write these spans' rings together too (v41_ledgers.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4.attention import attend_rows, pad_rows
from kvmesh.services.engine.model.deepseek_v4.v41_forward import (
    LayerState,
    Projected,
    RopeTables,
    Shared,
    SourceState,
    V41Config,
    _sub,
    apply_rope,
    compress,
    norm,
    wide,
)
from kvmesh.services.engine.model.deepseek_v4.v41_index import (
    candidate_blocks,
    select,
)


def decode_rows(cfg: V41Config, layer: int, w: dict, x: torch.Tensor, positions: torch.Tensor,
                tables: RopeTables, shareds: list[Shared], p: Projected,
                priors: list[LayerState], floors: list[int], lengths: list[int] | None = None,
                ) -> tuple[torch.Tensor, list[tuple[Shared, LayerState]]]:
    """B sequences' next rows against each one's prior state: sequence b's `lengths[b]`
    consecutive rows (1 each by default: decode rows; more: a verify span, its draft rows),
    in order in x [R, D], positions [R] and p (their `project`). Returns o [R, H, d] and per
    sequence what `attend_span` returns besides it."""
    lengths = lengths or [1] * len(priors)
    dev = x.device
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=dev),
                                    torch.tensor(lengths, device=dev))              # [R]
    starts = torch.tensor([0] + lengths[:-1], device=dev).cumsum(0)
    offsets = starts.tolist()                                  # each sequence's first row
    windows, at = [], 0
    for prior, n in zip(priors, lengths, strict=True):
        windows.append(torch.cat([prior.window, p.kv[at:at + n]]))
        at += n
    sizes = torch.tensor([k.shape[0] for k in windows], device=dev)
    width = int(sizes.max())
    slot = torch.arange(width, device=dev).view(1, -1)
    # key j of sequence b sits at position first_b - (size_b - n_b) + j, first_b its first row's
    first = positions[starts]
    key_pos = (first - (sizes - torch.tensor(lengths, device=dev))).view(-1, 1) + slot   # [B, K]
    pos = positions.view(-1, 1)
    allowed = (slot < sizes.view(-1, 1))[owner] & (key_pos[owner] <= pos) \
        & (pos - key_pos[owner] < cfg.window) \
        & (key_pos[owner] >= torch.tensor(floors, device=dev)[owner].view(-1, 1))
    keys = pad_rows(windows, width)[owner]                                             # [R, K, d]
    states = [LayerState(k, None) for k in windows]
    results = [(shared, state) for shared, state in zip(shareds, states, strict=True)]
    if cfg.ratio(layer):
        if layer in cfg.kv_sources:
            sources = _compress(cfg, layer, w, x, tables, priors, lengths, offsets, first)
            states = [LayerState(k, own) for k, own in zip(windows, sources, strict=True)]
        else:
            sources = [shared.source for shared in shareds]
        counts = torch.tensor([s.entries.shape[0] for s in sources], device=dev)
        t = int(counts.max())
        slot = torch.arange(t, device=dev).view(1, -1)
        if layer in cfg.index_sources:
            # the entries each row sees: written (slot < count) and closed before it
            seen = (slot < counts[owner].view(-1, 1)) & (slot < ((positions + 1) // cfg.ratio(layer)).view(-1, 1))
            q, head_weights = p.index
            index_keys = pad_rows([s.keys for s in sources], t).to(q.dtype)[owner]
            scores = (F.relu(torch.matmul(q, index_keys.transpose(1, 2)))
                      * head_weights.unsqueeze(-1)).sum(dim=1)                     # [R, T]
            if layer == cfg.candidate_source:
                candidates = candidate_blocks(scores, seen, cfg.candidate_topk_blocks,
                                              cfg.candidate_block_size)
            else:
                candidates = _chosen([s.candidates for s in shareds], t, lengths)
            limit = seen & candidates if cfg.uses_candidates(layer) else seen
            chosen = select(scores, limit, cfg.index_topk)
            shareds = [Shared(src, chosen[a:a + n, :c],
                              None if candidates is None else candidates[a:a + n, :c])
                       for src, a, n, c in zip(sources, offsets, lengths, counts.tolist(),
                                               strict=True)]
        else:
            chosen = _chosen([s.chosen for s in shareds], t, lengths)
            shareds = [s._replace(source=src) for s, src in zip(shareds, sources, strict=True)]
        keys = torch.cat([keys, pad_rows([s.entries for s in sources], t)[owner]], dim=1)
        allowed = torch.cat([allowed, chosen], dim=1)
        results = list(zip(shareds, states, strict=True))
    o = attend_rows(p.q, keys, allowed, w["attn_sink"], cfg.head_dim ** -0.5)
    return o, results


def _compress(cfg: V41Config, layer: int, w: dict, x: torch.Tensor, tables: RopeTables,
              priors: list[LayerState], lengths: list[int], starts: list[int],
              first: torch.Tensor) -> list[SourceState]:
    """KV source `layer`'s state after each sequence's rows: decode rows together
    (`compress_rows`), a verify span's rows by `compress`."""
    ones = [b for b, n in enumerate(lengths) if n == 1]
    out: dict[int, SourceState] = {}
    if ones:
        rows = torch.tensor([starts[b] for b in ones], device=x.device)
        for b, src in zip(ones, compress_rows(cfg, layer, w, x[rows], tables,
                                              [priors[b].source for b in ones]), strict=True):
            out[b] = src
    for b, n in enumerate(lengths):
        if n > 1:
            out[b] = compress(cfg, w, x[starts[b]:starts[b] + n], tables, layer,
                              priors[b].source, int(first[b]))
    return [out[b] for b in range(len(lengths))]


def compress_rows(cfg: V41Config, layer: int, w: dict, x: torch.Tensor, tables: RopeTables,
                  priors: list[SourceState]) -> list[SourceState]:
    """`compress` of KV source `layer` for B sequences' single next rows x [B, D] (priors: each
    one's state before it): the projections of every row at once, then the groups these rows
    close (ratio 1: every row's; ratio m: those completing m open rows) pooled, normed and
    rotated together. w: the layer's weights under `attn.`."""
    m, d = cfg.ratio(layer), cfg.head_dim
    cw, iw = _sub(w, "compressor."), _sub(w, "indexer.")
    none = x.new_zeros((0, d), dtype=wide(x.dtype))
    if m == 1:
        closing = list(range(len(priors)))
        latent = norm(F.linear(x, cw["wkv.weight"]), cw["norm.weight"], cfg.rms_eps)
    else:
        work = wide(x.dtype)                                   # the gate runs in at least fp32
        kv = F.linear(x.to(work), cw["wkv.weight"].to(work))
        gate = F.linear(x.to(work), cw["wgate.weight"].to(work))
        closing = [b for b, prior in enumerate(priors) if prior.open_kv.shape[0] == m - 1]
        if closing:
            group_kv = torch.stack([torch.cat([priors[b].open_kv, kv[b:b + 1]]) for b in closing])
            group_gate = torch.stack([torch.cat([priors[b].open_gate, gate[b:b + 1]])
                                      for b in closing])
            pooled = (group_kv * group_gate.softmax(dim=1)).sum(dim=1)
            latent = norm(pooled.to(x.dtype), cw["norm.weight"], cfg.rms_eps)
    if closing:
        keys = norm(F.linear(latent, iw["wk.weight"]), iw["k_norm.weight"], cfg.rms_eps)
        cos, sin = tables.at(cfg.compress_rope,
                             torch.tensor([priors[b].entries.shape[0] * m for b in closing],
                                          device=x.device))
        entries, keys = apply_rope(latent, cos, sin), apply_rope(keys, cos, sin)
    where = {b: k for k, b in enumerate(closing)}
    out = []
    for b, prior in enumerate(priors):
        new_kv, new_gate = (none, none) if m == 1 else (kv[b:b + 1], gate[b:b + 1])
        if b in where:
            k = where[b]
            out.append(SourceState(layer, torch.cat([prior.entries, entries[k:k + 1]]),
                                   torch.cat([prior.keys, keys[k:k + 1]]), none, none,
                                   new_kv, new_gate))
        else:
            out.append(SourceState(layer, prior.entries, prior.keys,
                                   torch.cat([prior.open_kv, new_kv]),
                                   torch.cat([prior.open_gate, new_gate]), new_kv, new_gate))
    return out


def _chosen(masks: list[torch.Tensor | None], width: int, lengths: list[int],
            ) -> torch.Tensor | None:
    """Each sequence's rows' [n_b, T_b] selections from an earlier layer -> [R, width]
    (padding unchosen)."""
    if masks[0] is None:
        return None
    out = torch.zeros(sum(lengths), width, dtype=torch.bool, device=masks[0].device)
    at = 0
    for m, n in zip(masks, lengths, strict=True):
        out[at:at + n, :m.shape[1]] = m
        at += n
    return out
