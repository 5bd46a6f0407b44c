"""DeepSeek V4's MoE block: routed experts as grouped products, plus one shared expert.

Routing: scores s = sqrtsoftplus(gate(x)) (or sigmoid). `moe` layers pick the top k of
s + bias (the bias only chooses); `hash_moe` layers take the experts fixed per token id
(`tid2eid`). The chosen scores, normalized and times `routed_scale`, weight the experts.
V4.1 (`route_v41`, `moe_v41`) divides the gate's logits by a temperature and has no hash layers.
Experts are SwiGLU with the gate clamped from above and the up projection clamped both ways.

Tokens are sorted by expert and each product is one grouped call over all experts' rows
(kernels/moe.py: a Triton kernel on CUDA, one product per expert with rows elsewhere); a
token's expert outputs are added in ascending expert order, as the reference adds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.kernels.moe import grouped_linear
from kvmesh.services.engine.model.deepseek_v4.config import HASH, V4Config
from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config


def route(cfg: V4Config, kind: str, w: dict, x: torch.Tensor, ids: torch.Tensor):
    """x [N, D], ids [N] -> (experts [N, k] int64, weights [N, k])."""
    logits = F.linear(x, w["gate.weight"])
    scores = F.softplus(logits).sqrt() if cfg.scoring_func == "sqrtsoftplus" else logits.sigmoid()
    if kind == HASH:
        experts = w["gate.tid2eid"][ids].long()
    else:
        biased = scores + w["gate.bias"]
        experts = torch.topk(biased, cfg.experts_per_token, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * cfg.routed_scale


def swiglu(h: torch.Tensor, limit: float) -> torch.Tensor:
    """h = [gate | up] along the last dim."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def routed(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
           w2: torch.Tensor, limit: float) -> torch.Tensor:
    """sum_e weight_e * expert_e(x) per token. w13 [E, 2I, D] (gate rows, then up), w2 [E, D, I]."""
    tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(experts.shape[1])
    return routed_pairs(x, tokens, experts.reshape(-1), weights.reshape(-1), w13, w2, limit)


def routed_pairs(x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
                 weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 limit: float) -> torch.Tensor:
    """`routed` for some (token, expert, weight) pairs, flat [P] each, in token order; experts
    index w13 / w2 (a rank of an expert-parallel engine passes the pairs of its own experts)."""
    order = torch.argsort(experts, stable=True)        # the pairs grouped by expert
    offsets = [0, *torch.bincount(experts, minlength=w13.shape[0]).cumsum(0).tolist()]
    tokens = tokens[order]
    hidden = swiglu(grouped_linear(x[tokens], offsets, w13), limit)
    y = grouped_linear(hidden, offsets, w2) * weights[order].unsqueeze(-1)
    # rows are in expert order, so each token's outputs are added in ascending expert order
    return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


def shared(x: torch.Tensor, w: dict, limit: float) -> torch.Tensor:
    gate = F.linear(x, w["shared_experts.w1.weight"]).clamp(max=limit)
    up = F.linear(x, w["shared_experts.w3.weight"]).clamp(min=-limit, max=limit)
    return F.linear(F.silu(gate) * up, w["shared_experts.w2.weight"])


def moe(cfg: V4Config, layer: int, w: dict, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One MoE sub-block. w: the layer's weights under `ffn.`; x [N, D]; ids [N]."""
    experts, weights = route(cfg, cfg.mlp_kinds[layer], w, x, ids)
    out = routed(x, experts, weights, w["experts.w13"], w["experts.w2"], cfg.swiglu_limit)
    return out + shared(x, w, cfg.swiglu_limit)


def route_v41(cfg: V41Config, w: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V4.1's routing (scores over a gate temperature, no hash layers): x [S, D] -> each
    token's experts [S, k] (chosen by score + gate.bias) and their
    weights [S, k] (from the scores alone); w: the layer's weights under `ffn.`."""
    logits = F.linear(x, w["gate.weight"]) / cfg.gate_temp
    scores = F.softplus(logits).sqrt() if cfg.scoring_func == "sqrtsoftplus" else logits.sigmoid()
    experts = torch.topk(scores + w["gate.bias"], cfg.experts_per_token, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    return experts, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * cfg.routed_scale


def moe_v41(cfg: V41Config, w: dict, x: torch.Tensor, experts: torch.Tensor | None = None,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """V4.1's MoE sub-block; w: the layer's weights under `ffn.`. experts, weights: `route_v41`'s
    choice when the caller already made it (training counts the experts' loads)."""
    if experts is None:
        experts, weights = route_v41(cfg, w, x)
    out = routed(x, experts, weights, w["experts.w13"], w["experts.w2"], cfg.swiglu_limit)
    return out + shared(x, w, cfg.swiglu_limit)
