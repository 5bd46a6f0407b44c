"""Every KVMESH_* environment variable, read in one place with its type and default.

Environment is only a fallback: a value given on the command line (or passed to
a config constructor) always wins, then the variable, then the dataclass
default. Values are read when a config is built, never at import, and nothing
derived from them is cached at module level: a config object, once built, is
the single answer for the process.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

# EngineConfig field -> the variable the design uses for it. These names have no
# common prefix (they predate the per-service KVMESH_<SERVICE>_* scheme), so the
# engine lists them instead of deriving them from field names.
ENGINE_VARS = {
    "truncation": "KVMESH_YOCO_PREFILL_TRUNCATION_MODE",     # off | mask | compact
    "keep_tokens": "KVMESH_YOCO_PREFILL_KEEP_TOKENS",        # KEEP; required with truncation
    "extra_state": "KVMESH_PREFILL_STORE_EXTRA_STATE",       # 1/0: prefill-engine long ring
    "extra_state_size": "KVMESH_PREFILL_STORE_EXTRA_SIZE",   # PREFILL_STORE_EXTRA (128)
    "max_backtrack": "KVMESH_MAX_BACKTRACKING_TOKENS",       # B (6)
    "device": "KVMESH_ENGINE_DEVICE",                        # auto | cpu | cuda | cuda:N
}


def _to_bool(name: str, raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use 1/0)")


def _parse(name: str, raw: str, kind: type):
    """`raw` as the type of the field's default; errors name the variable."""
    if kind is bool:
        return _to_bool(name, raw)
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def _from_names(cls, names: Mapping[str, str], env: Mapping[str, str] | None,
                overrides: dict):
    """Defaults, then each set variable `names[field]`, then overrides that are not None.
    A variable whose field is overridden is not even parsed: a given flag wins outright."""
    env = os.environ if env is None else env
    given = {k: v for k, v in overrides.items() if v is not None}
    values: dict = {}
    for f in dataclasses.fields(cls):
        name = names.get(f.name)
        raw = env.get(name) if name and f.name not in given else None
        if raw is None or raw == "":
            continue
        values[f.name] = _parse(name, raw, type(f.default))
    values.update(given)
    return cls(**values)


def config_from_env(cls, prefix: str, env=None, **overrides):
    """Build a frozen config dataclass: field defaults, then `<prefix><FIELD>` variables
    (parsed as the default's type), then explicit overrides that are not None."""
    names = {f.name: prefix + f.name.upper() for f in dataclasses.fields(cls)}
    return _from_names(cls, names, env, overrides)


def engine_config_from_flags(cls, env=None, **flags):
    """EngineConfig from command-line values: a flag that is not None wins, then the
    ENGINE_VARS variable, then the field default. The only place the engine reads
    the environment."""
    return _from_names(cls, ENGINE_VARS, env, flags)
