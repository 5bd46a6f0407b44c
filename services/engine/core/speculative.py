"""Speculative decoding: settings, drafters and lossless verification.

A running request proposes k draft tokens after its pending (sampled, not yet computed)
token; one forward computes the pending token and the drafts (1 + k rows beside the
step's other work) and returns k + 1 logit rows. Row j is the target distribution of the
token after position start + j, so draft j + 1 is checked against row j. Verification
takes each row's token exactly as plain decoding would take it there, and keeps the
drafts up to the first one that differs:

    greedy         row j's token is its argmax
    temperature>0  row j's token is drawn as sampling.draw draws token step + j of the
                   request: from target_probs(row) (temperature, top_k, top_p) with the
                   generator seeded by (request seed, step + j)

So the tokens emitted are plain decoding's, token for token, greedy or seeded: whether a
step drafted, how many drafts it verified (core/draft_policy.py decides that from timing),
the batch, or a decode engine's own setting never changes a request's output. For a
deterministic drafter (prompt lookup) a draft d is accepted with probability p(d), as
rejection sampling would accept it; a sampling drafter would accept more often under
rejection sampling (min(1, p/q)), but its tokens would then depend on the drafting, so
the MTP drafter proposes its argmax instead (core/mtp_draft.py).

The rows of rejected drafts are never committed: the engine commits only up to the last
accepted token, so no block hash, snapshot, kvstore upload or directory entry ever sees a
rejected token (docs/design.md §8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvmesh.errors import InvalidArgument
from kvmesh.generation import parse_speculative
from kvmesh.services.engine.core.draft_policy import DraftPolicy
from kvmesh.services.engine.core.sampling import SamplingParams, draw
from kvmesh.services.engine.device import Uploads

if TYPE_CHECKING:
    from kvmesh.services.engine.core.mtp_draft import MtpDrafter


@dataclass(frozen=True)
class SpecSetting:
    method: str = "off"          # off | ngram | mtp
    k: int = 0                   # drafts per step (0 when off)

    @property
    def on(self) -> bool:
        return self.k > 0


def parse(text: str, field: str = "speculative") -> SpecSetting:
    """'off' | 'ngram:K' | 'mtp:K' (K >= 1); the error names `field`."""
    return SpecSetting(*parse_speculative(text, field))


def engine_setting(text: str, backtrack: int, has_mtp: bool) -> SpecSetting:
    """The engine's --speculative, checked against its layout (K <= B) and weights."""
    s = parse(text)
    if s.k > backtrack:
        raise InvalidArgument(f"speculative: K = {s.k} exceeds B = {backtrack}, the tokens a "
                              f"sequence can take back (--max-backtrack)")
    if s.method == "mtp" and not has_mtp:
        raise InvalidArgument("speculative: mtp needs MTP weights in the checkpoint (DeepSeek "
                              "V4's mtp.* tensors; on V4.1 kvmesh's MTP module (kvmesh.mtp.*), "
                              "which `kvmesh train-mtp` adds: the release's DSpark layers, which "
                              "kvmesh does not serve yet, are another drafter), and this one has "
                              "none; use ngram:K or off")
    return s


def request_setting(params: SamplingParams, engine: SpecSetting) -> SpecSetting:
    """A request's own setting, bounded by the engine's: off, or the engine's method with
    K no larger than the engine's; an mtp engine also serves ngram (it needs no state).
    Empty = the engine's setting."""
    if not params.speculative:
        return engine
    s = parse(params.speculative)
    if not s.on:
        return s
    methods = ("ngram", "mtp") if engine.method == "mtp" else (engine.method,)
    if s.method not in methods or s.k > engine.k:
        have = f"{engine.method}:{engine.k}" if engine.on else "off"
        raise InvalidArgument(f"speculative: {params.speculative!r} is not allowed on this engine "
                              f"(it runs {have}; a request may ask for off or "
                              f"{' or '.join(methods)} with K up to {engine.k})")
    return s


# --- drafters -------------------------------------------------------------------------
class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the longest suffix of
    the tokens (n from max_n down to min_n) and propose what followed it. The proposal is
    a copy pointer: when the match overlaps the suffix (a run or a short period), the
    copy continues through the tokens it has just proposed, so a periodic tail still
    yields k drafts instead of the one token left before the end."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise InvalidArgument(f"speculative: ngram sizes need 1 <= min_n <= max_n, got "
                                  f"{min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        n_tok = len(tokens)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = tokens[n_tok - n:]
            first = suffix[0]
            # scan backwards from the latest possible start (the match must end before
            # the suffix itself starts so that something follows it)
            i = n_tok - n - 1
            while i >= 0:
                if tokens[i] == first and tokens[i:i + n] == suffix:
                    out: list[int] = []
                    for j in range(i + n, i + n + k):
                        out.append(tokens[j] if j < n_tok else out[j - n_tok])
                    return out
                i -= 1
        return []


