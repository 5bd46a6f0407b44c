"""Block ledger bookkeeping: exact ids, sharing, refcounts, LRU eviction, integrity."""

import random

import pytest

from kvmesh import cachekeys as hashing
from kvmesh.services.engine.cache.block_pool import BlockPool, NoFreeBlocks


def H(i: int) -> bytes:
    return bytes([i]) * 32


def test_allocation_takes_lowest_ids_first():
    pool = BlockPool(11)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free == 6
    pool.check_integrity()


def test_share_refcounts_and_eviction_order():
    pool = BlockPool(11)
    a = pool.allocate(4)                        # sequence A: blocks 0..3, all full
    for i, b in enumerate(a):
        assert pool.register(b, H(i))
    assert pool.lookup(H(2)) == 2
    for b in a[:3]:                             # sequence B shares A's first three blocks
        pool.acquire(b)
    b_own = pool.allocate(1)
    assert b_own == [4]
    assert pool.ref_cnt[:5] == [2, 2, 2, 1, 1]
    pool.release(reversed(a))                   # A finishes, tail first
    assert pool.ref_cnt[:5] == [1, 1, 1, 0, 1]
    assert pool.stats().cached == 1             # block 3 is cached, evictable
    pool.release(reversed(a[:3] + b_own))       # B finishes: frees 4 (no hash), then 2, 1, 0
    s = pool.stats()
    assert (s.in_use, s.cached, s.free) == (0, 4, 7)
    # unhashed blocks are reused first (block 4 went to the head), then never-used ones,
    # then cached blocks in LRU order: 3 (freed first), 2, 1, 0
    assert pool.allocate(1) == [4]
    assert pool.allocate(6) == [5, 6, 7, 8, 9, 10]
    assert pool.evictions == 0
    assert pool.allocate(2) == [3, 2]
    assert pool.evictions == 2
    assert pool.lookup(H(3)) is None and pool.lookup(H(2)) is None
    assert pool.lookup(H(1)) == 1               # still cached, still reusable
    pool.check_integrity()


def test_reviving_a_cached_block_removes_it_from_eviction():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.register(b, H(7))
    pool.release([b])
    pool.acquire(pool.lookup(H(7)))             # a new prompt hits the cached block
    assert pool.ref_cnt[b] == 1
    assert pool.allocate(2) == [1, 2]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.check_integrity()


@pytest.mark.parametrize("first,second,ok", [(H(1), H(1), True), (H(1), H(2), False)])
def test_register_is_idempotent_per_block(first, second, ok):
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    assert pool.register(b, first)
    assert pool.register(b, second) is ok


def test_duplicate_content_keeps_the_first_block():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.register(a, H(5))
    assert not pool.register(b, H(5))
    assert pool.lookup(H(5)) == a and pool.hash_of[b] is None


def test_chained_hashes_depend_on_prefix_model_and_salt():
    t = list(range(256))
    base = hashing.chain(t, 128, "fp")
    assert len(base) == 2
    assert hashing.chain(t[:128] + [0] + t[129:], 128, "fp")[1] != base[1]
    other_first = hashing.chain([1] + t[1:], 128, "fp")
    assert other_first[0] != base[0] and other_first[1] != base[1]   # chained
    assert hashing.chain(t, 128, "fp2")[0] != base[0]
    assert hashing.chain(t, 128, "fp", salt="tenant")[0] != base[0]
    assert hashing.chain(t + [1] * 127, 128, "fp") == base            # only complete blocks


def test_random_workload_keeps_integrity():
    rng = random.Random(1)
    pool = BlockPool(64)
    tables: list[list[int]] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.4 and pool.num_free:
            n = rng.randint(1, min(4, pool.num_free))
            tables.append(pool.allocate(n))
        elif op < 0.6 and tables:
            t = rng.choice(tables)
            for b in t:
                pool.register(b, H(rng.randint(0, 40)) + bytes([b]))
        elif op < 0.75 and pool.by_hash:
            h = rng.choice(list(pool.by_hash))
            b = pool.lookup(h)
            pool.acquire(b)
            tables.append([b])
        elif tables:
            pool.release(reversed(tables.pop(rng.randrange(len(tables)))))
        pool.check_integrity()
        refs = [0] * 64
        for t in tables:
            for b in t:
                refs[b] += 1
        assert refs == pool.ref_cnt, step
