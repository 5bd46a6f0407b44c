"""MTP drafts for a DeepSeek V4 or V4.1 engine (`--speculative mtp:K`), from the checkpoint's
MTP module (model/deepseek_v4/mtp.py; on V4.1 kvmesh's own, v41_mtp.py: the same interface).

The drafter contract the Speculator (core/speculative.py) drives:
`observe` stashes the trunk's last streams of committed positions after each step (at most
the last W), `propose` turns them into MTP rows and drafts (each row's argmax), `forget`
drops a request. Row p needs token p + 1, so the rows of
positions [first, c) are computed once token c (the pending one) is known; the last of them
gives draft 1, and K - 1 chained rows (each from the previous row's output streams and its
draft) give the rest.

State per request: the MTP block's window rows of the committed positions [done - m, done)
(`window`, m <= W + 8: enough for the next row and for rows a rejection takes back). A
stash that starts inside the window continues it (rows from its first position on are
rewritten: chained rows and rejected tokens' rows never stay); one that starts after it (a
prefix hit, a bounded replay, a handoff) starts the window over there: drafts are weaker
for W tokens, outputs never change (verification decides). Kept in host memory, not in the
slot, so nothing of it is in snapshots or handoffs. Engine thread only (the Speculator
owns the drafter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.services.engine.core.sampling import read_ids
from kvmesh.services.engine.model.deepseek_v4.attention import AttentionParts
from kvmesh.services.engine.model.deepseek_v4.mtp import MtpModule
from kvmesh.services.engine.model.deepseek_v4.v41_mtp import V41MtpModule

SPARE_ROWS = 8         # window rows kept past W - 1: a rejection takes back at most 6


@dataclass
class _State:
    owner: object                          # the request record the rows belong to
    done: int = 0                          # window rows cover positions [done - m, done)
    window: torch.Tensor | None = None     # [m, head_dim] MTP block KV rows
    first: int = 0                         # stash: trunk streams of [first, first + len(h))
    h: torch.Tensor | None = None


class MtpDrafter:
    def __init__(self, module: MtpModule | V41MtpModule, window: int):
        self.module, self.window = module, window
        self.states: dict[str, _State] = {}

    def observe(self, request_id: str, owner: object, first: int, h: torch.Tensor) -> None:
        """Trunk streams [n_rows, n, D] of committed positions [first, first + n_rows)."""
        s = self.states.get(request_id)
        if s is None or s.owner is not owner:
            s = self.states[request_id] = _State(owner, done=first, first=first)
        s.first, s.h = stash(s.first, s.h, first, h, self.window)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def propose(self, wanted: list[tuple[object, int]]) -> dict[str, list[int]]:
        """wanted: (decoding Request, k) -> the drafts of each request whose stash reaches
        its last computed position."""
        out: dict[str, list[int]] = {}
        picked: dict[str, list[torch.Tensor]] = {}
        for req, k in wanted:
            s = self.states.get(req.request_id)
            end = req.seq.length
            if s is None or s.h is None or s.owner is not req or \
                    min(s.first + len(s.h), end) != end or end <= s.first:
                continue                          # the last computed position was not seen
            m = self.module
            prior = self._window_before(s, s.first)
            dev = s.h.device
            y, parts = m.rows(torch.arange(s.first, end, device=dev),
                              torch.tensor(req.tokens[s.first + 1:end + 1], device=dev),
                              s.h[: end - s.first], prior)
            s.window, s.done, s.h = parts.window_kv[-(self.window - 1 + SPARE_ROWS):], end, None
            y = y[-1:]
            window = s.window
            drafts = [torch.argmax(m.logits(y)[0])]
            for depth in range(1, k):             # chained rows: never kept in the window
                y, parts = m.rows(torch.tensor([end + depth - 1], device=dev), drafts[-1].view(1),
                                  y, AttentionParts(None, window, None, None, None))
                window = parts.window_kv[-(self.window - 1):]
                drafts.append(torch.argmax(m.logits(y)[0]))
            picked[req.request_id] = drafts
        ids = read_ids([torch.stack(d) for d in picked.values()])    # one host read
        for rid, d in zip(picked, ids, strict=True):
            out[rid] = d
        return out

    @staticmethod
    def _window_before(s: _State, first: int) -> AttentionParts | None:
        """The window rows of positions < first, or None when they do not reach first."""
        if s.window is None or not s.done - len(s.window) <= first <= s.done:
            return None
        rows = s.window[: len(s.window) - (s.done - first)]
        return AttentionParts(None, rows, None, None, None) if len(rows) else None


def stash(old_first: int, old: torch.Tensor | None, first: int, h: torch.Tensor,
          window: int) -> tuple[int, torch.Tensor]:
    """A stash of rows of positions [old_first, ...) given rows of [first, first + len(h)):
    continued when they start inside it or right after it, else replaced; at most the last
    `window` rows are kept (no draft reads further back). Returns (first, rows)."""
    if old is not None and old_first <= first <= old_first + len(old):
        h, first = torch.cat([old[: first - old_first], h]), old_first
    keep = min(len(h), window)
    return first + len(h) - keep, h[len(h) - keep:]
