"""Tiny random DeepSeek V4.1 configs and weights (no library makes them: V4.1 is not in
transformers), in the release's tensor names with the routed experts stacked as the engine
keeps them (`experts.w13` [E, 2I, D], `experts.w2` [E, D, I]).

Parameters are drawn wide enough that every piece moves the logits (sinks, gate biases and
hyper-connection bases are not zero).
"""

from __future__ import annotations

import functools

import torch

from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config, v41_config_from_dict

BASE = dict(model_type="deepseek_v41", vocab_size=100, hidden_size=64, num_attention_heads=4,
            head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            index_n_heads=2, index_head_dim=16, rms_norm_eps=1e-6,
            max_position_embeddings=4096, engram_layer_ids=[])

# name -> (text_config fields, tokens to score). Between them: window-only, ratio-2 and
# ratio-1 layers; KV sources with consumers; index sources that own keys and ones that do not;
# a candidate source with later index sources choosing inside its blocks; hc_mult 2 and 4;
# YaRN on the compress RoPE; and the release's window and block (W = 128, candidate blocks of
# 8) over a prompt longer than two windows.
CONFIGS = {
    "flash_like": (dict(num_hidden_layers=6, sliding_window=8, hc_mult=2, index_topk=4,
                        compress_ratios=[0, 2, 2, 1, 1, 1, 0], kv_source_layer_ids=[1, 3],
                        index_source_layer_ids=[1, 3, 5], candidate_source_layer_id=3,
                        candidate_topk_blocks=2, candidate_block_size=4), 48),
    "yarn_hc4": (dict(num_hidden_layers=5, sliding_window=16, hc_mult=4, index_topk=6,
                      compress_ratios=[2, 2, 0, 1, 1], kv_source_layer_ids=[0, 3],
                      index_source_layer_ids=[0, 1, 3, 4], candidate_source_layer_id=3,
                      candidate_topk_blocks=3, candidate_block_size=2,
                      rope_scaling={"type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 32,
                                    "beta_fast": 32.0, "beta_slow": 1.0}), 60),
    "flash_geometry": (dict(num_hidden_layers=4, sliding_window=128, hc_mult=2, index_topk=64,
                            compress_ratios=[0, 2, 1, 1], kv_source_layer_ids=[1, 2],
                            index_source_layer_ids=[1, 2, 3], candidate_source_layer_id=2,
                            candidate_topk_blocks=16, candidate_block_size=8), 300),
}


# A word-level tokenizer over the tiny vocabulary whose words fold under Engram's
# normalization: upper case, accents and surrounding whitespace map to the plain word.
WORDS = ([f"w{i}" for i in range(70)] + [f"W{i}" for i in range(10)] + [f" w{i} " for i in range(10, 15)]
         + ["café", "cafe", "CAFÉ", "naïve", "naive", " ", "\t", "\n\n", "ｆｕｌｌ", "full"])


def tokenizer_json() -> str:
    from tokenizers import Tokenizer, models

    vocab = {word: i for i, word in enumerate(WORDS)}
    return Tokenizer(models.WordLevel(vocab, unk_token="w0")).to_str()


@functools.lru_cache(maxsize=1)
def _compressed() -> tuple[tuple[int, ...], int]:
    """The tokenizer's compressed token map and its number of distinct ids."""
    import tempfile

    from kvmesh.services.engine.model.deepseek_v4.v41_engram import compressed_token_map
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(tokenizer_json())
        f.flush()
        mapping, distinct = compressed_token_map(f.name)
    return tuple(mapping), distinct


def token_map() -> torch.Tensor:
    return torch.tensor(_compressed()[0])


def engram_fields(layers: list[int], head_dim: int = 32) -> dict:
    """text_config fields giving `layers` Engram modules (2- and 3-grams, two heads each)."""
    from kvmesh.services.engine.model.deepseek_v4.v41_engram import EngramSpec, table_rows

    distinct = _compressed()[1]
    spec = EngramSpec(tuple(layers), (), 3, 2, head_dim, 23, distinct, 0)
    return dict(engram_layer_ids=layers, engram_num_embeddings=table_rows(spec),
                engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=head_dim,
                engram_vocab_size=23, engram_compressed_vocab_size=distinct, engram_pad_id=0)


