"""DraftPolicy: how many drafts each speculating request sends to verification this step.

A verify row is not free: it is one more row through every layer. At batch 1 a step is
mostly fixed cost and drafts ride along almost for nothing; in a full batch each row costs
about as much as a plain decode row, and drafts that are rarely accepted slow every stream
of the step. So the engine decides per step, from what it has measured:

    a decode row (a draft's included) adds about        b        seconds to a step
    a request that verifies drafts adds about            c        seconds more
    a step of these n decode rows with no drafts takes   base(n)  seconds
    draft j of request i is accepted (it and every draft before it) with probability g_ij

A step with the D drafts of largest g (each request's in order: g_i1 >= g_i2 >= ...), of
R(D) requests, is expected to emit n + G(D) tokens in base(n) + b D + c R(D) seconds, G(D)
the sum of those D probabilities. The policy takes the D that maximizes that rate, D = 0
being a plain step: a draft is verified only while its g beats what it costs (b, and c for
a request's first) times the tokens per second the step already promises. c is what a
drafting request costs besides its rows: its MTP forward, its compressor run, its verdict
(on a DeepSeek V4 engine, its verify span attends alone too). A request's `speculative`
setting (or the engine's) bounds its drafts; the policy
never gives more.

Costs. b and c are a least-squares fit (through the origin) over the differences of
consecutive decode-only steps whose row or drafting-request counts differ (the last
ROW_PAIRS): the seconds a step took minus the one before, against the rows and drafting
requests it had more (c is 0 while the two never vary apart). Consecutive steps share the
machine's
state, so a machine that slows down or speeds up (a shared CPU, a GPU clocking) moves both
and cancels out, where comparing a plain step measured a while ago with a drafted step
measured now would not. base(n) is the mean of the last RECENT decode-only steps, each
moved to n rows and no drafts by b and c. Steps that also prefill are not measured and
break the pairing.
Until MIN_PAIRS differences are known, steps alternate between a probe and drafting nothing;
afterwards every EXPLORE_EVERY-th choice is flipped (a plain step when drafting pays, a probe
when it does not), so b and c stay measured. A probe drafts one request's proposals (in
turn; all it may take or one, by turns): drafting every request to learn what that costs
would cost several plain steps in a full batch.

Acceptance. Prompt-lookup drafts are deterministic, so the policy learns from every proposal,
drafted or not: a proposal made when a request had L output tokens is scored against the
tokens the request later emits at L, L + 1, ... (for greedy decoding that is exactly what
verification would have accepted; for sampling, a one-hot draft is accepted with the target
probability of its token, the same chance the emitted token has of being it). MTP drafts
cost a forward to make, so they are scored from verification only, and a request whose
estimate kept it from drafting for FORGET_AFTER tokens falls back to the engine-wide rate
(which lets it try again). Each request's per-position rates are decayed counts shrunk
toward the engine-wide rate of that position.

Output never depends on any of this: drafting or not, verification emits exactly the tokens
plain decoding would (core/speculative.py). Owned by the Speculator (engine thread only);
the engine reports each step's rows and seconds (`step_done`); tests inject costs there.
"""

from __future__ import annotations

from collections import deque

DECAY = 0.9             # a request's acceptance follows its last ~10 verifications
ENGINE_DECAY = 0.995    # the engine-wide rate follows the last ~200
PRIOR_WEIGHT = 4.0      # pseudo-observations of the engine-wide rate in a request's estimate
FIRST_RATE = 0.5        # engine-wide rate before anything was scored (it drafts, and learns)
ROW_PAIRS = 64          # step differences b is fit over (most recent)
MIN_PAIRS = 4           # differences needed before b is trusted
RECENT = 4              # decode-only steps base(n) is the mean of
EXPLORE_EVERY = 64      # every this many choices, the other choice is taken once
FORGET_AFTER = 32       # tokens an MTP request goes unscored before it retries


class Acceptance:
    """Decayed counts of (proposals scored, accepted through draft j) per position j."""

    def __init__(self, k: int, decay: float):
        self.decay = decay
        self.scored = [0.0] * k
        self.accepted = [0.0] * k

    def add(self, n_drafts: int, n_accepted: int) -> None:
        for j in range(min(n_drafts, len(self.scored))):
            self.scored[j] = self.scored[j] * self.decay + 1.0
            self.accepted[j] = self.accepted[j] * self.decay + (j < n_accepted)

    def rate(self, j: int, prior: float, weight: float) -> float:
        return (self.accepted[j] + weight * prior) / (self.scored[j] + weight)


