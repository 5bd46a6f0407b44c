"""The shared live index: `MetaStore`'s interface over Valkey/Redis, for several
kvstore replicas over the same shard locations (`--index redis://...`).

Why Redis and not the sqlite file: every replica must see one truth about which
generation of a key is committed, which runs still hold live blocks and which may
go; the mesh already runs Valkey (with appendonly persistence where kvmesh starts
it), and its Lua scripts make each index change atomic against every replica
(index_scripts.py has the data model). Only this class talks to those keys.

Sync client, on purpose: core.py relies on "no await between reading a record and
taking the read lease" (GC in the same process cannot strike in between), and an
index call is one loopback round trip (~0.1-0.3 ms). A blocked Redis costs at most
`socket_timeout` (1 s) before the call raises `Unavailable`.

Across replicas the read leases are per process: another replica's GC or delete can
remove a block a reader is fetching. The reader then gets a clean miss, never other
bytes: run ids are never reused (a reclaimed run's shards are gone, 404), a single
object's shards carry their generation (a mixed or overwritten set does not decode
as the wanted generation), and every durable read is checked against the digest.

Access times are batched in memory as in sqlite (`touch`, `flush`); nothing else is
cached here, so `current` always says what the shared index says now.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import redis
from redis import exceptions as rexc

from kvmesh.errors import Unavailable
from kvmesh.services.kvstore import index_scripts as S
from kvmesh.services.kvstore.meta import Record, RunRecord

_KEYS = ("o", "la", "runs", "live", "dead", "info", "pend")


def _rec_json(rec: Record, complete: bool | None = None) -> str:
    c = rec.complete if complete is None else complete
    # "c" first: a commit rewrites the prefix `{"c":0` (index_scripts.py).
    return json.dumps({"c": int(c), "g": str(rec.generation), "s": rec.size,
                       "t": rec.traffic_class, "cr": repr(rec.created),
                       "d": rec.digest.hex() if rec.digest is not None else None,
                       "r": rec.run, "o": rec.offset}, separators=(",", ":"))


def _rec(raw: str | None, la: str | None) -> Record | None:
    if raw is None:
        return None
    d = json.loads(raw)
    created = float(d["cr"])
    return Record(int(d["g"]), d["s"], d["t"], created, float(la) if la else created,
                  bool(d["c"]), bytes.fromhex(d["d"]) if d["d"] is not None else None,
                  d["r"], d["o"])


def _run_json(info: RunRecord) -> str:
    return json.dumps({"g": str(info.generation), "s": info.size, "f": info.frag_data,
                       "a": info.data_at, "d": info.digest.hex(), "cr": repr(info.created)},
                      separators=(",", ":"))


def _run(raw: str | None) -> RunRecord | None:
    if raw is None:
        return None
    d = json.loads(raw)
    return RunRecord(int(d["g"]), d["s"], d["f"], d["a"], bytes.fromhex(d["d"]), float(d["cr"]))


def connect(url: str, username: str = "", password: str = "") -> redis.Redis:
    """A sync client that fails fast and dials again after a Redis restart."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=1.0,
                                socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 1),
                                client_name="kvmesh-kvstore", username=username or None,
                                password=password or None)


class _Runs:
    """`meta.runs`: the run rows, read from Redis on each access (a mapping's reads)."""

    def __init__(self, meta: RedisMeta):
        self._m = meta

    def get(self, run: str) -> RunRecord | None:
        return _run(self._m._do(lambda r: r.hget(self._m.keys[2], run)))

    def __getitem__(self, run: str) -> RunRecord:
        info = self.get(run)
        if info is None:
            raise KeyError(run)
        return info

    def __contains__(self, run: object) -> bool:
        return bool(self._m._do(lambda r: r.hexists(self._m.keys[2], str(run))))

    def items(self) -> list[tuple[str, RunRecord]]:
        rows = self._m._do(lambda r: r.hgetall(self._m.keys[2]))
        return [(k, _run(v)) for k, v in rows.items()]  # type: ignore[misc]

    def __iter__(self) -> Iterator[str]:
        return iter(self._m._do(lambda r: r.hkeys(self._m.keys[2])))


