"""Chained block hashes: a block's identity covers everything before it.

    h_k = sha256(h_{k-1} || token ids of block k || model fingerprint || cache salt)

Two sequences share block k only if all tokens up to the end of block k agree,
the model (and so the cache semantics) is the same, and they belong to the same
tenant (salt). Hashes are 32 bytes; their hex form is the kvstore key.
"""

from __future__ import annotations

import hashlib
import struct

ROOT = b"\x00" * 32


def block_hash(parent: bytes, token_ids, fingerprint: str, salt: str = "") -> bytes:
    h = hashlib.sha256()
    h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(fingerprint.encode())
    h.update(b"\x00")
    h.update(salt.encode())
    return h.digest()


def chain(token_ids, block_size: int, fingerprint: str, salt: str = "") -> list[bytes]:
    """Hashes of every complete block of `token_ids`."""
    out, parent = [], ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], fingerprint, salt)
        out.append(parent)
    return out
