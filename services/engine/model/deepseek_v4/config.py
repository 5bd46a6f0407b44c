"""DeepSeek V4's configuration, read from `config.json` in either published form.

transformers' form (what `DeepseekV4Config.save_pretrained` writes): `layer_types`,
`compress_rates` per type, `mlp_layer_types`, nested `rope_parameters` {main, compress},
`partial_rotary_factor`. DeepSeek's own form: `compress_ratios` (0 / 4 / 128 per layer, then
one entry per MTP layer), `num_hash_layers`, `qk_rope_head_dim`, a flat `rope_scaling` (YaRN of
the compress RoPE). Missing fields take DeepseekV4Config's defaults (V4-Flash's sizes).

Every problem is a `CheckpointError` naming the file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError

SLIDING, CSA, HCA = "sliding", "csa", "hca"
HASH, MOE = "hash", "moe"
ATTENTION_TYPES = {"sliding_attention": SLIDING, "compressed_sparse_attention": CSA,
                   "heavily_compressed_attention": HCA}
MLP_TYPES = {"hash_moe": HASH, "moe": MOE}
MODEL_TYPES = ("deepseek_v4",)
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")


@dataclass(frozen=True)
class Yarn:
    """YaRN scaling of a RoPE: frequencies between the two correction dims are interpolated."""
    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class Rope:
    """One RoPE setting: `main` (sliding-only layers) or `compress` (CSA / HCA layers)."""
    theta: float
    dim: int                      # rotated channels: the trailing `dim` of each head
    yarn: Yarn | None = None
    # multiplies cos and sin (YaRN's attention factor; V4 forces 1.0 where it writes the field)
    scaling: float = 1.0


@dataclass(frozen=True)
class V4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    layer_kinds: tuple[str, ...] = ()      # SLIDING / CSA / HCA per layer
    mlp_kinds: tuple[str, ...] = ()        # HASH / MOE per layer
    num_heads: int = 64
    head_dim: int = 512                    # the one shared K = V head
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window: int = 128
    csa_rate: int = 4
    hca_rate: int = 128
    main_rope: Rope = field(default_factory=lambda: Rope(10000.0, 64))
    compress_rope: Rope = field(default_factory=lambda: Rope(160000.0, 64))
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    index_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_experts: int = 256
    experts_per_token: int = 6
    moe_inter: int = 2048
    scoring_func: str = "sqrtsoftplus"
    routed_scale: float = 1.5
    swiglu_limit: float = 10.0
    rms_eps: float = 1e-6
    num_mtp_layers: int = 1
    mtp_kind: str = SLIDING                # the MTP block's attention (DeepSeek's last ratio)
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    max_position: int = 1048576            # max_position_embeddings: prompt + output at most
    # None, or the checkpoint's quantization_config (the loader decides what it can read)
    quantization: dict | None = None

    def __post_init__(self):
        def bad(msg: str):
            raise CheckpointError(msg)
        if not self.layer_kinds:
            bad("num_hidden_layers must be positive")
        if len(self.mlp_kinds) != len(self.layer_kinds):
            bad(f"mlp_layer_types has {len(self.mlp_kinds)} entries for "
                f"{len(self.layer_kinds)} layers")
        check_shared_sizes(self)
        if self.csa_rate <= 0 or self.hca_rate <= 0 or self.window <= 0:
            bad("compress rates and sliding_window must be positive")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of `layer` (0 for a sliding-only layer)."""
        return self.rate_of(self.layer_kinds[layer])

    def rate_of(self, kind: str) -> int:
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[kind]

    def rope(self, layer: int) -> Rope:
        return self.main_rope if self.layer_kinds[layer] == SLIDING else self.compress_rope


