"""Hot tiers in front of the durable store: memory LRU, then local disk LRU.

Both are caches of durable objects and may drop anything at any time. Entries
carry the object's generation, so a stale copy (the key was overwritten) is a
miss, never wrong data. Each class is the only owner of its LRU index and byte
count; all calls come from the one asyncio event loop, so no locks.

Disk file layout (`<data_dir>/blocks/<key>`):

    0..3 magic b"KVDT" | 4..11 generation u64 | 12..19 size u64 | 20..23 crc32(payload)
    24.. payload (size bytes)

Files are written to a temp name and renamed, so a reader sees the old file or
the new one, never half of one, and an open file stays readable after GC
unlinks it.
"""

from __future__ import annotations

import itertools
import os
import struct
from collections import OrderedDict
from pathlib import Path

import aiofiles
from isal.isal_zlib import crc32

_DISK_HEADER = struct.Struct("<4sQQI")
_DISK_MAGIC = b"KVDT"


class MemoryTier:
    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.used = 0
        self._items: OrderedDict[str, tuple[int, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str, generation: int) -> bytes | None:
        item = self._items.get(key)
        if item is None or item[0] != generation:
            return None
        self._items.move_to_end(key)
        return item[1]

    def put(self, key: str, generation: int, data: bytes) -> None:
        self.drop(key)
        if len(data) > self.capacity or self.capacity == 0:
            return
        self._items[key] = (generation, data)
        self.used += len(data)
        while self.used > self.capacity:
            _, (_, old) = self._items.popitem(last=False)
            self.used -= len(old)

    def drop(self, key: str) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self.used -= len(item[1])


class DiskTier:
    def __init__(self, root: Path, capacity_bytes: int):
        self.root = Path(root)
        self.capacity = capacity_bytes
        self.used = 0
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (gen, size)
        self._tmp = itertools.count()
        self.root.mkdir(parents=True, exist_ok=True)
        self._load()

    def __len__(self) -> int:
        return len(self._index)

    def _load(self) -> None:
        """Rebuild the index from the files, oldest first (mtime = last use)."""
        entries = []
        for path in self.root.iterdir():
            if path.name.startswith("."):
                path.unlink(missing_ok=True)  # a temp file from a crash
                continue
            try:
                with open(path, "rb") as f:
                    magic, gen, size, _ = _DISK_HEADER.unpack(f.read(_DISK_HEADER.size))
                if magic != _DISK_MAGIC:
                    raise ValueError
                entries.append((path.stat().st_mtime, path.name, gen, size))
            except (OSError, ValueError, struct.error):
                path.unlink(missing_ok=True)
        for _, key, gen, size in sorted(entries):
            self._index[key] = (gen, size)
            self.used += size
        self._evict()

    def _evict(self) -> None:
        while self.used > self.capacity and self._index:
            key, (_, size) = self._index.popitem(last=False)
            self.used -= size
            (self.root / key).unlink(missing_ok=True)

    async def get(self, key: str, generation: int) -> bytes | None:
        entry = self._index.get(key)
        if entry is None or entry[0] != generation:
            return None
        self._index.move_to_end(key)
        try:
            async with aiofiles.open(self.root / key, "rb") as f:
                blob = await f.read()
        except FileNotFoundError:
            return None
        magic, gen, size, crc = _DISK_HEADER.unpack_from(blob)
        payload = blob[_DISK_HEADER.size:]
        if (magic, gen, size) != (_DISK_MAGIC, generation, len(payload)) or crc32(payload) != crc:
            self.drop(key)  # bit rot or a torn file: the durable tier still has it
            return None
        return payload

    async def put(self, key: str, generation: int, data: bytes) -> None:
        self.drop(key)
        if len(data) > self.capacity or self.capacity == 0:
            return
        tmp = self.root / f".{key}.{next(self._tmp)}"
        header = _DISK_HEADER.pack(_DISK_MAGIC, generation, len(data), crc32(data))
        async with aiofiles.open(tmp, "wb") as f:
            await f.write(header)
            await f.write(data)
        os.replace(tmp, self.root / key)
        old = self._index.pop(key, None)  # a concurrent put of the same key got here first
        if old is not None:
            self.used -= old[1]
        self._index[key] = (generation, len(data))
        self.used += len(data)
        self._evict()

    def drop(self, key: str) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self.used -= entry[1]
            (self.root / key).unlink(missing_ok=True)
