"""An independent truncated-window reference for DeepSeek V4's bounded replay.

Written from the rule (docs/design.md §6), not from `ledgers.replay`: an exact pass over the
prefix gives the cached entries; a second pass over [hit - 128, L) with explicit masks sees
window keys only from its own rows and compressed keys = the exact entries before `hit`,
then entries pooled from its own rows (the first CSA entry after `hit` pools the A series
of the window before it, recomputed here by pooling from hit - m and dropping the entry
that pooling recomputes). Only the layer pieces pinned against transformers are shared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.kernels import mxfp8
from kvmesh.services.engine.model.deepseek_v4 import compressor, hyper
from kvmesh.services.engine.model.deepseek_v4.attention import (
    attend,
    grouped_output,
    window_visible,
)
from kvmesh.services.engine.model.deepseek_v4.cached import SequenceCache, extend
from kvmesh.services.engine.model.deepseek_v4.config import CSA, SLIDING
from kvmesh.services.engine.model.deepseek_v4.moe import moe
from kvmesh.services.engine.model.deepseek_v4.numerics import apply_rope, rms_norm, unit_rms_norm


def truncated_window_logits(m, prompt: list[int], hit: int) -> torch.Tensor:
    """Logits of rows [hit - 128, len(prompt)) (a model built with stored=True)."""
    exact = SequenceCache()
    extend(m, exact, prompt[:hit])
    start = hit - 128
    ids = torch.tensor(prompt[start:])
    pos = torch.arange(start, len(prompt))
    streams = m.embed(ids)
    for i in range(m.cfg.num_layers):
        w = m.layers[i]
        pre, post, comb = m._mix(streams, w, "hc_attn")
        x = rms_norm(hyper.collapse(streams, pre), w["attn_norm.weight"], m.cfg.rms_eps)
        streams = hyper.expand(streams, _attention(m, i, x, pos, exact.layers[i], hit), post, comb)
        pre, post, comb = m._mix(streams, w, "hc_ffn")
        x = rms_norm(hyper.collapse(streams, pre), w["ffn_norm.weight"], m.cfg.rms_eps)
        streams = hyper.expand(streams, moe(m.cfg, i, m.ffn[i], x, ids), post, comb)
    return m.head(streams)


def _attention(m, i, x, pos, exact, hit):
    cfg, a = m.cfg, m.attn[i]
    kind, eps = cfg.layer_kinds[i], cfg.rms_eps
    cos, sin = m.tables.at(cfg.rope(i), pos)
    q_res = rms_norm(F.linear(x, a["wq_a.weight"]), a["q_norm.weight"], eps)
    q = F.linear(q_res, a["wq_b.weight"]).view(x.shape[0], cfg.num_heads, cfg.head_dim)
    q = apply_rope(unit_rms_norm(q, eps), cos, sin)
    kv = mxfp8.fake_quantize(apply_rope(rms_norm(F.linear(x, a["wkv.weight"]), a["norm.weight"],
                                                 eps), cos, sin))
    keys, allowed = kv, window_visible(pos, pos, cfg.window)       # only this pass's rows
    if kind != SLIDING:
        rate = cfg.rate(i)
        at = lambda p: m.tables.at(cfg.compress_rope, p)  # noqa: E731
        entries = _entries(x, a, "compressor.", exact.pooled, kind == CSA, rate, hit, pos, at, eps)
        if kind == CSA:
            index_w = {k[len("indexer."):]: v for k, v in a.items() if k.startswith("indexer.")}
            index_keys = _entries(x, a, "indexer.compressor.", exact.index_pooled, True, rate,
                                  hit, pos, at, eps)
            chosen = compressor.index_select(x, q_res, index_keys, index_w, pos, rate,
                                             cfg.index_topk, at)
        else:
            chosen = compressor.visible(pos, entries.shape[0], rate)
        keys = torch.cat([kv, entries])
        allowed = torch.cat([allowed, chosen], dim=1)
    o = apply_rope(attend(q, keys, allowed, a["attn_sink"], cfg.head_dim ** -0.5), cos, -sin)
    return grouped_output(o, a["wo_a.weight"], a["wo_b.weight"], cfg.o_groups)


def _entries(x, a, prefix, exact_pooled, overlapping, rate, hit, pos, at, eps):
    """The exact entries before `hit`, then those pooled from this pass's rows."""
    w = {k[len(prefix):]: v for k, v in a.items() if k.startswith(prefix)}
    cached = exact_pooled.entries[: hit // rate]
    first = hit - rate if overlapping else hit          # CSA re-pools the window before hit
    empty = x.new_zeros(0, w["wkv.weight"].shape[0])
    prior = compressor.Pooled(cached[: first // rate], empty, empty, None, None)
    pooled = compressor.pool(x[first - int(pos[0]):], w, rate, overlapping, at, eps, prior,
                             stored=True)
    return torch.cat([cached, pooled.entries[hit // rate:]])
