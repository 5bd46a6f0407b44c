"""Prefix reuse for a DeepSeek V4 engine: block hashes, shared blocks, window snapshots.

Owns the engine's SnapshotStore (host memory, LRU + TTL, what FetchSwaSnapshot serves and the
directory indexes) and the hash chains of its
requests. It never runs the model: Engine asks it, at admission, how a prompt starts
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

from dataclasses import dataclass, field

from kvmesh import cachekeys
from kvmesh.services.engine.cache.prefetch import LocalView
from kvmesh.services.engine.cache.snapshots import Snapshot, SnapshotStore
from kvmesh.services.engine.model.deepseek_v4 import snapshots
from kvmesh.services.engine.model.deepseek_v4.ledgers import BLOCK, Ledgers, Sequence


@dataclass
class Match:
    """How an admitted prompt starts: local `blocks` to share, then `fetched` blocks
    ((hash, serialized block) from the kvstore) to install after them, and the snapshot to
    restore at the end of both; with blocks and no snapshot, a bounded replay."""
    blocks: list[int]
    snapshot: snapshots.Snapshot | None
    fetched: list[tuple[bytes, bytes]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return (len(self.blocks) + len(self.fetched)) * BLOCK

    @property
    def replay(self) -> bool:
        return self.tokens > 0 and self.snapshot is None


class PrefixReuse:
    def __init__(self, led: Ledgers, model_fp: str, period: int | None, capacity_bytes: int,
                 ttl_min: float, snaps=snapshots):
        self.led = led
        self.model_fp = model_fp
        self.period = period                # snapshot every N-th boundary; None: never
        self.snaps = snaps                  # snapshots.py (V4) or v41_snapshots.py
        self.ring_bytes, self.snapshot_bytes, stored = snaps.sizes(led)
        self.layout_fp = cachekeys.layout_fingerprint(
            model_fp, led.inference_rows, led.slot_layout.row_bytes, stored, self.snapshot_bytes)
        self.store = SnapshotStore(capacity_bytes, ttl_min, self.layout_fp, model_fp)
        self.refused = 0          # fetched blocks that failed their checks

    # --- hashes -------------------------------------------------------------------------
    def hashes(self, chain: list[bytes], tokens, n_blocks: int, salt: str) -> list[bytes]:
        """The chain of `tokens`' first n_blocks complete blocks, grown in place."""
        return cachekeys.extend_chain(chain, tokens, n_blocks, BLOCK, self.model_fp, salt)

    def key(self, block_hash: bytes) -> str:
        return cachekeys.snapshot_key(block_hash, self.layout_fp)

    # --- admission ----------------------------------------------------------------------
    def local_view(self, chain: list[bytes], tokens, salt: str,
                   limit: int | None = None) -> LocalView:
        """What a prefetch from the other tiers needs to know (rpc/remote.py); `limit` as
        for `match`."""
        hashes = self.hashes(chain, tokens, (len(tokens) - 1) // BLOCK, salt)
        if limit is not None:
            hashes = hashes[:limit // BLOCK]
        n = len(self._local(hashes))
        return LocalView(list(hashes), n, {k for k in map(self.key, hashes) if k in self.store})

    def match(self, chain: list[bytes], tokens, salt: str, fetched=None,
              limit: int | None = None) -> Match:
        """The longest run of this prompt's leading blocks cached here, continued by blocks
        the kvstore returned (`fetched`: a cache.prefix.Prefetched), L1 tokens. With a
        snapshot (here, or fetched from a peer) at S = L1 or L1 - W the match stops at S
        and resumes exactly; otherwise it keeps all L1 and the caller replays the last W
        (the design's search range [L1 - W, L1], docs/design.md §5: a snapshot further back
        would recompute more than the replay's W tokens). A fetched block that fails its
        checks ends the run there (`refused` counts it). limit: at most this many tokens
        from cache (V4.1 under truncation: the decoder's cut)."""
        hashes = self.hashes(chain, tokens, (len(tokens) - 1) // BLOCK, salt)
        if limit is not None:
            hashes = hashes[:limit // BLOCK]
        blocks = self._local(hashes)
        more = []
        for h in hashes[len(blocks):] if fetched is not None else ():
            blob = fetched.blocks.get(h)
            if blob is None:
                break
            try:
                self.led.blocks.check(blob)
            except ValueError:
                self.refused += 1
                break
            more.append((h, blob))
        n = len(blocks) + len(more)
        for k in range(n, max(n - 2, 0), -1):            # S = L1, then S = L1 - W
            key = self.key(hashes[k - 1])
            snap = self.store.get(key) or (fetched.snapshots.get(key) if fetched else None)
            if snap is not None and len(snap.data) == self.snapshot_bytes:
                return Match(blocks[:k], self._unpack(snap), more[:max(0, k - len(blocks))])
        return Match(blocks, None, more)

    def start(self, seq: Sequence, match: Match) -> None:
        """Give the empty `seq` the matched blocks (fetched ones installed in fresh blocks
        and registered), and the snapshot's window state."""
        self.led.share(seq, match.blocks)
        fresh = self.led.take_blocks(len(match.fetched))
        for b, (h, blob) in zip(fresh, match.fetched, strict=True):
            self.led.blocks.deserialize(b, blob)
            self.led.pool.register(b, h)
        seq.blocks += fresh
        if match.snapshot is not None:
            self.snaps.restore(self.led, seq, match.snapshot)

    def _local(self, hashes: list[bytes]) -> list[int]:
        blocks = []
        for h in hashes:
            b = self.led.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

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
        snap = self.snaps.take(self.led, seq)
        return self.store.put(Snapshot(self.key(block_hash), snap.position, self.layout_fp,
                                       self.model_fp, snap.rings + snap.overlap,
                                       self.store.clock()))

    def _unpack(self, snap: Snapshot) -> snapshots.Snapshot:
        return snapshots.Snapshot(snap.position, snap.data[:self.ring_bytes],
                                  snap.data[self.ring_bytes:])
