"""The engine's side of snapshot and block names (the names themselves: kvmesh/cachekeys.py).

`layout_fingerprint` names this engine's stored-window byte layout (part of every
snapshot key); the two helpers take a ModelConfig where kvmesh.cachekeys takes its
block size and fingerprint.
"""

from __future__ import annotations

from kvmesh import cachekeys
from services.engine.cache.state_layout import StateBlock
from services.engine.config import ModelConfig


def layout_fingerprint(block: StateBlock) -> str:
    return cachekeys.layout_fingerprint(block.cfg.fingerprint(), block.inference_ring,
                                        block.swa_token_bytes, block.n_stored_layers,
                                        block.state_size_to_disk)


def prefix_snapshot_keys(token_ids, cfg: ModelConfig, layout_fp: str, salt: str = ""
                         ) -> list[tuple[int, str]]:
    """(position, key) for every block boundary of token_ids, shortest first."""
    return cachekeys.prefix_snapshot_keys(token_ids, cfg.block_size, cfg.fingerprint(),
                                          layout_fp, salt)


def block_keys(token_ids, cfg: ModelConfig, salt: str = "") -> list[str]:
    """kvstore keys (hex chained block hashes) of every complete block."""
    return cachekeys.block_keys(token_ids, cfg.block_size, cfg.fingerprint(), salt)
