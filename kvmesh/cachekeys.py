"""Names of cached state, shared by the engines (store, publish) and the gateway (routing).

Pure functions over token ids and fingerprints; no service imports this module's
callers' types, so the gateway can name an engine's cache contents without the engine.

Block hashes chain, so a block's identity covers everything before it:

    h_k = sha256(h_{k-1} || token ids of block k (uint32 LE) || model fp || 0x00 || salt)

Two sequences share block k only if all tokens up to the end of block k agree, the
model (and so the cache semantics) is the same, and they belong to the same tenant
(salt). Hashes are 32 bytes; their hex form is the kvstore key.

A snapshot at position S (a multiple of the block size) is named by the hash of the
block that ends at S and by the layout fingerprint, so a snapshot from an engine with
a different model or slot layout can never be restored:

    key(S) = sha256(h_{S/B - 1} || layout fingerprint).hex()      (64 hex chars)
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence

ROOT = b"\x00" * 32


def model_fingerprint(config: Mapping) -> str:
    """16 hex chars naming a model's cache semantics, from its config fields (the dict of
    served model's fields (core/request.py ServedModel.to_json), as an engine's
    GetModelInfo returns them, parsed)."""
    blob = json.dumps(dict(config), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def layout_fingerprint(model_fp: str, inference_ring: int, swa_token_bytes: int,
                       n_stored_layers: int, state_size_to_disk: int) -> str:
    """16 hex chars naming the byte layout of a stored SWA window (part of snapshot keys)."""
    parts = [model_fp, inference_ring, swa_token_bytes, n_stored_layers, state_size_to_disk]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def block_hash(parent: bytes, token_ids: Sequence[int], fingerprint: str, salt: str = "") -> bytes:
    h = hashlib.sha256()
    h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(fingerprint.encode())
    h.update(b"\x00")
    h.update(salt.encode())
    return h.digest()


def chain(token_ids: Sequence[int], block_size: int, fingerprint: str, salt: str = ""
          ) -> list[bytes]:
    """Hashes of every complete block of `token_ids`."""
    return extend_chain([], token_ids, len(token_ids) // block_size, block_size, fingerprint, salt)


def extend_chain(hashes: list[bytes], token_ids: Sequence[int], n_blocks: int, block_size: int,
                 fingerprint: str, salt: str = "") -> list[bytes]:
    """Grow `hashes` (the chain of `token_ids`' first blocks, computed earlier) to cover
    min(n_blocks, complete blocks) blocks, in place, and return that many. A request keeps
    its chain this way and hashes each block once, however often it is asked."""
    n = max(0, min(n_blocks, len(token_ids) // block_size))
    while len(hashes) < n:
        k = len(hashes)
        parent = hashes[-1] if hashes else ROOT
        hashes.append(block_hash(parent, token_ids[k * block_size:(k + 1) * block_size],
                                 fingerprint, salt))
    return hashes[:n]


def snapshot_key(block_hash: bytes, layout_fp: str) -> str:
    return hashlib.sha256(block_hash + layout_fp.encode()).hexdigest()


def prefix_snapshot_keys(token_ids: Sequence[int], block_size: int, model_fp: str,
                         layout_fp: str, salt: str = "") -> list[tuple[int, str]]:
    """(position, key) for every block boundary of token_ids, shortest first."""
    hashes = chain(token_ids, block_size, model_fp, salt)
    return [((i + 1) * block_size, snapshot_key(h, layout_fp)) for i, h in enumerate(hashes)]


def block_keys(token_ids: Sequence[int], block_size: int, model_fp: str, salt: str = ""
               ) -> list[str]:
    """kvstore keys (hex chained block hashes) of every complete block."""
    return [h.hex() for h in chain(token_ids, block_size, model_fp, salt)]
