"""Turning sampled tokens into what a client sees: text deltas, stop rules, finish reasons.

`OutputState` belongs to one sequence and is changed only by the engine thread.
Text that might be the start of a stop string is held back until it is clear
that it is not; a matched stop string and everything after it is never sent.
Stop strings are matched incrementally (`stops.StopMatcher`): each step costs
what its new characters cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.errors import InvalidArgument
from kvmesh.tokenizer import TextStream
from services.engine.core.sampling import SamplingParams
from services.engine.core.sequence import Finish
from services.engine.core.stops import StopMatcher


@dataclass
class OutputState:
    params: SamplingParams
    eos_id: int | None
    stream: TextStream
    sent: int = 0                       # characters of stream.text already sent
    done_text: str | None = None        # final text once a stop string matched
    pending_ids: list[int] = field(default_factory=list)
    stops: StopMatcher = field(init=False)   # built from params.stop

    def __post_init__(self) -> None:
        self.stops = StopMatcher(tuple(self.params.stop))

    def resume(self, tokens: list[int]) -> None:
        """Take over a generation whose `tokens` another engine produced and sent: rebuild
        the stop-string state and what was sent from them, so the next push continues as
        the first engine would have."""
        p = self.params
        if any((t == self.eos_id and not p.ignore_eos) or t in p.stop_token_ids for t in tokens):
            raise InvalidArgument("resumed output contains an end token: it already finished")
        self.stream.push(tokens)
        if self.stops.feed(self.stream.text) is not None:
            raise InvalidArgument("resumed output contains a stop string: it already finished")
        self.sent = len(self.stream.text) - self.stops.hold

    def push(self, token: int, n_generated: int) -> tuple[str, Finish | None]:
        """Feed one sampled token; return (text delta, finish reason or None)."""
        p = self.params
        if (token == self.eos_id and not p.ignore_eos) or token in p.stop_token_ids:
            return self._flush(), Finish.STOP
        new = self.stream.push([token])
        text = self.stream.text
        hit = self.stops.feed(new)
        if hit is not None:
            end, length = hit
            at = len(text) - len(new) + end - length   # where the stop string starts
            delta = text[self.sent : at]
            self.sent = at
            return delta, Finish.STOP
        finish = Finish.LENGTH if n_generated >= p.max_tokens else None
        if finish:
            return self._flush(), finish
        end = len(text) - self.stops.hold
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta, None

    def _flush(self) -> str:
        delta = self.stream.text[self.sent :]
        self.sent = len(self.stream.text)
        return delta
