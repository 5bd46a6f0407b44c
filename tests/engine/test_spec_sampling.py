"""Rejection sampling keeps the target distribution (issue 12): with a fixed context and a
synthetic draft distribution, 20,000 accepted-or-resampled tokens match the target by a
chi-square test (p > 0.01), and the same test rejects the sampler once its residual step
(max(0, p - q), normalized) is replaced by drawing from p again."""

import math

import pytest
import torch

from services.engine.core import speculative
from services.engine.core.sampling import SamplingParams, target_probs

V = 9                 # 8 degrees of freedom: the chi-square tail has a closed form
DRAWS = 20_000


def chi2_sf_even(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with an even number of degrees of freedom."""
    half, term, total = x / 2, 1.0, 0.0
    for i in range(df // 2):
        total += term
        term *= half / (i + 1)
    return math.exp(-half) * total


def draw_many(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """DRAWS tokens: d ~ q, then accept it or take the replacement (one verify position)."""
    gen = torch.Generator().manual_seed(1234)
    drafts = torch.multinomial(q, DRAWS, replacement=True, generator=gen).tolist()
    counts = torch.zeros(V)
    for i, d in enumerate(drafts):
        gu = torch.Generator().manual_seed(2 * i + 1)
        gr = torch.Generator().manual_seed(2 * i + 2)
        tok = speculative.accept_one(p, q, d, gu, gr)
        counts[d if tok is None else tok] += 1
    return counts


def p_value(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * DRAWS
    stat = float(((counts - expected) ** 2 / expected).sum())
    return chi2_sf_even(stat, V - 1)


def case():
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=0.9, top_k=0, top_p=1.0)
    p = target_probs(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, params)
    q = target_probs(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, params)
    return p, q


def test_accept_or_resample_matches_the_target():
    p, q = case()
    assert float((p - q).abs().sum()) > 0.5        # the draft really is a different distribution
    assert p_value(draw_many(p, q), p) > 0.01


def test_without_the_residual_step_the_test_fails(monkeypatch):
    p, q = case()
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    assert p_value(draw_many(p, q), p) < 0.01


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (0, 0.7)])
def test_truncation_applies_to_target_and_draft_alike(top_k, top_p):
    """verify() with a sampling drafter: the first emitted token follows the truncated
    target; tokens outside the truncation never come out, even when drafted."""
    g = torch.Generator().manual_seed(11)
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    logits = torch.randn(2, V, generator=g, dtype=torch.float64) * 1.5
    q_logits = torch.randn(1, V, generator=g, dtype=torch.float64) * 1.5
    p = target_probs(logits[0], params)
    counts = torch.zeros(V)
    qprob = target_probs(q_logits[0], params)
    n = 4000
    drafts = torch.multinomial(qprob, n, replacement=True,
                               generator=torch.Generator().manual_seed(5)).tolist()
    for i, d in enumerate(drafts):
        out = speculative.verify(logits, [d], params, step=0, seed=i, q=q_logits)
        counts[out[0]] += 1
    assert float(counts[p == 0].sum()) == 0
    kept = p > 0
    expected = p[kept] * n
    stat = float(((counts[kept] - expected) ** 2 / expected).sum())
    df = int(kept.sum()) - 1
    # a loose bound (df <= 8): the chi-square 0.999 quantile for 8 dof is 26.1
    assert stat < 26.1, (stat, df)


def test_greedy_is_longest_matching_prefix():
    logits = torch.full((4, V), -1.0, dtype=torch.float64)
    for j, t in enumerate([3, 5, 1, 2]):
        logits[j, t] = 1.0
    g = SamplingParams(temperature=0)
    assert speculative.verify(logits, [3, 5, 1], g, 0, 0) == [3, 5, 1, 2]     # all + bonus
    assert speculative.verify(logits, [3, 4, 1], g, 0, 0) == [3, 5]           # replaced at 1
    assert speculative.verify(logits, [0, 5, 1], g, 0, 0) == [3]
    assert speculative.verify(logits[:1], [], g, 0, 0) == [3]
