"""Turning sampled tokens into what a client sees: text deltas, stop rules, finish reasons.

`OutputState` belongs to one sequence and is changed only by the engine thread.
Text that might be the start of a stop string is held back until it is clear
that it is not; a matched stop string and everything after it is never sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.tokenizer import TextStream
from services.engine.sampling import SamplingParams
from services.engine.sequence import Finish


@dataclass
class OutputState:
    params: SamplingParams
    eos_id: int | None
    stream: TextStream
    sent: int = 0                       # characters of stream.text already sent
    done_text: str | None = None        # final text once a stop string matched
    pending_ids: list[int] = field(default_factory=list)

    def push(self, token: int, n_generated: int) -> tuple[str, Finish | None]:
        """Feed one sampled token; return (text delta, finish reason or None)."""
        p = self.params
        if (token == self.eos_id and not p.ignore_eos) or token in p.stop_token_ids:
            return self._flush(), Finish.STOP
        self.stream.push([token])
        text = self.stream.text
        for stop in p.stop:
            at = text.find(stop, max(0, self.sent - len(stop) + 1))
            if at != -1:
                delta = text[self.sent : at]
                self.sent = at
                return delta, Finish.STOP
        finish = Finish.LENGTH if n_generated >= p.max_tokens else None
        if finish:
            return self._flush(), finish
        hold = max((k for s in p.stop for k in range(len(s) - 1, 0, -1)
                    if text.endswith(s[:k])), default=0)
        end = len(text) - hold
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta, None

    def _flush(self) -> str:
        delta = self.stream.text[self.sent :]
        self.sent = len(self.stream.text)
        return delta
