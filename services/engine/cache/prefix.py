"""PrefixReuse: SWA snapshots (when to take them, where they are, how to restore them).

Owns the SnapshotStore and the per-slot replica area (`replica`, `replica_pos`).
It never hands out slots or blocks: CacheManager calls it to find and restore a
snapshot while it admits a sequence, and to keep or drop a slot's replica when
the slot goes back; EngineCore calls it around every forward.

Hit policy for a prompt of L tokens (KEEP >= W + B tokens are always computed):

    cap  = L - KEEP                   at most this many tokens come from cache
    L1   = longest run of cached blocks within cap      (a multiple of the block size)
    S    = the deepest snapshot at a block boundary in [L1 - W, L1]
    found  -> restore the encoder SWA rings at S, recompute [S, L1) exactly over the
              cached entries (cmp_from = L1), resume: exact, costs L1 - S <= W tokens
    none   -> bounded replay: resume at s = L1 - W with every encoder SWA query i
              seeing keys [max(s, i - W + 1), i]; the entries of [s, L1) are reused
              as they are (cmp_from = L1): approximate, costs W tokens

         0            S          L1-W..L1      L-KEEP             L
         |== cached blocks ======================|                 |
                      |-recompute-|------ computed -----------------|
                                                 |--- decoder ------|

Restoring S < L1 costs no more than the replay it replaces (L1 - S <= W), so an
exact resume is always preferred; under `periodic:2` a block run often ends one
block past the last snapshot.

Reuse needs YOCO truncation on: decoder layers keep no persisted state, so only
a decoder that starts at L - KEEP >= L1 can resume without the prefix's decoder
SWA. With truncation off every prompt runs cold (and exact).

Snapshot positions (multiples of the block size, filtered by the policy):
    prefill  floor((L - 1) / (N * bs)) * (N * bs) when >= bs (N = 1 for `full`);
             captured while the chunk that reaches it runs (or re-assembled from the
             396-token ring in extra-state mode), stored after the last chunk
    decode   each crossing of a stored boundary b copies the window [b - R, b) into the
             replica area when the step ends at most B - 1 tokens past b (the rows
             overwritten since then are spare rows outside the window)

Replica rule: when a slot goes back (the request finished, was aborted, ran out
of memory, or was preempted) its latest completed replica is stored unless a
snapshot of that position is already held. The replica only ever covers
committed tokens whose blocks are registered, so it is valid whatever the
reason; a preempted request then resumes from it when readmitted. A rollback
below the replica's position drops it (rejected tokens never reach a snapshot).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from kvmesh.cachekeys import snapshot_key
from services.engine import device as device_mod
from services.engine.cache.snapshot_keys import layout_fingerprint
from services.engine.cache.snapshots import Snapshot, SnapshotStore
from services.engine.cache.state_pool import StatePool
from services.engine.config import EngineConfig
from services.engine.core.sequence import Sequence

if TYPE_CHECKING:
    from services.engine.model.runner import ForwardResult, Work


class PrefixReuse:
    def __init__(self, states: StatePool, ecfg: EngineConfig, clock=time.monotonic):
        self.states, self.ecfg = states, ecfg
        self.cfg = states.cfg
        self.model_fp = self.cfg.fingerprint()
        block = states.block
        self.r_inf = block.inference_ring
        self.layout_fp = layout_fingerprint(block)
        self.store = SnapshotStore(ecfg.snapshot_bytes, ecfg.snapshot_ttl_min, self.layout_fp,
                                   self.model_fp, clock=clock)
        e = self.cfg.n_encoder_layers
        self.replica = torch.zeros(states.num_slots, e, self.r_inf,
                                   self.cfg.swa_bytes_per_token, dtype=torch.uint8,
                                   device=states.data.device)
        self.replica_pos = [0] * states.num_slots     # 0 = empty
        # replica bytes on their way to the host store (pinned, non-blocking on CUDA): a
        # snapshot is put when its copy lands (EngineCore polls between steps)
        self.copies = device_mod.HostCopies(states.data.device)
        self.enabled = ecfg.truncation != "off"

    # --- admission (called by CacheManager) ------------------------------------------
    def key_at(self, hashes: list[bytes], position: int) -> str:
        return snapshot_key(hashes[position // self.cfg.block_size - 1], self.layout_fp)

    def find(self, hashes: list[bytes], l1: int, prefetched=None) -> tuple[Snapshot | None, int]:
        """The deepest usable snapshot at a block boundary in [L1 - W, L1] (local store
        first, then what was prefetched for this request), and how many were refused."""
        bs, refused = self.cfg.block_size, 0
        pos = l1
        while pos >= bs and l1 - pos <= self.cfg.window:
            key = self.key_at(hashes, pos)
            snap = self.store.get(key) or (prefetched.snapshots.get(key) if prefetched else None)
            if snap is not None:
                if snap.position == pos and self._valid(snap):
                    return snap, refused
                refused += 1
            pos -= bs
        return None, refused

    def holds(self, key: str) -> bool:
        return key in self.store

    def _valid(self, snap: Snapshot) -> bool:
        return (snap.layout_fp == self.layout_fp and snap.model_fp == self.model_fp
                and len(snap.data) == self.replica[0].numel())

    def restore(self, slot: int, snap: Snapshot) -> None:
        """Write a snapshot's window into a freshly allocated slot's encoder SWA rings."""
        canon = torch.frombuffer(bytearray(snap.data), dtype=torch.uint8).view(self.replica[0].shape)
        canon = device_mod.upload(canon, self.replica.device)
        positions = torch.arange(max(0, snap.position - self.r_inf), snap.position,
                                 device=self.replica.device)
        for layer in range(self.cfg.n_encoder_layers):
            ring = self.states.swa[layer]
            ring[slot, positions.remainder(ring.shape[1])] = canon[layer, positions.remainder(self.r_inf)]

    def admitted(self, slot: int) -> None:
        self.replica_pos[slot] = 0

    def expire(self) -> None:
        """Drop snapshots past their TTL (EngineCore calls this now and then)."""
        self.store.expire()

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
        return self.states.ring > self.r_inf

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
            # The window [b - W, b) is intact in the ring while lag <= B: the step wrote
            # [b, b + lag) over the rows of [b - W - B, b - W - B + lag), spare rows. B is
            # also the most a step can end past b (a verify step of 1 + K <= 1 + B
            # positions reaching b starts at b - 1 at the latest), so no boundary is missed.
            if b > self.replica_pos[slot] and lag <= self.r_inf - self.cfg.window \
                    and self._stores_at(b):
                self._copy_from_ring(seq, b)
                self._zero_spare_rows(seq.slot, b)

    def on_release(self, seq: Sequence) -> None:
        """The slot goes back (finish, abort, out of memory, preemption): store its latest
        completed replica (see the replica rule above), then forget it."""
        slot = seq.slot
        if slot is None:
            return
        pos = self.replica_pos[slot]
        if pos and pos <= seq.num_computed and pos // self.cfg.block_size <= len(seq.hashes):
            if self.key_at(seq.hashes, pos) not in self.store:
                self._store(seq, pos)
        self.replica_pos[slot] = 0

    def rolled_back(self, seq: Sequence) -> None:
        """Tokens past num_computed were taken back: a replica that saw them is dropped."""
        if seq.slot is not None and self.replica_pos[seq.slot] > seq.num_computed:
            self.replica_pos[seq.slot] = 0

    def _zero_spare_rows(self, slot: int, b: int) -> None:
        """Zero a decode copy's rows older than the window [b - W, b). They are never read
        after a restore, and in the ring they may already hold later positions, rolled-back
        draft tokens among them: a snapshot must not depend on which tokens a request once
        computed and took back (issue 12)."""
        old = torch.arange(max(0, b - self.r_inf), max(0, b - self.cfg.window))
        self.replica[slot][:, old.remainder(self.r_inf)] = 0

    def _copy_from_ring(self, seq: Sequence, b: int) -> None:
        positions = torch.arange(max(0, b - self.r_inf), b, device=self.replica.device)
        for layer in range(self.cfg.n_encoder_layers):
            ring = self.states.swa[layer]
            self.replica[seq.slot, layer, positions.remainder(self.r_inf)] = \
                ring[seq.slot, positions.remainder(ring.shape[1])]
        self.replica_pos[seq.slot] = b

    def _store(self, seq: Sequence, position: int) -> None:
        if position // self.cfg.block_size > len(seq.hashes):
            return
        key, now = self.key_at(seq.hashes, position), self.store.clock()
        self.copies.submit(self.replica[seq.slot], lambda data: self.store.put(
            Snapshot(key, position, self.layout_fp, self.model_fp, data, now)))