def raw_config(name: str, **overrides) -> dict:
    fields, _ = CONFIGS[name]
    return {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
            "text_config": {**BASE, **fields, **overrides}}


def config(name: str, **overrides) -> V41Config:
    return v41_config_from_dict(raw_config(name, **overrides))


def weights(cfg: V41Config, seed: int = 0, dtype: torch.dtype = torch.float64) -> dict:
    """Random weights for `cfg` under the release's names (experts stacked)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.03, mean=0.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * std + mean).to(dtype)

    D, V, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    H, d, R = cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    mix = (2 + n) * n
    w = {"embed.weight": rnd(V, D, std=1.0), "norm.weight": rnd(D, std=0.15, mean=1.0),
         "head.weight": rnd(V, D)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w.update({p + "attn_norm.weight": rnd(D, std=0.15, mean=1.0),
                  p + "ffn_norm.weight": rnd(D, std=0.15, mean=1.0)})
        for hc in ("hc_attn", "hc_ffn"):
            w.update({p + f"{hc}_fn": rnd(mix, n * D), p + f"{hc}_base": rnd(mix, std=0.15),
                      p + f"{hc}_scale": rnd(3, std=0.15, mean=1.0)})
        a = p + "attn."
        w.update({a + "wq_a.weight": rnd(R, D), a + "q_norm.weight": rnd(R, std=0.15, mean=1.0),
                  a + "wq_b.weight": rnd(H * d, R), a + "wkv.weight": rnd(d, D),
                  a + "kv_norm.weight": rnd(d, std=0.15, mean=1.0),
                  a + "wo_a.weight": rnd(cfg.o_groups * cfg.o_lora_rank, H * d // cfg.o_groups),
                  a + "wo_b.weight": rnd(D, cfg.o_groups * cfg.o_lora_rank),
                  a + "attn_sink": rnd(H, std=0.15)})
        if i in cfg.kv_sources:
            c = a + "compressor."
            w.update({c + "wkv.weight": rnd(d, D), c + "norm.weight": rnd(d, std=0.15, mean=1.0)})
            if cfg.ratio(i) > 1:
                w[c + "wgate.weight"] = rnd(d, D, std=0.3)
        if i in cfg.index_sources:
            x = a + "indexer."
            w.update({x + "wq_b.weight": rnd(cfg.index_heads * cfg.index_head_dim, R, std=0.1),
                      x + "weights_proj.weight": rnd(cfg.index_heads, D, std=0.1)})
            if i in cfg.kv_sources:
                w.update({x + "wk.weight": rnd(cfg.index_head_dim, d, std=0.1),
                          x + "k_norm.weight": rnd(cfg.index_head_dim, std=0.15, mean=1.0)})
        f = p + "ffn."
        E, inter = cfg.n_experts, cfg.moe_inter
        w.update({f + "gate.weight": rnd(E, D, std=0.1), f + "gate.bias": rnd(E, std=0.1),
                  f + "experts.w13": rnd(E, 2 * inter, D), f + "experts.w2": rnd(E, D, inter),
                  f + "shared_experts.w1.weight": rnd(inter, D), f + "shared_experts.w3.weight": rnd(inter, D),
                  f + "shared_experts.w2.weight": rnd(D, inter)})
    if cfg.engram is not None:
        from kvmesh.services.engine.model.deepseek_v4.v41_engram import TOKEN_MAP
        from kvmesh.services.engine.model.deepseek_v4.v41_names import engram_shapes

        for name, shape in engram_shapes(cfg).items():
            std, mean = {"embed.weight": (1.0, 0.0), "wkv.weight": (0.05, 0.0)}.get(
                name.split("engram.")[1], (0.15, 1.0))
            w[name] = rnd(*shape, std=std, mean=mean)
        w[TOKEN_MAP] = token_map()
    if cfg.mtp_layers:                   # kvmesh's MTP module ("kvmesh": {"mtp_layers": 1})
        from kvmesh.services.engine.model.deepseek_v4.v41_names import mtp_shapes

        for name, shape in mtp_shapes(cfg).items():
            if name.endswith(("norm.weight", "_scale")):
                w[name] = rnd(*shape, std=0.15, mean=1.0)
            elif len(shape) == 1 or name.endswith(("proj.weight", "_fn")) or "gate." in name:
                w[name] = rnd(*shape, std=0.15 if len(shape) == 1 else 0.1)
            else:
                w[name] = rnd(*shape)
    return w


def prompt(name: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, BASE["vocab_size"], (CONFIGS[name][1],), generator=g)


# matrices the release stores as FP8 e4m3 with 32 x 32 UE8M0 block scales (the routed experts
# are FP4; the router, embedding, head, norms, sinks and mixing weights stay floating point)
def _fp8(name: str) -> bool:
    return name.endswith(".weight") and ".attn." in name and "norm" not in name \
        or ".shared_experts." in name or name.endswith("engram.wkv.weight")


def quant_fp8_runs(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An Engram table as the release stores it: e4m3 with a UE8M0 scale per 1 x 32 run."""
    runs = w.float().unflatten(1, (-1, 32))
    scale = torch.exp2(torch.ceil(torch.log2(runs.abs().amax(-1).clamp(min=1e-12) / 448.0)))
    q = (runs / scale.unsqueeze(-1)).flatten(1).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def save_release(name: str, directory, seed: int = 0, shards: int = 2, quantized: bool = True,
                 **overrides) -> tuple[V41Config, dict]:
    """Write config `name` as DeepSeek's release lays a V4.1 checkpoint out: the release's
    names, per-expert w1 / w2 / w3, `shards` files with an index, and (quantized) FP8 dense
    weights with 32 x 32 UE8M0 scales and FP4 routed experts. Returns the config and the
    float64 weights the files stand for (each quantized tensor dequantized)."""
    import json

    from kvmesh.services.engine.model.deepseek_v4 import quant
    from tests.engine.deepseek_v4.tiny import quant_fp4, quant_fp8, write_safetensors

    raw = raw_config(name, **overrides)
    if quantized:
        raw["text_config"]["quantization_config"] = {
            "quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
            "expert_dtype": "fp4", "activation_scheme": "dynamic"}
    cfg = v41_config_from_dict(raw)
    w = weights(cfg, seed, torch.float32)
    stored, meant = {}, {}

    def put(key: str, value: torch.Tensor, fp4: bool = False):
        if quantized and key.endswith("engram.embed.weight"):
            q, scale = quant_fp8_runs(value)
            stored[key], stored[key[:-len(".weight")] + ".scale"] = q, scale
            return quant.dequant_fp8_runs(q, scale).double()
        if quantized and fp4:
            q, scale = quant_fp4(value)
            stored[key], stored[key[:-len(".weight")] + ".scale"] = q, scale
            return quant.dequant_fp4(q, scale).double()
        if quantized and _fp8(key):
            q, scale = quant_fp8(value, 32, ue8m0=True)
            stored[key], stored[key[:-len(".weight")] + ".scale"] = q, scale
            return quant.dequant_fp8(q, scale, 32).double()
        stored[key] = value.contiguous()
        return value.double()

    from kvmesh.services.engine.model.deepseek_v4.v41_engram import TOKEN_MAP
    if cfg.engram is not None:
        meant[TOKEN_MAP] = w.pop(TOKEN_MAP)
        (directory / "tokenizer.json").parent.mkdir(parents=True, exist_ok=True)
        (directory / "tokenizer.json").write_text(tokenizer_json())
    for key, value in w.items():
        if key.endswith("experts.w13"):
            base, inter = key[:-len("w13")], value.shape[1] // 2
            meant[key] = torch.stack([torch.cat([put(f"{base}{e}.w1.weight", value[e, :inter], True),
                                                 put(f"{base}{e}.w3.weight", value[e, inter:], True)])
                                      for e in range(value.shape[0])])
        elif key.endswith("experts.w2"):
            base = key[:-len("w2")]
            meant[key] = torch.stack([put(f"{base}{e}.w2.weight", value[e], True)
                                      for e in range(value.shape[0])])
        else:
            meant[key] = put(key, value)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    write_safetensors(stored, directory, shards)
    return cfg, meant
