"""Decode rows of several sequences through one V4.1 attention sub-block in one batch.

`attend_span` (v41_forward.py) runs one sequence's rows against that sequence's keys, so a
step of 32 decoding sequences makes 32 sets of small tensor calls per layer, and the step's
time grows with the batch nearly as if the sequences ran one after another. A decode row is
one query against its own window rows and compressed entries: here every row's keys are
padded to the longest and the rows attend, score and choose together:

    keys  [B, K + T, d]   the row's window (K: the longest window) then its source's entries
    allowed [B, K + T]    window visibility, the floor, and the indexer's choice; padding False

Padding never changes a real row's result: padded window keys and entries are masked out of
the softmax, padded entries score -inf in both levels of the top-k (`candidate_blocks`,
`select` keep only values above -inf) and sort after every real one. What stays per sequence
is the KV source's compressor (one token's projections joining its open group) and the
ledgers' reads and writes.
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
    norm,
    wide,
)
from kvmesh.services.engine.model.deepseek_v4.v41_index import (
    candidate_blocks,
    select,
)


def decode_rows(cfg: V41Config, layer: int, w: dict, x: torch.Tensor, positions: torch.Tensor,
                tables: RopeTables, shareds: list[Shared], p: Projected,
                priors: list[LayerState], floors: list[int]
                ) -> tuple[torch.Tensor, list[tuple[Shared, LayerState]]]:
    """B sequences' single next rows (x [B, D], positions [B], p their `project`) against
    each one's prior state: o [B, H, d] and per row what `attend_span` returns besides it."""
    windows = [torch.cat([prior.window, p.kv[b:b + 1]]) for b, prior in enumerate(priors)]
    lengths = torch.tensor([k.shape[0] for k in windows], device=x.device)
    width = int(lengths.max())
    slot = torch.arange(width, device=x.device).view(1, -1)
    # key j of row b sits at position pos_b - (len_b - 1) + j; the window holds pos_b - W < j_pos
    key_pos = positions.view(-1, 1) - (lengths.view(-1, 1) - 1) + slot
    allowed = (slot < lengths.view(-1, 1)) & (positions.view(-1, 1) - key_pos < cfg.window) \
        & (key_pos >= torch.tensor(floors, device=x.device).view(-1, 1))
    keys = pad_rows(windows, width)
    states = [LayerState(k, None) for k in windows]
    results = [(shared, state) for shared, state in zip(shareds, states, strict=True)]
    if cfg.ratio(layer):
        if layer in cfg.kv_sources:
            sources = compress_rows(cfg, layer, w, x, tables, [p.source for p in priors])
            states = [LayerState(k, own) for k, own in zip(windows, sources, strict=True)]
        else:
            sources = [shared.source for shared in shareds]
        counts = torch.tensor([s.entries.shape[0] for s in sources], device=x.device)
        t = int(counts.max())
        slot = torch.arange(t, device=x.device).view(1, -1)
        if layer in cfg.index_sources:
            # the entries each row sees: written (slot < count) and closed before it
            seen = (slot < counts.view(-1, 1)) & (slot < ((positions + 1) // cfg.ratio(layer)).view(-1, 1))
            q, head_weights = p.index
            index_keys = pad_rows([s.keys for s in sources], t).to(q.dtype)
            scores = (F.relu(torch.matmul(q, index_keys.transpose(1, 2)))
                      * head_weights.unsqueeze(-1)).sum(dim=1)                     # [B, T]
            if layer == cfg.candidate_source:
                candidates = candidate_blocks(scores, seen, cfg.candidate_topk_blocks,
                                              cfg.candidate_block_size)
            else:
                candidates = _chosen([s.candidates for s in shareds], t)
            limit = seen & candidates if cfg.uses_candidates(layer) else seen
            chosen = select(scores, limit, cfg.index_topk)
            shareds = [Shared(src, chosen[b:b + 1, :counts[b]],
                              None if candidates is None else candidates[b:b + 1, :counts[b]])
                       for b, src in enumerate(sources)]
        else:
            chosen = _chosen([s.chosen for s in shareds], t)
            shareds = [s._replace(source=src) for s, src in zip(shareds, sources, strict=True)]
        keys = torch.cat([keys, pad_rows([s.entries for s in sources], t)], dim=1)
        allowed = torch.cat([allowed, chosen], dim=1)
        results = list(zip(shareds, states, strict=True))
    o = attend_rows(p.q, keys, allowed, w["attn_sink"], cfg.head_dim ** -0.5)
    return o, results


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


def _chosen(masks: list[torch.Tensor | None], width: int) -> torch.Tensor | None:
    """Rows' [1, T_b] selections from an earlier layer -> [B, width] (padding unchosen)."""
    if masks[0] is None:
        return None
    out = torch.zeros(len(masks), width, dtype=torch.bool, device=masks[0].device)
    for b, m in enumerate(masks):
        out[b, :m.shape[1]] = m[0]
    return out
