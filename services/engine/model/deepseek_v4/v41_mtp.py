"""kvmesh's multi-token prediction module for a DeepSeek V4.1 model (`kvmesh.mtp.0.*`), the
drafter of `--speculative mtp:K` on V4.1.

DeepSeek's V4.1 release drafts with DSpark (its `mtp.*` tensors, not served); this module is
kvmesh's own, so that a V4.1-layout model trained here (`kvmesh train-mtp`) can draft: V4's
MTP design (mtp.py) on one V4.1 layer. A checkpoint says it has one with
`"kvmesh": {"mtp_layers": 1}` in its text config. Row p takes the trunk's last streams at p (before
the head's collapse) and the embedding of token p + 1, and predicts token p + 2:

    e  = enorm(embed[token p + 1])
    x  = h_proj(hnorm(streams_p)) + e_proj(e)          per stream: [n, D]
    x' = block(x)                            one V4.1 layer reading no compressed cache
                                             (its window of the module's own rows) with a
                                             routed MoE; its first collapse takes stream 0,
                                             as the trunk's first layer does
    logits = head(norm(hc_head(x')))         the module's own stream collapse (V4's
                                             `hc_head`) and norm, the model's head

A draft chain feeds x' back as the next row's streams, with the draft as its token. The
block is layer 0 of a one-layer V41Model, so it runs the trunk's attention, MoE and
hyper-connection code and rounds its window rows as the trunk's rings do. Its interface is
mtp.MtpModule's, so core/mtp_draft.py drives either.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4 import hyper
from kvmesh.services.engine.model.deepseek_v4.attention import AttentionParts
from kvmesh.services.engine.model.deepseek_v4.numerics import unit_rms_norm
from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config
from kvmesh.services.engine.model.deepseek_v4.v41_forward import (
    LayerState,
    Shared,
    V41Model,
    norm,
    wide,
)
from kvmesh.services.engine.model.deepseek_v4.v41_names import MTP

OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
       "hc_head_fn", "hc_head_base", "hc_head_scale")


def has_mtp(weights: dict) -> bool:
    return any(name.startswith(MTP) for name in weights)


def block_config(cfg: V41Config) -> V41Config:
    """The module's one layer as a model config: window only (no compressor, no indexer)."""
    return replace(cfg, ratios=(0,), kv_sources=(), index_sources=(), candidate_source=None,
                   mtp_layers=0, engram=None)


class V41MtpModule:
    def __init__(self, model: V41Model):
        cfg = model.whole
        if not has_mtp(model.weights):
            raise ValueError(f"the checkpoint has no {MTP}* tensors (its config's "
                             "kvmesh.mtp_layers is 0)")
        self.cfg = block_config(cfg)
        own = {k[len(MTP):]: v for k, v in model.weights.items() if k.startswith(MTP)}
        self.w = {k: own[k] for k in OWN}
        block = {f"layers.0.{k}": v for k, v in own.items() if k not in OWN}
        self.block = V41Model(self.cfg, block, model.dtype, model.rows)
        self.embed_w, self.vocab_logits = model.weights["embed.weight"], model.vocab_logits
        self.dtype = model.dtype

    def rows(self, positions: torch.Tensor, next_ids: torch.Tensor, streams: torch.Tensor,
             prior: AttentionParts | None = None) -> tuple[torch.Tensor, AttentionParts]:
        """Rows at consecutive `positions`: streams [S, n, D] (the trunk's, or a previous
        row's output), next_ids [S] (token p + 1 of each). prior: the window rows before
        them (`window_kv`, at least the last W - 1). Returns the output streams [S, n, D]
        and parts whose window_kv continues the window (the prior's rows, then these)."""
        cfg, w = self.cfg, self.w
        e = norm(F.embedding(next_ids.long(), self.embed_w), w["enorm.weight"], cfg.rms_eps)
        h = norm(streams, w["hnorm.weight"], cfg.rms_eps)
        x = (F.linear(h, w["h_proj.weight"]) + F.linear(e, w["e_proj.weight"]).unsqueeze(1))
        pre = torch.zeros(x.shape[0], cfg.hc_mult, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0
        state = None if prior is None else LayerState(prior.window_kv)
        y, _, _, kept = self.block.layer(0, x.to(self.dtype), pre, positions, Shared(), state)
        return y, AttentionParts(None, kept.window, None, None, None)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Output streams [S, n, D] -> logits [S, vocab] of the token after the next."""
        cfg, w, work = self.cfg, self.w, wide(self.dtype)
        # V4's hc_head (sigmoid weights, no Sinkhorn), in the V4.1 reduction dtype
        flat = unit_rms_norm(streams.flatten(-2).to(work), cfg.rms_eps, work)
        pre = torch.sigmoid(F.linear(flat, w["hc_head_fn"].to(work)) * w["hc_head_scale"].to(work)
                            + w["hc_head_base"].to(work)) + cfg.hc_eps
        h = hyper.collapse(streams, pre)
        return self.vocab_logits(norm(h, w["norm.weight"], cfg.rms_eps).to(self.dtype))
