"""The MTP module's training forward at depth 1 and chained depth 2, as the engine drafts.

Depth 1, MTP position p (p = 0..T-1): x1_p = project(h_p, t_{p+1}); one SWA block over
x1_0..x1_p (the training layer, train/model.py) -> y1_p, predicting t_{p+2}.

Depth 2 (chained): the engine's second draft comes from a row at position p + 1 whose input
is project(y1_p, draft) and whose keys are the MTP ring's depth-1 rows p - W + 2 .. p plus
its own (model/mtp_runner.py, core/mtp_draft.py). Trained teacher-forced the same way:

    query  position p + 1, input project(y1_p, t_{p+2})            predicts t_{p+3}
    keys   kv1 of positions [p - W + 2, p]  (the window less its oldest row)  +  its own kv2

`quantize=True` rounds kv1 and kv2 through MXFP8 as the engine's ring does, so the test can
compare with the reference chain exactly.
"""

from __future__ import annotations

import math

import torch

from services.engine.config import ModelConfig
from services.engine.model import mtp, ops
from training.model import _window_keys, _window_ok, layer_forward


def depth1(w, cfg: ModelConfig, h, next_tokens, chunk: int, quantize: bool = False):
    """h [N, T, hidden], next_tokens [N, T] -> (y1 [N, T, hidden], kv1 [N, T, D])."""
    view, bcfg = mtp.block_view(w), mtp.block_config(cfg)
    x = mtp.project(w, cfg, h, next_tokens)
    y, _ = layer_forward(view, bcfg, 0, x, None, chunk, quantize)
    hn = ops.rms_norm(x, view["layers.0.attn_norm"], cfg.norm_eps)
    _, kv1 = ops.query_and_kv(view, 0, hn, torch.arange(x.shape[1]).view(1, -1), bcfg)
    if quantize:
        _, kv1 = ops.quantize_kv(kv1)
    return y, kv1


def chained(w, cfg: ModelConfig, y1, kv1, next_tokens, chunk: int, quantize: bool = False):
    """Depth 2: y1, kv1 [N, T, *] of depth 1, next_tokens [N, T] (t_{p+2}) -> logits
    [N, T, V] of t_{p+3}. T must be a multiple of `chunk`."""
    view, bcfg = mtp.block_view(w), mtp.block_config(cfg)
    n, t, _ = y1.shape
    hh, d, win = cfg.n_heads, cfg.head_dim, cfg.window
    scale = 1.0 / math.sqrt(d)
    x = mtp.project(w, cfg, y1, next_tokens)
    hn = ops.rms_norm(x, view["layers.0.attn_norm"], cfg.norm_eps)
    q, kv2 = ops.query_and_kv(view, 0, hn, torch.arange(1, t + 1).view(1, -1), bcfg)
    if quantize:
        _, kv2 = ops.quantize_kv(kv2)
    nc = t // chunk
    keys = _window_keys(kv1, win, chunk)                                  # [N, nc, D, W + C]
    s_win = torch.einsum("ncqhd,ncdk->ncqhk", q.view(n, nc, chunk, hh, d), keys) * scale
    s_win = s_win.masked_fill(~_chain_ok(t, win, chunk)[None, :, :, None, :], float("-inf"))
    s_win = s_win.reshape(n, t, hh, -1)
    s_self = (q * kv2.unsqueeze(2)).sum(-1, keepdim=True) * scale          # [N, T, H, 1]
    sink = view["layers.0.sink"].view(1, 1, hh, 1).expand(n, t, hh, 1).to(q.dtype)
    probs = torch.softmax(torch.cat([s_win, s_self, sink], dim=-1), dim=-1)
    kw = s_win.shape[-1]
    p_win = probs[..., :kw].reshape(n, nc, chunk, hh, kw)
    o = torch.einsum("ncqhk,ncdk->ncqhd", p_win, keys).reshape(n, t, hh, d)
    o = o + probs[..., kw : kw + 1] * kv2.unsqueeze(2)
    x = x + ops.attn_output(view, 0, o)
    y2 = x + ops.ffn(view, 0, x, bcfg)
    return mtp.logits(w, cfg, y2)


def _chain_ok(t: int, window: int, chunk: int):
    """`_window_ok` without the oldest key: query index p sees depth-1 keys [p - W + 2, p]."""
    c = torch.arange(t // chunk).view(-1, 1, 1)
    i = torch.arange(chunk).view(1, -1, 1)
    j = torch.arange(window + chunk).view(1, 1, -1)
    kpos, qpos = c * chunk - window + j, c * chunk + i
    return _window_ok(t, window, chunk) & (kpos > qpos - window + 1)
