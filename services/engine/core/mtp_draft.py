"""MtpDrafter: `--speculative mtp:K` drafts from the MTP module (model/mtp.py).

Row p of the MTP module needs the trunk's hidden state h_p and token p + 1, so it can be
computed only once token p + 1 is known. The drafter therefore works one step behind the
trunk:

    step n    forward (prefill chunk, decode or verify rows) -> EngineCore commits what it
              keeps -> observe(): the committed positions' hidden states are stashed
              (at most the last W: no later draft reads further back)
    step n+1  propose(): ONE batched MtpRunner call writes the stashed rows into each
              slot's MTP ring; the last row (position c - 1, c = computed tokens, token c
              pending) gives draft 1 (q_1 = its softmax); K - 1 more batched calls chain
              it: row c + j - 1 takes (y of the previous depth, embed[draft j]) -> draft j + 1

Ring validity per admission (`_Ring.lo`, `.done`): rows of [lo, done) hold MTP rows of the
kept tokens. A stash starting inside [lo, done] continues them (rows from there on are
rewritten: after a rollback or a verify step that rejected drafts, the chained rows and
rows of rejected tokens are replaced); one starting after `done` (the rows between were
never seen: after a snapshot hit, a bounded replay, YOCO truncation, a handoff, or a long
prefill chunk of which only the last W rows matter) starts the window over at its first
row. A draft at position p then reads rows [max(lo, p - W + 1), p]: fewer than W right
after such a restart (documented cost: weaker drafts for W tokens; outputs never change,
verification decides). Nothing of the MTP ring is stored in snapshots or handoffs.

Drafts are the argmax of each row, for greedy and sampling requests alike: verification
accepts a draft when it is the token plain decoding draws there (core/speculative.py), so
the most likely token is the best guess whatever the temperature.
Owned by the Speculator (engine thread); only MtpRunner writes the ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.core.sampling import read_ids
from services.engine.core.v4_mtp_draft import stash
from services.engine.device import Uploads
from services.engine.model.mtp_runner import MtpRows, MtpRunner


@dataclass
class _Ring:
    owner: object              # the admission the ring rows belong to (request id, admitted_at)
    lo: int = 0                # ring rows of positions [lo, done) are valid
    done: int = 0
    first: int = 0             # stash: hidden states of positions [first, first + len(h))
    h: torch.Tensor | None = None


class MtpDrafter:
    def __init__(self, runner: MtpRunner, window: int):
        self.runner, self.window = runner, window
        self.rings: dict[str, _Ring] = {}

    def observe(self, request_id: str, owner: object, first: int, h: torch.Tensor) -> None:
        """Hidden states of committed positions [first, first + n) of one admission."""
        r = self.rings.get(request_id)
        if r is None or r.owner != owner:
            r = self.rings[request_id] = _Ring(owner, lo=first, done=first, first=first)
        r.first, r.h = stash(r.first, r.h, first, h, self.window)

    def forget(self, request_id: str) -> None:
        self.rings.pop(request_id, None)

    def propose(self, wanted: list[tuple[object, int]]) -> dict[str, list[int]]:
        """wanted: (decoding sequence, k) -> drafts of each sequence whose stash reaches its
        last computed position."""
        items, seqs = [], []
        for seq, k in wanted:
            r = self.rings.get(seq.request_id)
            if r is None or r.h is None or r.owner != (seq.request_id, seq.admitted_at):
                continue
            end = min(r.first + len(r.h), seq.num_computed)
            if end != seq.num_computed or end <= r.first:
                continue                    # the last computed position was not seen
            if not r.lo <= r.first <= r.done:
                r.lo = r.first              # a gap: the window starts over here
            items.append(MtpRows(seq.slot, r.lo, r.first, r.h[: end - r.first],
                                 seq.tokens[r.first + 1 : end + 1]))
            seqs.append((seq, k, r))
            r.done, r.h = end, None
        out: dict[str, list[int]] = {}
        if not items:
            return out
        y, logits = self.runner.forward(items)
        ends, n = [], 0
        for it in items:
            n += len(it.next_tokens)
            ends.append(n - 1)
        y = y[Uploads(y.device).longs(ends)]      # row j: the last row of item j
        picked: list[list[torch.Tensor]] = [[] for _ in seqs]    # drafts, on the device
        active = list(range(len(seqs)))          # row j of y / logits is seqs[active[j]]
        for depth in range(max(k for _, k, _ in seqs)):
            for j, i in enumerate(active):
                picked[i].append(torch.argmax(logits[j]))
            more = [j for j, i in enumerate(active) if seqs[i][1] > depth + 1]
            if not more:
                break
            # chained: the row after the last one, from the previous depth's output and its
            # draft, which stays on the device (read once, with every other draft, below)
            chained = [MtpRows(seqs[active[j]][0].slot, seqs[active[j]][2].lo,
                               seqs[active[j]][0].num_computed + depth, y[j : j + 1],
                               picked[active[j]][-1].view(1)) for j in more]
            active = [active[j] for j in more]
            y, logits = self.runner.forward(chained)
        # the drafting's one host read: every draft of every sequence
        drafts = read_ids([torch.stack(p) for p in picked])
        for (seq, _, _), d in zip(seqs, drafts, strict=True):
            out[seq.request_id] = d
        return out
