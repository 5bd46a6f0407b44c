"""Names of SWA snapshots, shared by engines (store, publish) and the gateway (routing).

A snapshot at position S (a multiple of the block size) holds the stored region
of a slot after S tokens. It is named by the chained hash of the block that
ends at S and by the layout fingerprint, so a snapshot from an engine with a
different model or slot layout can never be restored:

    key(S) = sha256(block_hash(S) || layout_fingerprint).hex()      (64 hex chars)
"""

from __future__ import annotations

import hashlib

from services.engine.cache import hashing
from services.engine.cache.state_layout import StateBlock
from services.engine.config import ModelConfig


def layout_fingerprint(block: StateBlock) -> str:
    cfg = block.cfg
    parts = [cfg.fingerprint(), block.inference_ring, block.swa_token_bytes, block.n_stored_layers,
             block.state_size_to_disk]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def snapshot_key(block_hash: bytes, layout_fp: str) -> str:
    return hashlib.sha256(block_hash + layout_fp.encode()).hexdigest()


def prefix_snapshot_keys(token_ids, cfg: ModelConfig, layout_fp: str, salt: str = ""
                         ) -> list[tuple[int, str]]:
    """(position, key) for every block boundary of token_ids, shortest first."""
    hashes = hashing.chain(token_ids, cfg.block_size, cfg.fingerprint(), salt)
    return [((i + 1) * cfg.block_size, snapshot_key(h, layout_fp)) for i, h in enumerate(hashes)]


def block_keys(token_ids, cfg: ModelConfig, salt: str = "") -> list[str]:
    """kvstore keys (hex chained block hashes) of every complete block."""
    return [h.hex() for h in hashing.chain(token_ids, cfg.block_size, cfg.fingerprint(), salt)]
