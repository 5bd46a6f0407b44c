"""Configuration: what the model is (`ModelConfig`) and how one engine runs it (`EngineConfig`).

Model configuration: the V4-mini family as frozen dataclasses.

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

from kvmesh import envs
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


# --- engine configuration ------------------------------------------------------------
# EngineConfig: how one engine process runs (not what the model is).
#
# Frozen and checked at construction: a truncation mode without an explicit
# KEEP, a KEEP smaller than W + B, or truncation together with deterministic
# mode stops start-up with a message saying so.
#
# Built from flags by `EngineConfig.from_flags` (flag > KVMESH_* variable >
# default, resolved in kvmesh/envs.py); constructing it directly reads no
# environment. Every size derived from it lives in `RuntimeLayout`
# (cache/layout.py), built once per engine.

TRUNCATION_MODES = ("off", "mask", "compact")
REPLAY_BLOCKS = ("share", "isolate")
# unified: prefill and decode (today's engine); prefill: extra-state ring (396/262), hands
# requests off after their first token; decode: the 134 ring, adopts handoffs (and still
# serves whole requests, e.g. a fallback). docs/design.md §9.
ROLES = ("unified", "prefill", "decode")
SPEC_POLICIES = ("adaptive", "always")      # core/draft_policy.py


@dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 16
    num_blocks: int = 1024
    max_batched_tokens: int = 512       # prefill chunk budget per step (decode tokens count too)
    max_running: int = 16
    long_prefill_chunk: int = 0         # most prompt tokens per sequence per step (0: budget only)
    itl_ratio: float = 0.0              # a step with decodes sized to <= this x a decode-only step
                                        # (measured, core/step_costs.py); 0: off
    step_slo_ms: float = 0.0            # a step with decodes sized to finish within this many
                                        # ms (fitted, core/step_budget.py); 0: off
    truncation: str = "off"             # YOCO prefill truncation: off | mask | compact
    keep_tokens: int = 0                # KEEP; must be explicit when truncation is on
    extra_state: bool = False           # prefill-engine SWA ring of 396
    extra_state_size: int = 128         # PREFILL_STORE_EXTRA: rows the long ring adds
    max_backtrack: int = 6              # B: tokens a sequence may take back (speculative decoding)
    speculative: str = "off"            # off | ngram:K | mtp:K, K <= B (core/speculative.py)
    spec_policy: str = "adaptive"       # adaptive | always (core/draft_policy.py)
    ngram_min: int = 1                  # ngram drafter: suffix lengths it looks up
    ngram_max: int = 4
    deterministic: bool = False
    swa_policy: str = "full"            # full | periodic:N | zero
    replay_blocks: str = "share"        # blocks completed after a bounded replay: share | isolate
    snapshot_bytes: int = 256 << 20     # host-memory snapshot store budget
    snapshot_ttl_min: float = 60.0
    dtype: str = "float32"
    seed: int = 0                       # weight init seed when no checkpoint is given
    device: str = "auto"                # auto (CUDA when available) | cpu | cuda | cuda:N
    role: str = "unified"               # unified | prefill | decode (ROLES)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")
        if self.role == "prefill" and not self.extra_state:
            raise ValueError("role prefill needs extra-state on (the 396-row ring): "
                             "--extra-state or no --no-extra-state")
        if self.role == "decode" and self.extra_state:
            raise ValueError("role decode keeps the 134-row inference ring: --no-extra-state")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, not {self.truncation!r}")
        if self.deterministic and self.truncation != "off":
            raise ValueError("deterministic mode refuses YOCO truncation: preemption with truncation "
                             "may change results; use --truncation off")
        for name in ("num_slots", "num_blocks", "max_batched_tokens", "max_running"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("keep_tokens", "extra_state_size", "max_backtrack", "long_prefill_chunk"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.spec_policy not in SPEC_POLICIES:
            raise ValueError(f"spec_policy must be one of {SPEC_POLICIES}, not {self.spec_policy!r}")
        if self.itl_ratio < 0 or 0 < self.itl_ratio <= 1:
            raise ValueError(f"itl_ratio must be 0 (off) or above 1, not {self.itl_ratio}")
        if self.step_slo_ms < 0:
            raise ValueError(f"step_slo_ms must be >= 0 (0: off), not {self.step_slo_ms}")
        if self.step_slo_ms and self.itl_ratio:
            raise ValueError("itl_ratio and step_slo_ms both size a step's prefill work: give "
                             "one (--itl-ratio X --step-slo-ms 0, or the default)")
        if self.dtype not in ("float32", "float64"):
            raise ValueError("dtype must be float32 or float64")
        dev = self.device
        if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {dev!r}")
        if self.replay_blocks not in REPLAY_BLOCKS:
            raise ValueError(f"replay_blocks must be one of {REPLAY_BLOCKS}, not {self.replay_blocks!r}")
        policy = self.swa_policy
        if not (policy in ("full", "zero") or (policy.startswith("periodic:")
                                               and policy[9:].isdigit() and int(policy[9:]) > 0)):
            raise ValueError(f"swa_policy must be full, zero or periodic:N (N > 0), not {policy!r}")

    @classmethod
    def from_flags(cls, env=None, **flags) -> EngineConfig:
        """Flags that are None fall back to the KVMESH_* variables in envs.ENGINE_VARS."""
        return envs.engine_config_from_flags(cls, env, **flags)

    def check_model(self, cfg) -> None:
        """Checks that need the model geometry: its window W (a V4-mini ModelConfig's or a
        V41Config's)."""
        if self.truncation == "off":
            return
        need = cfg.window + self.max_backtrack
        if self.keep_tokens == 0:
            raise ValueError(f"truncation {self.truncation!r} needs KEEP given explicitly "
                             f"(--keep-tokens / KVMESH_YOCO_PREFILL_KEEP_TOKENS), at least W + B = {need}")
        if self.keep_tokens < need:
            raise ValueError(f"KEEP = {self.keep_tokens} is smaller than W + B = {need}")

    @property
    def snapshot_period(self) -> int | None:
        """Store every N-th block boundary; None = never (zero policy)."""
        if self.swa_policy == "zero":
            return None
        return 1 if self.swa_policy == "full" else int(self.swa_policy[9:])
