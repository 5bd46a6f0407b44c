"""CacheManager: what each sequence holds in the two ledgers, and the prefix hits.

The only code that calls the pools: it hands slots and blocks to sequences,
takes them back, installs prefetched blocks and restores snapshots (through
the PrefixReuse it owns). BlockPool owns refcounts and hashes, StatePool owns
slots, PrefixReuse owns the snapshot store and the replica area; the manager
owns a sequence's token list and cache fields (see sequence.py) and keeps them
consistent with the pools.

Admission is two calls from the scheduler, no callback:

    match = cache.match_prefix(seq)   read only: the block run, L1, the deepest usable
                                      snapshot in [L1 - W, L1], where computing resumes
    cache.admit(seq, match)           slot, blocks, snapshot restore, bounds

Block table growth: a sequence about to compute tokens [.., end) needs
ceil(end / block_size) blocks. Complete blocks are registered under their
chained hash as soon as they are computed, so later prompts can share them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.cachekeys import ROOT, block_hash, extend_chain
from services.engine.cache.block_pool import BlockPool
from services.engine.cache.block_store import BlockStore
from services.engine.cache.handoff import SlotHandoff, handoff_block, rearrange_slot
from services.engine.cache.layout import RuntimeLayout
from services.engine.cache.prefetch import LocalView, Prefetched
from services.engine.cache.prefix import PrefixReuse
from services.engine.cache.snapshots import Snapshot
from services.engine.cache.state_pool import StatePool
from services.engine.core.sequence import Sequence


@dataclass(frozen=True)
class MatchResult:
    """A prefix hit, planned before anything is taken from the pools.

    hashes    chained hashes of the matched block run (L1 = len(hashes) * block size)
    blocks    per matched block: a local block id to share, or None = install the
              prefetched payload of that hash
    snapshot  the deepest usable snapshot in [L1 - W, L1], or None (bounded replay)
    start     where computing resumes: the snapshot's position, L1 - W, or 0 (cold)
    """
    hashes: tuple[bytes, ...] = ()
    blocks: tuple[int | None, ...] = ()
    l1: int = 0
    snapshot: Snapshot | None = None
    start: int = 0
    refused_blocks: int = 0       # prefetched payloads failing BlockStore.check (a miss from there)
    refused_snapshots: int = 0    # snapshots found but not restorable (layout, size, position)

    @property
    def source(self) -> str:
        return "remote" if None in self.blocks else "local"

    @property
    def recomputed(self) -> int:
        """Tokens recomputed exactly over the snapshot: [S, L1)."""
        return self.l1 - self.start if self.snapshot is not None else 0

    @property
    def replayed(self) -> int:
        """Tokens of the approximate bounded replay: [L1 - W, L1)."""
        return self.l1 - self.start if self.l1 and self.snapshot is None else 0


class CacheManager:
    def __init__(self, layout: RuntimeLayout, device: str | torch.device = "cpu") -> None:
        self.layout = layout                 # the engine's one layout: pool sizes come from here
        self.cfg = cfg = layout.model
        self.ecfg = layout.engine            # truncation, KEEP, snapshot policy
        self.states = StatePool(layout, device)
        self.pool = BlockPool(layout.num_blocks)
        self.store = BlockStore(cfg, layout.num_blocks, device=device)
        self.snapshots = PrefixReuse(self.states, self.ecfg)
        self.fingerprint = cfg.fingerprint()

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.cfg.block_size)

    # --- prefix matching -----------------------------------------------------------
    def _prompt_hashes(self, tokens: list[int], salt: str, chain: list[bytes] | None = None
                       ) -> list[bytes]:
        """Hashes of the complete blocks within the cap L - KEEP (none with truncation off).
        `chain` is a sequence's own `block_hashes`: grown in place, so no block is hashed twice."""
        if not self.snapshots.enabled:
            return []
        bs, cap = self.cfg.block_size, len(tokens) - self.ecfg.keep_tokens
        return extend_chain([] if chain is None else chain, tokens, max(0, cap) // bs, bs,
                            self.fingerprint, salt)

    def match_prefix(self, seq: Sequence) -> MatchResult:
        """The longest usable block run (local, then prefetched payloads) and how to resume."""
        hashes = self._prompt_hashes(seq.tokens, seq.salt, seq.block_hashes)
        prefetched = seq.prefetched
        blocks: list[int | None] = []
        free, refused = self.pool.num_free, 0
        for h in hashes:
            b = self.pool.lookup(h)
            if b is not None:
                free -= self.pool.ref_cnt[b] == 0      # reviving a cached block takes a free one
                blocks.append(b)
            elif prefetched is not None and h in prefetched.blocks and free > 0:
                try:                                   # size, header, layout, digest
                    self.store.check(prefetched.blocks[h])
                except ValueError:                     # damaged or foreign: a miss from here
                    refused = 1
                    break
                free -= 1
                blocks.append(None)
            else:
                break
        n = len(blocks)
        if n == 0:
            return MatchResult(refused_blocks=refused)
        l1 = n * self.cfg.block_size
        snap, bad = self.snapshots.find(hashes[:n], l1, prefetched)
        start = snap.position if snap is not None else l1 - self.cfg.window
        return MatchResult(tuple(hashes[:n]), tuple(blocks), l1, snap, start, refused, bad)

    def local_view(self, tokens: list[int], salt: str) -> LocalView:
        hashes = self._prompt_hashes(tokens, salt)
        n = 0
        while n < len(hashes) and self.pool.lookup(hashes[n]) is not None:
            n += 1
        keys = {self.snapshots.key_at(hashes, (i + 1) * self.cfg.block_size) for i in range(len(hashes))}
        return LocalView(hashes, n, {k for k in keys if self.snapshots.holds(k)})

    # --- admission / release --------------------------------------------------
    def can_admit(self, seq: Sequence, first_chunk_end: int) -> bool:
        return self.states.num_free > 0 and self.blocks_for(first_chunk_end) <= self.pool.num_free

    def admit(self, seq: Sequence, match: MatchResult | None = None) -> None:
        """Give seq a slot and fill it from the planned hit (match_prefix, same step)."""
        assert seq.slot is None and not seq.table, seq.request_id
        seq.slot = self.states.allocate()
        self.snapshots.admitted(seq.slot)
        seq.num_computed = seq.enc_lo = seq.cmp_from = 0
        seq.cached_tokens = seq.replayed_tokens = seq.recomputed_tokens = 0
        seq.lineage = ""
        seq.prefill_len = seq.num_tokens
        seq.dec_lo = 0 if self.ecfg.truncation == "off" else max(0, seq.prefill_len - self.ecfg.keep_tokens)
        prefetched, seq.prefetched = seq.prefetched, None
        if match is None or not match.l1:
            return
        seq.table, seq.hashes = self._take_blocks(match, prefetched), list(match.hashes)
        if match.snapshot is not None:
            self.snapshots.restore(seq.slot, match.snapshot)
        else:
            seq.enc_lo = match.start
            if self.ecfg.replay_blocks == "isolate":
                # named by where the replay started (for reading logs and stores); matching
                # follows the exact chain only, so no request is ever given these blocks
                seq.lineage = "replay@" + match.hashes[-1].hex()[:32]
        seq.num_computed, seq.cmp_from = match.start, match.l1
        seq.cached_tokens = match.l1
        seq.replayed_tokens, seq.recomputed_tokens = match.replayed, match.recomputed

    def _take_blocks(self, match: MatchResult, prefetched: Prefetched | None) -> list[int]:
        # Shared blocks first: they leave the free queue, so installing the prefetched
        # ones (which allocate from its head) cannot evict a block the plan relies on.
        for b in match.blocks:
            if b is not None:
                self.pool.acquire(b)
        table = []
        for h, b in zip(match.hashes, match.blocks, strict=True):
            if b is None:           # match_prefix plans these only from a prefetch
                assert prefetched is not None
                (b,) = self.pool.allocate(1)
                self.store.deserialize(b, prefetched.blocks[h])
                self.pool.register(b, h)
            table.append(b)
        return table

    def grow(self, seq: Sequence, end: int) -> bool:
        """Make the table cover `end` tokens; False (nothing changed) if blocks run out."""
        need = self.blocks_for(end) - len(seq.table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.table.extend(self.pool.allocate(need))
        return True

    def release(self, seq: Sequence) -> None:
        """Give back the slot (its replica stored by the replica rule, prefix.py) and every
        block (table tail first: its blocks are evicted first)."""
        if seq.slot is not None:
            self.snapshots.on_release(seq)
            self.states.free(seq.slot)
        self.pool.release(reversed(seq.table))
        seq.slot, seq.table, seq.hashes, seq.num_computed = None, [], [], 0

    # --- prefill/decode handoff (cache/handoff.py) --------------------------------------
    def export_slot(self, seq: Sequence) -> SlotHandoff:
        """seq's slot rearranged for a 134-row engine, its block hashes and blocks (read only:
        the caller releases seq afterwards as usual). Synchronous: the engine itself copies
        `export_parts` off the step instead."""
        data, build = self.export_parts(seq)
        return build(data.cpu().numpy().tobytes())

    def export_parts(self, seq: Sequence) -> tuple[torch.Tensor, Callable[[bytes], SlotHandoff]]:
        """What export_slot copies, as one uint8 tensor on the device (a copy of the slot and
        of its blocks' rows, so later writes cannot reach it), and the function that makes
        the SlotHandoff from its bytes once they are in host memory (device.HostCopies:
        non-blocking on CUDA). Everything else it needs is taken now."""
        n = seq.num_computed
        parts = [self.states.data[seq.slot].reshape(-1)] + \
            [self.store.raw(b) for b in seq.table[: self.blocks_for(n)]]
        sizes = [t.numel() for t in parts]                       # shapes: no device read
        facts = (n, seq.enc_lo, seq.dec_lo, seq.cmp_from, tuple(seq.hashes))

        def build(raw: bytes) -> SlotHandoff:
            at = sizes[0]
            slot = torch.frombuffer(bytearray(raw[:at]), dtype=torch.uint8)
            blocks = []
            for size in sizes[1:]:
                blocks.append(self.store.frame(raw[at : at + size]))
                at += size
            # rearranged in host memory: the handoff leaves as bytes
            state = rearrange_slot(self.states.block, slot, n)
            return SlotHandoff(*facts, tuple(blocks), state.numpy().tobytes())
        return torch.cat(parts), build

    def handoff_problem(self, h: SlotHandoff) -> str | None:
        """Why `h` can never be adopted here (ring, sizes, block coverage, damaged blocks)."""
        want = handoff_block(self.states.block).slot_bytes
        if self.states.ring != self.layout.inference_ring:
            return f"this engine's ring is {self.states.ring} rows; a decode engine keeps {self.layout.inference_ring}"
        if len(h.state) != want:
            return f"handoff state is {len(h.state)} B, this engine's slot is {want} B"
        bs = self.cfg.block_size
        if len(h.blocks) != self.blocks_for(h.num_computed) or len(h.hashes) != h.num_computed // bs:
            return f"{len(h.blocks)} blocks / {len(h.hashes)} hashes do not cover {h.num_computed} tokens"
        for i, blob in enumerate(h.blocks):
            if not blob and i < len(h.hashes):
                continue                      # skipped: this pool holds it (has_room checks)
            try:
                self.store.check(blob)
            except ValueError as exc:
                return str(exc)
        return None

    def has_room(self, h: SlotHandoff) -> bool:
        """A free slot and the blocks `adopt` would take (reviving a cached one takes one)."""
        local = [self.pool.lookup(x) for x in h.hashes]
        need = sum(b is None or self.pool.ref_cnt[b] == 0 for b in local) + len(h.blocks) - len(local)
        skipped_here = all(local[i] is not None for i, blob in enumerate(h.blocks[: len(local)])
                           if not blob)       # a skipped block evicted since: refuse, retryable
        return self.states.num_free > 0 and need <= self.pool.num_free and skipped_here

    def adopt(self, seq: Sequence, h: SlotHandoff) -> int:
        """Install a checked handoff (handoff_problem is None, has_room) as seq's slot and block
        table: complete blocks this pool already holds are shared (those the sender skipped
        among them), the rest installed and registered.
        Returns how many blocks were found here."""
        assert seq.slot is None and not seq.table, seq.request_id
        seq.slot = self.states.allocate()
        self.snapshots.admitted(seq.slot)
        # the handoff layout is this slot's up to its MTP ring (cache/handoff.py handoff_block)
        self.states.data[seq.slot, : len(h.state)] = torch.frombuffer(bytearray(h.state),
                                                                      dtype=torch.uint8)
        local = [self.pool.lookup(x) for x in h.hashes]
        for b in local:                        # shared first: installing cannot evict them
            if b is not None:
                self.pool.acquire(b)
        table = []
        for i, blob in enumerate(h.blocks):
            b = local[i] if i < len(local) else None
            if b is None:
                (b,) = self.pool.allocate(1)
                self.store.deserialize(b, blob)
                if i < len(h.hashes):
                    self.pool.register(b, h.hashes[i])
            table.append(b)
        seq.table, seq.hashes, seq.block_hashes = table, list(h.hashes), list(h.hashes)
        seq.num_computed = seq.prefill_len = h.num_computed
        seq.enc_lo, seq.dec_lo, seq.cmp_from = h.enc_lo, h.dec_lo, h.cmp_from
        seq.cached_tokens = seq.replayed_tokens = seq.recomputed_tokens = 0
        return sum(b is not None for b in local)

    # --- tokens and forwards --------------------------------------------------------
    def append_token(self, seq: Sequence, token: int) -> None:
        seq.output.append(token)

    def commit(self, seq: Sequence, new_computed: int) -> list[tuple[bytes, int]]:
        """Record computed tokens; register blocks that became complete.
        Returns (hash, block) of the blocks newly registered under their hash."""
        seq.num_computed = new_computed
        bs, fresh = self.cfg.block_size, []
        while len(seq.hashes) < new_computed // bs:      # a block completed (one step in bs)
            k, tokens = len(seq.hashes), seq.token_view()
            if seq.lineage and k * bs >= seq.cmp_from:
                # computed after a bounded replay, isolated: chained off the hashes this
                # sequence registered, under a salt no exact request uses
                parent = seq.hashes[-1] if seq.hashes else ROOT
                h = block_hash(parent, tokens[k * bs:(k + 1) * bs], self.fingerprint,
                               seq.salt + "\x00" + seq.lineage)
            else:
                h = extend_chain(seq.block_hashes, tokens, k + 1, bs, self.fingerprint, seq.salt)[k]
            if self.pool.hash_of[seq.table[k]] is None and self.pool.register(seq.table[k], h):
                fresh.append((h, seq.table[k]))
            seq.hashes.append(h)
        return fresh

    def rollback(self, seq: Sequence, r: int, max_backtrack: int) -> None:
        """Take back the last r computed tokens (r <= B). Ring rows and compression tails are
        position-indexed, so they need no copying; block rows past the new end become
        invalid: a block that is no longer complete loses its hash (copy-on-write if shared)."""
        if not 0 <= r <= min(max_backtrack, seq.num_computed):
            raise ValueError(f"rollback of {r} tokens: must be in [0, min(B={max_backtrack}, computed)]")
        new = seq.num_computed - r
        self._uncommit(seq, new)
        self.snapshots.rolled_back(seq)
        # the sequence ends at the rollback point (a sampled, not yet computed token goes too)
        drop = seq.num_tokens - new
        from_output = min(drop, len(seq.output))
        del seq.output[len(seq.output) - from_output :]
        del seq.prompt[len(seq.prompt) - (drop - from_output) :]
        seq.prefill_len = min(seq.prefill_len, new)

    def reopen(self, seq: Sequence) -> None:
        """The last computed token becomes pending again (a rollback took back the sampled
        one, so there is nothing to compute): the next step recomputes its rows, the same
        bytes, and samples from its logits. Safe for any rollback r <= B: that position's
        window reaches back to num_computed - W, and the rows the rolled-back tokens
        overwrote are older than num_computed - W (ring W + B, compression ring m + B).
        The replica stays: it covers the same token, recomputed identically."""
        assert seq.num_computed == seq.num_tokens > 0, seq.request_id
        self._uncommit(seq, seq.num_computed - 1)

    def trim(self, seq: Sequence) -> None:
        """Give back blocks past what the next token needs (grown for drafts that were
        rejected; unregistered, their rows are rewritten before they are ever read)."""
        self._release_from(seq, self.blocks_for(seq.num_computed + 1))

    def _release_from(self, seq: Sequence, keep: int) -> None:
        """Blocks past the first `keep` of seq's table go back to the pool, newest first."""
        self.pool.release(reversed(seq.table[keep:]))
        del seq.table[keep:]

    def _uncommit(self, seq: Sequence, new: int) -> None:
        """Computed tokens end at `new`: blocks past it leave, an incomplete one its hash."""
        full = new // self.cfg.block_size
        for k in range(full, len(seq.hashes)):
            block = seq.table[k]
            if self.pool.ref_cnt[block] == 1:
                self.pool.unregister(block)
            else:  # someone shares it: keep theirs intact, continue in a private copy
                (copy,) = self.pool.allocate(1)
                self.store.copy_block(block, copy)
                self.pool.release([block])
                seq.table[k] = copy
        del seq.hashes[full:]
        del seq.block_hashes[full:]
        self._release_from(seq, self.blocks_for(new))
        seq.num_computed = new

    def check_integrity(self, running: list[Sequence]) -> None:
        """free + in use + cached == total, slots balance, and refcounts match the tables."""
        self.pool.check_integrity()
        self.states.check_integrity(sum(s.slot is not None for s in running))
        refs = torch.zeros(self.pool.num_blocks, dtype=torch.long)
        for s in running:
            for b in s.table:
                refs[b] += 1
        assert refs.tolist() == self.pool.ref_cnt, "block refcounts differ from the block tables"