class DraftPolicy:
    def __init__(self, k_max: int, adaptive: bool, learn_from_proposals: bool):
        self.k_max = k_max
        self.adaptive = adaptive
        self.learn_from_proposals = learn_from_proposals      # ngram: yes; mtp: no
        self.engine = Acceptance(k_max, ENGINE_DECAY)
        self.requests: dict[str, Acceptance] = {}
        self.pending: dict[str, list[tuple[int, list[int]]]] = {}  # (output length, proposal)
        self.last_scored: dict[str, int] = {}                 # output length when last scored
        # (rows, drafting requests, seconds) of decode-only steps, and differences of them
        self.pairs: deque[tuple[int, int, float]] = deque(maxlen=ROW_PAIRS)
        self.recent: deque[tuple[int, int, float]] = deque(maxlen=RECENT)
        self.prev: tuple[int, int, float] | None = None     # the last step, if decode-only
        self.choices = 0
        self.probes = 0           # measuring steps taken (which request, how many drafts)
        self.counters = {"spec_policy_plain_steps": 0, "spec_policy_drafted_steps": 0,
                         "spec_withheld_tokens": 0}

    # --- acceptance ---------------------------------------------------------------
    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.last_scored.pop(request_id, None)

    def proposed(self, request_id: str, output_len: int, drafts: list[int]) -> None:
        """A deterministic proposal after `output_len` output tokens, to score later."""
        if self.learn_from_proposals and drafts:
            self.pending.setdefault(request_id, []).append((output_len, list(drafts)))

    def score(self, request_id: str, output: list[int]) -> None:
        """Score the request's pending proposals against the tokens it has emitted since."""
        left = []
        for at, drafts in self.pending.get(request_id, ()):
            n = 0
            while n < len(drafts) and at + n < len(output) and output[at + n] == drafts[n]:
                n += 1
            if n == len(drafts) or at + n < len(output):      # settled: all matched, or a miss
                self._add(request_id, len(drafts), n, len(output))
            else:
                left.append((at, drafts))
        if left:
            self.pending[request_id] = left
        else:
            self.pending.pop(request_id, None)

    def verified(self, request_id: str, n_drafts: int, n_accepted: int, output_len: int) -> None:
        """A verification's verdict (the only score MTP drafts get)."""
        if not self.learn_from_proposals:
            self._add(request_id, n_drafts, n_accepted, output_len)

    def _add(self, request_id: str, n_drafts: int, n_accepted: int, output_len: int) -> None:
        self.engine.add(n_drafts, n_accepted)
        acc = self.requests.get(request_id)
        if acc is None:
            acc = self.requests[request_id] = Acceptance(self.k_max, DECAY)
        acc.add(n_drafts, n_accepted)
        self.last_scored[request_id] = output_len

    def gains(self, request_id: str, k: int, output_len: int) -> list[float]:
        """g_1 >= ... >= g_k: the chance that drafts 1..j are all accepted."""
        engine = [self.engine.rate(j, FIRST_RATE, 2.0) for j in range(k)]
        acc = self.requests.get(request_id)
        stale = output_len - self.last_scored.get(request_id, output_len) > FORGET_AFTER
        if acc is None or (stale and not self.learn_from_proposals):
            rates = engine
        else:
            rates = [acc.rate(j, engine[j], PRIOR_WEIGHT) for j in range(k)]
        out, best = [], 1.0
        for r in rates:
            best = min(best, r)
            out.append(best)
        return out

    # --- costs ----------------------------------------------------------------------
    def step_done(self, decode_rows: int, draft_rows: int, other_tokens: int,
                  seconds: float, drafting: int = 0) -> None:
        """One finished step: its plain decode rows, its draft rows, any other work (prefill,
        replay), its seconds and how many requests verified drafts. Only decode-only steps
        are measured."""
        if other_tokens or not decode_rows or seconds <= 0:
            self.prev = None
            return
        now = (decode_rows + draft_rows, drafting, seconds)
        if self.prev is not None and self.prev[:2] != now[:2]:
            self.pairs.append((now[0] - self.prev[0], now[1] - self.prev[1],
                               seconds - self.prev[2]))
        self.prev = now
        self.recent.append(now)

    def costs(self) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]],
                             tuple[int, int, float] | None]:
        """What the cost estimates are made of: what `follow` needs to decide alike."""
        return list(self.pairs), list(self.recent), self.prev

    def follow(self, costs: tuple) -> None:
        """Estimate costs from another engine's measurements (a split engine's ranks take rank
        0's before each step: core/lockstep.py), so every rank drafts alike. Acceptance needs
        nothing: it comes from the tokens, which every rank has the same."""
        pairs, recent, self.prev = costs
        self.pairs = deque(pairs, maxlen=ROW_PAIRS)
        self.recent = deque(recent, maxlen=RECENT)

    def row_cost(self) -> float | None:
        """b: seconds a decode row adds to a step; None: not measured enough."""
        fit = self.fit()
        return None if fit is None else fit[0]

    def fit(self) -> tuple[float, float] | None:
        """(b, c): seconds a decode row and a drafting request add to a step; None: not
        measured enough. Both at least 0; c = 0 while rows and requests never vary apart."""
        if len(self.pairs) < MIN_PAIRS:
            return None
        xx = sum(r * r for r, _, _ in self.pairs)
        xy = sum(r * q for r, q, _ in self.pairs)
        yy = sum(q * q for _, q, _ in self.pairs)
        xs = sum(r * s for r, _, s in self.pairs)
        ys = sum(q * s for _, q, s in self.pairs)
        det = xx * yy - xy * xy
        if xx and det > 1e-9 * xx * yy:
            b, c = (xs * yy - ys * xy) / det, (ys * xx - xs * xy) / det
            if b >= 0 and c >= 0:
                return b, c
            if b < 0:                       # all of it on the requests
                return 0.0, max(0.0, ys / yy)
        return (max(0.0, xs / xx), 0.0) if xx else (0.0, max(0.0, ys / yy))

    def base_s(self, n: int, b: float, c: float = 0.0) -> float:
        """Seconds of a plain step of n decode rows now: the recent steps moved to n rows
        and no drafts."""
        return max(sum(s - b * (rows - n) - c * q for rows, q, s in self.recent)
                   / len(self.recent), 1e-9)

    # --- the decision ---------------------------------------------------------------
    def allot(self, decode_rows: int, wants: dict[str, tuple[int, int]]) -> dict[str, int]:
        """wants: request id -> (most drafts it may take, its output length); `decode_rows`
        counts every decoding request of the step. -> drafts per request (absent: none)."""
        full = {rid: k for rid, (k, _) in wants.items() if k > 0}
        if not self.adaptive or not full:
            return full
        self.choices += 1
        proposed = sum(full.values())
        fit = self.fit()
        if fit is None or not self.recent:     # not measured: alternate, and measure
            probe = self._probe(full) if self.choices % 2 else {}
            return self._count(probe, withheld=proposed - sum(probe.values()))
        b, c = fit
        items = sorted(((g, j, rid) for rid, (k, n_out) in wants.items()
                        for j, g in enumerate(self.gains(rid, k, n_out))), key=lambda t: (-t[0], t[1]))
        base = self.base_s(decode_rows, b, c)
        best_rate, best_d, tokens, spans = decode_rows / base, 0, float(decode_rows), 0
        for d, (g, j, _) in enumerate(items, start=1):
            tokens += g
            spans += j == 0                    # a request's first draft opens its span
            rate = tokens / (base + b * d + c * spans)
            if rate > best_rate:
                best_rate, best_d = rate, d
        out: dict[str, int] = {}
        for _, _, rid in items[:best_d]:
            out[rid] = out.get(rid, 0) + 1
        if self.choices % EXPLORE_EVERY == 0:  # the other choice, once: keeps b, c measured
            out = {} if out else self._probe(full)
        return self._count(out, withheld=proposed - sum(out.values()))

    def _probe(self, full: dict[str, int]) -> dict[str, int]:
        """A measuring step's drafts: one request's (in turn), all it may take or one, by
        turns, so rows and drafting requests vary apart. One request, not all: in a full
        batch, drafting everything to learn what it costs costs several plain steps."""
        self.probes += 1
        rid = sorted(full)[self.probes // 2 % len(full)]
        return {rid: full[rid] if self.probes % 2 else 1}

    def _count(self, out: dict[str, int], withheld: int = 0) -> dict[str, int]:
        self.counters["spec_policy_drafted_steps" if out else "spec_policy_plain_steps"] += 1
        self.counters["spec_withheld_tokens"] += withheld
        return out