class RedisMeta:
    """Same methods and meaning as `meta.MetaStore` (see there); state in Redis."""

    def __init__(self, url: str, now: float, prefix: str = "kvmesh:kv", username: str = "",
                 password: str = "", client: redis.Redis | None = None):
        self.redis = client or connect(url, username, password)
        self.prefix = prefix
        self.keys = [f"{prefix}:{k}" for k in _KEYS]
        self._s = {name: self.redis.register_script(getattr(S, name)) for name in (
            "INSERT", "REMOVE", "COMMIT_PUT", "BEGIN_RUN", "COMMIT_RUN", "ABORT_RUN", "ADD_RUN",
            "DROP_RUN", "TOUCH", "FIND_DEAD", "SWEEP_PENDING", "RELOCATE")}
        self._touched: dict[str, float] = {}
        self.runs = _Runs(self)
        self._now_at_start = now
        self._created: float | None = None
        try:
            self.created  # noqa: B018 - read now if Redis is up; else on first use
        except Unavailable:
            pass  # the kvstore still starts; index calls are UNAVAILABLE until Redis is back

    @property
    def created(self) -> float:
        """When this index was first used (GC leaves older shards alone, gc.find_orphans)."""
        if self._created is None:
            info, now = self.keys[5], self._now_at_start
            self._created = float(self._do(lambda r: (r.hsetnx(info, "created", repr(now)),
                                                      r.hget(info, "created"))[1]))
        return self._created

    def _do(self, fn):
        try:
            return fn(self.redis)
        except rexc.RedisError as exc:
            raise Unavailable(f"kvstore index (redis) unreachable: {exc}") from exc

    def _script(self, name: str, *args) -> object:
        return self._do(lambda r: self._s[name](keys=self.keys, args=list(args), client=r))

    def close(self) -> None:
        try:
            self.flush()
        except Unavailable:
            pass  # access times are a hint; the records themselves are all in Redis
        self.redis.close()

    def __len__(self) -> int:
        return int(self._do(lambda r: r.hlen(self.keys[0])))

    # -- reads -------------------------------------------------------------------
    def get(self, key: str) -> Record | None:
        raw, la = self._do(lambda r: r.pipeline(transaction=True)
                           .hget(self.keys[0], key).hget(self.keys[1], key).execute())
        return _rec(raw, la)

    def current(self, key: str) -> Record | None:
        rec = self.get(key)
        return rec if rec is not None and rec.complete else None

    def current_many(self, keys: list[str]) -> dict[str, Record]:
        """Committed records of `keys` in one round trip (a Get of a prefix)."""
        if not keys:
            return {}
        raws, las = self._do(lambda r: r.pipeline(transaction=True)
                             .hmget(self.keys[0], keys).hmget(self.keys[1], keys).execute())
        out = {k: _rec(raw, la) for k, raw, la in zip(keys, raws, las, strict=True)}
        return {k: rec for k, rec in out.items() if rec is not None and rec.complete}

    def items(self) -> list[tuple[str, Record]]:
        raws, las = self._do(lambda r: r.pipeline(transaction=True)
                             .hgetall(self.keys[0]).hgetall(self.keys[1]).execute())
        out = [(k, _rec(v, las.get(k))) for k, v in raws.items()]
        return out  # type: ignore[return-value]

    @property
    def complete_bytes(self) -> int:
        return int(self._do(lambda r: r.hget(self.keys[5], "bytes")) or 0)

    @property
    def dead_runs(self) -> set[str]:
        return set(self._do(lambda r: r.smembers(self.keys[4])))

    def live_blocks(self, run: str) -> int:
        return int(self._do(lambda r: r.hget(self.keys[3], run)) or 0)

    # -- changes (one Lua script each) -------------------------------------------
    def begin_put(self, key: str, generation: int, size: int, traffic_class: str,
                  now: float, digest: bytes | None = None) -> None:
        rec = Record(generation, size, traffic_class, now, now, False, digest)
        self._script("INSERT", key, _rec_json(rec), repr(now))

    def restore(self, key: str, rec: Record) -> None:
        self._script("INSERT", key, _rec_json(rec), repr(rec.last_access))

    def begin_run(self, run: str, info: RunRecord, blocks: list[tuple[str, Record]]) -> None:
        args: list[str] = [run, _run_json(info), repr(info.created)]
        for key, rec in blocks:
            args += [key, _rec_json(rec), _rec_json(rec, complete=True)]
        self._script("BEGIN_RUN", *args)

    def commit_put(self, key: str, generation: int) -> bool:
        return bool(self._script("COMMIT_PUT", key, str(generation)))

    def commit_run(self, run: str, blocks: list[tuple[str, int]]) -> list[str]:
        args = [run] + [x for key, gen in blocks for x in (key, str(gen))]
        return list(self._script("COMMIT_RUN", *args))  # type: ignore[call-overload]

    def abort_run(self, run: str, blocks: list[tuple[str, int]]) -> None:
        self._script("ABORT_RUN", run, *[x for key, gen in blocks for x in (key, str(gen))])

    def add_run(self, run: str, info: RunRecord) -> None:
        self._script("ADD_RUN", run, _run_json(info))

    def drop_run(self, run: str) -> bool:
        """Forget a run with no live block; True if this call dropped it (exactly one
        replica does, so exactly one deletes its shards)."""
        return bool(self._script("DROP_RUN", run))

    def relocate(self, old: str, new: str, info: RunRecord,
                 moves: list[tuple[str, Record, int]]) -> int:
        """Compaction: record the new run and move each (key, record as read, new offset)
        to it if still current in `old`; one script. Returns how many moved."""
        args = [old, new, _run_json(info)]
        for key, rec, off in moves:
            args += [key, str(rec.generation),
                     _rec_json(dataclasses.replace(rec, run=new, offset=off))]
        return int(self._script("RELOCATE", *args))  # type: ignore[call-overload]

    def find_dead_runs(self) -> set[str]:
        return set(self._script("FIND_DEAD"))  # type: ignore[call-overload]

    def sweep_pending(self, cutoff: float) -> int:
        """Drop overwrites pending since before `cutoff` (their putter died)."""
        return int(self._script("SWEEP_PENDING", repr(cutoff)))  # type: ignore[call-overload]

    def remove(self, key: str, generation: int | None = None) -> Record | None:
        old = self._script("REMOVE", key, "" if generation is None else str(generation))
        return _rec(old, None) if old else None  # type: ignore[arg-type]

    def touch(self, key: str, now: float) -> None:
        if now > self._touched.get(key, 0.0):
            self._touched[key] = now

    def flush(self) -> int:
        if not self._touched:
            return 0
        pending, self._touched = self._touched, {}
        try:
            self._script("TOUCH", *[x for k, t in pending.items() for x in (k, repr(t))])
        except Unavailable:
            for k, t in pending.items():  # try again with the next flush
                self.touch(k, t)
            raise
        return len(pending)
