"""Every KVMESH_* environment variable, read in one place with its type and default.

Values are read when asked for (not at import), so tests may set them; code
that caches a size derived from them must offer a way to clear that cache
(see services/engine/cache/rings.py).
"""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return _to_bool(name, raw)


def _to_bool(name: str, raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use 1/0)")


def max_backtracking_tokens() -> int:
    """B: tokens a sequence may take back (speculative decoding); also absorbs snapshot lag."""
    return _int("KVMESH_MAX_BACKTRACKING_TOKENS", 6)


def prefill_store_extra_state() -> bool:
    """Prefill engines keep a longer SWA ring so a window can be re-assembled at any chunk end."""
    return _bool("KVMESH_PREFILL_STORE_EXTRA_STATE", False)


def prefill_store_extra_size() -> int:
    return _int("KVMESH_PREFILL_STORE_EXTRA_SIZE", 128)


def yoco_truncation_mode() -> str:
    mode = os.environ.get("KVMESH_YOCO_PREFILL_TRUNCATION_MODE", "off") or "off"
    if mode not in ("off", "mask", "compact"):
        raise ValueError(f"KVMESH_YOCO_PREFILL_TRUNCATION_MODE={mode!r}: use off, mask or compact")
    return mode


def yoco_keep_tokens() -> int:
    """0 = not given. Must be set explicitly (>= W + B) when truncation is on."""
    return _int("KVMESH_YOCO_PREFILL_KEEP_TOKENS", 0)


def config_from_env(cls, prefix: str, env=None, **overrides):
    """Build a frozen config dataclass: field defaults, then `<prefix><FIELD>` variables
    (parsed as the default's type), then explicit overrides that are not None."""
    import dataclasses

    env = os.environ if env is None else env
    values: dict = {}
    for f in dataclasses.fields(cls):
        name = prefix + f.name.upper()
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        kind = type(f.default)
        try:
            values[f.name] = _to_bool(name, raw) if kind is bool else kind(raw)
        except ValueError as exc:
            raise ValueError(f"{name}={raw!r}: {exc}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)
