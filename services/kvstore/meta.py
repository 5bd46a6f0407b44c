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

A block stored in a run (runs.py) has `run` set to the run id and `offset`
into the run payload; the run's own row (`RunRecord`: size, fragment data
size, where fragment data starts in a shard) lives in the `runs` table. Only
this class tracks how many live blocks each run has; a run whose last block
was removed is listed in `dead_runs` until the caller deleted its shards and
called `drop_run`.

Access times change in memory on every hit and reach sqlite in one batched
transaction per `flush()` (the service calls it every `access_flush_s`).
"""

from __future__ import annotations

import dataclasses
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
CREATE TABLE IF NOT EXISTS runs (
  run TEXT PRIMARY KEY,
  generation INTEGER NOT NULL,
  size INTEGER NOT NULL,
  frag_data INTEGER NOT NULL,
  data_at INTEGER NOT NULL,
  digest BLOB NOT NULL,
  created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS info (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# Columns added after the first release: (name, type) added in place to older databases.
_LATER_COLUMNS = (("digest", "BLOB"), ("run", "TEXT NOT NULL DEFAULT ''"),
                  ("offset", "INTEGER NOT NULL DEFAULT 0"))


@dataclass
class Record:
    generation: int
    size: int
    traffic_class: str
    created: float
    last_access: float
    complete: bool
    digest: bytes | None = None  # blake3 of the object (32 bytes); None: written before digests
    run: str = ""  # run id when stored in a run (runs.py); "" = an object of its own
    offset: int = 0  # in the run payload


@dataclass(frozen=True)
class RunRecord:
    generation: int
    size: int  # payload bytes
    frag_data: int  # payload bytes per data shard (F)
    data_at: int  # offset of fragment data in every stored shard object
    digest: bytes  # blake3 of the payload
    created: float


class MetaStore:
    def __init__(self, path: Path, now: float):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(objects)")}
        for name, kind in _LATER_COLUMNS:  # an older database: keep its records
            if name not in columns:
                self._db.execute(f'ALTER TABLE objects ADD COLUMN "{name}" {kind}')
        self._db.execute("INSERT OR IGNORE INTO info VALUES ('created', ?)", (repr(now),))
        self.created = float(
            self._db.execute("SELECT value FROM info WHERE name='created'").fetchone()[0]
        )
        self._records: dict[str, Record] = {}
        self._dirty: set[str] = set()
        self.complete_bytes = 0
        self.runs: dict[str, RunRecord] = {}
        self._live: dict[str, int] = {}  # run id -> blocks with a record pointing at it
        self.dead_runs: set[str] = set()  # no live block left; shards still to delete
        # run id -> overwrites of committed blocks, not current before commit_run (memory only)
        self._pending: dict[str, list[tuple[str, Record]]] = {}
        for run, gen, size, frag, at, digest, created in self._db.execute(
            "SELECT run, generation, size, frag_data, data_at, digest, created FROM runs"
        ):
            self.runs[run] = RunRecord(gen, size, frag, at, bytes(digest), created)
            self._live[run] = 0
        for key, gen, size, tc, created, last, complete, digest, run, off in self._db.execute(
            "SELECT key, generation, size, traffic_class, created, last_access, complete, digest,"
            ' run, "offset" FROM objects'
        ):
            self._records[key] = Record(gen, size, tc, created, last, bool(complete),
                                        None if digest is None else bytes(digest), run, off)
            if run:
                self._live[run] = self._live.get(run, 0) + 1
            if complete:
                self.complete_bytes += size
        self.dead_runs = {r for r, n in self._live.items() if n == 0}

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

    def current_many(self, keys: list[str]) -> dict[str, Record]:
        """Committed records of `keys` (one round trip in the shared index)."""
        return {k: r for k in keys if (r := self.current(k)) is not None}

    def items(self) -> list[tuple[str, Record]]:
        return list(self._records.items())

    def begin_put(self, key: str, generation: int, size: int, traffic_class: str,
                  now: float, digest: bytes | None = None) -> None:
        """Record an upload before its shards are written (complete=0): a crash
        mid-put leaves a record GC can find and clean up."""
        self._insert(key, Record(generation, size, traffic_class, now, now, False, digest))

    def _insert(self, key: str, rec: Record) -> None:
        self._forget(key)
        self._records[key] = rec
        if rec.run:
            self._live[rec.run] = self._live.get(rec.run, 0) + 1
            self.dead_runs.discard(rec.run)
        if rec.complete:
            self.complete_bytes += rec.size
        self._db.execute(
            "INSERT OR REPLACE INTO objects (key, generation, size, traffic_class, created,"
            ' last_access, complete, digest, run, "offset") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)',
            (key, rec.generation, rec.size, rec.traffic_class, rec.created, rec.last_access,
             int(rec.complete), rec.digest, rec.run, rec.offset),
        )

    def begin_run(self, run: str, info: RunRecord, blocks: list[tuple[str, Record]]) -> None:
        """Record a run and its new blocks (complete=0) in one transaction, before the
        shards are written; a crash mid-put leaves stale records GC removes (then the run).
        A block that overwrites a committed one is held in memory only (`_pending`) until
        `commit_run`: the committed version stays current, so a crash mid-put loses
        nothing that was acknowledged (the new run is then reclaimed as dead)."""
        self._db.execute("BEGIN")
        self.add_run(run, info)
        for key, rec in blocks:
            cur = self._records.get(key)
            if cur is not None and cur.complete:
                self._pending.setdefault(run, []).append((key, rec))
                self._live[run] += 1
            else:
                self._insert(key, rec)
        self._db.execute("COMMIT")

    def abort_run(self, run: str, blocks: list[tuple[str, int]]) -> None:
        """The run's shards did not land: forget its blocks (the run becomes dead)."""
        for key, gen in blocks:
            self.remove(key, gen)
        for _ in self._pending.pop(run, []):
            self._release(run)

    def add_run(self, run: str, info: RunRecord) -> None:
        self.runs[run] = info
        self._live.setdefault(run, 0)
        self._db.execute("INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (run, info.generation, info.size, info.frag_data, info.data_at,
                          info.digest, info.created))

    def restore(self, key: str, rec: Record) -> None:
        """Insert a record as found on the locations (reindex); replaces any other."""
        self._insert(key, rec)

    def drop_run(self, run: str) -> bool:
        """Forget a run with no live block left (its shards are deleted or about to be);
        True if this call dropped it (False: blocks left, or dropped already)."""
        if self._live.get(run, 0) > 0 or run not in self.runs:
            return False
        self.runs.pop(run, None)
        self._live.pop(run, None)
        self.dead_runs.discard(run)
        self._db.execute("DELETE FROM runs WHERE run=?", (run,))
        return True

    def find_dead_runs(self) -> set[str]:
        """Recount runs with no live block (after `restore`, which may add runs whose
        every block is held newer elsewhere)."""
        self.dead_runs = {r for r in self.runs if self._live.get(r, 0) == 0}
        return self.dead_runs

    def live_blocks(self, run: str) -> int:
        return self._live.get(run, 0)

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

    def commit_run(self, run: str, blocks: list[tuple[str, int]]) -> list[str]:
        """Commit the blocks of a run (one transaction): new ones still at their
        generation, overwrites held in `_pending` (the last committed put wins).
        Returns the keys committed."""
        self._db.execute("BEGIN")
        done = [key for key, gen in blocks if self.commit_put(key, gen)]
        for key, rec in self._pending.pop(run, []):
            self._release(run)
            rec.complete = True
            self._insert(key, rec)
            done.append(key)
        self._db.execute("COMMIT")
        return done

    def relocate(self, old: str, new: str, info: RunRecord,
                 moves: list[tuple[str, Record, int]]) -> int:
        """Compaction: record the new run and move each (key, record as read, new offset)
        to it if still that generation, committed, in `old`; one transaction."""
        self._db.execute("BEGIN")
        self.add_run(new, info)
        moved = 0
        for key, rec, off in moves:
            cur = self._records.get(key)
            if cur is None or cur.generation != rec.generation or cur.run != old or not cur.complete:
                continue
            self._insert(key, dataclasses.replace(cur, run=new, offset=off))
            moved += 1
        if moved == 0:
            self.dead_runs.add(new)
        self._db.execute("COMMIT")
        return moved

    def sweep_pending(self, cutoff: float) -> int:
        """Pending overwrites live in this process's memory only and die with it: nothing
        to sweep (the shared index keeps them in Redis, meta_redis.py)."""
        return 0

    def _release(self, run: str) -> None:
        self._live[run] -= 1
        if self._live[run] == 0:
            self.dead_runs.add(run)

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
        if rec is not None and rec.run:
            self._release(rec.run)

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
