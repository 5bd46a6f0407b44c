"""Teacher-forced runs for the replay-quality benchmarks: the requests (run through a real
in-process V4.1 engine by v41_harness.py), teacher-forced continuations read in one prefill,
and the per-prompt metrics.

Two kinds of request:

    forced   the prompt followed by the continuation to score (n tokens), admitted as ONE
             prompt of L + n tokens. The engine computes the continuation's rows as prompt
             rows, and this harness keeps the logits of rows L-1 .. L+n-2 (each predicts the
             next forced token). Two things are pinned to what a request of the L-token
             prompt alone would get: the YOCO truncation point (dec_lo = L - KEEP, set at
             admission) and the prefix match (capped at L - KEEP, as the prompt alone would
             be). With those, every row is the same computation a decode step would do for a
             request of the L-token prompt whose sampled tokens were replaced by the forced
             ones (tests/engine/deepseek_v41/test_replay_harness.py pins that in float64), at a fraction of
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
from dataclasses import dataclass

import torch


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


def forced(name: str, prompt: list[int], cont: list[int], salt: str) -> Req:
    return Req(name, prompt + cont, salt, forced=len(cont))


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
