"""Decode rows of several sequences through one DeepSeek V4 attention sub-block in one batch.

`attention.attention` runs one sequence's rows against that sequence's keys, so a step of
B decoding sequences made B sets of projections, softmaxes and output products per layer.
Here the rows' projections, their attention and the output run once for all B (as for
V4.1, v41_decode.py): each row's keys (its window rows, then its compressed entries) are
padded to the longest and masked, so padding takes no probability and a real row computes
what it computes alone. What stays per sequence is the compressors (one token joining its
open window) and the indexer's choice among that sequence's entries.
"""

from __future__ import annotations

import torch

from kvmesh.services.engine.model.deepseek_v4 import compressor
from kvmesh.services.engine.model.deepseek_v4.attention import (
    AttentionParts,
    _sub,
    attend_rows,
    grouped_output,
    pad_rows,
    project,
)
from kvmesh.services.engine.model.deepseek_v4.config import CSA, HCA, V4Config
from kvmesh.services.engine.model.deepseek_v4.numerics import apply_rope


def decode_rows(cfg: V4Config, layer: int, w: dict, x: torch.Tensor, positions: torch.Tensor,
                tables, priors: list[AttentionParts], stored: bool, rows: str
                ) -> list[AttentionParts]:
    """B sequences' single next rows (x [B, D] normed, positions [B]) after each one's
    `prior`: what `attention.attention` returns for each, one row each."""
    kind = cfg.layer_kinds[layer]
    b = x.shape[0]
    q_res, q, kv, cos, sin = project(cfg, layer, w, x, positions, tables, stored, rows)
    windows = [torch.cat([prior.window_kv, kv[k:k + 1]]) for k, prior in enumerate(priors)]
    lengths = torch.tensor([k.shape[0] for k in windows], device=x.device)
    slot = torch.arange(int(lengths.max()), device=x.device).view(1, -1)
    key_pos = positions.view(-1, 1) - (lengths.view(-1, 1) - 1) + slot
    allowed = (slot < lengths.view(-1, 1)) & (positions.view(-1, 1) - key_pos < cfg.window)
    keys = pad_rows(windows, int(lengths.max()))
    pooled: list = [None] * b
    index_pooled: list = [None] * b
    chosen: list = [None] * b
    if kind in (CSA, HCA):
        rate = cfg.rate(layer)
        at = lambda p: tables.at(cfg.compress_rope, p)  # noqa: E731
        index_w = _sub(w, "indexer.")
        for k, prior in enumerate(priors):
            xk, pk = x[k:k + 1], positions[k:k + 1]
            pooled[k] = compressor.pool(xk, _sub(w, "compressor."), rate, kind == CSA, at,
                                        cfg.rms_eps, prior.pooled, stored)
            if kind == CSA:
                index_pooled[k] = compressor.pool(xk, _sub(index_w, "compressor."), rate, True,
                                                  at, cfg.rms_eps, prior.index_pooled, stored)
                chosen[k] = compressor.index_select(xk, q_res[k:k + 1], index_pooled[k].entries,
                                                    index_w, pk, rate, cfg.index_topk, at)
            else:
                chosen[k] = compressor.visible(pk, pooled[k].entries.shape[0], rate)
        t = max(p.entries.shape[0] for p in pooled)
        picked = torch.zeros(b, t, dtype=torch.bool, device=x.device)
        for k, c in enumerate(chosen):
            picked[k, :c.shape[1]] = c[0]
        keys = torch.cat([keys, pad_rows([p.entries for p in pooled], t)], dim=1)
        allowed = torch.cat([allowed, picked], dim=1)
    o = attend_rows(q, keys, allowed, w["attn_sink"], cfg.head_dim ** -0.5)
    out = grouped_output(apply_rope(o, cos, -sin), w["wo_a.weight"], w["wo_b.weight"],
                         cfg.o_groups)
    return [AttentionParts(out[k:k + 1], windows[k], pooled[k], index_pooled[k], chosen[k])
            for k in range(b)]
