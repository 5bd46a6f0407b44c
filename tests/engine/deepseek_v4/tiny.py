"""Tiny random DeepSeek V4 checkpoints made by transformers (the oracle), saved to disk.

Parameters are drawn wider than transformers' init (sinks, biases and position biases are
zero there) so every piece moves the logits; `tid2eid` and the correction bias are random.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvmesh.services.engine.model.deepseek_v4 import quant

BASE = dict(vocab_size=100, hidden_size=64, num_attention_heads=4, head_dim=32,
            partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            index_n_heads=2, index_head_dim=16, max_position_embeddings=4096)

# name -> (config fields, tokens to score). Between them: sliding, CSA and HCA layers; hash and
# routed MoE; hc_mult 2, 3 and 4; YaRN (flat and nested); DeepSeek's config form; and the real
# ring geometry (window 128, rates 4 / 128, head_dim 512) over a prompt longer than 300 tokens.
CONFIGS = {
    "mixed": (dict(num_hidden_layers=4, sliding_window=8, hc_mult=2, index_topk=64,
                   layer_types=["sliding_attention", "heavily_compressed_attention",
                                "compressed_sparse_attention", "compressed_sparse_attention"],
                   compress_rates={"compressed_sparse_attention": 4,
                                   "heavily_compressed_attention": 16},
                   mlp_layer_types=["hash_moe", "moe", "moe", "moe"]), 40),
    "yarn_hc4": (dict(num_hidden_layers=4, sliding_window=16, hc_mult=4, index_topk=64,
                      compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1,
                      compress_rates={"compressed_sparse_attention": 4,
                                      "heavily_compressed_attention": 8},
                      rope_scaling={"type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 32,
                                    "beta_fast": 32.0, "beta_slow": 1.0}), 70),
    "topk_nested_yarn": (dict(num_hidden_layers=3, sliding_window=8, hc_mult=3, index_topk=3,
                              index_n_heads=16,
                              layer_types=["compressed_sparse_attention",
                                           "heavily_compressed_attention",
                                           "compressed_sparse_attention"],
                              compress_rates={"compressed_sparse_attention": 4,
                                              "heavily_compressed_attention": 4},
                              mlp_layer_types=["moe", "hash_moe", "moe"],
                              rope_parameters={
                                  "main": {"rope_type": "default", "rope_theta": 10000.0},
                                  "compress": {"rope_type": "yarn", "rope_theta": 160000.0,
                                               "factor": 8.0,
                                               "original_max_position_embeddings": 16}}), 50),
    "flash_geometry": (dict(num_hidden_layers=3, sliding_window=128, hc_mult=2,
                            num_attention_heads=2, head_dim=512, partial_rotary_factor=0.125,
                            index_n_heads=4, index_head_dim=128, index_topk=512,
                            layer_types=["sliding_attention", "compressed_sparse_attention",
                                         "heavily_compressed_attention"],
                            mlp_layer_types=["hash_moe", "moe", "moe"]), 310),
}


def hf_config(name: str):
    from transformers import DeepseekV4Config
    fields, _ = CONFIGS[name]
    cfg = DeepseekV4Config(**{**BASE, **fields})
    cfg._experts_implementation = "eager"  # grouped_mm refuses float64
    return cfg


def hf_model(name: str, seed: int = 0):
    from transformers import DeepseekV4ForCausalLM
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(name)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(0.0, 0.15 if p.dim() < 2 else 0.03)
            if pname.endswith(("norm.weight", "hc_scale", ".scale")):
                p.add_(1.0)
        for bname, b in model.named_buffers():
            if bname.endswith("tid2eid"):
                b.copy_(torch.randint(0, model.config.n_routed_experts, b.shape))
            elif bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def save(name: str, directory: Path, seed: int = 0):
    """Save config `name` with transformers; returns the float32 model it saved."""
    model = hf_model(name, seed)
    model.save_pretrained(directory)
    return model


def prompt(name: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, BASE["vocab_size"], (CONFIGS[name][1],), generator=g)


def hf_logprobs(model, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S - 1] log-probabilities of ids[1:] under transformers' forward in `dtype`."""
    model = model.to(dtype)
    with torch.no_grad():
        logits = model(ids.view(1, -1), use_cache=False).logits[0]
    lp = torch.log_softmax(logits.double(), dim=-1)
    return lp[:-1].gather(1, ids[1:].view(-1, 1)).view(-1), logits


