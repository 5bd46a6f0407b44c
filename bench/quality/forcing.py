"""Teacher-forced runs for the replay-quality benchmarks: requests run through a real
in-process engine (V4-mini's EngineCore here; V4.1's in v41_harness.py), teacher-forced continuations read in one prefill, and the per-prompt metrics.

Two kinds of request:

    forced   the prompt followed by the continuation to score (n tokens), admitted as ONE
             prompt of L + n tokens. The engine computes the continuation's rows as prompt
             rows, and this harness keeps the logits of rows L-1 .. L+n-2 (each predicts the
             next forced token). Two things are pinned to what a request of the L-token
             prompt alone would get: the YOCO truncation point (dec_lo = L - KEEP, set at
             admission) and the prefix match (capped at L - KEEP, as the prompt alone would
             be). With those, every row is the same computation a decode step would do for a
             request of the L-token prompt whose sampled tokens were replaced by the forced
             ones (tests/engine/bench/test_replay_harness.py pins that in float64), at a fraction of
             the steps: 64 decode steps become two prefill chunks.
    greedy   free-running, temperature 0 (only for the exact path: a variant's greedy
             agreement is read from a forced request over the exact path's greedy tokens:
             its free-running greedy would follow them up to the first row whose argmax
             differs, which is therefore its first divergence).

Requests that must see the same cache state are admitted in the same scheduler step
(before either forward registers a block): make_engine sizes the step budget so that a
whole batch is admitted in the first step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from services.engine.config import EngineConfig, ModelConfig
from services.engine.core.engine import EngineCore
from services.engine.core.sampling import SamplingParams

# Prompt tokens per sequence per step. Chunks longer than 16 rows share one masked window-key
# pool across the step's sequences (model/windows.py), so a step's attention grows with the
# square of its sequence count: the bench runs few sequences per step (replay_quality.py
# --group). Chunks of <= 16 rows gather W keys per row instead, which measured slower here.
CHUNK = 32


@dataclass
class Req:
    name: str
    tokens: list[int]       # forced: prompt + continuation; greedy: the prompt
    salt: str
    forced: int = 0         # the last `forced` tokens are teacher-forced (their logits kept)
    greedy: int = 0         # else: free-running greedy tokens to generate


@dataclass
class Out:
    logits: torch.Tensor | None     # [forced, V] (engine dtype): row i predicts the i-th forced token
    tokens: list[int]               # greedy: the generated tokens
    start: int                      # first prompt position computed (0 cold; S or L1 - W on a hit)
    cached: int                     # prompt tokens whose blocks came from cache (L1)
    replayed: int                   # tokens of bounded replay at admission
    snapshot_hit: bool
    ttft_s: float                   # submission to the row that gives the first token
    preemptions: int                # times it was preempted (and recomputed from scratch)


class ForcingEngine(EngineCore):
    """EngineCore whose forced requests (`forced`: request id -> n) keep the logits of their
    last n + 1 prompt rows and act, for truncation and prefix matching, as the prompt without
    its last n tokens. The bench wraps two of the engine's own calls (admission and the
    forward) instead of changing the engine for a measurement."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.forced: dict[str, int] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.starts: dict[str, int] = {}
        self.first_row_at: dict[str, float] = {}
        self._admit, self._match, self._forward = self.cache.admit, self.cache.match_prefix, self.runner.forward
        self.cache.admit, self.cache.match_prefix = self._admit_forced, self._match_forced
        self.runner.forward = self._forward_forced

    def _match_forced(self, seq):
        n = self.forced.get(seq.request_id)
        if not n:
            return self._match(seq)
        prompt = seq.prompt
        seq.prompt = prompt[:-n]          # the cap L - KEEP of the prompt alone
        try:
            return self._match(seq)
        finally:
            seq.prompt = prompt

    def _admit_forced(self, seq, match=None):
        self._admit(seq, match)
        n = self.forced.get(seq.request_id)
        if n and self.ecfg.truncation != "off":
            seq.dec_lo = max(0, seq.prefill_len - n - self.ecfg.keep_tokens)
        self.starts[seq.request_id] = seq.num_computed

    def _forward_forced(self, works):
        spans = {}
        for i, w in enumerate(works):
            rid = w.owner[0] if w.owner else None
            n = self.forced.get(rid)
            if n is None:
                if w.want_logits and w.end > w.start and rid not in self.first_row_at:
                    spans[i] = (rid, None)
                continue
            first = len(w.tokens) - n - 1          # row L - 1: predicts the first forced token
            if w.end > first:
                w.want_logits, w.n_logits = True, w.end - max(w.start, first)
                spans[i] = (rid, w.end == len(w.tokens))
        res = self._forward(works)
        now = time.perf_counter()
        for i, (rid, last) in spans.items():
            self.first_row_at.setdefault(rid, now)
            if last is None:
                continue
            rows = res.logits[i].reshape(-1, self.cfg.vocab_size)
            self.logits.setdefault(rid, []).append((rows[:-1] if last else rows).clone())
            if last:        # the engine samples the row after the continuation (discarded)
                res.logits[i] = rows[-1]
            else:
                del res.logits[i]
        return res


