"""Differentiable training forward for V4-mini: the reference's math, batched and cheaper.

Same layers, same ops (`services.engine.model.ops`), same selection rule
(`kernels.indexer.select_topk`) as `model/reference.py`; what differs is only how
the work is laid out, so that a training step is affordable on one CPU core:

- window attention runs in query chunks of `chunk` tokens, each against the
  `window + chunk` keys that can reach it, instead of a [T, T] score matrix;
- CSA attends to its top-k entries through a hard mask over dense scores (one
  large matmul beats T small gathers on a CPU); the selection carries no gradient;
- the lightning indexer gets no gradient from the LM loss (its inputs are
  detached); it is trained by KL(main attention || indexer) over the visible
  compressed entries, the main attention distribution being the head-averaged
  softmax of q.k over those entries (DeepSeek's indexer warm-up objective);
- SWA KV is not MXFP8-quantized unless `quantize=True` (serving quantizes; the
  flag exists so tests can compare with the reference exactly).

`forward` returns logits for every position plus the summed indexer KL; `hidden_states`
the residual stream before the final norm (what the MTP module reads, train/mtp.py).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from kernels.indexer import indexer_scores, select_topk
from kernels.pooling import gated_pool
from services.engine.config import ModelConfig
from services.engine.model import ops
from services.engine.model.reference import compressed_visible


def _pool(v, z, bias, m: int):
    """v, z: [N, G*m, D] -> [N, G, D] (batched `gated_pool`)."""
    n, gm, d = v.shape
    g = gm // m
    return gated_pool(v.reshape(n * g, m, d), z.reshape(n * g, m, d), bias).view(n, g, d)


def _window_keys(kv, window: int, chunk: int):
    """kv [N, T, D] -> keys [N, T/chunk, D, window + chunk]: for chunk c the keys at
    positions [c*chunk - window, (c+1)*chunk), zero-padded before position 0."""
    padded = F.pad(kv, (0, 0, window, 0))
    return padded.unfold(1, window + chunk, chunk)


@functools.lru_cache(maxsize=8)
def _window_ok(t: int, window: int, chunk: int):
    """[T/chunk, chunk, window + chunk] bool: query i of chunk c sees key j iff the key's
    position c*chunk - window + j lies in [max(0, q - window + 1), q], q = c*chunk + i."""
    c = torch.arange(t // chunk).view(-1, 1, 1)
    i = torch.arange(chunk).view(1, -1, 1)
    j = torch.arange(window + chunk).view(1, 1, -1)
    kpos = c * chunk - window + j
    qpos = c * chunk + i
    return (kpos <= qpos) & (kpos > qpos - window) & (kpos >= 0)


def _indexer_kl(s_main, visible, iscores):
    """KL(p_main || p_indexer) per query over visible entries, summed over queries that see
    at least one entry. s_main [N,T,H,G] main-attention logits (detached), visible [T,G],
    iscores [N,T,G] indexer scores."""
    target = torch.softmax(s_main.masked_fill(~visible[None, :, None, :], float("-inf")), -1).mean(2)
    logp = torch.log_softmax(iscores.masked_fill(~visible[None], float("-inf")), dim=-1)
    rows = visible.any(-1)                                                  # [T]
    tgt, lp = target[:, rows], logp[:, rows]
    # tgt == 0 exactly where an entry is invisible (lp = -inf there): those terms are 0
    return (tgt * (torch.log(tgt.clamp_min(1e-30)) - lp.masked_fill(tgt == 0, 0.0))).sum()


def layer_forward(w, cfg: ModelConfig, layer: int, x, src, chunk: int, quantize: bool):
    """x [N, T, hidden] at positions 0..T-1; src: decoder compressor input (H_enc) or None
    (encoder: the layer's own normed input). Returns (x, indexer KL sum)."""
    n, t, _ = x.shape
    p = f"layers.{layer}."
    scale = 1.0 / math.sqrt(cfg.head_dim)
    pos = torch.arange(t).view(1, t)
    h = ops.rms_norm(x, w[p + "attn_norm"], cfg.norm_eps)
    q, kv = ops.query_and_kv(w, layer, h, pos, cfg)                      # [N,T,H,D], [N,T,D]
    if quantize:
        _, kv = ops.quantize_kv(kv)
    nc, hh = t // chunk, cfg.n_heads
    keys = _window_keys(kv, cfg.window, chunk)                           # [N, nc, D, W+C]
    qc = q.view(n, nc, chunk, hh, cfg.head_dim)
    s_win = torch.einsum("ncqhd,ncdk->ncqhk", qc, keys) * scale
    s_win = s_win.masked_fill(~_window_ok(t, cfg.window, chunk)[None, :, :, None, :], float("-inf"))
    s_win = s_win.reshape(n, t, hh, -1)

    kl = x.new_zeros(())
    m = cfg.compress_ratio(layer)
    cmp_keys, s_cmp = None, x.new_zeros(n, t, hh, 0)
    if m is not None and t // m:
        src = h if src is None else src
        g = t // m
        v, z = ops.compressor_inputs(w, layer, src[:, : g * m])
        pooled = ops.rms_norm(_pool(v, z, w[p + "cmp_bias"], m), w[p + "cmp_norm"], cfg.norm_eps)
        entries = ops.storage_round(ops.rope(pooled, (torch.arange(g) * m).view(1, g), cfg))
        visible = compressed_visible(torch.arange(t), g, m)               # [T, G]
        cmp_keys = entries                                                 # [N, G, D]
        s_cmp = torch.einsum("nthd,ngd->nthg", q, entries) * scale         # [N, T, H, G]
        ok = visible[None]
        if cfg.layers[layer] == "csa":
            # Dense scores over every entry, then the top-k mask: one large matmul is
            # cheaper on a CPU than T small per-query gathers, and it is the reference's form.
            sd = src.detach()[:, : g * m]
            iv, iz = ops.indexer_inputs(w, layer, sd)
            ikeys = ops.storage_round(_pool(iv, iz, w[p + "idx_bias"], m))
            iq, iw = ops.index_query(w, layer, h.detach(), cfg)
            iscores = indexer_scores(iq, iw, ikeys)                        # [N, T, G]
            kl = _indexer_kl(s_cmp.detach(), visible, iscores)
            ok = select_topk(iscores.detach(), visible.expand(n, t, g), cfg.csa_topk)
        s_cmp = s_cmp.masked_fill(~ok[:, :, None, :], float("-inf"))

    sink = w[p + "sink"].view(1, 1, hh, 1).expand(n, t, hh, 1)
    probs = torch.softmax(torch.cat([s_win, s_cmp, sink], dim=-1), dim=-1)
    kw, kc = s_win.shape[-1], s_cmp.shape[-1]
    p_win = probs[..., :kw].reshape(n, nc, chunk, hh, kw)
    o = torch.einsum("ncqhk,ncdk->ncqhd", p_win, keys).reshape(n, t, hh, cfg.head_dim)
    if kc:
        p_cmp = probs[..., kw : kw + kc]
        o = o + torch.einsum("nthg,ngd->nthd", p_cmp, cmp_keys)
    x = x + ops.attn_output(w, layer, o)
    return x + ops.ffn(w, layer, x, cfg), kl


def forward(w, cfg: ModelConfig, tokens, chunk: int = 64, quantize: bool = False):
    """tokens [N, T] (long) -> (logits [N, T, V], indexer KL summed over layers and queries)."""
    x, kl = hidden_states(w, cfg, tokens, chunk, quantize)
    return ops.logits(w, x, cfg), kl


def hidden_states(w, cfg: ModelConfig, tokens, chunk: int = 64, quantize: bool = False):
    """tokens [N, T] (long) -> (last residual stream [N, T, hidden] before the final norm,
    indexer KL summed over layers and queries); the MTP module reads the former.

    T need not be a multiple of `chunk`: the batch is padded at the end and the padding
    cut off again (attention is causal, so padding never reaches a real position)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.dim() == 1:
        tokens = tokens[None]
    if chunk <= 0 or chunk > cfg.window:
        raise ValueError(f"chunk must be in (0, window={cfg.window}], got {chunk}")
    n, t = tokens.shape
    pad = -t % chunk
    if pad:
        tokens = F.pad(tokens, (0, pad))
    x = w["embed"][tokens]
    kl = x.new_zeros(())
    for layer in range(cfg.n_encoder_layers):
        x, k = layer_forward(w, cfg, layer, x, None, chunk, quantize)
        kl = kl + k
    enc = ops.encoder_output(w, x, cfg)
    for layer in range(cfg.n_encoder_layers, cfg.n_layers):
        x, k = layer_forward(w, cfg, layer, x, enc, chunk, quantize)
        kl = kl + k
    return x[:, :t], kl