def check_shared_sizes(cfg) -> None:
    """The checks V4's and V4.1's configs share (their fields of the same names)."""
    if cfg.head_dim % 2 or cfg.main_rope.dim % 2 or not 0 < cfg.main_rope.dim <= cfg.head_dim:
        raise CheckpointError(f"the rotary dims ({cfg.main_rope.dim}) must be even and at most "
                              f"head_dim ({cfg.head_dim})")
    if (cfg.num_heads * cfg.head_dim) % cfg.o_groups:
        raise CheckpointError(f"num_attention_heads x head_dim ({cfg.num_heads * cfg.head_dim}) "
                              f"is not divisible by o_groups ({cfg.o_groups})")
    if not 0 < cfg.experts_per_token <= cfg.n_experts:
        raise CheckpointError(f"num_experts_per_tok ({cfg.experts_per_token}) must be in "
                              f"1..n_routed_experts ({cfg.n_experts})")
    if cfg.scoring_func not in SCORING_FUNCS:
        raise CheckpointError(f"scoring_func {cfg.scoring_func!r} is not supported (expected "
                              f"one of {SCORING_FUNCS})")
    if cfg.index_head_dim < cfg.compress_rope.dim:
        raise CheckpointError(f"index_head_dim ({cfg.index_head_dim}) is smaller than the "
                              f"rotary dims ({cfg.compress_rope.dim})")


def read_config(path: str | Path) -> V4Config:
    """`config.json` (or the directory holding it) -> V4Config; CheckpointError names the file."""
    return read_json_config(path, config_from_dict)


