"""Window snapshots, block bytes and hand-offs for DeepSeek V4's ledgers: what a prefix hit
restores and what a prefill engine gives a decode engine.

A snapshot is taken at a 128-aligned position P (docs/design.md §8): the sequence may have
run up to 6 tokens past it, which the rings' spare rows still cover. It holds

    | SWA ring of every layer, as the slot holds it (R = 134 rows of 528 B) |  the stored cut
    | per CSA layer: the A series (kv, gate) of the 4 tokens before P, for  |
    |   the compressor (4 x 2 x c fp32) and the indexer (4 x 2 x c_I fp32)  |  the overlap

The overlap is what a V4 snapshot carries beyond the rings: the first CSA entry after P pools
the window that ends at P. HCA needs nothing (P is a multiple of its rate), and every entry
before P is in the blocks, which a hit shares (same engine) or installs from their bytes
(kvstore, another engine). Rings are stored in the inference layout whatever the engine's
ring length (`rering`: a prefill engine's 396 rows, --extra-state).

A hand-off (`hand_off`) moves a prefilled sequence to a decode engine: rings re-laid to its
ring, compressor tails as they are, every block (the open one too) by its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.services.engine.model.deepseek_v4 import layout
from kvmesh.services.engine.model.deepseek_v4.config import CSA
from kvmesh.services.engine.model.deepseek_v4.ledgers import BLOCK, Ledgers, Sequence

SPARE = 6   # rows of the ring past the window: how far a sequence may have run past P


@dataclass(frozen=True)
class Snapshot:
    position: int
    rings: bytes
    overlap: bytes


def overlap_bytes(led: Ledgers) -> int:
    return layout.overlap_bytes(led.cfg)


def sizes(led: Ledgers) -> tuple[int, int, int]:
    """(ring bytes, snapshot bytes, layers stored) of this engine's snapshots."""
    rings = led.cfg.num_layers * led.inference_rows * led.slot_layout.row_bytes
    return rings, rings + overlap_bytes(led), led.cfg.num_layers


def take(led: Ledgers, seq: Sequence) -> Snapshot:
    """The snapshot of `seq` at the 128-aligned position at most SPARE tokens behind it."""
    position = seq.length // BLOCK * BLOCK
    if position == 0 or seq.length - position > SPARE:
        raise ValueError(f"no snapshot at length {seq.length}: the last 128 boundary "
                         f"({position}) is 0 or more than {SPARE} tokens back")
    rows = layout.ring_rows(led.cfg, extra_state=False)
    rings = torch.cat([rering(led.swa[i][seq.slot], seq.length, rows).reshape(-1)
                       for i in sorted(led.swa)])
    return Snapshot(position, rings.cpu().numpy().tobytes(), _overlap(led, seq.slot, position))


def rering(ring: torch.Tensor, length: int, rows: int) -> torch.Tensor:
    """The same positions in a ring of `rows` rows (row p mod rows holds position p): a
    prefill engine's 396-row ring (--extra-state) into the inference layout, for snapshots
    and hand-offs. Rows no position fills are zero."""
    if ring.shape[0] == rows:
        return ring
    out = ring.new_zeros(rows, ring.shape[1])
    pos = torch.arange(max(0, length - min(rows, ring.shape[0])), length, device=ring.device)
    out[pos % rows] = ring[pos % ring.shape[0]]
    return out


def hand_off(src, seq: Sequence, dst) -> Sequence:
    """Move a prefilled sequence from a prefill engine's ledgers (rings of any length) to a
    decode engine's: rings rearranged to its layout, compressor tails copied as they are
    (their layout does not depend on the ring), every block (the open one too) by its bytes.
    The source keeps its copy until it closes the sequence. V4's ledgers or V4.1's: the
    slot's regions say what is where (`getattr(led, region.name)[layer]`)."""
    out = dst.open()
    install_blocks(dst, out, block_bytes(src, seq.blocks))
    for r in src.slot_layout.regions:
        have, want = getattr(src, r.name)[r.layer], getattr(dst, r.name)[r.layer]
        if r.name == "swa":
            want[out.slot].copy_(rering(have[seq.slot], seq.length, want.shape[1]))
        else:
            want[out.slot].copy_(have[seq.slot])
    out.length = seq.length
    return out


