"""DeepSeek V4's multi-token prediction module (`mtp.N.*`), the drafter of `--speculative
mtp:K`.

Row p of the module takes the trunk's last residual streams at p (before `hc_head`
collapses them) and the embedding of token p + 1, and predicts token p + 2:

    e  = enorm(embed[token p + 1])           (a zero vector at position 0)
    x  = h_proj(hnorm(streams_p)) + e_proj(e)          per stream: [n, D]
    x' = block(x)                            one decoder block: attention of the kind the
                                             config's last compress ratio names (sliding on
                                             V4-Flash) over the module's own window of rows,
                                             routed MoE, hyper-connections
    logits = head(norm(hc_head'(x')))        the module's own stream collapse and norm, the
                                             model's head

A draft chain feeds x' back as the next row's streams, with the draft as its token. The
block is built as layer 0 of a one-layer V4Model, so it runs the same attention, MoE and
hyper-connection code as the trunk (and rounds its window rows as the trunk's rings do).
Only a sliding-window block is served: its state is its last W - 1 rows, nothing else.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4 import hyper
from kvmesh.services.engine.model.deepseek_v4.attention import AttentionParts
from kvmesh.services.engine.model.deepseek_v4.config import MOE, SLIDING
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
from kvmesh.services.engine.model.deepseek_v4.numerics import rms_norm

OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
       "hc_head_fn", "hc_head_base", "hc_head_scale")


def has_mtp(weights: dict) -> bool:
    return any(name.startswith("mtp.") for name in weights)


class MtpModule:
    def __init__(self, model: V4Model, index: int = 0):
        # the whole model's config: a split rank holds the MTP block whole and runs it whole
        # (parallel.py); only the head is its share, gathered by model.vocab_logits
        cfg, prefix = model.whole, f"mtp.{index}."
        if not any(k.startswith(prefix) for k in model.weights):
            raise ValueError(f"the checkpoint has no {prefix}* tensors (no MTP module)")
        if cfg.mtp_kind != SLIDING:
            raise ValueError(f"MTP drafting with a {cfg.mtp_kind} block is not served (only a "
                             "sliding-window one, as V4-Flash's)")
        self.cfg = replace(cfg, layer_kinds=(SLIDING,), mlp_kinds=(MOE,))
        own = {k[len(prefix):]: v for k, v in model.weights.items() if k.startswith(prefix)}
        self.w = {k: own[k] for k in OWN}
        block = {f"layers.0.{k}": v for k, v in own.items() if k not in OWN}
        self.block = V4Model(self.cfg, block, model.dtype, model.stored, model.rows)
        self.embed_w, self.vocab_logits = model.weights["embed.weight"], model.vocab_logits
        self.dtype = model.dtype

    def rows(self, positions: torch.Tensor, next_ids: torch.Tensor, streams: torch.Tensor,
             prior: AttentionParts | None = None) -> tuple[torch.Tensor, AttentionParts]:
        """Rows at consecutive `positions`: streams [S, n, D] (the trunk's, or a previous
        row's output), next_ids [S] (token p + 1 of each). prior: the window rows before
        them (`AttentionParts.window_kv`, at least the last W - 1). Returns the output
        streams [S, n, D] and the parts whose window_kv continues the window."""
        cfg, w = self.cfg, self.w
        e = F.embedding(next_ids.long(), self.embed_w)
        e = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(e), e)
        e = rms_norm(e, w["enorm.weight"], cfg.rms_eps)
        h = rms_norm(streams, w["hnorm.weight"], cfg.rms_eps)
        x = F.linear(h, w["h_proj.weight"]) + F.linear(e, w["e_proj.weight"]).unsqueeze(1)
        return self.block.layer(0, x, positions, next_ids.long(), prior)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Output streams [S, n, D] -> logits [S, vocab] of the token after the next."""
        cfg, w = self.cfg, self.w
        h = hyper.head_collapse(streams, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"],
                                cfg.hc_eps, cfg.rms_eps)
        return self.vocab_logits(rms_norm(h, w["norm.weight"], cfg.rms_eps))
