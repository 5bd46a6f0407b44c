"""Fetch a peer's SWA snapshot, or replay 128 tokens? A cost model from measurements.

    fetch  ~ rtt + size / bandwidth          (EMA over completed fetches)
    replay ~ W * prefill seconds per token   (EMA kept by the engine)

`always` and `never` force the choice. Until a fetch has been measured the
model assumes loopback-class numbers (1 ms, 1 GB/s), so the first fetch happens
and teaches it the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("auto", "always", "never")


@dataclass
class FetchPolicy:
    mode: str = "auto"
    rtt_s: float = 1e-3
    bandwidth: float = 1e9          # bytes / s
    fetches: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"fetch mode must be one of {MODES}, not {self.mode!r}")

    def fetch_estimate(self, size: int) -> float:
        return self.rtt_s + size / self.bandwidth

    def should_fetch(self, size: int, replay_s: float) -> bool:
        if self.mode != "auto":
            return self.mode == "always"
        return replay_s <= 0 or self.fetch_estimate(size) < replay_s

    def record_fetch(self, size: int, seconds: float) -> None:
        """Split a measured fetch into latency and bandwidth (small fetches teach latency)."""
        self.fetches += 1
        a = 0.3
        if size < 64 * 1024:
            self.rtt_s = (1 - a) * self.rtt_s + a * seconds
        else:
            bw = size / max(seconds - self.rtt_s, 1e-6)
            self.bandwidth = (1 - a) * self.bandwidth + a * bw
