"""Secrets on disk (credentials, keys, configs that hold them): created 0600 before a byte
is written, so no other user can read them even for a moment."""

from __future__ import annotations

from pathlib import Path


def write_private(path: Path, data: str | bytes) -> Path:
    """Write `data` to `path` (its directory made if needed), readable by this user only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)                       # touch keeps the mode of a file already there
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path
