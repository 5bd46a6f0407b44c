"""Scheduler: continuous batching with chunked prefill and preemption.

Owns the waiting queue, the running list and each sequence's scheduling fields
(status, finish, preemptions, admitted_at). Each step:

    1. every running sequence that is decoding gets one token (one batched forward), and
       with speculative decoding its k draft tokens, while the budget lasts (1 + k rows);
    2. running sequences still in prefill get chunks, oldest first, within the
       token budget `max_batched_tokens` (decode tokens count against it), each chunk at
       most `long_prefill_chunk` tokens when that is set, so one long prompt cannot make
       a step (and the inter-token latency of every decode in it) arbitrarily long; with
       `step_slo_ms` (the default), a step that has decodes carries at most the prefill
       tokens a fit of recent step times says keep it within that many milliseconds
       (StepBudget, step_budget.py); with `itl_ratio` instead, within that many decode-only
       steps (StepCosts, step_costs.py);
    3. waiting sequences are admitted while a slot, blocks for their first chunk,
       and budget remain: the cache manager plans the prefix hit (match_prefix) and
       fills the slot from it (admit); the plan goes back to the engine in the StepPlan.

When a sequence needs a block and none is free, the most recently admitted
running sequence is preempted: its slot and blocks go back, it returns to the
front of the queue and is recomputed (prompt + what it generated; with truncation on,
from its prefix hits) when readmitted. Its slot's replica is stored first, so a
readmission can resume from it (see the replica rule in prefix.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from services.engine.cache.manager import CacheManager, MatchResult
from services.engine.config import EngineConfig
from services.engine.core.sequence import Finish, Sequence, Status
from services.engine.core.step_budget import StepBudget
from services.engine.core.step_costs import StepCosts


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int, int]] = field(default_factory=list)   # (seq, start, end)
    out_of_memory: list[Sequence] = field(default_factory=list)              # finished: cache full
    admitted: list[tuple[Sequence, MatchResult]] = field(default_factory=list)  # and their hits
    drafts: dict[str, int] = field(default_factory=dict)    # request id -> draft rows granted

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.out_of_memory


class Scheduler:
    def __init__(self, ecfg: EngineConfig, cache: CacheManager):
        self.ecfg = ecfg
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = 0
        # timing-sized steps would change chunk boundaries (and fp32 bits) between runs
        self.costs = StepBudget(0.0 if ecfg.deterministic else ecfg.step_slo_ms) \
            if ecfg.step_slo_ms else StepCosts(0.0 if ecfg.deterministic else ecfg.itl_ratio)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def adopt(self, seq: Sequence) -> None:
        """A handed-off sequence whose cache is already filled (CacheManager.adopt): it runs
        from the next step on, decoding; the caller checked `can_adopt`."""
        seq.status = Status.RUNNING
        self._admissions += 1
        seq.admitted_at = self._admissions
        seq.scheduled_s = seq.scheduled_s or time.monotonic()
        self.running.append(seq)

    @property
    def can_adopt(self) -> bool:
        return len(self.running) < self.ecfg.max_running

    def finish(self, seq: Sequence, reason: Finish) -> None:
        """The request is over (stop, length, aborted): leave the queues, give back its cache."""
        if seq in self.running:
            self.running.remove(seq)
            self.cache.release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish = Status.FINISHED, reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: dict[str, int] | None = None) -> StepPlan:
        """`drafts`: draft tokens each decoding request proposes (speculative decoding);
        they are granted while the token budget lasts, after every decode's own rows."""
        plan = StepPlan()
        budget = self.ecfg.max_batched_tokens
        drafts = drafts or {}
        decoding = [s for s in self.running if s.status is Status.RUNNING and not s.prefilling]
        for seq in decoding:
            if seq.num_computed == seq.num_tokens:     # rolled back past its sampled token
                self.cache.reopen(seq)
            budget -= seq.num_tokens - seq.num_computed
        for seq in decoding:           # the running order; some may be preempted on the way
            if seq.status is not Status.RUNNING:
                continue
            k = min(drafts.get(seq.request_id, 0), max(0, budget))
            if self._make_room(seq, seq.num_tokens + k, plan):
                plan.decode.append(seq)
                if k:
                    plan.drafts[seq.request_id] = k
                    budget -= k
        rows = sum(s.num_tokens - s.num_computed for s in plan.decode) + sum(plan.drafts.values())
        cap = self.costs.prefill_cap(rows)
        if cap is not None:            # the rest of the budget is prefill work: keep the step short
            budget = min(budget, cap)
        planned = set(plan.decode)     # a set: `seq in list` was quadratic in the batch
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is Status.RUNNING and seq.prefilling and seq not in planned:
                budget -= self._plan_chunk(seq, budget, plan)
        while self.waiting and budget > 0 and len(self.running) < self.ecfg.max_running:
            seq = self.waiting[0]
            if not self.cache.can_admit(seq, min(seq.num_tokens, budget)):
                break
            self.waiting.popleft()
            match = self.cache.match_prefix(seq)
            self.cache.admit(seq, match)
            plan.admitted.append((seq, match))
            seq.status = Status.RUNNING
            self._admissions += 1
            seq.admitted_at = self._admissions
            seq.scheduled_s = seq.scheduled_s or time.monotonic()   # the first admission
            self.running.append(seq)
            budget -= self._plan_chunk(seq, budget, plan)
            if seq.status is Status.WAITING:
                break       # it had to give its blocks back at once: readmitting it now would loop
        return plan

    def _plan_chunk(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        start = seq.num_computed
        cap = self.ecfg.long_prefill_chunk or budget
        end = min(seq.prefill_len, start + min(budget, cap))
        if not self._make_room(seq, end, plan):
            return 0
        plan.prefill.append((seq, start, end))
        return end - start

    def _make_room(self, seq: Sequence, end: int, plan: StepPlan) -> bool:
        """Grow seq's table to `end`, preempting newer sequences; False if seq itself had to go."""
        while not self.cache.grow(seq, end):
            others = [s for s in self.running if s is not seq]
            if not others:
                # alone and still too big: the pool cannot hold this sequence
                self.running.remove(seq)
                self.cache.release(seq)
                seq.status, seq.finish = Status.FINISHED, Finish.LENGTH
                plan.out_of_memory.append(seq)
                return False
            victim = max(self.running, key=lambda s: s.admitted_at)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.cache.release(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        if seq in plan.decode:
            plan.decode.remove(seq)
        plan.drafts.pop(seq.request_id, None)
        plan.prefill = [p for p in plan.prefill if p[0] is not seq]
        plan.admitted = [a for a in plan.admitted if a[0] is not seq]
