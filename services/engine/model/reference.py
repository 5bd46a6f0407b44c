"""Reference forward: the whole sequence at once, explicit masks, no cache.

This is the oracle for the cached engine path: it never touches a ring, a slot
or a block, it builds every mask from positions. It is O(T^2) in memory: use it
for tests and scripts, not for serving.

Decoder truncation (YOCO prefill truncation) is a parameter: decoder layers
see SWA keys only from `dec_lo` on. `dec_mode="compact"` runs decoder layers on
positions >= dec_lo only; `"mask"` runs them on every position with keys before
dec_lo masked. Both return logits for positions [dec_lo, T).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.attention import union_attention
from kernels.indexer import indexer_scores, select_topk
from services.engine.config import ModelConfig
from services.engine.model import ops
from services.engine.model.weights import Weights


@dataclass
class ReferenceOutput:
    logits: torch.Tensor          # [T - dec_lo, V], row r is position dec_lo + r
    hidden: torch.Tensor          # [T - dec_lo, hidden] final residual stream
    enc_hidden: torch.Tensor      # [T, hidden] H_enc
    entries: dict[int, torch.Tensor]      # layer -> [G, D] compressed entries
    index_keys: dict[int, torch.Tensor]   # csa layer -> [G, Di]


def window_mask(qpos, kpos, lo: int, window: int):
    """[Tq, Tk]: key position in [max(lo, q - W + 1), q]."""
    q, k = qpos.unsqueeze(1), kpos.unsqueeze(0)
    return (k <= q) & (k >= torch.clamp(q - window + 1, min=lo))


def compressed_visible(qpos, n_entries: int, m: int):
    """[Tq, G]: query i sees entry j iff j < floor((i + 1) / m)."""
    return torch.arange(n_entries).unsqueeze(0) < ((qpos + 1) // m).unsqueeze(1)


def layer_forward(w: Weights, cfg: ModelConfig, layer: int, x, qpos, lo: int, src, out: ReferenceOutput):
    """x: [Tq, hidden] at positions qpos; src: [Ts, hidden] compressor input from position 0
    (None = use this layer's own normed input, encoder style)."""
    p = f"layers.{layer}."
    h = ops.rms_norm(x, w[p + "attn_norm"], cfg.norm_eps)
    q, kv = ops.query_and_kv(w, layer, h, qpos, cfg)
    _, kv = ops.quantize_kv(kv)
    win_ok = window_mask(qpos, qpos, lo, cfg.window)

    m = cfg.compress_ratio(layer)
    if m is None:
        k_cmp = kv.new_zeros(0, cfg.head_dim)
        cmp_ok = torch.zeros(len(qpos), 0, dtype=torch.bool)
    else:
        src = h if src is None else src
        g = src.shape[0] // m
        v, z = ops.compressor_inputs(w, layer, src[: g * m])
        k_cmp = ops.pool_entries(w, layer, v, z, 0, m, cfg)
        out.entries[layer] = k_cmp
        cmp_ok = compressed_visible(qpos, g, m)
        if cfg.layers[layer] == "csa":
            iv, iz = ops.indexer_inputs(w, layer, src[: g * m])
            keys_i = ops.pool_index_keys(w, layer, iv, iz, m)
            out.index_keys[layer] = keys_i
            iq, iw = ops.index_query(w, layer, h, cfg)
            scores = indexer_scores(iq[None], iw[None], keys_i[None])
            cmp_ok = select_topk(scores, cmp_ok[None], cfg.csa_topk)[0]

    groups = [(kv[None], win_ok[None]), (k_cmp[None], cmp_ok[None])]
    o = union_attention(q[None], groups, w[p + "sink"], 1.0 / math.sqrt(cfg.head_dim))[0]
    x = x + ops.attn_output(w, layer, o)
    return x + ops.ffn(w, layer, x, cfg)


@torch.no_grad()
def forward(w: Weights, cfg: ModelConfig, tokens, dec_lo: int = 0, dec_mode: str = "compact"):
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    t = len(tokens)
    if not 0 <= dec_lo < t:
        raise ValueError(f"dec_lo must be in [0, {t})")
    if dec_mode not in ("compact", "mask"):
        raise ValueError(f"dec_mode must be compact or mask, not {dec_mode!r}")
    pos = torch.arange(t)
    out = ReferenceOutput(None, None, None, {}, {})
    x = w["embed"][tokens]
    for layer in range(cfg.n_encoder_layers):
        x = layer_forward(w, cfg, layer, x, pos, 0, None, out)
    out.enc_hidden = ops.encoder_output(w, x, cfg)
    keep = slice(dec_lo, t) if dec_mode == "compact" else slice(0, t)
    xd, posd = x[keep], pos[keep]
    for layer in range(cfg.n_encoder_layers, cfg.n_layers):
        xd = layer_forward(w, cfg, layer, xd, posd, dec_lo, out.enc_hidden, out)
    if dec_mode == "mask":
        xd = xd[dec_lo:]
    out.hidden = xd
    out.logits = ops.logits(w, xd, cfg)
    return out
