"""What a request's prompt finds in the other tiers: what this engine holds of it (LocalView,
which decides what to fetch), and what was fetched before admission (Prefetched)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.services.engine.cache.snapshots import Snapshot


@dataclass
class LocalView:
    """What this engine holds for a prompt, for prefetching from the other tiers."""
    hashes: list[bytes] = field(default_factory=list)
    n_local: int = 0                   # leading blocks found in the local pool
    snapshot_keys: set[str] = field(default_factory=set)   # keys of those hashes held here


@dataclass
class Prefetched:
    """Cache contents fetched from other tiers before admission (kvstore blocks, peer snapshot),
    and the prompt's block hashes computed for the fetch (the sequence starts its chain with
    them instead of hashing the prompt again)."""
    hashes: list[bytes] = field(default_factory=list)
    blocks: dict[bytes, bytes] = field(default_factory=dict)   # block hash -> serialized block
    snapshots: dict[str, Snapshot] = field(default_factory=dict)
