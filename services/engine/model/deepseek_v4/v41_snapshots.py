"""Window snapshots for DeepSeek V4.1's ledgers: what a prefix hit restores.

A snapshot is taken at a 128-aligned position P (the sequence may have run up to 6 tokens
past it, which the rings' spare rows still cover). It is the stored region of the slot: the
encoder layers' rings in the inference layout (20 x 134 x 528 = 1,415,040 B on V4.1-Flash).
Nothing else is needed for the encoder: every entry and index key before P is in the blocks,
and P ends a group of every pooling source (128 is a multiple of the ratio), so no tail is
open. The decoder's rings are the dropped region: after a restore, the decoder layers run
from P on with no window rows before it, which is exact when the prompt's decoder cut
(prefill truncation) is at or past P, as a hit capped 134 tokens before the prompt's end is
under truncation, and a decoder-side replay otherwise.

Hand-offs and the bytes of blocks are snapshots.py's (they go by the slot's regions).
"""

from __future__ import annotations

import torch

from kvmesh.services.engine.model.deepseek_v4.ledgers import BLOCK, Sequence
from kvmesh.services.engine.model.deepseek_v4.snapshots import SPARE, Snapshot, rering
from kvmesh.services.engine.model.deepseek_v4.v41_layout import encoder_layers
from kvmesh.services.engine.model.deepseek_v4.v41_ledgers import V41Ledgers


def snapshot_bytes(led: V41Ledgers) -> int:
    return encoder_layers(led.cfg) * led.inference_rows * led.slot_layout.row_bytes


def sizes(led: V41Ledgers) -> tuple[int, int, int]:
    """(ring bytes, snapshot bytes, layers stored) of this engine's snapshots."""
    return snapshot_bytes(led), snapshot_bytes(led), encoder_layers(led.cfg)


def take(led: V41Ledgers, seq: Sequence) -> Snapshot:
    """The snapshot of `seq` at the 128-aligned position at most SPARE tokens behind it."""
    position = seq.length // BLOCK * BLOCK
    if position == 0 or seq.length - position > SPARE:
        raise ValueError(f"no snapshot at length {seq.length}: the last 128 boundary "
                         f"({position}) is 0 or more than {SPARE} tokens back")
    rings = [rering(led.swa[i][seq.slot], seq.length, led.inference_rows).reshape(-1)
             for i in range(encoder_layers(led.cfg))]
    return Snapshot(position, torch.cat(rings).cpu().numpy().tobytes(), b"")


def restore(led: V41Ledgers, seq: Sequence, snap: Snapshot) -> None:
    """Resume `seq` at the snapshot's position. Its block table must already hold the
    position / 128 blocks of the prefix (shared or installed). The decoder starts over at
    the position: pass it (or a later cut) as the sequence's decoder_from."""
    if len(seq.blocks) != snap.position // BLOCK or seq.length:
        raise ValueError(f"restore: the sequence needs exactly the prefix's "
                         f"{snap.position // BLOCK} blocks and no tokens")
    rows, row_bytes = led.inference_rows, led.slot_layout.row_bytes
    if len(snap.rings) != snapshot_bytes(led) or snap.overlap:
        raise ValueError("restore: the snapshot does not fit this engine's slot layout")
    rings = torch.frombuffer(bytearray(snap.rings), dtype=torch.uint8)
    for i in range(encoder_layers(led.cfg)):
        one = rings[i * rows * row_bytes:(i + 1) * rows * row_bytes].view(rows, row_bytes)
        led.swa[i][seq.slot].copy_(rering(one, snap.position, led.swa[i].shape[1]))
    seq.length = snap.position
