"""DeepSeek V4 attention over a whole sequence: window rows plus compressed entries, one softmax.

    x ─ wq_a ─ q_norm ─┬─ wq_b ─ per-head unit norm ─ RoPE ─ q [S, H, d]
                       └─ (q_res: the indexer's query input)
    x ─ wkv ─ kv_norm ─ RoPE ─ kv [S, d]     one head, used as key and value
    keys = window rows (i - W < j <= i)  +  compressed entries (HCA: all visible; CSA: the
           indexer's picks among the visible), then a per-head sink logit joins the softmax
    out ─ inverse RoPE at the query position ─ grouped wo_a (block diagonal) ─ wo_b

The parts a cache keeps are returned beside the output (`AttentionParts`): the rotated window
rows and, for compressed layers, the pooled state of the compressor and the indexer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4 import compressor, window_rows
from kvmesh.services.engine.model.deepseek_v4.config import CSA, HCA, V4Config
from kvmesh.services.engine.model.deepseek_v4.numerics import apply_rope, rms_norm, unit_rms_norm


class AttentionParts(NamedTuple):
    out: torch.Tensor                       # [S, D]
    window_kv: torch.Tensor                 # [S, d] rotated K = V rows
    pooled: compressor.Pooled | None        # the layer's compressor (CSA / HCA)
    index_pooled: compressor.Pooled | None  # the indexer's compressor (CSA)
    chosen: torch.Tensor | None             # [S, T] bool: compressed entries each query saw


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[S, K] bool: key j is in query i's window iff i - W < j <= i."""
    delta = q_pos.view(-1, 1) - k_pos.view(1, -1)
    return (delta >= 0) & (delta < window)


def attend(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q [S, H, d], keys [K, d] (also the values), allowed [S, K] -> [S, H, d].

    The sink is an extra logit per head that takes probability mass and adds no value."""
    logits = torch.matmul(q.transpose(0, 1), keys.transpose(0, 1)) * scale      # [H, S, K]
    logits = logits.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(logits.dtype).view(-1, 1, 1).expand(-1, logits.shape[1], 1)
    logits = torch.cat([logits, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(keys.dtype), keys).transpose(0, 1)               # [S, H, d]


def attend_rows(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
                scale: float) -> torch.Tensor:
    """`attention.attend` with one query row per batch entry: q [B, H, d], keys [B, K, d]
    (also the values), allowed [B, K] -> [B, H, d]."""
    logits = torch.matmul(q, keys.transpose(1, 2)) * scale                       # [B, H, K]
    logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    sink = sinks.to(logits.dtype).view(1, -1, 1).expand(logits.shape[0], -1, 1)
    logits = torch.cat([logits, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(keys.dtype), keys)


def pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """[n_b, ...] tensors -> [B, width, ...], zeros after each one's rows."""
    out = rows[0].new_zeros((len(rows), width, *rows[0].shape[1:]))
    for b, r in enumerate(rows):
        out[b, :r.shape[0]] = r
    return out


def grouped_output(o: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor, groups: int) -> torch.Tensor:
    """o [S, H, d] -> [S, D]: heads split into `groups`, each projected by its own block of wo_a."""
    s = o.shape[0]
    per_group = o.reshape(s, groups, -1).transpose(0, 1)                        # [g, S, H d / g]
    blocks = wo_a.view(groups, -1, per_group.shape[-1]).transpose(1, 2)         # [g, H d / g, R]
    mid = torch.bmm(per_group, blocks).transpose(0, 1).reshape(s, -1)           # [S, g R]
    return F.linear(mid, wo_b)


def project(cfg: V4Config, layer: int, w: dict, x: torch.Tensor, positions: torch.Tensor,
            tables, stored: bool, rows: str):
    """What attention computes of each row alone (any rows, of any sequences): the indexer's
    query input q_res, the rotated queries [S, H, d] and K = V rows [S, d] (in the ring's
    rounding when `stored`), and the layer's RoPE (cos, sin) at the rows' positions."""
    cos, sin = tables.at(cfg.rope(layer), positions)
    s = x.shape[0]
    q_res = rms_norm(F.linear(x, w["wq_a.weight"]), w["q_norm.weight"], cfg.rms_eps)
    q = unit_rms_norm(F.linear(q_res, w["wq_b.weight"]).view(s, cfg.num_heads, cfg.head_dim),
                      cfg.rms_eps)
    q = apply_rope(q, cos, sin)
    kv = apply_rope(rms_norm(F.linear(x, w["wkv.weight"]), w["norm.weight"], cfg.rms_eps), cos, sin)
    if stored:
        kv = window_rows.round_like_stored(rows, kv)
    return q_res, q, kv, cos, sin


def attention(cfg: V4Config, layer: int, w: dict, x: torch.Tensor, positions: torch.Tensor,
              tables, prior: AttentionParts | None = None, stored: bool = False,
              given: int = 0, rows: str = "mxfp8") -> AttentionParts:
    """One attention sub-block over consecutive tokens at `positions`.

    w: the layer's weights under `attn.`; tables: the model's RoPE tables (`RopeTables`).
    prior: what this layer kept of the earlier tokens (None: the sequence starts here):
    `window_kv` holds at least the last W - 1 of their rows, `pooled` / `index_pooled` the
    compressors' state. The result's `window_kv` is those rows followed by this call's.
    stored: round what the engine's ledgers keep as they keep it: window rows in the ring's
    format `rows` (window_rows.py), compressor projections and entries to fp32
    (`compressor.pool`).
    given: bounded replay; the first `given` rows' compressed entries are the prior's
    (`compressor.pool`).
    """
    kind = cfg.layer_kinds[layer]
    q_res, q, kv, cos, sin = project(cfg, layer, w, x, positions, tables, stored, rows)
    if prior is not None:
        kv = torch.cat([prior.window_kv, kv])
    end = int(positions[-1]) + 1
    key_pos = torch.arange(end - kv.shape[0], end, device=kv.device)
    keys, allowed = kv, window_visible(positions, key_pos, cfg.window)
    pooled = index_pooled = chosen = None
    if kind in (CSA, HCA):
        rate = cfg.rate(layer)
        at = lambda p: tables.at(cfg.compress_rope, p)  # noqa: E731
        pooled = compressor.pool(x, _sub(w, "compressor."), rate, kind == CSA, at, cfg.rms_eps,
                                 prior.pooled if prior else None, stored, given)
        entries = pooled.entries
        if kind == CSA:
            index_w = _sub(w, "indexer.")
            index_pooled = compressor.pool(x, _sub(index_w, "compressor."), rate, True, at,
                                           cfg.rms_eps, prior.index_pooled if prior else None,
                                           stored, given)
            chosen = compressor.index_select(x, q_res, index_pooled.entries, index_w, positions,
                                             rate, cfg.index_topk, at)
        else:
            chosen = compressor.visible(positions, entries.shape[0], rate)
        keys = torch.cat([kv, entries], dim=0)
        allowed = torch.cat([allowed, chosen], dim=1)

    o = attend(q, keys, allowed, w["attn_sink"], cfg.head_dim ** -0.5)
    o = apply_rope(o, cos, -sin)
    out = grouped_output(o, w["wo_a.weight"], w["wo_b.weight"], cfg.o_groups)
    return AttentionParts(out, kv, pooled, index_pooled, chosen)


def _sub(w: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}