def make_engine(cfg: ModelConfig, weights, n_seqs: int, max_len: int, chunk: int = CHUNK,
                **ecfg) -> ForcingEngine:
    """Room for n_seqs running requests of max_len tokens, all admitted in one step (ecfg
    may override any field, e.g. a smaller pool or snapshot store)."""
    base = {"num_slots": n_seqs, "max_running": n_seqs,
            "num_blocks": n_seqs * (max_len // cfg.block_size + 2) + 64,
            "max_batched_tokens": n_seqs * chunk + 1, "long_prefill_chunk": chunk,
            "snapshot_bytes": 4 << 30}
    return ForcingEngine(cfg, EngineConfig(**{**base, **ecfg}), weights=weights)


def run(engine: ForcingEngine, reqs: list[Req]) -> dict[str, Out]:
    """Submit every request at once and step until all are done."""
    seqs, t0 = {}, time.perf_counter()
    for r in reqs:
        rid = f"{r.name}#{engine.counters['requests']}"
        if r.forced:
            engine.forced[rid] = r.forced
        params = SamplingParams(temperature=0.0, max_tokens=1 if r.forced else r.greedy, ignore_eos=True)
        seqs[r.name] = engine.add_request(r.tokens, params, request_id=rid, salt=r.salt)
    while engine.has_work:
        engine.step()
    out = {}
    for name, s in seqs.items():
        rid = s.request_id
        logits = engine.logits.pop(rid, None)
        out[name] = Out(torch.cat(logits) if logits else None, list(s.output),
                        engine.starts.pop(rid), s.cached_tokens, s.replayed_tokens,
                        s.cached_tokens > 0 and s.replayed_tokens == 0,
                        engine.first_row_at.pop(rid) - t0, s.preemptions)
        engine.forced.pop(rid, None)
    return out


def forced(name: str, prompt: list[int], cont: list[int], salt: str) -> Req:
    return Req(name, prompt + cont, salt, forced=len(cont))


def warm(engine: ForcingEngine, items: list[tuple[str, list[int], str]]) -> None:
    """Run prompts (one token each) so that their blocks (and snapshots, by the policy) are cached."""
    run(engine, [Req(name + "/w", prompt, salt, greedy=1) for name, prompt, salt in items])


def prompt_stats(exact: torch.Tensor, variant: torch.Tensor, target: list[int]) -> dict:
    """One prompt: KL(exact || variant) per token (sum, max) and both NLLs on the true
    continuation (sums)."""
    lp_e, lp_v = torch.log_softmax(exact.double(), -1), torch.log_softmax(variant.double(), -1)
    kl = (lp_e.exp() * (lp_e - lp_v)).sum(-1)
    tgt = torch.tensor(target).view(-1, 1)
    return {"tokens": len(target), "kl_sum": float(kl.sum()), "kl_max": float(kl.max()),
            "nll_e": float(-lp_e.gather(1, tgt).sum()), "nll_v": float(-lp_v.gather(1, tgt).sum())}


def greedy_divergence(exact: list[int], variant: list[int]) -> dict:
    """First position where the variant's greedy tokens leave the exact path's. `variant` may
    be the argmax of a forced pass over `exact`: up to its first difference it is the
    variant's own free-running greedy, so the first difference is the same."""
    first = next((i for i, (a, b) in enumerate(zip(exact, variant, strict=True)) if a != b), len(exact))
    return {"first": first, "same": first == len(exact)}


def aggregate(per_prompt: list[dict]) -> dict:
    """Mean per-token KL, relative perplexity change, greedy agreement over prompts."""
    n, tokens = len(per_prompt), sum(p["tokens"] for p in per_prompt)
    ne, nv = (sum(p[k] for p in per_prompt) / tokens for k in ("nll_e", "nll_v"))
    out = {"prompts": n, "tokens": tokens,
           "kl_mean": sum(p["kl_sum"] for p in per_prompt) / tokens,
           "kl_max": max(p["kl_max"] for p in per_prompt),
           "nll_exact": ne, "nll_variant": nv, "ppl_change_pct": 100 * (math.exp(nv - ne) - 1)}
    if "first" in per_prompt[0]:
        out["greedy_identical_pct"] = 100 * sum(p["same"] for p in per_prompt) / n
        out["first_divergence_mean"] = sum(p["first"] for p in per_prompt) / n
    for k in ("replayed", "cached", "snapshot_hit"):
        if k in per_prompt[0]:
            out[f"{k}_mean"] = sum(p[k] for p in per_prompt) / n
    return out
