"""Verification emits plain decoding's tokens (issues 12, 46): a sampled request's tokens are
those sampling.draw gives at each index, whatever was drafted, so they follow the (truncated)
target by construction and never depend on whether or how much a step drafted; the emitted
tokens of 20,000 verifications of random drafts match the target by a chi-square test
(p > 0.01), and the same test rejects a verifier that keeps a draft without checking it."""

import math

import pytest
import torch

from kvmesh.errors import InvalidArgument
from kvmesh.services.engine.core import speculative
from kvmesh.services.engine.core.sampling import SamplingParams, draw, target_probs

V = 9                 # 8 degrees of freedom: the chi-square tail has a closed form
DRAWS = 20_000


def chi2_sf_even(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with an even number of degrees of freedom."""
    half, term, total = x / 2, 1.0, 0.0
    for i in range(df // 2):
        total += term
        term *= half / (i + 1)
    return math.exp(-half) * total


def plain_tokens(logits, params, step, seed) -> list[int]:
    """What k + 1 plain decode steps over these rows draw."""
    return [int(draw(row, params, step + j, seed)) for j, row in enumerate(logits)]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (4, 1.0), (0, 0.7)])
def test_sampled_verification_emits_the_tokens_of_plain_sampling(top_k, top_p):
    g = torch.Generator().manual_seed(3)
    accepted = rejected = 0
    for i in range(200):
        params = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p, seed=i)
        k = i % 5
        logits = torch.randn(k + 1, V, generator=g) * 2
        plain = plain_tokens(logits, params, i, 99)
        # drafts right up to a random point, then random (right or wrong by chance)
        cut = int(torch.randint(0, k + 1, (1,), generator=g))
        drafts = plain[:cut] + torch.randint(0, V, (k - cut,), generator=g).tolist()
        got = speculative.verify(logits, drafts, params, i, 99)
        a = len(got) - 1
        assert got == plain[: a + 1] and drafts[:a] == plain[:a]
        assert a == k or drafts[a] != plain[a]
        accepted += a
        rejected += a < k
    assert accepted > 100 and rejected > 50


def first_tokens(verifier) -> torch.Tensor:
    """DRAWS first emitted tokens of one-draft verifications, drafts uniform at random."""
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=0.9)
    logits = torch.randn(2, V, generator=g, dtype=torch.float64) * 1.5
    drafts = torch.randint(0, V, (DRAWS,), generator=g).tolist()
    counts = torch.zeros(V)
    for i, d in enumerate(drafts):
        counts[verifier(logits, [d], params, 0, i)[0]] += 1
    return counts, target_probs(logits[0], params)


def p_value(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * DRAWS
    stat = float(((counts - expected) ** 2 / expected).sum())
    return chi2_sf_even(stat, V - 1)


def test_emitted_tokens_follow_the_target():
    counts, p = first_tokens(speculative.verify)
    assert p_value(counts, p) > 0.01


def test_a_verifier_that_keeps_drafts_unchecked_fails_the_test():
    counts, p = first_tokens(lambda logits, drafts, *a: drafts)
    assert p_value(counts, p) < 0.01


def test_greedy_is_longest_matching_prefix():
    logits = torch.full((4, V), -1.0, dtype=torch.float64)
    for j, t in enumerate([3, 5, 1, 2]):
        logits[j, t] = 1.0
    g = SamplingParams(temperature=0)
    assert speculative.verify(logits, [3, 5, 1], g, 0, 0) == [3, 5, 1, 2]     # all + bonus
    assert speculative.verify(logits, [3, 4, 1], g, 0, 0) == [3, 5]           # replaced at 1
    assert speculative.verify(logits, [0, 5, 1], g, 0, 0) == [3]
    assert speculative.verify(logits[:1], [], g, 0, 0) == [3]


def test_ngram_drafter_proposes_the_continuation_of_the_latest_longest_match():
    d = speculative.NgramDrafter(min_n=1, max_n=3)
    assert d.propose([5, 6, 7, 8, 1, 5, 6, 7], 4) == [8, 1, 5, 6]     # 3-gram 5 6 7
    assert d.propose([1, 9, 2, 9, 3, 4, 9], 2) == [3, 4]              # latest 1-gram match
    assert d.propose([9, 9, 9, 9], 4) == [9, 9, 9, 9]                 # a run: copy pointer
    assert d.propose([1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]        # period 2
    assert d.propose([1, 2, 3], 3) == []                              # nothing repeats
    assert speculative.NgramDrafter(min_n=2, max_n=2).propose([1, 4, 2, 1], 2) == []
    with pytest.raises(InvalidArgument, match="speculative: ngram sizes"):
        speculative.NgramDrafter(min_n=3, max_n=2)


def test_wholly_rejected_drafts_back_off_1_2_4_tokens():
    """With --spec-policy always, a request whose drafts are all rejected decodes plainly for
    1, then 2, then 4 tokens before drafting again; one accepted draft resets it."""
    from kvmesh.services.engine.core.request import Request
    from kvmesh.services.engine.model.deepseek_v4.ledgers import Sequence

    spec = speculative.Speculator(speculative.SpecSetting("ngram", 2), adaptive=False)
    params = SamplingParams(temperature=0, max_tokens=100)
    req = Request("r", [1, 2, 1, 2, 1, 2], params, seed=0, seq=Sequence(slot=0, length=6))
    spec.add("r", params)

    class Ones:
        def propose(self, tokens, k):
            return [1] * k

    def emit(tokens):             # decoded: every token but the newest one is computed
        req.output.extend(tokens)
        req.seq.length = len(req.tokens) - 1

    spec.drafter = Ones()
    wrong = torch.zeros(3, V, dtype=torch.float64)          # argmax 0: every draft rejected
    pauses = []
    for _ in range(3):
        drafts = spec.propose([req])["r"]
        emit(spec.verify(req, wrong, drafts))
        waited = 0
        while "r" not in spec.propose([req]):
            emit([0])
            waited += 1
        pauses.append(waited)
    assert pauses == [1, 2, 4]
    right = torch.zeros(3, V, dtype=torch.float64)
    drafts = spec.propose([req])["r"]
    right[0, drafts[0]] = 1.0                                 # the first draft is accepted
    emit(spec.verify(req, right, drafts))
    assert "r" in spec.propose([req])
