"""What the engine reports: its counters, the events of a step, the hooks it calls.

Only the engine thread creates and changes these (Engine owns them); the hooks run on it
and must only enqueue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.generation import TokenLogprob
from kvmesh.services.engine.core.finish import Finish
from kvmesh.services.engine.core.handoff_store import Handoff

if TYPE_CHECKING:
    from kvmesh.services.engine.core.request import Request

# Counters the engine always reports, 0 until their event first happens, so GetStats and
# /metrics (kvmesh_engine_<name>) show every one from the start. Only the engine thread
# changes them; remote.py adds its own kvstore_*/peer_*/directory_* keys (through it too).
COUNTERS = ("requests", "prompt_tokens", "cache_hit_tokens", "replayed_tokens",
            "recomputed_tokens", "snapshot_hits", "snapshot_misses", "snapshot_stores",
            "snapshot_refused", "block_hits_local", "block_hits_remote", "remote_blocks_refused",
            "generated_tokens", "computed_tokens", "finished", "aborted", "steps",
            "handoffs_out", "handoff_out_bytes", "handoffs_in", "handoff_in_bytes",
            "handoff_blocks_local", "handoff_refused", "handoff_fetch_ms")


class Hooks:
    """What the engine thread tells the outside about cache contents (no-ops by default).
    Implementations must only enqueue: they run on the engine thread."""

    wants_blocks = False

    def block_done(self, block_hash: bytes, payload: bytes, traffic_class: str) -> None: ...

    def snapshot_stored(self, key: str, snap) -> None: ...

    def snapshot_evicted(self, key: str) -> None: ...


@dataclass
class Event:
    request_id: str
    token_ids: list[int]
    text: str
    finish: Finish | None
    seq: Request
    handoff: Handoff | None = None      # finish HANDOFF: what a decode engine adopts
    drafted: int = 0           # on the last event: draft tokens this request proposed
    accepted: int = 0          # and how many of them verification accepted
    logprobs: list[TokenLogprob] | None = None   # one per token id, when the request asks