# --- verification ---------------------------------------------------------------------
def judge(logits: torch.Tensor, drafts: list[int], params: SamplingParams, step: int,
          seed: int) -> torch.Tensor:
    """logits [k + 1, V] of one verify work -> [2] long on the logits' device: a, the number
    of drafts accepted, and the token emitted after them (row a's token: a replacement, or
    the bonus when a = k). Nothing is read back: the caller reads every work's verdict of
    the step at once (Engine.step), and the work emits drafts[:a] + [token].

    Row j's token is plain decoding's token step + j (sampling.draw, row by row, the same
    generator and distribution), so the work emits exactly what k + 1 plain steps would."""
    k, dev = len(drafts), logits.device
    d = Uploads(dev).longs(drafts)                   # pinned and non-blocking on CUDA
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)                                  # [k + 1]
    else:
        tokens = torch.stack([draw(row, params, step + j, seed) for j, row in enumerate(logits)])
    a = torch.cumprod((tokens[:k] == d).long(), 0).sum()
    return torch.cat([a.view(1), tokens.gather(0, a.view(1))])      # (t[a] would read a)


def emitted(drafts: list[int], verdict: list[int]) -> list[int]:
    """A judged work's tokens from its verdict [a, token] (read from `judge`'s tensor)."""
    a, token = verdict
    return list(drafts[:a]) + [token]


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, step: int,
           seed: int) -> list[int]:
    """logits [k + 1, V] of one verify work -> the tokens it emits (accepted drafts, then
    one replacement or bonus token). `step` = tokens the request generated before. One
    work judged and read on its own (the engine reads a step's verdicts together)."""
    return emitted(drafts, judge(logits, drafts, params, step, seed).tolist())


# --- the engine's side ----------------------------------------------------------------
MAX_BACKOFF = 16     # tokens a request decodes plainly after repeated wholly rejected drafts


