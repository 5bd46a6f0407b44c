"""Greedy verification of drafted tokens on DeepSeek V4's ledgers.

One forward over [last token, d1 .. dk] (k <= 6) gives the model's choice after each of
them; drafts are accepted while they equal those choices, the first choice that differs
(or the one after the last draft) is the step's bonus token, and the rejected drafts are
taken back (`ledgers.rollback`: rings, compressor tails, entries and blocks). The output is
the same as plain greedy decoding; only the number of forwards changes.
"""

from __future__ import annotations

from kvmesh.services.engine.model.deepseek_v4 import layout
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
from kvmesh.services.engine.model.deepseek_v4.ledgers import Ledgers, Sequence, extend, rollback


def verify_greedy(model: V4Model, led: Ledgers, seq: Sequence, last: int,
                  drafts: list[int]) -> list[int]:
    """`last` is the newest token, not yet run. Returns the tokens this step decodes:
    the accepted drafts, then the model's next choice. `seq` then holds `last` and the
    accepted drafts."""
    if len(drafts) > layout.BACKTRACK:
        raise ValueError(f"drafts: at most {layout.BACKTRACK} (the ledgers' rollback), "
                         f"got {len(drafts)}")
    start = seq.length
    choices = extend(model, led, seq, [last, *drafts]).argmax(-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
        accepted += 1
    rollback(led, seq, start + 1 + accepted)
    return drafts[:accepted] + [choices[accepted]]
