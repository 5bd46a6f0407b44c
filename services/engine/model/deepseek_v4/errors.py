"""The one error a DeepSeek V4 checkpoint directory can raise at load."""

from __future__ import annotations

from kvmesh.errors import KvmeshError


class CheckpointError(KvmeshError, ValueError):
    """A checkpoint that cannot be served. The message is one line naming the file, the tensor
    or field, and what was expected; the CLI prints it as is."""
