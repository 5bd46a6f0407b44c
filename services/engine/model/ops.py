"""Per-token pieces of V4-mini, shared by the reference and the cached forward.

Nothing here looks at other positions: attention, windows and caches are the
callers' business. Shapes: `[*, hidden]` in, per-head outputs as `[*, H, D]`.
"""

from __future__ import annotations

import torch

from kernels import cpu_rows, mxfp8
from kernels.cpu_gemm import matmul as mm
from kernels.pooling import gated_pool
from services.engine.config import ModelConfig
from services.engine.model.weights import Weights


def rms_norm(x, weight, eps: float):
    out = cpu_rows.rms_norm(x, weight, eps)          # one C call on the CPU (not under autograd)
    if out is not None:
        return out
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_angles(pos, cfg: ModelConfig, dtype):
    """(cos, sin) [..., rope_dim / 2] of positions pos[...]: what rope() needs, computed once
    and shared by every layer of a step (and by q and kv) instead of once per call."""
    half = cfg.rope_dim // 2
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64, device=pos.device) / half))
    ang = pos.to(torch.float64).unsqueeze(-1) * inv                # [..., half]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope(x, pos, cfg: ModelConfig, angles=None, in_place: bool = False):
    """Rotate the last `rope_dim` dims of x[..., D] by position pos[...] (x's leading dims
    minus an optional head dim). Halves layout: pairs (i, i + rope_dim/2). `angles`:
    rope_angles(pos, ...) when the caller has them already (same numbers). `in_place`: write
    the rotated dims into x (a tensor of the caller's own) instead of copying all D dims."""
    r = cfg.rope_dim
    half = r // 2
    cos, sin = angles if angles is not None else rope_angles(pos, cfg, x.dtype)
    if in_place and cpu_rows.rope_(x, cos, sin, r):                # one C call on the CPU
        return x
    if x.dim() == pos.dim() + 2:                                   # per-head x: [..., H, D]
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    keep, rot = x[..., :-r], x[..., -r:]
    a, b = rot[..., :half], rot[..., half:]
    if in_place:
        rot.copy_(torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1))
        return x
    return torch.cat([keep, a * cos - b * sin, a * sin + b * cos], dim=-1)


def query_and_kv(w: Weights, layer: int, h, pos, cfg: ModelConfig, angles=None):
    """h: [T, hidden] (already attn-normed), pos: [T] -> q [T, H, D], kv [T, D] (full precision).
    Without autograd q and kv are roped in place (they are fresh tensors): a 512-row prefill
    chunk copies 64 of the 512 dims instead of all of them (3 MB per layer)."""
    p = f"layers.{layer}."
    own = not torch.is_grad_enabled()
    q = mm(h, w[p + "wq"]).view(*h.shape[:-1], cfg.n_heads, cfg.head_dim)
    q = rope(q, pos, cfg, angles, in_place=own)
    kv = rms_norm(mm(h, w[p + "wkv"]), w[p + "kv_norm"], cfg.norm_eps)
    kv = rope(kv, pos, cfg, angles, in_place=own)
    return q, kv


def quantize_kv(kv):
    """SWA KV as stored: MXFP8 bytes and the values every reader sees."""
    return mxfp8.quantize_values(kv)


def storage_round(t):
    """Round to the fp32 the cache stores (compression tails, block entries), so a value
    computed in this chunk and one read back from the cache are the same number in any
    compute dtype (a no-op in fp32)."""
    return t.float().to(t.dtype)


def compressor_inputs(w: Weights, layer: int, u):
    """u: [T, hidden] compressor input -> v, z [T, D] (at storage precision)."""
    p = f"layers.{layer}."
    return storage_round(mm(u, w[p + "cmp_wv"])), storage_round(mm(u, w[p + "cmp_wz"]))


def indexer_inputs(w: Weights, layer: int, u):
    p = f"layers.{layer}."
    return storage_round(mm(u, w[p + "idx_wv"])), storage_round(mm(u, w[p + "idx_wz"]))


def pool_entries(w: Weights, layer: int, v, z, first_group: int, m: int, cfg: ModelConfig):
    """v, z: [G*m, D] for G complete groups starting at group `first_group` -> entries [G, D]."""
    g = v.shape[0] // m
    pooled = gated_pool(v.view(g, m, -1), z.view(g, m, -1), w[f"layers.{layer}.cmp_bias"])
    pooled = rms_norm(pooled, w[f"layers.{layer}.cmp_norm"], cfg.norm_eps)
    pos = (torch.arange(g) + first_group) * m
    return storage_round(rope(pooled, pos, cfg))


def pool_entries_at(w: Weights, layer: int, v, z, groups, m: int, cfg: ModelConfig, angles=None):
    """Like pool_entries for groups that need not be consecutive: v, z [G*m, D], groups [G]
    the group index of each (its entry is roped at position group * m; `angles`: of those)."""
    g = v.shape[0] // m
    pooled = gated_pool(v.view(g, m, -1), z.view(g, m, -1), w[f"layers.{layer}.cmp_bias"])
    pooled = rms_norm(pooled, w[f"layers.{layer}.cmp_norm"], cfg.norm_eps)
    return storage_round(rope(pooled, groups * m, cfg, angles))


def pool_index_keys(w: Weights, layer: int, v, z, m: int):
    g = v.shape[0] // m
    return storage_round(gated_pool(v.view(g, m, -1), z.view(g, m, -1), w[f"layers.{layer}.idx_bias"]))


def index_query(w: Weights, layer: int, h, cfg: ModelConfig):
    p = f"layers.{layer}."
    q = mm(h, w[p + "idx_wq"]).view(*h.shape[:-1], cfg.index_heads, cfg.index_dim)
    return q, mm(h, w[p + "idx_ww"])


def attn_output(w: Weights, layer: int, o):
    """o: [T, H, D] -> [T, hidden]."""
    return mm(o.reshape(*o.shape[:-2], -1), w[f"layers.{layer}.wo"])


def ffn(w: Weights, layer: int, x, cfg: ModelConfig):
    p = f"layers.{layer}."
    h = rms_norm(x, w[p + "ffn_norm"], cfg.norm_eps)
    return mm(torch.nn.functional.silu(mm(h, w[p + "w1"])) * mm(h, w[p + "w3"]), w[p + "w2"])


def logits(w: Weights, x, cfg: ModelConfig):
    return mm(rms_norm(x, w["final_norm"], cfg.norm_eps), w["lm_head"])


def encoder_output(w: Weights, x, cfg: ModelConfig):
    """H_enc: the normed encoder output that decoder compressed layers project from."""
    return rms_norm(x, w["enc_norm"], cfg.norm_eps)
