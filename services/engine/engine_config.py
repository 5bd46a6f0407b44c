"""EngineConfig: how one engine process runs (not what the model is).

Frozen and checked at construction: a truncation mode without an explicit
KEEP, a KEEP smaller than W + B, or truncation together with deterministic
mode stops start-up with a message saying so.

Built from flags by `EngineConfig.from_flags` (flag > KVMESH_* variable >
default, resolved in kvmesh/envs.py); constructing it directly reads no
environment. Every size derived from it lives in `RuntimeLayout`
(cache/layout.py), built once per engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh import envs
from services.engine.config import ModelConfig

TRUNCATION_MODES = ("off", "mask", "compact")


@dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 16
    num_blocks: int = 1024
    max_batched_tokens: int = 512       # prefill chunk budget per step (decode tokens count too)
    max_running: int = 16
    truncation: str = "off"             # YOCO prefill truncation: off | mask | compact
    keep_tokens: int = 0                # KEEP; must be explicit when truncation is on
    extra_state: bool = False           # prefill-engine SWA ring of 396
    extra_state_size: int = 128         # PREFILL_STORE_EXTRA: rows the long ring adds
    max_backtrack: int = 6              # B: tokens a sequence may take back (speculative decoding)
    deterministic: bool = False
    swa_policy: str = "full"            # full | periodic:N | zero
    snapshot_bytes: int = 256 << 20     # host-memory snapshot store budget
    snapshot_ttl_min: float = 60.0
    dtype: str = "float32"
    seed: int = 0                       # weight init seed when no checkpoint is given

    def __post_init__(self):
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, not {self.truncation!r}")
        if self.deterministic and self.truncation != "off":
            raise ValueError("deterministic mode refuses YOCO truncation: preemption with truncation "
                             "may change results; use --truncation off")
        for name in ("num_slots", "num_blocks", "max_batched_tokens", "max_running"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("keep_tokens", "extra_state_size", "max_backtrack"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError("dtype must be float32 or float64")
        policy = self.swa_policy
        if not (policy in ("full", "zero") or (policy.startswith("periodic:")
                                               and policy[9:].isdigit() and int(policy[9:]) > 0)):
            raise ValueError(f"swa_policy must be full, zero or periodic:N (N > 0), not {policy!r}")

    @classmethod
    def from_flags(cls, env=None, **flags) -> EngineConfig:
        """Flags that are None fall back to the KVMESH_* variables in envs.ENGINE_VARS."""
        return envs.engine_config_from_flags(cls, env, **flags)

    def check_model(self, cfg: ModelConfig) -> None:
        """Checks that need the model geometry (window W)."""
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
