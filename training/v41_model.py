"""Training a DeepSeek V4.1 model: the shipped model's shape, its first weights, and the
differentiable forward with the two things training adds to V41Model's.

- The lightning indexer chooses entries by top-k, which passes no gradient, so each index
  source learns from its own loss: the KL divergence from the layer's main attention over
  every visible entry (averaged over heads, detached) to the softmax of its index scores.
  The indexer's inputs are detached too, so this loss trains only the indexer's own weights
  (wq_b, weights_proj, and the KV source's wk and k_norm), not the layers it reads.
- Every layer routes by score plus `gate.bias`; the bias is not trained by gradient but
  nudged after each step towards equal expert loads (`balance`: DeepSeek's auxiliary-loss-
  free balancing), so routing stays spread without a loss term bending the LM loss.

The layer loop is V41Model.layer_spans for one sequence with nothing cut (the tests pin
`forward`'s logits to V41Model.logits); it is written out here because training needs the
attention input of each index source and the experts each MoE chose.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4 import hyper
from kvmesh.services.engine.model.deepseek_v4.compressor import visible
from kvmesh.services.engine.model.deepseek_v4.moe import moe_v41, route_v41
from kvmesh.services.engine.model.deepseek_v4.numerics import apply_rope
from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config
from kvmesh.services.engine.model.deepseek_v4.v41_forward import (
    Shared,
    SourceState,
    V41Model,
    attention,
    norm,
)
from kvmesh.services.engine.model.deepseek_v4.v41_index import (
    index_query,
    index_scores,
)

# The shipped model: the design's window (128), CSA m = 4 and HCA m = 128 (a V4.1 layer's
# ratio is that of the cache it reads), in the V4.1 layout. Layer 0 is window-only; layer 1
# owns the m = 128 cache (few entries: index_topk covers them all, which is HCA's dense
# read); layer 2 owns the m = 4 cache and picks candidate blocks; layer 3 chooses inside
# them; layers 4-5 reuse layer 3's choice. Layers 2-5 are the decoder (consumers of layer
# 2's entries), so truncation and both bounded replays have layers to act on.
SHIPPED_TEXT_CONFIG = dict(
    model_type="deepseek_v41", vocab_size=4096, hidden_size=256, num_hidden_layers=6,
    num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=128, o_groups=2,
    o_lora_rank=64, sliding_window=128, hc_mult=2, compress_ratios=[0, 128, 4, 4, 4, 4],
    kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2, 3], candidate_source_layer_id=2,
    candidate_topk_blocks=8, candidate_block_size=16, index_topk=32, index_n_heads=4,
    index_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
    rms_norm_eps=1e-6, max_position_embeddings=65536, bos_token_id=0, eos_token_id=1,
    engram_layer_ids=[])


def shipped_config(**overrides) -> dict:
    """config.json of the shipped model (overrides go into text_config)."""
    return {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
            "text_config": {**SHIPPED_TEXT_CONFIG, **overrides}}


def initial_weights(cfg: V41Config, seed: int) -> dict[str, torch.Tensor]:
    """float32 weights under the release's names, experts stacked. Linear layers draw
    N(0, 1 / fan_in); the outputs that add into the residual streams (wo_b, the experts' w2)
    are scaled by 1 / sqrt(2 L) more, so the streams start at the embedding's scale however
    deep the model; norms start at 1; sinks, gate biases and the hyper-connection bases at 0
    (each stream then weighs half, and the mixing matrix is uniform)."""
    g = torch.Generator().manual_seed(seed)

    def lin(out: int, fan_in: int, extra: float = 1.0, *lead: int):
        return torch.randn(*lead, out, fan_in, generator=g) * (extra / math.sqrt(fan_in))

    D, V, n, L = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult, cfg.num_layers
    H, d, R = cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    E, inter, damp = cfg.n_experts, cfg.moe_inter, 1.0 / math.sqrt(2 * L)
    ones, zeros = torch.ones, torch.zeros
    mix = (2 + n) * n
    w = {"embed.weight": torch.randn(V, D, generator=g), "norm.weight": ones(D),
         "head.weight": lin(V, D)}
    for i in range(L):
        p, a, f = f"layers.{i}.", f"layers.{i}.attn.", f"layers.{i}.ffn."
        w.update({p + "attn_norm.weight": ones(D), p + "ffn_norm.weight": ones(D)})
        for hc in ("hc_attn", "hc_ffn"):
            w.update({p + f"{hc}_fn": lin(mix, n * D, 0.1), p + f"{hc}_base": zeros(mix),
                      p + f"{hc}_scale": ones(3)})
        w.update({a + "wq_a.weight": lin(R, D), a + "q_norm.weight": ones(R),
                  a + "wq_b.weight": lin(H * d, R), a + "wkv.weight": lin(d, D),
                  a + "kv_norm.weight": ones(d),
                  a + "wo_a.weight": lin(cfg.o_groups * cfg.o_lora_rank, H * d // cfg.o_groups),
                  a + "wo_b.weight": lin(D, cfg.o_groups * cfg.o_lora_rank, damp),
                  a + "attn_sink": zeros(H)})
        if i in cfg.kv_sources:
            c = a + "compressor."
            w.update({c + "wkv.weight": lin(d, D), c + "norm.weight": ones(d)})
            if cfg.ratio(i) > 1:
                w[c + "wgate.weight"] = lin(d, D, 0.1)   # near-uniform pooling to start
        if i in cfg.index_sources:
            x = a + "indexer."
            w.update({x + "wq_b.weight": lin(cfg.index_heads * cfg.index_head_dim, R),
                      x + "weights_proj.weight": lin(cfg.index_heads, D)})
            if i in cfg.kv_sources:
                w.update({x + "wk.weight": lin(cfg.index_head_dim, d),
                          x + "k_norm.weight": ones(cfg.index_head_dim)})
        w.update({f + "gate.weight": lin(E, D), f + "gate.bias": zeros(E),
                  f + "experts.w13": lin(2 * inter, D, 1.0, E),
                  f + "experts.w2": lin(D, inter, damp, E),
                  f + "shared_experts.w1.weight": lin(inter, D),
                  f + "shared_experts.w3.weight": lin(inter, D),
                  f + "shared_experts.w2.weight": lin(D, inter, damp)})
    return w


class Outputs(NamedTuple):
    logits: torch.Tensor        # [S, vocab]
    indexer_kl: torch.Tensor    # mean over index sources of the per-query KL (nats)
    loads: list[torch.Tensor]   # per layer: tokens routed to each expert [E]


def forward(model: V41Model, ids: torch.Tensor) -> Outputs:
    """One sequence ids [S] from position 0, with gradients (model's weights may require
    them)."""
    cfg = model.cfg
    positions = torch.arange(ids.shape[0])
    streams, pre = model.embed(ids)
    shared_state, kls, loads = Shared(), [], []
    for i in range(cfg.num_layers):
        w = model.layers[i]
        attn_pre, post, comb = model._mix(streams, w, "hc_attn")
        x = norm(hyper.collapse(streams, pre), w["attn_norm.weight"], cfg.rms_eps)
        out, shared_state, _ = attention(cfg, i, model.attn[i], x, positions, model.tables,
                                         shared_state)
        if i in cfg.index_sources:
            kls.append(indexer_kl(model, i, x, positions, shared_state.source))
        streams = hyper.expand(streams, out, post, comb)
        pre, post, comb = model._mix(streams, w, "hc_ffn")
        x = norm(hyper.collapse(streams, attn_pre), w["ffn_norm.weight"], cfg.rms_eps)
        experts, weights = route_v41(cfg, model.ffn[i], x)
        loads.append(torch.bincount(experts.reshape(-1), minlength=cfg.n_experts))
        streams = hyper.expand(streams, moe_v41(cfg, model.ffn[i], x, experts, weights), post, comb)
    kl = torch.stack(kls).mean() if kls else model.weights["norm.weight"].new_zeros(())
    return Outputs(model.head(streams, pre), kl, loads)


def indexer_kl(model: V41Model, layer: int, x: torch.Tensor, positions: torch.Tensor,
               source: SourceState) -> torch.Tensor:
    """Index source `layer`'s loss: KL(main attention over the visible entries, mean over
    heads || softmax of the index scores), averaged over the queries that see an entry.
    x: the layer's normed attention input."""
    cfg, w, tables = model.cfg, model.attn[layer], model.tables
    m, s = cfg.ratio(layer), x.shape[0]
    seen = visible(positions, source.entries.shape[0], m)
    rows = seen.any(dim=-1)
    if not bool(rows.any()):
        return x.new_zeros(())
    x, entries = x.detach(), source.entries.detach()
    with torch.no_grad():
        q_res = norm(F.linear(x, w["wq_a.weight"]), w["q_norm.weight"], cfg.rms_eps)
        cos, sin = tables.at(cfg.rope(layer), positions)
        q = apply_rope(F.linear(q_res, w["wq_b.weight"]).view(s, cfg.num_heads, cfg.head_dim),
                       cos, sin)
        logits = torch.einsum("shd,td->hst", q.float(), entries.float()) * cfg.head_dim ** -0.5
        target = logits.masked_fill(~seen, float("-inf")).softmax(dim=-1).mean(dim=0)[rows]
    # the keys again, from the entries before RoPE, so their gradient stops at wk and k_norm
    src = model.attn[source.layer]
    cos_e, sin_e = tables.at(cfg.compress_rope, torch.arange(entries.shape[0]) * m)
    latent = apply_rope(entries, cos_e, -sin_e)
    keys = apply_rope(norm(F.linear(latent, src["indexer.wk.weight"]),
                           src["indexer.k_norm.weight"], cfg.rms_eps), cos_e, sin_e)
    scores = index_scores(index_query(cfg, _indexer(w), x, q_res, positions, tables), keys)[rows]
    logp = scores.masked_fill(~seen[rows], float("-inf")).log_softmax(dim=-1)
    terms = target * (target.clamp_min(1e-30).log() - logp)
    return terms.masked_fill(~seen[rows], 0.0).sum(dim=-1).mean()


@torch.no_grad()
def balance(weights: dict[str, torch.Tensor], cfg: V41Config, loads: list[torch.Tensor],
            rate: float) -> None:
    """Auxiliary-loss-free balancing: each layer's gate.bias moves `rate` towards equal loads
    (up for an expert that took fewer tokens than the mean, down for one that took more)."""
    for i, load in enumerate(loads):
        load = load.float()
        weights[f"layers.{i}.ffn.gate.bias"].add_(torch.sign(load.mean() - load) * rate)


def _indexer(w: dict) -> dict:
    return {k[len("indexer."):]: v for k, v in w.items() if k.startswith("indexer.")}
