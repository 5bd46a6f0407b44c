"""Which live index a kvstore uses (`KvstoreConfig.index`), and its maintenance lease.

    sqlite     meta.MetaStore over <data_dir>/meta.sqlite: one kvstore process
    redis://   meta_redis.RedisMeta, shared by every replica over the same locations,
               with lease.SharedLease (GC, scrub --repair, reindex: one runner at a time)
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kvmesh.services.kvstore.config import KvstoreConfig
from kvmesh.services.kvstore.lease import LocalLease, SharedLease
from kvmesh.services.kvstore.meta import MetaStore
from kvmesh.services.kvstore.meta_redis import RedisMeta


def open_index(cfg: KvstoreConfig, now: float):
    """(meta, lease) for this configuration."""
    if cfg.index == "sqlite":
        return MetaStore(Path(cfg.data_dir) / "meta.sqlite", now=now), LocalLease()
    meta = RedisMeta(cfg.index, now, prefix=cfg.index_prefix, username=cfg.redis_username,
                     password=cfg.redis_password)
    holder = cfg.replica or f"{socket.gethostname()}:{os.getpid()}"
    return meta, SharedLease(meta, holder, cfg.lease_ttl_s)
