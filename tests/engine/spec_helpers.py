"""Drafters for the speculative decoding tests."""

from __future__ import annotations


class OracleDrafter:
    """Proposes the reference continuation (a run without speculation) with one wrong
    token on purpose: call n puts it at draft position n % (k + 1), so every position
    0..k-1 is rejected in turn and every k-th call is accepted whole."""

    def __init__(self, references: list[list[int]], vocab: int = 256):
        self.references = references
        self.vocab = vocab
        self.calls = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        ref = next(r for r in self.references if r[: len(tokens)] == tokens)
        drafts = list(ref[len(tokens) : len(tokens) + k])
        wrong = self.calls % (k + 1)
        self.calls += 1
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % self.vocab
        return drafts
