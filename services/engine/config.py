"""Model configuration: the V4-mini family as frozen dataclasses.

`ModelConfig` describes weights and attention geometry; it checks its own
invariants in `__post_init__`, so a bad preset fails at construction rather
than as a shape error deep in a forward pass. Values discovered at run time
(slots, blocks, ring sizes from the environment) live elsewhere and are never
written back here.

Layer kinds:
    swa  window only
    csa  window + top-k compressed entries (1 per `csa_m` tokens, lightning indexer)
    hca  window + all visible compressed entries (1 per `hca_m` tokens)
The first half of the layers is the YOCO encoder, the second half the decoder.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace

from kvmesh.cachekeys import model_fingerprint

LAYER_KINDS = ("swa", "csa", "hca")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: tuple[str, ...]
    hidden: int
    n_heads: int
    head_dim: int = 512          # shared K = V latent
    rope_dim: int = 64           # RoPE on the last `rope_dim` dims of q and kv
    rope_theta: float = 10000.0
    window: int = 128            # W
    csa_m: int = 4
    hca_m: int = 128
    block_size: int = 128        # tokens per cache block: a multiple of both m
    csa_topk: int = 16
    index_heads: int = 2
    index_dim: int = 64
    ffn_hidden: int = 256
    vocab_size: int = 260
    max_seq_len: int = 131072
    norm_eps: float = 1e-6
    mxfp8_block: int = 32        # values per E8M0 scale

    def __post_init__(self):
        if not self.layers or len(self.layers) % 2:
            raise ValueError(f"{self.name}: need an even, non-zero number of layers (encoder + decoder halves)")
        bad = [k for k in self.layers if k not in LAYER_KINDS]
        if bad:
            raise ValueError(f"{self.name}: unknown layer kinds {bad}; expected {LAYER_KINDS}")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"{self.name}: rope_dim must be even and in (0, head_dim]")
        if self.head_dim % self.mxfp8_block:
            raise ValueError(f"{self.name}: head_dim must be a multiple of {self.mxfp8_block} (MXFP8)")
        for m in (self.csa_m, self.hca_m):
            if m <= 0 or self.block_size % m:
                raise ValueError(f"{self.name}: block_size {self.block_size} must be a multiple of m={m}")
        if self.window <= 0 or self.window > self.block_size:
            # Snapshots sit on block boundaries and bounded replay spans one block,
            # so the window must fit inside one block.
            raise ValueError(f"{self.name}: window must be in (0, block_size]")
        if self.csa_topk <= 0:
            raise ValueError(f"{self.name}: csa_topk must be positive")
        # Once per config (so once per engine): admission, snapshot checks and GetModelInfo
        # read it. Not a field, so equality, asdict() and to_json() ignore it.
        object.__setattr__(self, "_fingerprint", model_fingerprint(asdict(self)))

    # --- derived geometry -------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_encoder_layers(self) -> int:
        return len(self.layers) // 2

    def is_encoder(self, layer: int) -> bool:
        return layer < self.n_encoder_layers

    def compress_ratio(self, layer: int) -> int | None:
        kind = self.layers[layer]
        return {"csa": self.csa_m, "hca": self.hca_m}.get(kind)

    @property
    def compressed_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layers) if k != "swa"]

    @property
    def csa_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layers) if k == "csa"]

    @property
    def swa_bytes_per_token(self) -> int:
        """MXFP8: one E4M3 byte per value + one E8M0 scale byte per block of 32."""
        return self.head_dim + self.head_dim // self.mxfp8_block

    def fingerprint(self) -> str:
        """Identifies the model's cache semantics: part of every block hash
        (kvmesh.cachekeys.model_fingerprint of the fields, computed at construction)."""
        return self._fingerprint

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> ModelConfig:
        d = json.loads(text)
        d["layers"] = tuple(d["layers"])
        return ModelConfig(**d)


def _alternating(n: int, first: str) -> list[str]:
    other = "hca" if first == "csa" else "csa"
    return [first if i % 2 == 0 else other for i in range(n)]


TINY = ModelConfig(
    name="tiny",
    layers=("swa", "swa", "csa", "hca", "csa", "hca", "csa", "hca"),
    hidden=128,
    n_heads=2,
    ffn_hidden=256,
    index_dim=32,
)

# 40 layers = 20 encoder + 20 decoder; layers 0-1 swa, then csa/hca alternating.
V41_FLASH = ModelConfig(
    name="v41-flash",
    layers=tuple(["swa", "swa"] + _alternating(38, "csa")),
    hidden=4096,
    n_heads=64,
    index_heads=64,
    index_dim=128,
    csa_topk=512,
    ffn_hidden=11264,
    vocab_size=129280,
    max_seq_len=1 << 20,
)

PRESETS = {c.name: c for c in (TINY, V41_FLASH)}


def preset(preset_name: str, **overrides) -> ModelConfig:
    """A preset by name, optionally with fields replaced (tests shrink W and m this way)."""
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[preset_name]
    return replace(cfg, **overrides) if overrides else cfg


def small_test_config(**overrides) -> ModelConfig:
    """tiny with W, m and block size shrunk so prompts span many windows and groups quickly."""
    base = dict(window=16, csa_m=4, hca_m=16, block_size=16, csa_topk=4, max_seq_len=4096)
    base.update(overrides)
    return preset("tiny", name="tiny-small", **base)


assert math.lcm(TINY.csa_m, TINY.hca_m) == TINY.block_size
