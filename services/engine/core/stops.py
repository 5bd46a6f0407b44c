"""Stop-string matching over a growing text, in O(new characters x stop strings) per step.

Each stop string keeps a Knuth-Morris-Pratt state: the length of its longest prefix
that is a suffix of the text seen so far. Feeding a character updates every state in
amortized O(1), so a step costs what its new characters cost, whatever the length of
the text or of the stop strings (re-searching the text or testing every prefix of every
stop string each step is quadratic: a 1 MiB stop string took minutes per request).

The largest state is also how much text must be held back: it might be the start of a
stop string that the next token completes.
"""

from __future__ import annotations


def _prefix_function(s: str) -> list[int]:
    """fail[i] = length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Owned by one sequence's OutputState (engine thread only)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.fail = [_prefix_function(s) for s in stops]
        self.state = [0] * len(stops)

    def feed(self, text: str) -> tuple[int, int] | None:
        """Feed new characters. On the first completed stop string return (index in `text`
        just past its end, its length); None when no stop string ends in `text`."""
        if not self.stops:              # the common case: nothing to scan, every token
            return None
        for i, ch in enumerate(text):
            best = None
            for j, s in enumerate(self.stops):
                k, fail = self.state[j], self.fail[j]
                if k == len(s):             # only after a match; generation ends there
                    k = fail[k - 1]
                while k and s[k] != ch:
                    k = fail[k - 1]
                if s[k] == ch:
                    k += 1
                self.state[j] = k
                if k == len(s) and (best is None or k > best):
                    best = k                # several end here: the longest starts first
            if best is not None:
                return i + 1, best
        return None

    @property
    def hold(self) -> int:
        """Characters at the end of the text that may still become a stop string."""
        return max(self.state, default=0)
