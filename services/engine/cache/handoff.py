"""Prefill -> decode handoff: a prefill engine's slot re-laid for a 134-row decode engine.

A prefill engine (PE) runs extra-state on, so each SWA ring has R_src = 396 rows
(262 with truncation off); a decode engine (CE) keeps the inference ring, R_dst = 134.
After the PE has computed `end` tokens, both SWA groups (stored encoder SWA and
consumer/decoder SWA) are rearranged: position p of [end - 134, end) moves from row
p % R_src to row p % 134, which is exactly where a unified 134-row engine would hold
it. Rows of positions < 0 stay zero. The compression and indexer tails are
`m + B` rows indexed by position % (m + B) in both modes, so they are copied as they are.

    PE slot (R_src = 396)                                    handoff state (R = 134)
    | enc ring 0 .. E-1  (E x 396 x 528) |  rearrange  ->    | enc ring 0 .. E-1 (E x 134 x 528) |
    | dec ring 0 .. D-1  (D x 396 x 528) |  rearrange  ->    | dec ring 0 .. D-1 (D x 134 x 528) |
    | cmp / idx tails (fp32)             |  copy       ->    | cmp / idx tails (fp32)            |

The handoff state is therefore one slot image in the CE's layout (`handoff_block`):
its size is the closed form stored + consumer SWA at 134 rows + compression state,
and the CE installs it with one copy into a free slot.

Pure functions over tensors; no pools are touched here (CacheManager owns them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.cache.state_layout import StateBlock


def handoff_block(src: StateBlock) -> StateBlock:
    """The slot layout the handoff state is written in: the inference ring, same B, no MTP
    ring (drafter state is rebuilt by the decode engine, state_layout.py): a prefix of a
    decode engine's slot with or without one."""
    return StateBlock(src.cfg, src.inference_ring, src.inference_ring, src.backtrack)


def handoff_state_bytes(src: StateBlock) -> int:
    """Closed form: stored + consumer SWA at the inference ring, plus the compression state."""
    e = src.n_stored_layers
    d = src.cfg.n_layers - e
    return (e + d) * src.inference_ring * src.swa_token_bytes + src.compression_bytes


def rearrange_ring(ring: torch.Tensor, end: int, r_dst: int) -> torch.Tensor:
    """ring: [R_src, row] holding position p at row p % R_src for p in [end - R_src, end).
    Returns [r_dst, row] holding p at row p % r_dst for p in [end - r_dst, end) (zeros
    for rows no position reaches)."""
    r_src = ring.shape[0]
    if r_dst > r_src:
        raise ValueError(f"cannot rearrange a {r_src}-row ring into {r_dst} rows")
    if end < 0:
        raise ValueError(f"end must be >= 0, got {end}")
    out = torch.zeros(r_dst, *ring.shape[1:], dtype=ring.dtype)
    positions = torch.arange(max(0, end - r_dst), end)
    out[positions.remainder(r_dst)] = ring[positions.remainder(r_src)]
    return out


def rearrange_slot(src: StateBlock, slot: torch.Tensor, end: int) -> torch.Tensor:
    """slot: [src.slot_bytes] uint8, one PE slot after `end` computed tokens.
    Returns the handoff state: [handoff_state_bytes(src)] uint8 in `handoff_block(src)`."""
    if slot.dtype != torch.uint8 or slot.shape != (src.slot_bytes,):
        raise ValueError(f"slot must be uint8 [{src.slot_bytes}], got {slot.dtype} {tuple(slot.shape)}")
    dst = handoff_block(src)
    out = torch.empty(dst.slot_bytes, dtype=torch.uint8)
    kept = [r for r in src.regions() if r.name != "mtp"]
    for a, b in zip(kept, dst.regions(), strict=True):
        if (a.name, a.layer, a.dtype) != (b.name, b.layer, b.dtype):
            raise AssertionError(f"region order differs: {a.name}[{a.layer}] vs {b.name}[{b.layer}]")
        raw = slot[a.offset : a.offset + a.nbytes]
        if a.name == "swa":
            rows = rearrange_ring(raw.view(a.shape), end, dst.swa_ring).flatten()
        else:
            if a.shape != b.shape:
                raise AssertionError(f"{a.name}[{a.layer}] tails differ: {a.shape} vs {b.shape}")
            rows = raw
        out[b.offset : b.offset + b.nbytes] = rows
    return out


@dataclass(frozen=True)
class SlotHandoff:
    """What a sequence holds in both ledgers, ready to leave its engine.

    state    the rearranged slot (`rearrange_slot`), handoff_state_bytes long
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
