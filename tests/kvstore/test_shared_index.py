"""The shared index (meta_redis.RedisMeta on a real Valkey) against the sqlite index as
the reference, the maintenance lease, and two kvstores sharing one index."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvmesh.errors import Unavailable
from kvmesh.services.kvstore.lease import SharedLease
from kvmesh.services.kvstore.meta import MetaStore, Record, RunRecord
from kvmesh.services.kvstore.meta_redis import RedisMeta
from tests.kvstore.conftest import hexkey


def state(meta) -> tuple:
    recs = {k: (r.generation, r.size, r.traffic_class, r.created, r.last_access, r.complete,
                r.digest, r.run, r.offset) for k, r in meta.items()}
    runs = dict(meta.runs.items())
    return (recs, runs, set(meta.dead_runs), {r: meta.live_blocks(r) for r in runs},
            meta.complete_bytes, {k: meta.current(k) is not None for k in recs})


def test_redis_index_matches_sqlite_reference(tmp_path, shared_index):
    """The same 400 random index changes (puts, runs with overwrites, commits, aborts,
    removes, restores, drops, touches) on both: identical state after every step."""
    ref = MetaStore(tmp_path / "meta.sqlite", now=1.0)
    red = RedisMeta(shared_index["index"], now=1.0, prefix=shared_index["index_prefix"])
    rng = random.Random(7)
    keys = [hexkey(i) for i in range(24)]
    runs: list[tuple[str, list[tuple[str, int]]]] = []  # begun, not yet committed/aborted
    now = 10.0
    ops: dict[str, int] = {}
    for step in range(400):
        now += 1.0
        op = rng.choice(["put", "commit", "run", "commit_run", "abort_run", "remove",
                         "restore", "drop", "touch", "find_dead"])
        ops[op] = ops.get(op, 0) + 1
        for m in (ref, red):
            r = random.Random(step)  # both stores see the same arguments
            if op == "put":
                m.begin_put(r.choice(keys), r.randrange(1 << 63), r.randrange(1, 999),
                            r.choice(["agent", "chatbot"]), now, r.randbytes(32))
            elif op == "commit":
                k = r.choice(keys)
                cur = m.get(k)
                m.commit_put(k, cur.generation if cur else 5)
            elif op == "run" and m is ref:
                run = f"{step:032x}"
                blocks = [(k, Record(r.randrange(1 << 63), 100, "agent", now, now, False,
                                     r.randbytes(32), run, 100 * i))
                          for i, k in enumerate(r.sample(keys, 4))]
                info = RunRecord(r.randrange(1 << 63), 400, 40, 90, b"d" * 32, now)
                for mm in (ref, red):
                    mm.begin_run(run, info, blocks)
                runs.append((run, [(k, rec.generation) for k, rec in blocks]))
            elif op in ("commit_run", "abort_run") and runs and m is ref:
                run, blocks = runs.pop(r.randrange(len(runs)))
                for mm in (ref, red):
                    (mm.commit_run(run, blocks) if op == "commit_run"
                     else mm.abort_run(run, blocks))
            elif op == "remove":
                k = r.choice(keys)
                cur = m.get(k)
                m.remove(k, cur.generation if cur and r.random() < 0.8 else None)
            elif op == "restore":
                m.restore(r.choice(keys), Record(r.randrange(1 << 63), 7, "chatbot", now, now,
                                                 True, None))
            elif op == "drop":
                for run in sorted(m.dead_runs):
                    m.drop_run(run)
            elif op == "touch":
                m.touch(r.choice(keys), now)
                m.flush()
            elif op == "find_dead":
                m.find_dead_runs()
        got, want = state(red), state(ref)
        assert got == want, f"step {step} ({op}): " + "; ".join(
            f"{k}: {got[0].get(k)} != {want[0].get(k)}" for k in got[0].keys() | want[0].keys()
            if got[0].get(k) != want[0].get(k))
    assert min(ops.values()) > 20 and len(ref.items()) > 5 and ref.runs
    red.close()


def test_pending_overwrite_of_a_dead_putter_is_swept(shared_index):
    """A run put overwriting committed blocks, its putter dead before commit: the old
    versions stay current; GC's sweep releases the pending blocks and the run goes dead."""
    m = RedisMeta(shared_index["index"], now=1.0, prefix=shared_index["index_prefix"])
    k = hexkey(1)
    m.begin_put(k, 11, 5, "agent", 2.0)
    assert m.commit_put(k, 11)
    m.begin_run("r" * 32, RunRecord(1, 5, 1, 1, b"x" * 32, 3.0),
                [(k, Record(22, 5, "agent", 3.0, 3.0, False, None, "r" * 32, 0))])
    assert m.current(k).generation == 11 and m.live_blocks("r" * 32) == 1
    assert m.sweep_pending(2.0) == 0  # younger than the cutoff: kept
    assert m.sweep_pending(4.0) == 1
    assert m.dead_runs == {"r" * 32} and m.current(k).generation == 11
    assert m.commit_run("r" * 32, []) == []  # a late commit finds nothing pending
    assert m.drop_run("r" * 32) and not m.drop_run("r" * 32)  # exactly one dropper


def test_redis_down_is_unavailable():
    """A kvstore starts with its Redis down; index calls are UNAVAILABLE meanwhile."""
    m = RedisMeta("redis://127.0.0.1:1/0", now=1.0)
    for call in (lambda: m.current("a" * 64), lambda: m.items(), lambda: m.created,
                 lambda: m.begin_put("a" * 64, 1, 1, "agent", 1.0)):
        with pytest.raises(Unavailable, match="index"):
            call()


def test_lease_one_holder_renewed_released_and_expiring(shared_index):
    async def go():
        a = RedisMeta(shared_index["index"], now=1.0, prefix=shared_index["index_prefix"])
        la, lb = SharedLease(a, "replica-a", 0.6), SharedLease(a, "replica-b", 0.6)
        async with la.hold("gc") as held:
            with pytest.raises(Unavailable, match="held by replica-a"):
                async with lb.hold("gc"):
                    pass
            await asyncio.sleep(1.5)  # > ttl: renewed meanwhile
            held.check()
            with pytest.raises(Unavailable, match="held by replica-a"):
                async with lb.hold("gc"):
                    pass
        async with lb.hold("gc"):  # released: the other one gets it at once
            pass
        # A holder that stops renewing (killed) frees the lease after its ttl.
        assert a.redis.set(la.key, "replica-a/dead", nx=True, px=600)
        with pytest.raises(Unavailable):
            async with lb.hold("gc"):
                pass
        await asyncio.sleep(0.8)
        async with lb.hold("gc"):
            pass
        # Taken away under a holder (it expired while paused): found lost, check raises.
        async with la.hold("gc") as held:
            a.redis.set(la.key, "replica-b/x")
            await asyncio.sleep(0.5)
            assert held.lost
            with pytest.raises(Unavailable, match="lost"):
                held.check()
        assert a.redis.get(la.key) == "replica-b/x"  # not released: it was not ours
        a.redis.delete(la.key)
        log = la.history()
        assert [(e["holder"], e["lost"]) for e in log] == [
            ("replica-a", False), ("replica-b", False), ("replica-b", False), ("replica-a", True)]
        assert all(x["end"] <= y["start"] for x, y in zip(log, log[1:], strict=False))

    asyncio.run(go())
