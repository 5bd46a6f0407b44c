"""Sequence: one request's tokens and cache bookkeeping as the engine sees it.

Every field has one writer, all on the engine thread:

    request      request_id, params, seed, salt, traffic_class, handoff
                 set when EngineCore creates the Sequence; never changed
    tokens       prompt, output
                 set when EngineCore creates the Sequence (a resumed generation starts
                 with output); then CacheManager: `append_token` after a sample, `rollback`
                 takes tokens back
                 together with their cache rows (the two must never disagree)
    cache        slot, table, hashes, block_hashes, num_computed, prefill_len, enc_lo,
                 dec_lo, cmp_from, cached_tokens, replayed_tokens, recomputed_tokens, lineage,
                 prefetched
                 CacheManager (match, admit, grow, commit, release, rollback); EngineCore
                 seeds `prefetched` and `block_hashes` (the prefetch's hashes) at creation
    scheduling   status, finish, preemptions, admitted_at, scheduled_s
                 Scheduler (admission, preemption, finish)

What the cache fields say about the two ledgers:

    slot          its state slot (SWA rings, compression tails), None while waiting
    table         block ids; entry rows for tokens [0, num_computed)
    hashes        chained hashes of the blocks registered for sharing (complete blocks)
    block_hashes  the chain of `tokens`' complete blocks as far as it was needed: each
                  block is hashed once per request (admission, commit, re-admission
                  after preemption read it); cut back only by a rollback
    num_computed  tokens whose KV is in the cache; the next forward starts here
    enc_lo        encoder SWA keys start here (bounded replay start; 0 = full window)
    dec_lo        decoder SWA keys start here (YOCO truncation: L - KEEP)
    cmp_from      compressed entries before this position are cached: never rewritten
    lineage       "" = exact; else (`--replay-blocks isolate` after a bounded replay) the
                  salt suffix its blocks from cmp_from on are registered under, so that
                  exact requests never match them
"""

from __future__ import annotations

import enum
from collections import abc
from dataclasses import dataclass, field
from typing import Any, overload

from services.engine.core.sampling import SamplingParams


class TokenView(abc.Sequence[int]):
    """Lists read as one (a sequence's prompt, output and drafts), without joining them: a
    step's work slices the few tokens it computes (a decode row's one), where joining
    copied the whole context of every sequence on every step."""

    __slots__ = ("_parts",)

    def __init__(self, *parts: list[int]):
        self._parts = parts

    def __len__(self) -> int:
        return sum(len(p) for p in self._parts)

    @overload
    def __getitem__(self, at: int) -> int: ...

    @overload
    def __getitem__(self, at: slice) -> list[int]: ...

    def __getitem__(self, at: int | slice) -> int | list[int]:
        if isinstance(at, slice):
            return self._slice(at)
        n = len(self)
        i = at + n if at < 0 else at
        if not 0 <= i < n:
            raise IndexError(f"token {at} of {n}")
        for p in self._parts:
            if i < len(p):
                return p[i]
            i -= len(p)
        raise AssertionError("unreachable: i < len(self)")

    def _slice(self, at: slice) -> list[int]:
        start, stop = at.start, at.stop
        if at.step is not None or start is None or stop is None or start < 0 or stop < 0:
            start, stop, stride = at.indices(len(self))         # the general case
            if stride != 1:
                return self.list()[at]
        out: list[int] = []                # a step's case, [start, end): a few ops a part
        for p in self._parts:
            if stop <= 0:
                break
            n = len(p)
            if start < n:
                out += p[start:stop]
                start = 0
            else:
                start -= n
            stop -= n
        return out

    def list(self) -> list[int]:
        return [t for p in self._parts for t in p]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Finish(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORTED = "aborted"
    HANDOFF = "handoff"     # prefill done and first token sent: a decode engine continues


# eq=False: a Sequence is one request's record, equal only to itself. The scheduler's
# membership tests (`seq in decoding`, list.remove) then compare identities instead of
# building and comparing every field (a dataclass __eq__): at 32 decoding sequences that was
# ~500 field-tuple comparisons per step (0.7 ms of a 35 ms step), growing with the square.
@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    salt: str = ""
    traffic_class: str = ""
    handoff: bool = False       # stop after the first token and hand the request off (PE)
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
    # cache contents fetched from other tiers for this request (prefix.Prefetched); used by
    # the first admission only, then dropped
    prefetched: Any = None
    # accounting (of the latest admission)
    cached_tokens: int = 0      # tokens whose blocks came from cache (L1)
    replayed_tokens: int = 0    # approximate: encoder bounded replay of [L1 - W, L1)
    recomputed_tokens: int = 0  # exact: [S, L1) recomputed over a snapshot at S < L1
    lineage: str = ""
    preemptions: int = 0
    admitted_at: int = 0
    scheduled_s: float = 0.0    # time.monotonic() of its first admission (0: still waiting)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_view(self, *more: list[int]) -> TokenView:
        """prompt + output (and `more`, e.g. drafts) to slice or measure without building the
        joined list `tokens` builds: a step reads a few of them, a completed block 128."""
        return TokenView(self.prompt, self.output, *more)

    @property
    def num_tokens(self) -> int:
        """len(tokens) without building the list (a decode step asked it ~8 times a sequence:
        ~0.2 ms a step at batch 32 spent concatenating prompts)."""
        return len(self.prompt) + len(self.output)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_len

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
