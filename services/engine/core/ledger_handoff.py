"""Prefill/decode handoff for DeepSeek V4 / V4.1 engines (the wire form: core/handoff_store.py).

A prefill engine (--role prefill: rings of 396 rows) hands a request to a decode engine
(134 rows) after its first token, as a `core.handoff_store.Handoff` whose SlotHandoff holds

    state   the slot in the decode engine's layout (snapshots.export_state: rings re-laid
            to W + 6 rows, compressor tails as they are)
    hashes  the chained hashes of its complete blocks
    blocks  every block of table[:ceil(length / 128)], serialized (the open one too: its
            completed compressor entries are stored nowhere else)

so FetchHandoff, the gateway and `rpc/handoff_transfer.py` carry it unchanged. The decode engine
shares the complete blocks its pool already holds (the sender skips them on the wire),
installs and registers the rest, and writes the state into a free slot.

Pure functions over one engine's Ledgers; Engine owns the ledgers and calls them on the
engine thread.
"""

from __future__ import annotations

from kvmesh.services.engine.cache.slot_handoff import SlotHandoff
from kvmesh.services.engine.core.handoff_store import Handoff
from kvmesh.services.engine.model.deepseek_v4 import snapshots
from kvmesh.services.engine.model.deepseek_v4.ledgers import BLOCK, Ledgers, Sequence


def export(led: Ledgers, req, layout_fp: str, model_fp: str) -> Handoff:
    """The handoff of `req` (a Request that has computed all but its first output token)."""
    seq = req.seq
    n_blocks = -(-seq.length // BLOCK)
    slot = SlotHandoff(seq.length, 0, 0, 0, tuple(req.chain[: seq.length // BLOCK]),
                       tuple(led.blocks.serialize(b) for b in seq.blocks[:n_blocks]),
                       snapshots.export_state(led, seq))
    return Handoff(req.request_id, tuple(req.prompt), tuple(req.output), req.params, req.seed,
                   req.salt, req.traffic_class, layout_fp, model_fp, slot)


def problem(led: Ledgers, h: SlotHandoff) -> str | None:
    """Why `h` can never be adopted here (ring, state size, block coverage, damaged blocks)."""
    state = snapshots.state_problem(led, h.state)
    if state is not None:
        return state
    if h.enc_lo or h.dec_lo or h.cmp_from:
        return "a DeepSeek V4 handoff has no replay or truncation bounds"
    if len(h.blocks) != -(-h.num_computed // BLOCK) or len(h.hashes) != h.num_computed // BLOCK:
        return f"{len(h.blocks)} blocks / {len(h.hashes)} hashes do not cover " \
               f"{h.num_computed} tokens"
    for i, blob in enumerate(h.blocks):
        if not blob and i < len(h.hashes):
            continue                          # skipped: this pool holds it (`room` checks)
        try:
            led.blocks.check(blob)
        except ValueError as exc:
            return str(exc)
    return None


def room(led: Ledgers, h: SlotHandoff, owed: int, max_blocks: int) -> bool:
    """A free slot, the blocks the adoption takes and the ones its generation may still
    need beside `owed` (what running requests may take), and every block the sender
    skipped still here."""
    pool = led.pool
    local = [pool.lookup(x) for x in h.hashes]
    skipped_here = all(local[i] is not None for i, blob in enumerate(h.blocks[: len(local)])
                       if not blob)
    revived = sum(1 for b in local if b is not None and pool.ref_cnt[b] == 0)
    held = sum(b is not None for b in local)
    return led.free_slots > 0 and skipped_here and \
        max_blocks - held <= pool.num_free - revived - owed


def adopt(led: Ledgers, h: SlotHandoff) -> tuple[Sequence, int]:
    """Install a checked handoff (`problem` None, `room` True) in a new slot: returns the
    sequence and how many of its blocks this pool already held."""
    seq = led.open()
    local = [led.pool.lookup(x) for x in h.hashes]
    for b in local:                           # shared first: installing cannot evict them
        if b is not None:
            led.pool.acquire(b)
    for i, blob in enumerate(h.blocks):
        b = local[i] if i < len(local) else None
        if b is None:
            (b,) = led.take_blocks(1)
            led.blocks.deserialize(b, blob)
            if i < len(h.hashes):
                led.pool.register(b, h.hashes[i])
        seq.blocks.append(b)
    snapshots.adopt_state(led, seq, h.state, h.num_computed)
    return seq, sum(b is not None for b in local)
