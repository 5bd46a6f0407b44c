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
from kvmesh.services.engine.core.finish import Finish
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.core.stops import StopMatcher
from kvmesh.tokenizer import TextStream


@dataclass
class OutputState:
    params: SamplingParams
    eos_id: int | None
    stream: TextStream
    # the text produced but not sent yet: what may still be the start of a stop string (at
    # most the longest stop string) and this token's characters. A push reads only this,
    # never the whole text (copying or slicing that made a long generation quadratic)
    held: str = ""
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
        text = self.stream.text
        if self.stops.feed(text) is not None:
            raise InvalidArgument("resumed output contains a stop string: it already finished")
        hold = self.stops.hold
        self.held = text[len(text) - hold :] if hold else ""

    def push(self, token: int, n_generated: int) -> tuple[str, Finish | None]:
        """Feed one sampled token; return (text delta, finish reason or None)."""
        p = self.params
        if (token == self.eos_id and not p.ignore_eos) or token in p.stop_token_ids:
            return self._flush(), Finish.STOP
        new = self.stream.push([token])
        held = self.held + new
        hit = self.stops.feed(new)
        if hit is not None:
            end, length = hit
            at = len(held) - len(new) + end - length   # where the stop string starts
            self.held = ""                             # it and what follows are never sent
            return held[:at], Finish.STOP
        if n_generated >= p.max_tokens:
            self.held = held
            return self._flush(), Finish.LENGTH
        # a stop string's possible start is held: the largest match state, which never
        # reaches past the held characters (it grows by one a character)
        end = max(0, len(held) - self.stops.hold)
        self.held = held[end:]
        return held[:end], None

    def _flush(self) -> str:
        delta, self.held = self.held, ""
        return delta