def resave(model, directory: Path, naming: str, shards: int = 1, fp8: str | None = None,
           fp4_experts: bool = False, config_form: str = "transformers") -> None:
    """Write `model`'s weights again: naming "deepseek" (`layers.0.attn.wq_a.weight`, per-expert
    w1 / w2 / w3, no prefix) or "transformers" (module names, stacked experts); split into
    `shards` files with an index; FP8 e4m3 dense weights with float32 or "ue8m0" 128 x 128
    scales; FP4 routed experts (DeepSeek naming only)."""
    import json


    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    if config_form == "deepseek":
        raw = json.loads((directory / "config.json").read_text())
        ratio = {"sliding_attention": 0, "compressed_sparse_attention": 4,
                 "heavily_compressed_attention": 128}
        raw["compress_ratios"] = [ratio[t] for t in raw.pop("layer_types")] + [0]
        hashed = raw.pop("mlp_layer_types").count("hash_moe")
        raw["num_hash_layers"] = hashed
        raw.pop("partial_rotary_factor")  # qk_rope_head_dim stays
        compress = raw.pop("rope_parameters")["compress"]
        if compress["rope_type"] == "yarn":  # flat form: the attention factor reads as 1.0
            raw["rope_scaling"] = {"type": "yarn", **{k: compress[k] for k in (
                "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")}}
        (directory / "config.json").write_text(json.dumps(raw))
    state = {k: v.detach().float().clone() if v.is_floating_point() else v.clone()
             for k, v in model.state_dict().items()}
    if naming == "deepseek":
        from kvmesh.services.engine.model.deepseek_v4.names import source
        renamed = {}
        for k, v in state.items():
            name = source(k).name
            if name.endswith("experts.w13"):
                inter = v.shape[1] // 2
                for e in range(v.shape[0]):
                    base = name[: -len("w13")] + f"{e}."
                    renamed[base + "w1.weight"] = v[e, :inter].contiguous()
                    renamed[base + "w3.weight"] = v[e, inter:].contiguous()
            elif name.endswith("experts.w2"):
                for e in range(v.shape[0]):
                    renamed[name[: -len("w2")] + f"{e}.w2.weight"] = v[e].contiguous()
            else:
                renamed[name] = v
        state = renamed
    if fp8 or fp4_experts:
        state = _quantize(state, naming, fp8, fp4_experts)
    write_safetensors(state, directory, shards)


def write_safetensors(state: dict, directory: Path, shards: int = 1) -> None:
    """`state` as model.safetensors, or split over `shards` files with an index."""
    import json

    from safetensors.torch import save_file

    if shards == 1:
        save_file(state, str(directory / "model.safetensors"))
        return
    keys, weight_map = sorted(state), {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i::shards]}
        save_file(part, str(directory / file))
        weight_map.update({k: file for k in part})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


def _fp8_dense(name: str) -> bool:
    """Dense weights DeepSeek ships in FP8 (by this package's names)."""
    return name.endswith(("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight",
                          "attn.wo_a.weight", "attn.wo_b.weight", "indexer.wq_b.weight")) \
        or ".shared_experts." in name


def _quantize(state: dict, naming: str, fp8: str | None, fp4_experts: bool) -> dict:
    from kvmesh.services.engine.model.deepseek_v4.names import source
    out = {}
    for k, v in state.items():
        expert = source(k).expert is not None
        scale_name = k[: -len(".weight")] + ".scale" if naming == "deepseek" else k + "_scale_inv"
        if expert and fp4_experts:
            out[k], out[scale_name] = quant_fp4(v)
        elif fp8 and (_fp8_dense(source(k).name) or expert):
            out[k], out[scale_name] = quant_fp8(v, 128, ue8m0=fp8 == "ue8m0")
        else:
            out[k] = v
    return out


def dequantized_copy(model, naming: str, fp8: str | None, fp4_experts: bool):
    """The float model a quantized checkpoint stands for (stacked experts, in transformers'
    naming, stay unquantized)."""
    import copy

    from kvmesh.services.engine.model.deepseek_v4 import quant
    from kvmesh.services.engine.model.deepseek_v4.names import source

    def round_trip(w: torch.Tensor, experts: bool) -> torch.Tensor:
        if experts and fp4_experts:
            return quant.dequant_fp4(*quant_fp4(w))
        if fp8:
            return quant.dequant_fp8(*quant_fp8(w, 128, fp8 == "ue8m0"), 128)
        return w

    out = copy.deepcopy(model)
    with torch.no_grad():
        for k, p in out.named_parameters():
            name = source(k).name
            if ".experts.w" in name and naming != "deepseek":
                continue
            if name.endswith("experts.w13"):  # w1 and w3 are stored (and quantized) apart
                inter = p.shape[1] // 2
                for e in range(p.shape[0]):
                    p[e, :inter] = round_trip(p[e, :inter], True)
                    p[e, inter:] = round_trip(p[e, inter:], True)
            elif name.endswith("experts.w2"):
                for e in range(p.shape[0]):
                    p[e] = round_trip(p[e], True)
            elif fp8 and _fp8_dense(name):
                p.copy_(round_trip(p, False))
    return out


def stored_model(name: str, directory: Path, dtype: torch.dtype = torch.float64):
    """Config `name` saved by transformers, loaded as the engine's ledger path computes it."""
    from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_checkpoint
    from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
    save(name, directory)
    cfg, weights = load_checkpoint(directory, dtype)
    return V4Model(cfg, weights, dtype, stored=True)


# The inverses of services/engine/model/deepseek_v4/quant.py, for writing test checkpoints.
def quant_fp8(w: torch.Tensor, block: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for writing test checkpoints: per-tile scale = amax / 448 (a power of two
    when `ue8m0`), q = e4m3(w / scale)."""
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    padded = w.float().new_zeros(rows * block, cols * block)
    padded[:out, :inp] = w.float()
    tiles = padded.view(rows, block, cols, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (tiles / scale.view(rows, 1, cols, 1)).view(rows * block, cols * block)[:out, :inp]
    q = q.to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For test checkpoints: the nearest e2m1 code per value, UE8M0 scale per 32-run."""
    out, inp = w.shape
    runs = w.float().view(out, inp // quant.FP4_RUN, quant.FP4_RUN)
    amax = runs.abs().amax(dim=-1).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
    scaled = (runs / scale.unsqueeze(-1)).reshape(out, inp)
    codes = (scaled.unsqueeze(-1) - quant.FP4_VALUES).abs().argmin(dim=-1).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)
