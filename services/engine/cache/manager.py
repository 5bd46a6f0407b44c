"""CacheManager: what each sequence holds in the two ledgers.

The only code that hands slots and blocks to sequences and takes them back.
BlockPool owns refcounts and hashes, StatePool owns slots; the manager keeps a
sequence's `slot`, `table`, `hashes` and `num_computed` consistent with them.

Block table growth: a sequence about to compute tokens [.., end) needs
ceil(end / block_size) blocks. Complete blocks are registered under their
chained hash as soon as they are computed, so later prompts can share them.
"""

from __future__ import annotations

import torch

from services.engine.cache import hashing
from services.engine.cache.block_pool import BlockPool
from services.engine.cache.block_store import BlockStore
from services.engine.cache.layout import RuntimeLayout
from services.engine.cache.state_pool import StatePool
from services.engine.sequence import Sequence


class CacheManager:
    def __init__(self, layout: RuntimeLayout):
        self.layout = layout                 # the engine's one layout: pool sizes come from here
        self.cfg = cfg = layout.model
        self.states = StatePool(layout)
        self.pool = BlockPool(layout.num_blocks)
        self.store = BlockStore(cfg, layout.num_blocks)
        self.fingerprint = cfg.fingerprint()

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.cfg.block_size)

    # --- admission / release --------------------------------------------------
    def can_admit(self, seq: Sequence, first_chunk_end: int) -> bool:
        return self.states.num_free > 0 and self.blocks_for(first_chunk_end) <= self.pool.num_free

    def admit(self, seq: Sequence) -> None:
        assert seq.slot is None and not seq.table, seq.request_id
        seq.slot = self.states.allocate()
        seq.num_computed = 0
        seq.prefill_len = len(seq.tokens)

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
        """Give back the slot and every block (table tail first: its blocks are evicted first)."""
        if seq.slot is not None:
            self.states.free(seq.slot)
        self.pool.release(reversed(seq.table))
        seq.slot, seq.table, seq.hashes, seq.num_computed = None, [], [], 0

    # --- after a forward --------------------------------------------------------
    def commit(self, seq: Sequence, new_computed: int) -> list[tuple[bytes, int]]:
        """Record computed tokens; register blocks that became complete.
        Returns (hash, block) of the blocks newly registered under their hash."""
        seq.num_computed = new_computed
        bs, tokens = self.cfg.block_size, seq.tokens
        fresh = []
        while len(seq.hashes) < new_computed // bs:
            k = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else hashing.ROOT
            h = hashing.block_hash(parent, tokens[k * bs : (k + 1) * bs], self.fingerprint, seq.salt)
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
        keep = self.blocks_for(new)
        self.pool.release(reversed(seq.table[keep:]))
        del seq.table[keep:]
        seq.num_computed = new
        # the sequence ends at the rollback point (a sampled, not yet computed token goes too)
        drop = len(seq.tokens) - new
        from_output = min(drop, len(seq.output))
        del seq.output[len(seq.output) - from_output :]
        del seq.prompt[len(seq.prompt) - (drop - from_output) :]
        seq.prefill_len = min(seq.prefill_len, new)

    def check_integrity(self, running: list[Sequence]) -> None:
        """free + in use + cached == total, slots balance, and refcounts match the tables."""
        self.pool.check_integrity()
        self.states.check_integrity(sum(s.slot is not None for s in running))
        refs = torch.zeros(self.pool.num_blocks, dtype=torch.long)
        for s in running:
            for b in s.table:
                refs[b] += 1
        assert refs.tolist() == self.pool.ref_cnt, "block refcounts differ from the block tables"
