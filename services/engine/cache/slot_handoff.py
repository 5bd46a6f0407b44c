"""SlotHandoff: what a sequence holds in both ledgers, ready to leave a prefill engine for a
decode engine (the wire form core/handoff_store.py and rpc/handoff_transfer.py carry; the model's ledgers
make and install it: core/ledger_handoff.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotHandoff:
    """What a sequence holds in both ledgers, ready to leave its engine.

    state    the slot in the decode engine's layout (its SWA rings at 134 rows)
    hashes   chained hashes of its complete blocks (they name the blocks on every engine)
    blocks   serialized blocks (block_store.py format) of table[:ceil(num_computed / bs)]:
             the complete ones in hash order, then the partial last block, whose completed
             compression groups are not stored anywhere else; the receiver installs only
             the complete blocks its pool does not already hold
    """
    num_computed: int
    enc_lo: int
    dec_lo: int
    cmp_from: int
    hashes: tuple[bytes, ...]
    blocks: tuple[bytes, ...]
    state: bytes

    @property
    def nbytes(self) -> int:
        return len(self.state) + sum(len(b) for b in self.blocks)
