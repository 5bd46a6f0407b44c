"""PrefixReuse: the hit policy, SWA snapshots and bounded replay.

Owns the snapshot store and the per-slot replica area; the engine calls it at
admission, around every forward, and when a request ends.

Hit policy for a prompt of L tokens (KEEP >= W + B tokens are always computed):

    cap  = L - KEEP                        at most this many tokens come from cache
    L1   = longest run of cached blocks within cap        (a multiple of the block size)
    snapshot at L1?  -> restore the encoder SWA rings, resume exactly at L1
    else             -> bounded replay: resume at s = L1 - W with every encoder SWA
                        query i seeing keys [max(s, i - W + 1), i]; the entries of
                        [s, L1) are reused as they are (cmp_from = L1)

         0                  s = L1-W     L1           L-KEEP             L
         |== cached blocks ===|==========|               |                |
                              |-- replay --|-------- computed ------------|
                                           |             |-- decoder -----|

Reuse needs YOCO truncation on: decoder layers keep no persisted state, so only
a decoder that starts at L - KEEP >= L1 can resume without the prefix's decoder
SWA. With truncation off every prompt runs cold (and exact).

Snapshot positions (multiples of the block size, filtered by the policy):
    prefill  floor((L - 1) / bs) * bs when >= bs; captured while the chunk that
             reaches it runs (or re-assembled from the 396-token ring in extra-state
             mode), stored after the last chunk
    decode   each crossing of a boundary copies the window into the replica area
             (lag <= B - 1 tokens, inside the ring's spare rows); stored at request end
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvmesh.cachekeys import chain, extend_chain, snapshot_key
from services.engine.cache.manager import CacheManager
from services.engine.cache.snapshot_keys import layout_fingerprint
from services.engine.engine_config import EngineConfig
from services.engine.runner import ForwardResult, Work
from services.engine.sequence import Sequence
from services.engine.snapshots import Snapshot, SnapshotStore


@dataclass
class Prefetched:
    """Cache contents fetched from other tiers before admission (kvstore blocks, peer snapshot),
    and the prompt's block hashes computed for the fetch (the sequence starts its chain with
    them instead of hashing the prompt again)."""
    hashes: list[bytes] = field(default_factory=list)
    blocks: dict[bytes, bytes] = field(default_factory=dict)   # block hash -> serialized block
    snapshots: dict[str, Snapshot] = field(default_factory=dict)


class PrefixReuse:
    def __init__(self, cache: CacheManager, ecfg: EngineConfig, counters, clock=time.monotonic):
        self.cache, self.ecfg, self.counters = cache, ecfg, counters
        self.cfg = cache.cfg
        block = cache.states.block
        self.r_inf = block.inference_ring
        self.layout_fp = layout_fingerprint(block)
        self.store = SnapshotStore(ecfg.snapshot_bytes, ecfg.snapshot_ttl_min, self.layout_fp,
                                   self.cfg.fingerprint(), clock=clock)
        e = self.cfg.n_encoder_layers
        self.replica = torch.zeros(cache.states.num_slots, e, self.r_inf,
                                   self.cfg.swa_bytes_per_token, dtype=torch.uint8)
        self.replica_pos = [0] * cache.states.num_slots     # 0 = empty
        self.enabled = ecfg.truncation != "off"
        self.on_store = lambda key, snap: None              # engine hook: publish to the directory

    # --- admission ------------------------------------------------------------------
    def admit(self, seq: Sequence, prefetched: Prefetched | None = None) -> None:
        """Fill a freshly admitted sequence from cache; sets num_computed and the bounds."""
        self.replica_pos[seq.slot] = 0
        if not self.enabled:
            return
        bs, w = self.cfg.block_size, self.cfg.window
        cap = len(seq.tokens) - self.ecfg.keep_tokens
        hashes = extend_chain(seq.block_hashes, seq.tokens, max(0, cap) // bs, bs,
                              self.cfg.fingerprint(), seq.salt)
        table, hit = self._acquire_blocks(hashes, prefetched)
        if not table:
            return
        l1 = len(table) * bs
        seq.table, seq.hashes = table, hashes[: len(table)]
        key = snapshot_key(hashes[len(table) - 1], self.layout_fp)
        snap = self.store.get(key) or (prefetched.snapshots.get(key) if prefetched else None)
        if snap is not None and snap.position == l1 and self._valid(snap):
            self._restore(seq.slot, snap)
            seq.num_computed = l1
            self.counters["snapshot_hits"] += 1
        else:
            seq.num_computed = seq.enc_lo = l1 - w
            seq.cmp_from = l1
            seq.replayed_tokens = w
            self.counters["snapshot_misses"] += 1
            self.counters["replayed_tokens"] += w
        seq.cached_tokens = l1
        self.counters["cache_hit_tokens"] += l1
        self.counters["block_hits_" + hit] += len(table)

    def local_view(self, tokens, salt: str) -> tuple[list[bytes], int, set[str]]:
        """For prefetching: the prompt's block hashes within the cap, how many lead the
        local pool, and which of their snapshot keys this engine holds."""
        if not self.enabled:
            return [], 0, set()
        cap = len(tokens) - self.ecfg.keep_tokens
        hashes = chain(tokens[: max(0, cap)], self.cfg.block_size, self.cfg.fingerprint(), salt)
        n = 0
        while n < len(hashes) and self.cache.pool.lookup(hashes[n]) is not None:
            n += 1
        keys = {snapshot_key(h, self.layout_fp) for h in hashes}
        return hashes, n, {k for k in keys if k in self.store}

    def _acquire_blocks(self, hashes, prefetched):
        """Longest prefix of hashes found locally or in prefetched blocks (installed here)."""
        pool, table, source = self.cache.pool, [], "local"
        for h in hashes:
            b = pool.lookup(h)
            if b is not None:
                pool.acquire(b)
            elif prefetched is not None and h in prefetched.blocks and pool.num_free > 0:
                (b,) = pool.allocate(1)
                try:
                    self.cache.store.deserialize(b, prefetched.blocks[h])
                except ValueError:           # wrong size: not this layout's block; a miss
                    pool.release([b])
                    self.counters["remote_blocks_refused"] += 1
                    break
                pool.register(b, h)
                source = "remote"
            else:
                break
            table.append(b)
        return table, source

    def _valid(self, snap: Snapshot) -> bool:
        ok = (snap.layout_fp == self.layout_fp and snap.model_fp == self.cfg.fingerprint()
              and len(snap.data) == self.replica[0].numel())
        if not ok:
            self.counters["snapshot_refused"] += 1
        return ok

    def _restore(self, slot: int, snap: Snapshot) -> None:
        canon = torch.frombuffer(bytearray(snap.data), dtype=torch.uint8).view(self.replica[0].shape)
        positions = torch.arange(max(0, snap.position - self.r_inf), snap.position)
        for layer in range(self.cfg.n_encoder_layers):
            ring = self.cache.states.swa[layer]
            ring[slot, positions.remainder(ring.shape[1])] = canon[layer, positions.remainder(self.r_inf)]

    # --- store rules ----------------------------------------------------------------
    def _stores_at(self, position: int) -> bool:
        period = self.ecfg.snapshot_period if self.enabled else None
        bs = self.cfg.block_size
        return period is not None and position >= bs and position % (bs * period) == 0

    def prefill_target(self, seq: Sequence) -> int | None:
        period = self.ecfg.snapshot_period if self.enabled else None
        if period is None:
            return None
        step = self.cfg.block_size * period
        s = (seq.prefill_len - 1) // step * step
        return s if s >= self.cfg.block_size else None

    def capture_for(self, seq: Sequence, work: Work) -> None:
        """Ask the runner to copy the window at the prefill store position while it passes
        (with the long extra-state ring the window is re-assembled at the end instead)."""
        s = self.prefill_target(seq)
        if s is not None and not self._long_ring and work.start < s <= work.end:
            work.capture = s

    @property
    def _long_ring(self) -> bool:
        return self.cache.states.ring > self.r_inf

    def after_forward(self, seq: Sequence, work: Work, res: ForwardResult, index: int) -> None:
        """Called after commit(seq, work.end)."""
        slot = seq.slot
        if index in res.captures:
            self.replica[slot] = res.captures[index]
            self.replica_pos[slot] = work.capture
        if work.end == seq.prefill_len:                       # last prefill chunk
            s = self.prefill_target(seq)
            if s is not None and self._long_ring:
                self._copy_from_ring(seq, s)
            if s is not None and self.replica_pos[slot] == s:
                self._store(seq, s)
        elif work.end > seq.prefill_len:                      # a decode step
            bs = self.cfg.block_size
            b = work.end // bs * bs
            lag = work.end - b
            # the window [b - W, b) is intact in the ring while lag <= B - 1 (spare rows)
            if b > self.replica_pos[slot] and lag < self.r_inf - self.cfg.window and self._stores_at(b):
                self._copy_from_ring(seq, b)

    def on_finish(self, seq: Sequence) -> None:
        slot = seq.slot
        if slot is None:
            return
        pos = self.replica_pos[slot]
        if pos and pos <= seq.num_computed and pos // self.cfg.block_size <= len(seq.hashes):
            key = snapshot_key(seq.hashes[pos // self.cfg.block_size - 1], self.layout_fp)
            if key not in self.store:
                self._store(seq, pos)
        self.replica_pos[slot] = 0

    def _copy_from_ring(self, seq: Sequence, b: int) -> None:
        positions = torch.arange(max(0, b - self.r_inf), b)
        for layer in range(self.cfg.n_encoder_layers):
            ring = self.cache.states.swa[layer]
            self.replica[seq.slot, layer, positions.remainder(self.r_inf)] = \
                ring[seq.slot, positions.remainder(ring.shape[1])]
        self.replica_pos[seq.slot] = b

    def _store(self, seq: Sequence, position: int) -> None:
        k = position // self.cfg.block_size
        if k > len(seq.hashes):
            return
        key = snapshot_key(seq.hashes[k - 1], self.layout_fp)
        snap = Snapshot(key, position, self.layout_fp, self.cfg.fingerprint(),
                        self.replica[seq.slot].numpy().tobytes(), self.store.clock())
        if self.store.put(snap):
            self.counters["snapshot_stores"] += 1
            self.on_store(key, snap)
