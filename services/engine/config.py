"""How one engine runs its model (`EngineConfig`); what the model is comes from its
checkpoint's config (model/deepseek_v4/config.py, v41_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh import envs

# --- engine configuration ------------------------------------------------------------
# EngineConfig: how one engine process runs (not what the model is).
#
# Frozen and checked at construction: a truncation mode without an explicit
# KEEP, a KEEP smaller than W + B, or truncation together with deterministic
# mode stops start-up with a message saying so.
#
# Built from flags by `EngineConfig.from_flags` (flag > KVMESH_* variable >
# default, resolved in kvmesh/envs.py); constructing it directly reads no
# environment.

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
        if self.step_slo_ms < 0:
            raise ValueError(f"step_slo_ms must be >= 0 (0: off), not {self.step_slo_ms}")
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
        """Checks that need the model geometry: its window W."""
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
