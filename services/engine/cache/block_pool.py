"""BlockPool: the block ledger's bookkeeping (ids, refcounts, hashes, LRU).

Only BlockPool changes `ref_cnt`, the free queue and the hash map; callers
hold block ids and get answers back. A block is in exactly one state:

    in use   ref_cnt > 0                     (not in the free queue)
    cached   ref_cnt == 0, has a hash        (in the free queue: evictable, reusable by hash)
    free     ref_cnt == 0, no hash           (in the free queue)

The free queue is an insertion-ordered dict (O(1) removal from the middle).
Allocation takes from its head. Freed blocks without a hash go to the head
(nothing to lose), freed cached blocks to the tail, so cached blocks are
evicted least-recently-freed first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


class NoFreeBlocks(RuntimeError):
    pass


@dataclass(frozen=True)
class PoolStats:
    total: int
    in_use: int
    cached: int
    free: int


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now (free + cached)."""
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise NoFreeBlocks(f"need {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._drop_hash(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    def acquire(self, block: int) -> None:
        """Take one more reference to a block (prefix sharing); revives a cached block."""
        if self.ref_cnt[block] == 0:
            if block not in self.free_queue:
                raise AssertionError(f"block {block} has no refs and is not in the free queue")
            del self.free_queue[block]
        self.ref_cnt[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; pass a table tail-first so its last blocks
        are evicted first."""
        for block in blocks:
            if self.ref_cnt[block] <= 0:
                raise AssertionError(f"release of free block {block}")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free_queue[block] = None
                if self.hash_of[block] is None:
                    self.free_queue.move_to_end(block, last=False)

    def register(self, block: int, h: bytes) -> bool:
        """Mark a full block reusable under hash h. False if another block already holds h."""
        if self.hash_of[block] is not None:
            return self.hash_of[block] == h
        if h in self.by_hash:
            return False
        self.hash_of[block] = h
        self.by_hash[h] = block
        return True

    def unregister(self, block: int) -> None:
        self._drop_hash(block, evicted=False)

    def _drop_hash(self, block: int, evicted: bool = True) -> None:
        h = self.hash_of[block]
        if h is not None:
            del self.by_hash[h]
            self.hash_of[block] = None
            self.evictions += evicted

    def stats(self) -> PoolStats:
        in_use = sum(1 for r in self.ref_cnt if r > 0)
        cached = sum(1 for b in self.free_queue if self.hash_of[b] is not None)
        return PoolStats(self.num_blocks, in_use, cached, len(self.free_queue) - cached)

    def check_integrity(self) -> None:
        s = self.stats()
        assert s.free + s.in_use + s.cached == s.total, s
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] >= 0, b
            assert (self.ref_cnt[b] == 0) == (b in self.free_queue), (b, self.ref_cnt[b])
        for h, b in self.by_hash.items():
            assert self.hash_of[b] == h, (b, h)
        assert sum(h is not None for h in self.hash_of) == len(self.by_hash)
