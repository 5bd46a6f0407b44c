"""Window snapshots and block bytes for DeepSeek V4's ledgers: what a prefix hit restores.

A snapshot is taken at a 128-aligned position P (docs/design.md §8): the sequence may have
run up to 6 tokens past it, which the rings' spare rows still cover. It holds

    | SWA ring of every layer, as the slot holds it (R = 134 rows of 528 B) |  the stored cut
    | per CSA layer: the A series (kv, gate) of the 4 tokens before P, for  |
    |   the compressor (4 x 2 x c fp32) and the indexer (4 x 2 x c_I fp32)  |  the overlap

The overlap is what a V4 snapshot carries beyond the rings: the first CSA entry after P pools
the window that ends at P. HCA needs nothing (P is a multiple of its rate), and every entry
before P is in the blocks, which a hit shares (same engine) or installs from their bytes
(kvstore, another engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.model.deepseek_v4.config import CSA
from services.engine.model.deepseek_v4.ledgers import BLOCK, Ledgers, Sequence

SPARE = 6   # rows of the ring past the window: how far a sequence may have run past P


@dataclass(frozen=True)
class Snapshot:
    position: int
    rings: bytes
    overlap: bytes


def overlap_bytes(led: Ledgers) -> int:
    cfg = led.cfg
    return sum(cfg.csa_rate * (cfg.head_dim + cfg.index_head_dim) * 4 * 2
               for kind in cfg.layer_kinds if kind == CSA)


def take(led: Ledgers, seq: Sequence) -> Snapshot:
    """The snapshot of `seq` at the 128-aligned position at most SPARE tokens behind it."""
    position = seq.length // BLOCK * BLOCK
    if position == 0 or seq.length - position > SPARE:
        raise ValueError(f"no snapshot at length {seq.length}: the last 128 boundary "
                         f"({position}) is 0 or more than {SPARE} tokens back")
    rings = torch.cat([led.swa[i][seq.slot].reshape(-1) for i in sorted(led.swa)])
    return Snapshot(position, rings.numpy().tobytes(), _overlap(led, seq.slot, position))


def _overlap(led: Ledgers, slot: int, position: int) -> bytes:
    parts = []
    for _, tails in _csa_tails(led):
        for tail in tails:
            rows = tail[slot][_rows(led, position, tail.shape[1])]
            parts.append(rows[:, :, : tail.shape[-1] // 2].reshape(-1))   # A series: kv, gate
    return torch.cat(parts).numpy().tobytes() if parts else b""


def restore(led: Ledgers, seq: Sequence, snap: Snapshot) -> None:
    """Resume `seq` at the snapshot's position. Its block table must already hold the
    position / 128 blocks of the prefix (shared or installed)."""
    if len(seq.blocks) != snap.position // BLOCK or seq.length:
        raise ValueError(f"restore: the sequence needs exactly the prefix's "
                         f"{snap.position // BLOCK} blocks and no tokens")
    rings = torch.frombuffer(bytearray(snap.rings), dtype=torch.uint8)
    if rings.numel() != sum(led.swa[i][seq.slot].numel() for i in led.swa):
        raise ValueError("restore: the snapshot's rings do not fit this engine's slot layout")
    start = 0
    for i in sorted(led.swa):
        ring = led.swa[i][seq.slot]
        ring.copy_(rings[start:start + ring.numel()].view(ring.shape))
        start += ring.numel()
    overlap = torch.frombuffer(bytearray(snap.overlap), dtype=torch.float32) \
        if snap.overlap else torch.empty(0)
    start = 0
    for _, tails in _csa_tails(led):
        for tail in tails:
            half = tail.shape[-1] // 2
            rows = _rows(led, snap.position, tail.shape[1])
            n = rows.numel() * 2 * half
            tail[seq.slot][rows, :, :half] = overlap[start:start + n].view(-1, 2, half)
            start += n
    if start != overlap.numel():
        raise ValueError("restore: the snapshot's overlap does not fit this engine's layout")
    seq.length = snap.position


def block_bytes(led: Ledgers, blocks: list[int]) -> bytes:
    """The rows of `blocks` (every compressed layer's entries, then CSA keys), as the
    kvstore would carry them."""
    idx = torch.tensor(blocks, dtype=torch.long)
    tables = [led.entries[i] for i in sorted(led.entries)] + [led.keys[i] for i in sorted(led.keys)]
    return torch.cat([t[idx].reshape(-1) for t in tables]).numpy().tobytes()


def install_blocks(led: Ledgers, seq: Sequence, data: bytes) -> None:
    """Give the empty `seq` fresh blocks holding `data` (from `block_bytes` elsewhere)."""
    tables = [led.entries[i] for i in sorted(led.entries)] + [led.keys[i] for i in sorted(led.keys)]
    per_block = sum(t[0].numel() for t in tables)
    values = torch.frombuffer(bytearray(data), dtype=torch.float32)
    if not per_block or values.numel() % per_block:
        raise ValueError("install_blocks: the bytes are not whole blocks of this layout")
    n = values.numel() // per_block
    blocks = led.take_blocks(n)
    idx, start = torch.tensor(blocks, dtype=torch.long), 0
    for t in tables:
        size = n * t[0].numel()
        t[idx] = values[start:start + size].view(n, *t.shape[1:])
        start += size
    if seq.length or seq.blocks:
        raise ValueError("install_blocks: the sequence must be empty")
    seq.blocks = blocks


def _csa_tails(led: Ledgers):
    for i, kind in enumerate(led.cfg.layer_kinds):
        if kind == CSA:
            yield i, (led.cmp[i], led.idx[i])


def _rows(led: Ledgers, position: int, ring_rows: int) -> torch.Tensor:
    return torch.arange(position - led.cfg.csa_rate, position) % ring_rows
