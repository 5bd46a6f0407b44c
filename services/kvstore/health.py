"""Per-location health and latency budget for shard reads. Pure: the caller passes times.

`LocationHealth` is owned by `ShardStore` (one per location, only it records
outcomes). Two questions are answered from recent history only:

* **Is the location down?** From the error *rate* over a sliding window
  (`window_s`): at least `min_errors` errors and an error fraction of at least
  `error_rate`. One timeout among many good reads never takes a location
  away; a location whose reads all fail or hang goes down after a few. A down
  location is skipped on the data path except for one trial read every
  `retry_s`; a trial (or any read) that succeeds brings it back at once.
* **When is a shard read late?** `budget()` = `factor` x the p90 of the last
  `samples` successful read latencies, at least `floor_s`, at most `ceiling_s`
  (the socket read timeout). A late read is hedged: the reader starts another
  shard instead of waiting. Lateness alone is not an error (a busy machine is
  not a broken location); the late read runs on and its real outcome (an
  answer, or the socket timeout) is what gets recorded here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class HealthPolicy:
    window_s: float = 10.0
    min_errors: int = 3
    error_rate: float = 0.6
    retry_s: float = 2.0
    factor: float = 2.0
    floor_s: float = 0.1
    ceiling_s: float = 5.0
    samples: int = 64


class LocationHealth:
    def __init__(self, policy: HealthPolicy):
        self.policy = policy
        self._outcomes: deque[tuple[float, bool]] = deque()  # (time, ok), oldest first
        self._latencies: deque[float] = deque(maxlen=policy.samples)
        self._next_trial = 0.0
        self._budget: float | None = None  # cached until the next latency sample
        self._refused = False  # the last connection attempt was refused; cleared by a success

    def _trim(self, now: float) -> None:
        horizon = now - self.policy.window_s
        while self._outcomes and self._outcomes[0][0] < horizon:
            self._outcomes.popleft()
        while len(self._outcomes) > 4 * self.policy.samples:
            self._outcomes.popleft()

    def record(self, now: float, ok: bool, latency: float | None = None,
               refused: bool = False) -> None:
        if ok and self.down(now):
            self._outcomes.clear()  # it answered: back at once, old errors forgotten
        self._refused = refused and not ok
        self._outcomes.append((now, ok))
        if ok and latency is not None:
            self._latencies.append(latency)
            self._budget = None
        self._trim(now)

    def error_rate(self, now: float) -> tuple[int, float]:
        """(errors, error fraction) within the window."""
        self._trim(now)
        if not self._outcomes:
            return 0, 0.0
        errors = sum(1 for _, ok in self._outcomes if not ok)
        return errors, errors / len(self._outcomes)

    def down(self, now: float) -> bool:
        if self._refused:
            return True
        errors, rate = self.error_rate(now)
        return errors >= self.policy.min_errors and rate >= self.policy.error_rate

    def claim_trial(self, now: float) -> bool:
        """For a down location: True once per `retry_s` (the caller then really reads)."""
        if now < self._next_trial:
            return False
        self._next_trial = now + self.policy.retry_s
        return True

    def budget(self) -> float:
        if self._budget is None:
            p = self.policy
            if self._latencies:
                ordered = sorted(self._latencies)
                p90 = ordered[min(len(ordered) - 1, (9 * len(ordered)) // 10)]
            else:
                p90 = 0.0
            self._budget = min(p.ceiling_s, max(p.floor_s, p.factor * p90))
        return self._budget
