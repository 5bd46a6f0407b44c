"""The MTP module (DeepSeek-V3/V4 multi-token prediction): its weights and per-token math.

One extra block that predicts token i+2 from the trunk's last hidden state h_i (pre
final-norm residual) and the embedding of token i+1:

    x_i  = [rms(h_i; mtp.hnorm) ; rms(embed[t_{i+1}]; mtp.enorm)] @ mtp.eh_proj   [2h] -> [h]
    y_i  = one SWA block (attention over the MTP ring: rows of x_{i-W+1..i}, FFN)
    q    = softmax(rms(y_i; mtp.norm) @ lm_head)                                    shared head
Chained for K > 1: draft k+1 is MTP(y of draft k, embed[draft k]) at the next position.

It shares `embed` and `lm_head` with the trunk. Its block has a plain SWA layer's
weights, stored as `mtp.<leaf>`; `block_view` presents them as layer 0 of
`block_config(cfg)` (two SWA layers, so layer 0 is SWA) for the shared layer math
(model/ops.py, train/model.py layer_forward) without copying a tensor.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.engine.config import ModelConfig
from services.engine.model import ops
from services.engine.model import weights as weights_mod

PREFIX = "mtp."
BLOCK_LEAVES = ("attn_norm", "ffn_norm", "wq", "wkv", "kv_norm", "sink", "wo", "w1", "w3", "w2")


shapes = weights_mod.mtp_shapes


def has_mtp(weights) -> bool:
    return any(k.startswith(PREFIX) for k in weights)


def block_config(cfg: ModelConfig) -> ModelConfig:
    """The geometry the block's layer math reads: the model's, with layer 0 an SWA layer."""
    return replace(cfg, name=cfg.name + "-mtp", layers=("swa", "swa"))


def block_view(w) -> dict[str, torch.Tensor]:
    """The block's tensors under the names `ops` looks up for layer 0 (same tensors)."""
    return {f"layers.0.{leaf}": w[PREFIX + leaf] for leaf in BLOCK_LEAVES}


def project(w, cfg: ModelConfig, h, next_tokens):
    """h [..., hidden] trunk (or previous depth) states, next_tokens [...] -> block input."""
    e = w["embed"][next_tokens]
    cat = torch.cat([ops.rms_norm(h, w["mtp.hnorm"], cfg.norm_eps),
                     ops.rms_norm(e, w["mtp.enorm"], cfg.norm_eps)], dim=-1)
    return ops.mm(cat, w["mtp.eh_proj"])


def logits(w, cfg: ModelConfig, y):
    return ops.mm(ops.rms_norm(y, w["mtp.norm"], cfg.norm_eps), w["lm_head"])


def reference_block(w, cfg: ModelConfig, x):
    """The block over a whole sequence, explicit masks, no ring: x [T, hidden] at positions
    0..T-1 -> y [T, hidden] (the oracle MtpRunner is tested against)."""
    from services.engine.model import reference

    out = reference.ReferenceOutput(None, None, None, {}, {})
    return reference.layer_forward(block_view(w), block_config(cfg), 0, x,
                                   torch.arange(len(x), device=x.device), 0, None, out)
