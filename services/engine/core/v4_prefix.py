"""Prefix reuse for a DeepSeek V4 engine: block hashes, shared blocks, window snapshots.

Owns the engine's SnapshotStore (host memory, LRU + TTL, the same store V4-mini engines keep,
so FetchSwaSnapshot and the directory see it unchanged) and the hash chains of its
requests. It never runs the model: V4Engine asks it, at admission, how a prompt starts
(`match`), and after each step which blocks became complete (`register`) and whether the
step ended on the request's snapshot position (`snapshot_due`).

A prompt of L tokens starts in one of three ways:

    cold      no leading block of it is cached here
    snapshot  its first k blocks are cached and so is the window snapshot at 128 k: share
              the blocks, restore the rings and CSA overlap, compute [128 k, L): exact
    replay    its first k blocks are cached, no snapshot at any of their boundaries: share
              them and run the bounded replay from 128 k (ledgers.replay): approximate, costs
              128 + (L - 128 k) tokens whatever k is

At most (L - 1) // 128 blocks come from cache: the prompt's last token is always computed
(its logits give the first sampled token).

One snapshot is taken per prompt, at the deepest policy boundary below L (full: every
block boundary qualifies; periodic:N: multiples of N blocks), while the chunk reaching it
runs: the engine ends that chunk there (`snapshot_due`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh import cachekeys
from services.engine.cache.snapshots import Snapshot, SnapshotStore
from services.engine.model.deepseek_v4 import layout, snapshots
from services.engine.model.deepseek_v4.ledgers import BLOCK, Ledgers, Sequence


@dataclass
class Match:
    """How an admitted prompt starts: `blocks` to share (in order), the snapshot to restore
    at len(blocks) * 128, or, with blocks and no snapshot, a bounded replay."""
    blocks: list[int]
    snapshot: snapshots.Snapshot | None

    @property
    def tokens(self) -> int:
        return len(self.blocks) * BLOCK

    @property
    def replay(self) -> bool:
        return bool(self.blocks) and self.snapshot is None


class V4Prefix:
    def __init__(self, led: Ledgers, model_fp: str, period: int | None, capacity_bytes: int,
                 ttl_min: float):
        self.led = led
        self.model_fp = model_fp
        self.period = period                # snapshot every N-th boundary; None: never
        cfg = led.cfg
        row = led.slot_layout.row_bytes
        self.ring_bytes = cfg.num_layers * layout.ring_rows(cfg, False) * row
        self.snapshot_bytes = self.ring_bytes + layout.overlap_bytes(cfg)
        self.layout_fp = cachekeys.layout_fingerprint(
            model_fp, layout.ring_rows(cfg, False), row, cfg.num_layers, self.snapshot_bytes)
        self.store = SnapshotStore(capacity_bytes, ttl_min, self.layout_fp, model_fp)

    # --- hashes -------------------------------------------------------------------------
    def hashes(self, chain: list[bytes], tokens, n_blocks: int, salt: str) -> list[bytes]:
        """The chain of `tokens`' first n_blocks complete blocks, grown in place."""
        return cachekeys.extend_chain(chain, tokens, n_blocks, BLOCK, self.model_fp, salt)

    def key(self, block_hash: bytes) -> str:
        return cachekeys.snapshot_key(block_hash, self.layout_fp)

    # --- admission ----------------------------------------------------------------------
    def match(self, chain: list[bytes], tokens, salt: str) -> Match:
        """The longest run of this prompt's leading blocks cached here, cut back to the
        deepest boundary with a snapshot when there is one (an exact start beats a longer
        approximate one)."""
        hashes = self.hashes(chain, tokens, (len(tokens) - 1) // BLOCK, salt)
        blocks = []
        for h in hashes:
            b = self.led.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        for k in range(len(blocks), 0, -1):
            snap = self.store.get(self.key(hashes[k - 1]))
            if snap is not None:
                return Match(blocks[:k], self._unpack(snap))
        return Match(blocks, None)

    def start(self, seq: Sequence, match: Match) -> None:
        """Give the empty `seq` the matched blocks, and the snapshot's window state."""
        self.led.share(seq, match.blocks)
        if match.snapshot is not None:
            snapshots.restore(self.led, seq, match.snapshot)

    # --- after a step ---------------------------------------------------------------------
    def snapshot_position(self, n_prompt: int) -> int | None:
        """The one boundary a prompt of n_prompt tokens is snapshotted at, or None."""
        if self.period is None:
            return None
        step = self.period * BLOCK
        at = (n_prompt - 1) // step * step
        return at if at >= BLOCK else None

    def register(self, seq: Sequence, chain: list[bytes], tokens, registered: int,
                 salt: str) -> list[tuple[bytes, int]]:
        """Register the blocks `seq` completed since the first `registered` ones; returns
        (hash, block) of each newly registered one."""
        done = seq.length // BLOCK
        hashes = self.hashes(chain, tokens, done, salt)
        out = []
        for i in range(registered, done):
            if self.led.pool.register(seq.blocks[i], hashes[i]):
                out.append((hashes[i], seq.blocks[i]))
        return out

    def take(self, seq: Sequence, block_hash: bytes) -> bool:
        """Store the snapshot of `seq`, which stands on the boundary `block_hash` ends."""
        snap = snapshots.take(self.led, seq)
        return self.store.put(Snapshot(self.key(block_hash), snap.position, self.layout_fp,
                                       self.model_fp, snap.rings + snap.overlap,
                                       self.store.clock()))

    def _unpack(self, snap: Snapshot) -> snapshots.Snapshot:
        return snapshots.Snapshot(snap.position, snap.data[:self.ring_bytes],
                                  snap.data[self.ring_bytes:])
