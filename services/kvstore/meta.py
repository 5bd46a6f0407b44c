"""Object metadata (generation, size, traffic class, times, complete flag).

Kept in a sqlite file in the kvstore data dir, mirrored in a dict for reads.
Why sqlite and not a metadata object per key in S3: GC needs every record
(sizes, access times) at once, which would mean listing and fetching every
meta object on each start and each GC pass; the put path would pay a 13th S3
round trip; and access-time updates would be S3 writes. sqlite gives atomic
commits on local disk at tens of microseconds, and WAL mode survives a
process crash. The cost: the data dir is part of the durable state. If it is
lost, shards written before the new database existed are never swept as
orphans (see `gc.find_orphans`), so data is not destroyed by mistake.

`MetaStore` is the only owner of the records and of the sqlite connection.
Each record carries the object's blake3 digest, taken at put time: the
durable tier checks reassembled bytes against it before answering (records
written before digests existed have none and are served unchecked).

Access times change in memory on every hit and reach sqlite in one batched
transaction per `flush()` (the service calls it every `access_flush_s`).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
  key TEXT PRIMARY KEY,
  generation INTEGER NOT NULL,
  size INTEGER NOT NULL,
  traffic_class TEXT NOT NULL,
  created REAL NOT NULL,
  last_access REAL NOT NULL,
  complete INTEGER NOT NULL,
  digest BLOB
);
CREATE TABLE IF NOT EXISTS info (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass
class Record:
    generation: int
    size: int
    traffic_class: str
    created: float
    last_access: float
    complete: bool
    digest: bytes | None = None  # blake3 of the object (32 bytes); None: written before digests


class MetaStore:
    def __init__(self, path: Path, now: float):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(objects)")}
        if "digest" not in columns:  # a database from before digests: keep its records
            self._db.execute("ALTER TABLE objects ADD COLUMN digest BLOB")
        self._db.execute("INSERT OR IGNORE INTO info VALUES ('created', ?)", (repr(now),))
        self.created = float(
            self._db.execute("SELECT value FROM info WHERE name='created'").fetchone()[0]
        )
        self._records: dict[str, Record] = {}
        self._dirty: set[str] = set()
        self.complete_bytes = 0
        for key, gen, size, tc, created, last, complete, digest in self._db.execute(
            "SELECT key, generation, size, traffic_class, created, last_access, complete, digest"
            " FROM objects"
        ):
            self._records[key] = Record(gen, size, tc, created, last, bool(complete),
                                        None if digest is None else bytes(digest))
            if complete:
                self.complete_bytes += size

    def close(self) -> None:
        self.flush()
        self._db.close()

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: str) -> Record | None:
        return self._records.get(key)

    def current(self, key: str) -> Record | None:
        """The record if the object is committed and readable."""
        rec = self._records.get(key)
        return rec if rec is not None and rec.complete else None

    def items(self) -> list[tuple[str, Record]]:
        return list(self._records.items())

    def begin_put(self, key: str, generation: int, size: int, traffic_class: str,
                  now: float, digest: bytes | None = None) -> None:
        """Record an upload before its shards are written (complete=0): a crash
        mid-put leaves a record GC can find and clean up."""
        self._forget(key)
        self._records[key] = Record(generation, size, traffic_class, now, now, False, digest)
        self._db.execute(
            "INSERT OR REPLACE INTO objects (key, generation, size, traffic_class, created,"
            " last_access, complete, digest) VALUES (?, ?, ?, ?, ?, ?, 0, ?)",
            (key, generation, size, traffic_class, now, now, digest),
        )

    def commit_put(self, key: str, generation: int) -> bool:
        rec = self._records.get(key)
        if rec is None or rec.generation != generation or rec.complete:
            return False
        rec.complete = True
        self.complete_bytes += rec.size
        self._db.execute(
            "UPDATE objects SET complete=1 WHERE key=? AND generation=?", (key, generation)
        )
        return True

    def remove(self, key: str, generation: int | None = None) -> Record | None:
        """Delete the record (only if still at `generation`, when given)."""
        rec = self._records.get(key)
        if rec is None or (generation is not None and rec.generation != generation):
            return None
        self._forget(key)
        self._db.execute("DELETE FROM objects WHERE key=?", (key,))
        return rec

    def _forget(self, key: str) -> None:
        rec = self._records.pop(key, None)
        self._dirty.discard(key)
        if rec is not None and rec.complete:
            self.complete_bytes -= rec.size

    def touch(self, key: str, now: float) -> None:
        rec = self._records.get(key)
        if rec is not None and now > rec.last_access:
            rec.last_access = now
            self._dirty.add(key)

    def flush(self) -> int:
        """Write pending access times in one transaction; returns how many."""
        if not self._dirty:
            return 0
        rows = [(self._records[k].last_access, k) for k in self._dirty if k in self._records]
        self._dirty.clear()
        self._db.execute("BEGIN")
        self._db.executemany("UPDATE objects SET last_access=? WHERE key=?", rows)
        self._db.execute("COMMIT")
        return len(rows)
