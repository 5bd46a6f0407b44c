"""Prefill/decode handoff, the engine side: what leaves a prefill engine, what a decode
engine adopts, and the prefill engine's store of handoffs waiting to be fetched.

    prefill engine (PE)                                  decode engine (CE)
    add_request(handoff=True)
    prefill, sample the first token
    ledger_handoff.export: request + slot + blocks       Engine.adopt(handoff)
      (rings re-laid 396 -> 134, blocks, hashes)           handoff_problem: fingerprints,
    HandoffStore.put; the request finishes (HANDOFF)       sizes; ledger_handoff.adopt: slot,
    ...FetchHandoff (rpc/handoff_transfer.py) -> bytes -->  blocks, decoding at once

Sampling draws from (seed, token index) only (sampling.py), so the seed and the
output so far are the whole sampling state; the CE rebuilds the stop-string state
and what was sent from the output (OutputState.resume), as a mid-stream migration does.

Owners: Engine owns its HandoffStore (engine thread only); a Handoff is immutable.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from kvmesh.services.engine.cache.slot_handoff import SlotHandoff
from kvmesh.services.engine.core.sampling import SamplingParams


@dataclass(frozen=True)
class Handoff:
    request_id: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]          # what the PE generated (and already sent): the first token
    params: SamplingParams
    seed: int                        # the request's seed: with len(output), the generator position
    salt: str
    traffic_class: str
    layout_fp: str                   # the stored-window layout (cachekeys.layout_fingerprint)
    model_fp: str
    slot: SlotHandoff

    @property
    def nbytes(self) -> int:
        return self.slot.nbytes


def handoff_problem(h: Handoff, layout_fp: str, model_fp: str, vocab_size: int) -> str | None:
    """What is wrong with a handoff before the cache looks at it (None: nothing)."""
    if h.layout_fp != layout_fp or h.model_fp != model_fp:
        return "layout or model fingerprint differs from this engine's"
    if not h.prompt or not h.output:
        return "a handoff needs a prompt and at least its first generated token"
    if any(not 0 <= t < vocab_size for t in h.prompt + h.output):
        return f"token ids outside [0, {vocab_size})"
    if h.slot.num_computed != len(h.prompt) + len(h.output) - 1:
        return (f"{h.slot.num_computed} computed tokens; a handoff computes all but the last "
                f"sampled one ({len(h.prompt) + len(h.output) - 1})")
    if len(h.output) >= h.params.max_tokens:
        return "the request already reached max_tokens"
    return None


class HandoffStore:
    """Handoffs a PE keeps until fetched (a CE retry fetches again), bounded in bytes and
    age; the oldest goes first. Engine thread only (Engine owns it)."""

    def __init__(self, max_bytes: int, ttl_s: float, clock=time.monotonic):
        self.max_bytes, self.ttl_s, self.clock = max_bytes, ttl_s, clock
        self._items: OrderedDict[str, tuple[Handoff, float]] = OrderedDict()
        self.bytes = 0

    def put(self, h: Handoff) -> bool:
        """False (nothing kept) if it alone exceeds the budget."""
        if h.nbytes > self.max_bytes:
            return False
        self.pop(h.request_id)
        self._items[h.request_id] = (h, self.clock())
        self.bytes += h.nbytes
        while self.bytes > self.max_bytes:
            self.pop(next(iter(self._items)))
        return True

    def get(self, request_id: str) -> Handoff | None:
        self.expire()
        item = self._items.get(request_id)
        return item[0] if item else None

    def pop(self, request_id: str) -> Handoff | None:
        item = self._items.pop(request_id, None)
        if item is None:
            return None
        self.bytes -= item[0].nbytes
        return item[0]

    def expire(self) -> None:
        now = self.clock()
        for rid in [r for r, (_, t) in self._items.items() if now - t > self.ttl_s]:
            self.pop(rid)

    def __len__(self) -> int:
        return len(self._items)
