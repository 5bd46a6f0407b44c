"""StepCosts: how many prefill tokens a step beside decodes may carry, from measured step times.

A step's decodes all wait for its prefill work, so a long prompt's chunks set the inter-token
latency of every decoding stream. `--long-prefill-chunk` caps a chunk at a fixed size, which
is right for one machine, one model and one position in the prompt only (a chunk late in a
4K prompt costs more than an early one: more compressed entries, a wider CSA candidate set).
With `--itl-ratio X` the scheduler instead sizes the prefill work of a step that has decodes
so that the step is predicted to take at most X times a decode-only step:

    step(d decodes + n prefill tokens)  ~  decode_s + n * token_s
    n  =  max(MIN_PREFILL, floor((X - 1) * decode_s / token_s))

decode_s: the median seconds of the last WINDOW decode-only steps; token_s: the median of
what a prefill token added to the last WINDOW steps that had decodes (their seconds minus
decode_s, over their prefill tokens), or, before any such step, of the prefill-only steps
(all of their time: a little high per step, but their long chunks share a step's fixed costs
over more tokens, so beside decodes they start the cap on the long side; the first mixed steps
correct it). Medians over a short window follow the batch size and the prompt position as they
move, and a step stretched by something else on the machine (a wall-clock measure) moves the
cap by one sample, not by its size.

The cap is a number of tokens for the whole step (every chunk of it together), the token
budget and `long_prefill_chunk` still apply beneath it. Off when X = 0, and always off in
deterministic mode: a cap that depends on timing would change chunk boundaries, and with them
fp32 results, from run to run.

Owned by the Scheduler (which reads the cap); EngineCore reports each step's time (`observe`).
Tests inject costs through `observe` instead of timing anything.
"""

from __future__ import annotations

from collections import deque
from statistics import median

# Prefill tokens a step with decodes may always carry, so a prompt progresses however costly
# its tokens are measured to be (a cap of a few tokens would stretch the prompt's time to
# first token over many steps, each paying the decodes' cost again).
MIN_PREFILL = 16
# Steps each median is taken over: a 4K prompt's token cost rises by ~2x over its 64 chunks,
# which 8 steps follow; a one-off slow step is outvoted.
WINDOW = 8


class StepCosts:
    def __init__(self, ratio: float):
        if ratio < 0 or (0 < ratio <= 1):
            raise ValueError(f"itl_ratio must be 0 (off) or above 1, not {ratio}")
        self.ratio = ratio
        self._decode: deque[float] = deque(maxlen=WINDOW)     # decode-only steps' seconds
        self._mixed: deque[float] = deque(maxlen=WINDOW)      # per prefill token, beside decodes
        self._alone: deque[float] = deque(maxlen=WINDOW)      # per prefill token, prefill only

    @property
    def decode_s(self) -> float | None:
        """Seconds of a decode-only step (None: none seen)."""
        return median(self._decode) if self._decode else None

    @property
    def token_s(self) -> float | None:
        """Seconds a prefill token adds to a step beside decodes (None: no prefill seen)."""
        seen = self._mixed or self._alone
        return median(seen) if seen else None

    @property
    def active(self) -> bool:
        return self.ratio > 0

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """One finished step: its decode rows (drafts included), prefill tokens and seconds."""
        if not self.active or seconds <= 0:
            return
        if prefill_tokens == 0:
            if decode_rows:
                self._decode.append(seconds)
        elif not decode_rows:
            self._alone.append(seconds / prefill_tokens)
        elif self.decode_s is not None:
            self._mixed.append(max(seconds - self.decode_s, 0.0) / prefill_tokens)

    def prefill_cap(self, decode_rows: int) -> int | None:
        """Most prefill tokens a step with `decode_rows` decode rows may carry; None: no cap."""
        decode_s, token_s = self.decode_s, self.token_s
        if not self.active or not decode_rows or decode_s is None or not token_s:
            return None
        return max(MIN_PREFILL, int((self.ratio - 1.0) * decode_s / token_s))
