"""The models shipped in the repository's models/ directory (a source checkout's)."""

from __future__ import annotations

from pathlib import Path

MODELS = Path(__file__).resolve().parents[1] / "models"
# The default model: DeepSeek V4.1's architecture, trained here (models/deepseek-v41-tiny/
# README.md): what `kvmesh up`, `kvmesh engine serve` and `generate --local` serve when no
# model flag is given.
DEFAULT_MODEL = MODELS / "deepseek-v41-tiny"