def export_state(led, seq: Sequence) -> bytes:
    """`seq`'s slot as a decode engine lays it out (rings of W + 6 rows: `rering`, tails as
    they are), region by region at a decode engine's offsets: the state of a hand-off by
    bytes, which a decode engine writes into a free slot as it is (`adopt_state`)."""
    rows = led.inference_rows
    image, offset = [], 0
    for r in led.slot_layout.regions:
        view = getattr(led, r.name)[r.layer][seq.slot]
        part = rering(view, seq.length, rows).reshape(-1) if r.name == "swa" \
            else view.reshape(-1).view(torch.uint8)
        align = -offset % (1 if r.name == "swa" else view.element_size())   # the layout's padding
        image += [torch.zeros(align, dtype=torch.uint8, device=part.device), part]
        offset += align + part.numel()
    return torch.cat(image).cpu().numpy().tobytes()


def state_problem(led, state: bytes) -> str | None:
    """Why `state` (from `export_state`) cannot be adopted into these ledgers, or None."""
    if led.swa[0].shape[1] != led.inference_rows:
        return f"this engine's rings are {led.swa[0].shape[1]} rows; a decode engine keeps " \
               f"{led.inference_rows}"
    if len(state) != led.slot_layout.slot_bytes:
        return f"handoff state is {len(state)} B, this engine's slot is " \
               f"{led.slot_layout.slot_bytes} B"
    return None


def adopt_state(led, seq: Sequence, state: bytes, length: int) -> None:
    """Write a checked `export_state` image into `seq`'s slot; it then stands at `length`."""
    problem = state_problem(led, state)
    if problem is not None:
        raise ValueError(problem)
    led.data[seq.slot] = torch.frombuffer(bytearray(state), dtype=torch.uint8)
    seq.length = length


def _overlap(led: Ledgers, slot: int, position: int) -> bytes:
    parts = []
    for _, tails in _csa_tails(led):
        for tail in tails:
            rows = tail[slot][_rows(led, position, tail.shape[1])]
            parts.append(rows[:, :, : tail.shape[-1] // 2].reshape(-1))   # A series: kv, gate
    return torch.cat(parts).cpu().numpy().tobytes() if parts else b""


def restore(led: Ledgers, seq: Sequence, snap: Snapshot) -> None:
    """Resume `seq` at the snapshot's position. Its block table must already hold the
    position / 128 blocks of the prefix (shared or installed)."""
    if len(seq.blocks) != snap.position // BLOCK or seq.length:
        raise ValueError(f"restore: the sequence needs exactly the prefix's "
                         f"{snap.position // BLOCK} blocks and no tokens")
    rows, row_bytes = layout.ring_rows(led.cfg, extra_state=False), led.slot_layout.row_bytes
    if len(snap.rings) != len(led.swa) * rows * row_bytes \
            or len(snap.overlap) != layout.overlap_bytes(led.cfg):
        raise ValueError("restore: the snapshot does not fit this engine's slot layout")
    rings = torch.frombuffer(bytearray(snap.rings), dtype=torch.uint8)
    for k, i in enumerate(sorted(led.swa)):
        one = rings[k * rows * row_bytes:(k + 1) * rows * row_bytes].view(rows, row_bytes)
        led.swa[i][seq.slot].copy_(rering(one, snap.position, led.swa[i].shape[1]))
    overlap = torch.frombuffer(bytearray(snap.overlap), dtype=torch.float32) \
        if snap.overlap else torch.empty(0, device="cpu")
    start = 0
    for _, tails in _csa_tails(led):
        for tail in tails:
            half = tail.shape[-1] // 2
            rows = _rows(led, snap.position, tail.shape[1])
            n = rows.numel() * 2 * half
            tail[seq.slot][rows, :, :half] = overlap[start:start + n].view(-1, 2, half)
            start += n
    seq.length = snap.position


def block_bytes(led, blocks: list[int]) -> list[bytes]:
    """`blocks` serialized as the kvstore keeps them (header, rows, digest: BlockStore)."""
    return [led.blocks.serialize(b) for b in blocks]


def install_blocks(led, seq: Sequence, data: list[bytes]) -> None:
    """Give the empty `seq` fresh blocks holding serialized blocks (from `block_bytes`
    elsewhere). Every block is checked (size, layout, digest) before any is installed; a
    bad one is a ValueError and nothing changes."""
    if seq.length or seq.blocks:
        raise ValueError("install_blocks: the sequence must be empty")
    for blob in data:
        led.blocks.check(blob)
    blocks = led.take_blocks(len(data))
    for b, blob in zip(blocks, data, strict=True):
        led.blocks.deserialize(b, blob)
    seq.blocks = blocks


def _csa_tails(led: Ledgers):
    for i, kind in enumerate(led.cfg.layer_kinds):
        if kind == CSA:
            yield i, (led.cmp[i], led.idx[i])


def _rows(led: Ledgers, position: int, ring_rows: int) -> torch.Tensor:
    return torch.arange(position - led.cfg.csa_rate, position, device=led.data.device) % ring_rows