def read_json_config(path: str | Path, parse):
    """`config.json` (or the directory holding it) through `parse(raw dict)`; every
    CheckpointError names the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file (a checkpoint directory holds config.json)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    try:
        return parse(raw)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def config_from_dict(raw: dict) -> V4Config:
    raw = dict(raw.get("text_config") or {}, **{k: v for k, v in raw.items() if k != "text_config"})
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"model_type {model_type!r} is not DeepSeek V4 (expected one of "
                              f"{list(MODEL_TYPES)})")
    n = _int(raw, "num_hidden_layers", 43)
    if int(raw.get("num_key_value_heads", 1)) != 1:
        raise CheckpointError("num_key_value_heads must be 1 (DeepSeek V4 has one shared K = V head)")
    rates = dict(raw.get("compress_rates") or {})
    csa = int(raw.get("compress_rate_csa", rates.get("compressed_sparse_attention", 4)))
    hca = int(raw.get("compress_rate_hca", rates.get("heavily_compressed_attention", 128)))
    head_dim = _int(raw, "head_dim", 512)
    if raw.get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * float(raw["partial_rotary_factor"]))
    elif raw.get("qk_rope_head_dim") is not None:
        rope_dim = _int(raw, "qk_rope_head_dim", 64)
    else:  # DeepseekV4Config's default factor, 64 / 512
        rope_dim = head_dim // 8
    main, compress = _ropes(raw, rope_dim)
    eos = raw.get("eos_token_id", 1)
    return V4Config(
        vocab_size=_int(raw, "vocab_size", 129280), hidden_size=_int(raw, "hidden_size", 4096),
        layer_kinds=_layer_kinds(raw, n), mlp_kinds=_mlp_kinds(raw, n),
        num_heads=_int(raw, "num_attention_heads", 64), head_dim=head_dim,
        q_lora_rank=_int(raw, "q_lora_rank", 1024), o_groups=_int(raw, "o_groups", 8),
        o_lora_rank=_int(raw, "o_lora_rank", 1024), window=_int(raw, "sliding_window", 128),
        csa_rate=csa, hca_rate=hca, main_rope=main, compress_rope=compress,
        hc_mult=_int(raw, "hc_mult", 4), hc_sinkhorn_iters=_int(raw, "hc_sinkhorn_iters", 20),
        hc_eps=float(raw.get("hc_eps", 1e-6)), index_heads=_int(raw, "index_n_heads", 64),
        index_head_dim=_int(raw, "index_head_dim", 128), index_topk=_int(raw, "index_topk", 512),
        n_experts=_int(raw, "n_routed_experts", 256),
        experts_per_token=_int(raw, "num_experts_per_tok", 6),
        moe_inter=_int(raw, "moe_intermediate_size", 2048),
        scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
        routed_scale=float(raw.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        num_mtp_layers=_int(raw, "num_nextn_predict_layers", 1),
        mtp_kind=_mtp_kind(raw, n),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        max_position=_int(raw, "max_position_embeddings", 1048576),
        quantization=_quantization(raw))


def _int(raw: dict, key: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"field {key!r} must be an integer, got {value!r}")
    return value


def _named_types(raw: dict, key: str, names: dict[str, str], n: int) -> tuple[str, ...]:
    """A per-layer list of type names (`layer_types`, `mlp_layer_types`) -> kinds."""
    types = list(raw[key])
    unknown = sorted({str(t) for t in types if t not in names})
    if unknown:
        raise CheckpointError(f"{key}: unknown type(s) {unknown} (expected {sorted(names)})")
    if len(types) != n:
        raise CheckpointError(f"{key} has {len(types)} entries for num_hidden_layers = {n}")
    return tuple(names[t] for t in types)


def _layer_kinds(raw: dict, n: int) -> tuple[str, ...]:
    if raw.get("layer_types") is not None:
        return _named_types(raw, "layer_types", ATTENTION_TYPES, n)
    if raw.get("compress_ratios") is not None:
        # DeepSeek's ratios only choose the type (one more entry per MTP layer is dropped);
        # the rates themselves come from compress_rates.
        by_ratio = {0: SLIDING, 4: CSA, 128: HCA}
        kinds = []
        for i, r in enumerate(raw["compress_ratios"]):
            if r not in by_ratio:
                raise CheckpointError(f"compress_ratios[{i}] = {r!r}: expected 0, 4 or 128")
            kinds.append(by_ratio[r])
    else:  # DeepseekV4Config's default schedule: HCA, HCA, then HCA / CSA alternating
        kinds = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    if len(kinds) < n:
        raise CheckpointError(f"{len(kinds)} layer types for num_hidden_layers = {n}")
    return tuple(kinds[:n])


def _mtp_kind(raw: dict, n: int) -> str:
    """The MTP block's attention: DeepSeek's compress_ratios carry it after the layers'
    (0 on V4-Flash); sliding when the config does not say."""
    ratios = raw.get("compress_ratios") or []
    return {4: CSA, 128: HCA}.get(ratios[n], SLIDING) if len(ratios) > n else SLIDING


def _mlp_kinds(raw: dict, n: int) -> tuple[str, ...]:
    if raw.get("mlp_layer_types") is not None:
        return _named_types(raw, "mlp_layer_types", MLP_TYPES, n)
    hashed = _int(raw, "num_hash_layers", 3)
    return tuple([HASH] * min(n, hashed) + [MOE] * max(0, n - hashed))


def _ropes(raw: dict, rope_dim: int) -> tuple[Rope, Rope]:
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main_raw, compress_raw = params["main"], params["compress"]
        # a nested yarn dict without attention_factor gets YaRN's own mscale, as transformers does
        default_scaling = None
    else:
        flat = raw.get("rope_scaling") or {k: v for k, v in params.items()
                                           if k not in ("main", "compress")}
        main_raw = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        compress_raw = {**flat, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
        default_scaling = 1.0  # V4 forces attention_factor 1.0 when it nests a flat yarn dict
    return (_rope(main_raw, rope_dim, "main", default_scaling),
            _rope(compress_raw, rope_dim, "compress", default_scaling))


def _rope(d: dict, rope_dim: int, label: str, default_scaling: float | None) -> Rope:
    kind = d.get("rope_type", d.get("type", "default"))
    theta = float(d.get("rope_theta", 10000.0 if label == "main" else 160000.0))
    if kind == "default":
        return Rope(theta, rope_dim)
    if kind != "yarn":
        raise CheckpointError(f"rope_parameters.{label}: rope_type {kind!r} is not supported "
                              "(expected default or yarn)")
    try:
        factor = float(d["factor"])
        original = int(d["original_max_position_embeddings"])
    except KeyError as exc:
        raise CheckpointError(f"rope_parameters.{label}: yarn needs {exc.args[0]!r}") from None
    scaling = d.get("attention_factor", default_scaling)
    if scaling is None:
        scaling = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return Rope(theta, rope_dim, Yarn(factor, original, float(d.get("beta_fast") or 32),
                                      float(d.get("beta_slow") or 1)), float(scaling))


def _quantization(raw: dict) -> dict | None:
    q = raw.get("quantization_config")
    if q is None:
        return None
    q = dict(q)
    if raw.get("expert_dtype") is not None:  # DeepSeek's top-level field, as transformers moves it
        q.setdefault("expert_dtype", raw["expert_dtype"])
    return q
