"""An independent truncated-window reference for DeepSeek V4.1's encoder-side bounded replay.

Written from the rule (docs/design.md §6), not from `v41_cached.replay_state`: an exact run
over the prefix gives the cached entries and index keys; a second pass over [hit - 128, L)
with explicit masks sees window keys only from its own rows, and compressed keys = the exact
entries before `hit`, then entries compressed from its own rows at `hit` and after. Only the
pieces of v41_forward.py the whole-sequence tests pin are shared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4 import hyper, v41_engram
from kvmesh.services.engine.model.deepseek_v4.attention import (
    attend,
    grouped_output,
    window_visible,
)
from kvmesh.services.engine.model.deepseek_v4.compressor import visible
from kvmesh.services.engine.model.deepseek_v4.moe import moe_v41
from kvmesh.services.engine.model.deepseek_v4.numerics import apply_rope, wide
from kvmesh.services.engine.model.deepseek_v4.v41_cached import SequenceState, extend
from kvmesh.services.engine.model.deepseek_v4.v41_forward import (
    SourceState,
    V41Model,
    compress,
    norm,
)
from kvmesh.services.engine.model.deepseek_v4.v41_index import (
    candidate_blocks,
    index_query,
    index_scores,
    select,
)


def truncated_window_logits(m: V41Model, prompt: list[int], hit: int) -> torch.Tensor:
    """Logits of rows [hit - 128, len(prompt))."""
    cfg = m.cfg
    exact = SequenceState()
    extend(m, exact, prompt[:hit])
    start = hit - 128
    ids = torch.tensor(prompt[start:])
    pos = torch.arange(start, len(prompt))
    streams, pre = m.embed(ids)
    grams = m.grams(ids, prompt[:start])     # the replayed rows' n-grams reach back past it
    source = chosen = candidates = None
    for i in range(cfg.num_layers):
        w, a = m.layers[i], m.attn[i]
        if i in m.engram:
            streams = v41_engram.write(streams, grams[:, cfg.engram.layers.index(i)],
                                       m.engram[i], cfg.rms_eps, wide(m.dtype))
        attn_pre, post, comb = m._mix(streams, w, "hc_attn")
        x = norm(hyper.collapse(streams, pre), w["attn_norm.weight"], cfg.rms_eps)
        cos, sin = m.tables.at(cfg.rope(i), pos)
        q_res = norm(F.linear(x, a["wq_a.weight"]), a["q_norm.weight"], cfg.rms_eps)
        q = apply_rope(F.linear(q_res, a["wq_b.weight"]).view(len(pos), cfg.num_heads, -1), cos, sin)
        kv = apply_rope(norm(F.linear(x, a["wkv.weight"]), a["kv_norm.weight"], cfg.rms_eps),
                        cos, sin)
        keys, allowed = kv, window_visible(pos, pos, cfg.window)      # only this pass's rows
        if cfg.ratio(i):
            r = cfg.ratio(i)
            if i in cfg.kv_sources:
                cached = exact.layers[i].source
                empty = cached.open_kv[:0]
                prior = SourceState(i, cached.entries[:hit // r], cached.keys[:hit // r], empty, empty)
                source = compress(cfg, a, x[hit - start:], m.tables, i, prior, hit)
            if i in cfg.index_sources:
                seen = visible(pos, source.entries.shape[0], r)
                iw = {k[len("indexer."):]: v for k, v in a.items() if k.startswith("indexer.")}
                scores = index_scores(index_query(cfg, iw, x, q_res, pos, m.tables), source.keys)
                if i == cfg.candidate_source:
                    candidates = candidate_blocks(scores, seen, cfg.candidate_topk_blocks,
                                                  cfg.candidate_block_size)
                chosen = select(scores, seen & candidates if cfg.uses_candidates(i) else seen,
                                cfg.index_topk)
            keys = torch.cat([kv, source.entries])
            allowed = torch.cat([allowed, chosen], dim=1)
        o = apply_rope(attend(q, keys, allowed, a["attn_sink"], cfg.head_dim ** -0.5), cos, -sin)
        out = grouped_output(o, a["wo_a.weight"], a["wo_b.weight"], cfg.o_groups)
        streams = hyper.expand(streams, out, post, comb)
        ffn_pre, post, comb = m._mix(streams, w, "hc_ffn")
        x = norm(hyper.collapse(streams, attn_pre), w["ffn_norm.weight"], cfg.rms_eps)
        streams = hyper.expand(streams, moe_v41(cfg, m.ffn[i], x), post, comb)
        pre = ffn_pre
    return m.head(streams, pre)
