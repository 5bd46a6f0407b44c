"""The engine side of bench/replay_quality.py: teacher-forced and greedy requests run
through a real in-process EngineCore, and the metrics that compare two runs.

A measured prompt is a *pair* of requests with the same prompt and salt:

    forced   decodes the true continuation (each sampled token replaced by the next
             true one) and keeps the logits it was given at every position: per-token
             KL and perplexity are measured on them;
    greedy   free-running, temperature 0: the agreement is measured on its tokens.

Both members of a pair must see the same cache state, so they are admitted in the
same scheduler step (before either forward registers a block): the step budget is
sized so that every pair of a batch is admitted in the first step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.engine.config import EngineConfig, ModelConfig
from services.engine.core.engine import EngineCore
from services.engine.core.sampling import SamplingParams

CHUNK = 32           # prompt tokens per sequence per step: keeps a step of 2n sequences small


class ForcingEngine(EngineCore):
    """EngineCore that keeps the logits of every sampled position and, for the request ids in
    `forced`, replaces each sample by the given token (teacher forcing)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.forced: dict[str, list[int]] = {}

    def _emit(self, seq, logits, token=None):
        self.logits.setdefault(seq.request_id, []).append(logits.float().clone())
        want = self.forced.get(seq.request_id)
        if want is not None:          # the forced token instead of the one the step sampled
            token = want[len(seq.output)]
        return super()._emit(seq, logits, token=token)


def make_engine(cfg: ModelConfig, weights, n_pairs: int, max_len: int, **ecfg) -> ForcingEngine:
    blocks = 2 * n_pairs * (max_len // cfg.block_size + 2) + 64
    ecfg = EngineConfig(num_slots=2 * n_pairs, max_running=2 * n_pairs, num_blocks=blocks,
                        max_batched_tokens=2 * n_pairs * CHUNK + 1, long_prefill_chunk=CHUNK,
                        snapshot_bytes=4 << 30, **ecfg)
    return ForcingEngine(cfg, ecfg, weights=weights)


@dataclass
class PairResult:
    logits: torch.Tensor        # [n, V] the forced request's logits, one per true token
    greedy: list[int]           # the greedy request's tokens
    replayed: int               # the forced request's replayed tokens (its admission)
    cached: int                 # its prompt tokens whose blocks came from cache (L1)
    snapshot_hit: bool


def run_pairs(engine: ForcingEngine, items: list[tuple[str, list[int], list[int], str]]
              ) -> dict[str, PairResult]:
    """items: (name, prompt, true continuation, salt). Runs every pair to completion."""
    seqs = {}
    for name, prompt, cont, salt in items:
        n = len(cont)
        engine.forced[name + "/f"] = cont
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        seqs[name] = (engine.add_request(prompt, params, request_id=name + "/f", salt=salt),
                      engine.add_request(prompt, params, request_id=name + "/g", salt=salt))
    while engine.has_work:
        engine.step()
    out = {}
    for name, (f, g) in seqs.items():
        assert f.cached_tokens == g.cached_tokens, f"pair {name} saw different cache states"
        out[name] = PairResult(torch.stack(engine.logits.pop(f.request_id)), list(g.output),
                               f.replayed_tokens, f.cached_tokens,
                               f.cached_tokens > 0 and f.replayed_tokens == 0)
        engine.forced.pop(f.request_id)
        engine.logits.pop(g.request_id, None)
    return out


def warm(engine: ForcingEngine, items: list[tuple[str, list[int], str]]) -> None:
    """Run prompts (one token each) so that their blocks (and snapshots, by the policy) are cached."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for name, prompt, salt in items:
        engine.add_request(prompt, params, request_id=name + "/w", salt=salt)
    while engine.has_work:
        engine.step()
    for name, _, _ in items:
        engine.logits.pop(name + "/w", None)


def compare(exact: dict[str, PairResult], variant: dict[str, PairResult],
            targets: dict[str, list[int]]) -> dict:
    """Mean per-token KL(exact || variant), relative perplexity change on the true continuation,
    greedy agreement (all tokens identical; mean first divergence)."""
    kls, nll_e, nll_v, same, first = [], [], [], 0, []
    for name, e in exact.items():
        v = variant[name]
        lp_e, lp_v = torch.log_softmax(e.logits.double(), -1), torch.log_softmax(v.logits.double(), -1)
        kls.append((lp_e.exp() * (lp_e - lp_v)).sum(-1))
        tgt = torch.tensor(targets[name]).view(-1, 1)
        nll_e.append(-lp_e.gather(1, tgt)[:, 0])
        nll_v.append(-lp_v.gather(1, tgt)[:, 0])
        diff = [i for i, (a, b) in enumerate(zip(e.greedy, v.greedy, strict=True)) if a != b]
        same += not diff
        first.append(diff[0] if diff else len(e.greedy))
    kl = torch.cat(kls)
    ne, nv = torch.cat(nll_e), torch.cat(nll_v)
    n = len(exact)
    return {
        "prompts": n,
        "tokens": int(kl.numel()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "nll_exact": float(ne.mean()),
        "nll_variant": float(nv.mean()),
        "ppl_change_pct": 100 * (math.exp(float(nv.mean() - ne.mean())) - 1),
        "greedy_identical_pct": 100 * same / n,
        "first_divergence_mean": sum(first) / n,
        "replayed_tokens_mean": sum(v.replayed for v in variant.values()) / n,
        "snapshot_hit_pct": 100 * sum(v.snapshot_hit for v in variant.values()) / n,
        "cached_tokens_mean": sum(v.cached for v in variant.values()) / n,
    }