class Speculator:
    """Owned by the engine (engine thread only): the engine's setting, its drafter, each
    running request's own setting and draft counts, the draft counters of GetStats, and
    the DraftPolicy that decides each step how many drafts are worth verifying
    (`adaptive`; off: every request drafts what its setting allows, backing off after
    rejections)."""

    def __init__(self, setting: SpecSetting, ngram_min: int = 1, ngram_max: int = 4,
                 mtp: MtpDrafter | None = None, adaptive: bool = True):
        self.setting = setting
        self.policy = DraftPolicy(setting.k, adaptive, learn_from_proposals=setting.method != "mtp")
        # tests may replace the drafter (any object with propose(tokens, k) -> drafts)
        self.drafter = NgramDrafter(ngram_min, ngram_max) if setting.on else None
        # mtp:K: drafts from the MTP module, batched over the step's requests (core/mtp_draft.py)
        self.mtp = mtp if setting.method == "mtp" else None
        self.requests: dict[str, SpecSetting] = {}
        self.usage: dict[str, list[int]] = {}          # request id -> [drafted, accepted]
        # request id -> (output length at which it drafts again, wholly rejected drafts in
        # a row): a verify row costs more than a plain decode row, so a request whose
        # drafts keep failing decodes plainly for 1, 2, 4 .. MAX_BACKOFF tokens between tries
        self.backoff: dict[str, tuple[int, int]] = {}
        self.counters: dict[str, int] = {"spec_verify_steps": 0, "spec_drafted_tokens": 0,
                                         "spec_accepted_tokens": 0}
        for j in range(1, setting.k + 1):
            self.counters[f"spec_drafted_pos{j}"] = self.counters[f"spec_accepted_pos{j}"] = 0

    def add(self, request_id: str, params: SamplingParams) -> None:
        s = request_setting(params, self.setting)      # InvalidArgument naming `speculative`
        if s.on and self.drafter is not None and params.draftable:
            self.requests[request_id] = s
        self.usage[request_id] = [0, 0]

    def wants_hidden(self, request_id: str) -> bool:
        """Does this request's forward hand its hidden states to the MTP drafter?"""
        s = self.requests.get(request_id)
        return s is not None and s.method == "mtp"

    def observe(self, seq, owner, hidden: tuple[int, torch.Tensor] | None, end: int) -> None:
        """After a forward: the hidden states of seq's positions committed up to `end`."""
        if hidden is None or not self.wants_hidden(seq.request_id):
            return
        first, h = hidden
        if end > first:
            self.mtp.observe(seq.request_id, owner, first, h[: end - first])

    def forget(self, request_id: str) -> None:
        if self.mtp is not None:
            self.mtp.forget(request_id)
        self.requests.pop(request_id, None)
        self.usage.pop(request_id, None)
        self.backoff.pop(request_id, None)
        self.policy.forget(request_id)

    def propose(self, running) -> dict[str, list[int]]:
        """Drafts of every decoding request that speculates, as many as the policy finds
        worth verifying (never more than its setting or its remaining max_tokens allow:
        the step emits at most 1 + k tokens)."""
        out: dict[str, list[int]] = {}
        if not self.requests:            # nothing speculates: no walk over the running list
            return out
        policy = self.policy
        decoding = [seq for seq in running if not seq.prefilling and seq.slot is not None]
        wants: dict[str, tuple[int, int]] = {}
        by_mtp, proposals = [], {}
        for seq in decoding:
            rid = seq.request_id
            s = self.requests.get(rid)
            if s is None:
                continue
            policy.score(rid, seq.output)
            if not policy.adaptive and len(seq.output) < self.backoff.get(rid, (0, 0))[0]:
                continue
            k = min(s.k, seq.params.max_tokens - len(seq.output) - 1)
            if k <= 0:
                continue
            if s.method == "mtp":
                by_mtp.append(seq)
            else:
                proposals[rid] = self.drafter.propose(seq.tokens, k)[:k]
                policy.proposed(rid, len(seq.output), proposals[rid])
                k = len(proposals[rid])
            wants[rid] = (k, len(seq.output))
        allotted = policy.allot(len(decoding), wants)
        mtp = [(seq, allotted[seq.request_id]) for seq in by_mtp if seq.request_id in allotted]
        if mtp:
            out = self.mtp.propose(mtp)               # one batched call per draft depth
        for rid, drafts in proposals.items():
            if allotted.get(rid):
                out[rid] = drafts[: allotted[rid]]
        return out

    def step_done(self, decode_rows: int, draft_rows: int, other_tokens: int,
                  seconds: float, drafting: int = 0) -> None:
        """The step's measured cost, for the policy (DraftPolicy.step_done)."""
        self.policy.step_done(decode_rows, draft_rows, other_tokens, seconds, drafting)

    def judge(self, seq, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """The verdict of seq's drafts on the device ([2]: see `judge`); `settle` it once read."""
        return judge(logits, drafts, seq.params, len(seq.output), seq.seed)

    def verify(self, seq, logits: torch.Tensor, drafts: list[int]) -> list[int]:
        """judge + read + settle for one sequence."""
        return self.settle(seq, drafts, self.judge(seq, logits, drafts).tolist())

    def settle(self, seq, drafts: list[int], verdict: list[int]) -> list[int]:
        """The tokens of a read verdict; counts them (acceptance, backoff, usage)."""
        tokens = emitted(drafts, verdict)
        accepted = len(tokens) - 1
        c = self.counters
        c["spec_verify_steps"] += 1
        c["spec_drafted_tokens"] += len(drafts)
        c["spec_accepted_tokens"] += accepted
        for j in range(1, len(drafts) + 1):
            c[f"spec_drafted_pos{j}"] += 1          # j <= K: made in __init__
            c[f"spec_accepted_pos{j}"] += j <= accepted
        if not self.policy.adaptive:     # (the adaptive policy's estimates replace backoff)
            self._back_off(seq, accepted, len(tokens))
        use = self.usage.setdefault(seq.request_id, [0, 0])
        use[0] += len(drafts)
        use[1] += accepted
        self.policy.verified(seq.request_id, len(drafts), accepted, len(seq.output) + len(tokens))
        return tokens

    def _back_off(self, seq, accepted: int, emitted_n: int) -> None:
        """--spec-policy always: a wholly rejected draft pauses drafting 1, 2, 4 .. tokens."""
        if accepted:
            self.backoff.pop(seq.request_id, None)
            return
        misses = self.backoff.get(seq.request_id, (0, 0))[1] + 1
        wait = min(MAX_BACKOFF, 1 << (misses - 1))
        self.backoff[seq.request_id] = (len(seq.output) + emitted_n + wait, misses)

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in (self.counters | self.policy.counters).items()}
        steps = self.counters["spec_verify_steps"]
        out["spec_mean_accepted"] = self.counters["spec_accepted_tokens"] / steps if steps else 0.0
        for key, v in self.counters.items():
            if key.startswith("spec_drafted_pos") and v:
                j = key[len("spec_drafted_pos"):]
                out[f"spec_acceptance_pos{j}"] = self.counters[f"spec_accepted_pos{j}"] / v
        return out
