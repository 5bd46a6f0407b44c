"""The tensors a DeepSeek V4.1 text model reads, by the release's names (no `model.`
prefix, `attn` / `ffn`), routed experts stacked as for V4 (names.py).

Per layer: attention (its own window projection and norm, no per-layer compressor), a
compressor only on KV sources (`wgate` only where the ratio pools), an indexer only on index
sources (`wk` / `k_norm` only on those that are also KV sources), hyper-connection weights
for both sub-blocks, a score-routed MoE, and on Engram layers the Engram module (its table,
`wkv` and the two gate weights; v41_engram.py). There is no `hc_head`: the last MoE's `pre`
collapses the streams for the head. The release's other tensors (`gate.bias_vl` for image
tokens, the DSpark draft layers under `mtp.`, the vision tower) are not read. A checkpoint
with `"kvmesh": {"mtp_layers": 1}` also carries kvmesh's MTP module under `kvmesh.mtp.0.`.
"""

from __future__ import annotations

from kvmesh.services.engine.model.deepseek_v4.names import layer_shapes, mtp_own_shapes
from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config

MTP = "kvmesh.mtp.0."     # kvmesh's MTP module (v41_mtp.py; DSpark's `mtp.` is the release's)


def expected_shapes(cfg: V41Config) -> dict[str, tuple[int, ...]]:
    D, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"embed.weight": (V, D), "head.weight": (V, D),
                                       "norm.weight": (D,)}
    for i in range(cfg.num_layers):
        out.update(_layer(cfg, f"layers.{i}.", i in cfg.kv_sources, i in cfg.index_sources,
                          cfg.ratio(i) > 1))
    if cfg.engram is not None:
        out.update(engram_shapes(cfg))
    if cfg.mtp_layers:
        out.update(mtp_shapes(cfg))
    return out


def engram_shapes(cfg: V41Config) -> dict[str, tuple[int, ...]]:
    """Each Engram layer's table [rows, head_dim], its key/value projection and gate weights."""
    e, D, n = cfg.engram, cfg.hidden_size, cfg.hc_mult
    assert e is not None
    out: dict[str, tuple[int, ...]] = {}
    for layer, rows in zip(e.layers, e.rows, strict=True):
        p = f"layers.{layer}.engram."
        out.update({p + "embed.weight": (rows, e.head_dim),
                    p + "wkv.weight": ((n + 1) * D, e.columns * e.head_dim),
                    p + "q_weight": (n, D), p + "k_weight": (n, D)})
    return out


def mtp_shapes(cfg: V41Config) -> dict[str, tuple[int, ...]]:
    """kvmesh's MTP module: one window-only layer, its input projections and norms, its own
    stream collapse for the head (V4's `hc_head`; the embedding and head are the model's)."""
    return {**_layer(cfg, MTP, False, False, False), **mtp_own_shapes(cfg, MTP)}


def _layer(cfg: V41Config, p: str, kv_source: bool, index_source: bool,
           pools: bool) -> dict[str, tuple[int, ...]]:
    """One layer's tensors under prefix p."""
    D, d, r = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    out = layer_shapes(cfg, p, "attn.kv_norm.weight")
    if kv_source:
        c = p + "attn.compressor."
        out.update({c + "wkv.weight": (d, D), c + "norm.weight": (d,)})
        if pools:
            out[c + "wgate.weight"] = (d, D)
    if index_source:
        x, ci = p + "attn.indexer.", cfg.index_head_dim
        out.update({x + "wq_b.weight": (cfg.index_heads * ci, r),
                    x + "weights_proj.weight": (cfg.index_heads, D)})
        if kv_source:
            out.update({x + "wk.weight": (ci, d), x + "k_norm.weight": (ci,)})
    E, inter = cfg.n_experts, cfg.moe_inter
    out.update({
        p + "ffn.gate.weight": (E, D), p + "ffn.gate.bias": (E,),
        p + "ffn.experts.w13": (E, 2 * inter, D), p + "ffn.experts.w2": (E, D, inter),
        p + "ffn.shared_experts.w1.weight": (inter, D),
        p + "ffn.shared_experts.w2.weight": (D, inter),
        p + "ffn.shared_experts.w3.weight": (inter, D),
    })
    return out


def describe(cfg: V41Config, name: str) -> str:
    """What part of the config a tensor belongs to (for a missing-tensor error)."""
    if name.startswith(MTP):
        return "kvmesh's MTP module (the config's kvmesh.mtp_layers)"
    if not name.startswith("layers."):
        return "model"
    i = int(name.split(".")[1])
    if ".engram." in name:
        return f"layer {i}'s Engram module (engram_layer_ids)"
    roles = [role for role, ids in (("KV source", cfg.kv_sources),
                                    ("index source", cfg.index_sources)) if i in ids]
    return f"layer {i} (compress ratio {cfg.ratio(i)}{', ' + ', '.join(roles) if roles else ''})"


# The release's tensors kvmesh does not read, by what they belong to (see the docstring).
UNSERVED = (("mtp.", "the DSpark draft layers (--speculative dspark is not served; n-gram "
                     "speculation works)"),
            ("gate.bias_vl", "the image tokens' routing biases (images are refused)"))


def unserved(plan_names, cfg: V41Config) -> list[str]:
    """What a checkpoint holds beyond the text model kvmesh serves: one line per part, with
    its tensor count ("the DSpark draft layers (...): 57 tensors"), others by a first name."""
    expected = expected_shapes(cfg)
    counts: dict[str, int] = {}
    other: list[str] = []
    for name in plan_names:
        if name in expected:
            continue
        part = next((what for prefix, what in UNSERVED
                     if name.startswith(prefix) or name.endswith(prefix)), None)
        if part is None:
            other.append(name)
        else:
            counts[part] = counts.get(part, 0) + 1
    if other:
        counts[f"other tensors (such as {other[0]})"] = len(other)
    return [f"{part}: {n} tensor{'s' if n > 1 else ''}" for part, n in counts.items()]
