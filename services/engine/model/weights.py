"""Model weights: a flat name -> tensor dict, seeded init, safetensors checkpoints.

Names (per layer i):
    layers.i.attn_norm  [hidden]           layers.i.ffn_norm [hidden]
    layers.i.wq         [hidden, H*D]      layers.i.wkv      [hidden, D]
    layers.i.kv_norm    [D]                layers.i.sink     [H]
    layers.i.wo         [H*D, hidden]      layers.i.w1/w3    [hidden, F]   layers.i.w2 [F, hidden]
  compressed layers (csa, hca), input = own normed input (encoder) or H_enc (decoder):
    layers.i.cmp_wv/cmp_wz [hidden, D]     layers.i.cmp_bias [m, D]    layers.i.cmp_norm [D]
  csa layers, lightning indexer:
    layers.i.idx_wv/idx_wz [hidden, Di]    layers.i.idx_bias [m, Di]
    layers.i.idx_wq [hidden, Hi*Di]        layers.i.idx_ww [hidden, Hi]
  global: embed [V, hidden], enc_norm [hidden] (gives H_enc), final_norm [hidden], lm_head [hidden, V]
  optional MTP module (model/mtp.py), all or none:
    mtp.hnorm/enorm/norm [hidden]  mtp.eh_proj [2*hidden, hidden]  and one SWA block's tensors
    as mtp.<leaf> (attn_norm, wq, wkv, kv_norm, sink, wo, ffn_norm, w1, w3, w2)
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.engine.config import ModelConfig

Weights = dict[str, torch.Tensor]


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d, f = cfg.hidden, cfg.head_dim, cfg.ffn_hidden
    out: dict[str, tuple[int, ...]] = {
        "embed": (cfg.vocab_size, h),
        "enc_norm": (h,),
        "final_norm": (h,),
        "lm_head": (h, cfg.vocab_size),
    }
    for i, kind in enumerate(cfg.layers):
        p = f"layers.{i}."
        out.update({
            p + "attn_norm": (h,), p + "ffn_norm": (h,),
            p + "wq": (h, cfg.n_heads * d), p + "wkv": (h, d), p + "kv_norm": (d,),
            p + "sink": (cfg.n_heads,), p + "wo": (cfg.n_heads * d, h),
            p + "w1": (h, f), p + "w3": (h, f), p + "w2": (f, h),
        })
        if kind != "swa":
            m = cfg.compress_ratio(i)
            out.update({p + "cmp_wv": (h, d), p + "cmp_wz": (h, d), p + "cmp_bias": (m, d),
                        p + "cmp_norm": (d,)})
        if kind == "csa":
            di, hi = cfg.index_dim, cfg.index_heads
            out.update({p + "idx_wv": (h, di), p + "idx_wz": (h, di), p + "idx_bias": (cfg.csa_m, di),
                        p + "idx_wq": (h, hi * di), p + "idx_ww": (h, hi)})
    return out


def mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The MTP module's tensors: its input projection and norms, one SWA block (model/mtp.py)."""
    h, d, f = cfg.hidden, cfg.head_dim, cfg.ffn_hidden
    return {
        "mtp.hnorm": (h,), "mtp.enorm": (h,), "mtp.eh_proj": (2 * h, h), "mtp.norm": (h,),
        "mtp.attn_norm": (h,), "mtp.ffn_norm": (h,),
        "mtp.wq": (h, cfg.n_heads * d), "mtp.wkv": (h, d), "mtp.kv_norm": (d,),
        "mtp.sink": (cfg.n_heads,), "mtp.wo": (cfg.n_heads * d, h),
        "mtp.w1": (h, f), "mtp.w3": (h, f), "mtp.w2": (f, h),
    }


def init_weights(cfg: ModelConfig, seed: int = 0, dtype=torch.float32, mtp: bool = False) -> Weights:
    """Deterministic for a given (config, seed): same seed, same bytes. `mtp` adds the MTP
    module, drawn from its own generator so the trunk's bytes do not depend on it."""
    w = _init(shapes(cfg), torch.Generator().manual_seed(seed), dtype)
    if mtp:
        w.update(_init(mtp_shapes(cfg), torch.Generator().manual_seed(seed + 0x5EED), dtype))
    return w


def _init(named: dict[str, tuple[int, ...]], gen: torch.Generator, dtype) -> Weights:
    w: Weights = {}
    for name, shape in named.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("norm"):
            t = torch.ones(shape)
        elif leaf == "sink":
            t = torch.zeros(shape)
        elif leaf == "embed":
            t = torch.randn(shape, generator=gen)
        elif leaf.endswith("bias"):
            t = torch.randn(shape, generator=gen) * 0.5
        else:
            t = torch.randn(shape, generator=gen) / shape[0] ** 0.5
        w[name] = t.to(dtype)
    return w


def save(weights: Weights, cfg: ModelConfig, path: str | Path) -> None:
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path),
              metadata={"kvmesh_config": cfg.to_json()})


def load(path: str | Path, cfg: ModelConfig) -> Weights:
    """Load a checkpoint; refuse one whose config or tensor shapes differ from `cfg`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "kvmesh_config" in meta:
        saved = ModelConfig.from_json(meta["kvmesh_config"])
        diffs = [k for k in cfg.__dataclass_fields__ if getattr(saved, k) != getattr(cfg, k)]
        if diffs:
            detail = ", ".join(f"{k}: checkpoint {getattr(saved, k)!r} vs config {getattr(cfg, k)!r}"
                               for k in diffs)
            raise ValueError(f"checkpoint {path} does not match the model config ({detail})")
    weights = load_file(str(path))
    want = shapes(cfg)
    if any(k.startswith("mtp.") for k in weights):      # an MTP module: all of it or refuse
        want.update(mtp_shapes(cfg))
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    if missing or extra:
        raise ValueError(f"checkpoint {path}: missing tensors {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"checkpoint {path}: {name} has shape {tuple(weights[name].shape)}, "
                             f"config expects {shape}")
    return weights
