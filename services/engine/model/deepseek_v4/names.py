"""Tensor names: what a checkpoint stores -> the names this package computes with.

The package uses DeepSeek's own names (those of the release, and of what transformers'
`save_pretrained` writes, less its `model.` prefix), except that each layer's routed experts
are stacked: `layers.N.ffn.experts.w13` [E, 2I, D] (w1 rows, then w3) and `...experts.w2`
[E, D, I]. transformers' module names (`model.layers.N.self_attn.q_a_proj.weight`,
`mlp.experts.gate_up_proj`, ...) map onto the same.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

from kvmesh.services.engine.model.deepseek_v4.config import CSA, HASH, HCA, MOE, V4Config

if TYPE_CHECKING:
    from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config

# transformers' module path within a layer -> DeepSeek's
_LAYER_RENAMES = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.experts.gate_up_proj": "ffn.experts.w13",
    "mlp.experts.down_proj": "ffn.experts.w2",
}
_TOP_RENAMES = {
    "lm_head.weight": "head.weight", "embed_tokens.weight": "embed.weight",
    "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"(layers|mtp|kvmesh\.mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight")
# DeepSeek's copies of the shared embedding and head inside each MTP module: the main ones
# are read instead
_MTP_SHARED = re.compile(r"mtp\.\d+\.(emb\.tok_emb|head)\.weight")


class Source(NamedTuple):
    name: str                 # the package's name
    expert: int | None = None  # per-expert tensors: which expert
    part: str | None = None    # and which of w1 / w2 / w3


def source(stored: str) -> Source | None:
    """What a stored tensor is; None for tensors this package does not read (the MTP
    modules' copies of the embedding and head). An MTP module keeps DeepSeek's names under
    `mtp.N.` (its block's as a layer's, its experts stacked likewise)."""
    name = stored[len("model."):] if stored.startswith("model.") else stored
    if _MTP_SHARED.fullmatch(name):
        return None
    name = _TOP_RENAMES.get(name, name)
    m = _LAYER.fullmatch(name)
    if m:
        name = f"layers.{m[1]}.{_LAYER_RENAMES.get(m[2], m[2])}"
    e = _EXPERT.fullmatch(name)
    if e:
        return Source(f"{e[1]}.{e[2]}.ffn.experts.{'w2' if e[4] == 'w2' else 'w13'}",
                      int(e[3]), e[4])
    return Source(name)


def scale_of(stored: str) -> tuple[str, str] | None:
    """A block-scale tensor's weight: `X.scale` (DeepSeek) or `X.weight_scale_inv` (transformers)."""
    if stored.endswith(".weight_scale_inv"):
        return stored[: -len("_scale_inv")], "weight_scale_inv"
    if stored.endswith(".scale"):
        return stored[: -len(".scale")] + ".weight", "scale"
    return None


def expected_shapes(cfg: V4Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward reads, with its shape."""
    D, n, V = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {
        "embed.weight": (V, D), "head.weight": (V, D), "norm.weight": (D,),
        "hc_head_fn": (n, n * D), "hc_head_base": (n,), "hc_head_scale": (1,),
    }
    for i, kind in enumerate(cfg.layer_kinds):
        out.update(_block(cfg, f"layers.{i}.", kind, cfg.rate(i), cfg.mlp_kinds[i]))
    return out


def mtp_shapes(cfg: V4Config) -> dict[str, tuple[int, ...]]:
    """The tensors of the checkpoint's MTP modules (`mtp.N.`): a block of the kind the
    config's last compress ratio names, with routed MoE, and the module's own input
    projections, norms and stream collapse. The embedding and head are the model's."""
    out: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_mtp_layers):
        p = f"mtp.{i}."
        out.update(_block(cfg, p, cfg.mtp_kind, cfg.rate_of(cfg.mtp_kind), MOE))
        out.update(mtp_own_shapes(cfg, p))
    return out


def mtp_own_shapes(cfg: V4Config | V41Config, p: str) -> dict[str, tuple[int, ...]]:
    """An MTP module's own tensors besides its block (V4's and kvmesh's V4.1 one alike): its
    input projections and norms, its final norm and its stream collapse for the head."""
    D, n = cfg.hidden_size, cfg.hc_mult
    return {p + "e_proj.weight": (D, D), p + "h_proj.weight": (D, D),
            p + "enorm.weight": (D,), p + "hnorm.weight": (D,), p + "norm.weight": (D,),
            p + "hc_head_fn": (n, n * D), p + "hc_head_base": (n,), p + "hc_head_scale": (1,)}


def layer_shapes(cfg: V4Config | V41Config, p: str, kv_norm: str) -> dict[str, tuple[int, ...]]:
    """What every layer of DeepSeek V4 and V4.1 holds: the sub-blocks' norms and
    hyper-connection mixes, and attention's projections, sink and grouped output. kv_norm:
    the window projection's norm (`attn.norm.weight` in V4, `attn.kv_norm.weight` in V4.1)."""
    D, n = cfg.hidden_size, cfg.hc_mult
    H, d, r = cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    mix = (2 + n) * n
    return {
        p + "attn_norm.weight": (D,), p + "ffn_norm.weight": (D,),
        p + "hc_attn_fn": (mix, n * D), p + "hc_attn_base": (mix,), p + "hc_attn_scale": (3,),
        p + "hc_ffn_fn": (mix, n * D), p + "hc_ffn_base": (mix,), p + "hc_ffn_scale": (3,),
        p + "attn.attn_sink": (H,), p + "attn.wq_a.weight": (r, D),
        p + "attn.q_norm.weight": (r,), p + "attn.wq_b.weight": (H * d, r),
        p + "attn.wkv.weight": (d, D), p + kv_norm: (d,),
        p + "attn.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, H * d // cfg.o_groups),
        p + "attn.wo_b.weight": (D, cfg.o_groups * cfg.o_lora_rank),
    }


def _block(cfg: V4Config, p: str, kind: str, rate: int, mlp: str) -> dict[str, tuple[int, ...]]:
    """One decoder block's tensors under prefix `p`."""
    D, V = cfg.hidden_size, cfg.vocab_size
    d, r = cfg.head_dim, cfg.q_lora_rank
    out = layer_shapes(cfg, p, "attn.norm.weight")
    if kind in (CSA, HCA):
        out.update(_compressor(p + "attn.compressor.", d, D, rate, kind == CSA))
    if kind == CSA:
        c, hi = cfg.index_head_dim, cfg.index_heads
        out.update(_compressor(p + "attn.indexer.compressor.", c, D, cfg.csa_rate, True))
        out[p + "attn.indexer.wq_b.weight"] = (hi * c, r)
        out[p + "attn.indexer.weights_proj.weight"] = (hi, D)
    E, inter = cfg.n_experts, cfg.moe_inter
    out[p + "ffn.gate.weight"] = (E, D)
    if mlp == HASH:
        out[p + "ffn.gate.tid2eid"] = (V, cfg.experts_per_token)
    else:
        out[p + "ffn.gate.bias"] = (E,)
    out.update({
        p + "ffn.experts.w13": (E, 2 * inter, D), p + "ffn.experts.w2": (E, D, inter),
        p + "ffn.shared_experts.w1.weight": (inter, D),
        p + "ffn.shared_experts.w2.weight": (D, inter),
        p + "ffn.shared_experts.w3.weight": (inter, D),
    })
    return out


def _compressor(p: str, c: int, D: int, rate: int, overlapping: bool) -> dict:
    width = 2 * c if overlapping else c
    return {p + "wkv.weight": (width, D), p + "wgate.weight": (width, D),
            p + "ape": (rate, width), p + "norm.weight": (c,)}


# parameters used elementwise (norm weights, mixing, sinks, biases): kept in float32 when the
# model computes in a narrower dtype, as the reference keeps them
def keeps_fp32(name: str) -> bool:
    return (name.endswith("norm.weight") or "hc_" in name or name.endswith(("attn_sink", ".ape",
            "gate.bias")))
