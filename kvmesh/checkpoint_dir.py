"""What a checkpoint directory's config.json says, read without the model code (no torch):
the launchers, the gateway and the engine's loaders all ask it which architecture a
directory holds."""

from __future__ import annotations

import json
from pathlib import Path

V41_MODEL_TYPES = ("deepseek_v41",)


def model_type(path: str | Path) -> str | None:
    """config.json's model_type (its text_config's first): which loader a checkpoint
    directory, or a config file, takes. None when unreadable (the loader reports it,
    naming the file)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    text = raw.get("text_config")
    inner = text.get("model_type") if isinstance(text, dict) else None
    return inner or raw.get("model_type")


def is_v41(path: str | Path) -> bool:
    """A DeepSeek V4.1 checkpoint (KV-source and consumer layers)."""
    return model_type(path) in V41_MODEL_TYPES
