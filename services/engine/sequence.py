"""Sequence: one request's tokens and cache bookkeeping as the engine sees it.

Owned by the engine core: only `EngineCore` and its `Scheduler` change these
fields, from the engine thread. The cache fields say what the two ledgers hold
for this sequence:

    slot          its state slot (SWA rings, compression tails), None while waiting
    table         block ids; entry rows for tokens [0, num_computed)
    hashes        chained hashes of the blocks registered for sharing (complete blocks)
    block_hashes  the chain of `tokens`' complete blocks as far as it was needed: each
                  block is hashed once per request (admission, commit, re-admission
                  after preemption read it); cut back only by a rollback
    num_computed  tokens whose KV is in the cache; the next forward starts here
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Finish(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORTED = "aborted"


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    salt: str = ""
    traffic_class: str = ""
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish: Finish | None = None
    # cache state
    slot: int | None = None
    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed: int = 0
    prefill_len: int = 0        # tokens to compute before the next sample (set at admission)
    enc_lo: int = 0
    dec_lo: int = 0
    cmp_from: int = 0
    # accounting
    cached_tokens: int = 0
    replayed_tokens: int = 0
    preemptions: int = 0
    admitted_at: int = 0
    # stop-string handling: text emitted so far and text held back (could start a stop string)
    text: str = ""

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_len

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
