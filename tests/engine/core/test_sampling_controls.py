"""min_p and the three penalties (core/sampling.py) against sums written out by hand, their
range checks, and the rule that a penalized request decodes without drafts."""

from __future__ import annotations

import math

import pytest
import torch

from kvmesh.errors import InvalidArgument
from kvmesh.services.engine.core.sampling import (
    SamplingParams,
    penalize,
    target_probs,
    token_logprobs,
)
from kvmesh.services.engine.core.speculative import SpecSetting, Speculator


def by_hand(logits: list[float], prompt: list[int], output: list[int], rep: float,
            freq: float, pres: float) -> list[float]:
    out = list(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def test_penalties_match_the_sum_written_out():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    prompt, output = [1, 2, 3, 3, 40], [3, 7, 7, 7, 9, 2]
    p = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=-0.6)
    got = penalize(logits, p, prompt, output)
    want = by_hand(logits.tolist(), prompt, output, 1.7, 0.3, -0.6)
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    # untouched tokens, and the caller's logits, stay as they were
    assert got[20] == logits[20] and not torch.equal(got, logits)
    assert penalize(logits, SamplingParams(), prompt, output) is logits


def test_presence_and_frequency_see_only_the_output():
    logits = torch.zeros(10)
    got = penalize(logits, SamplingParams(presence_penalty=1.0, frequency_penalty=0.5),
                   [4, 4, 4], [5, 5])
    assert got[4] == 0 and got[5] == -(1.0 + 2 * 0.5)


def test_min_p_keeps_tokens_at_least_min_p_of_the_top_one():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    probs = target_probs(logits, SamplingParams(min_p=0.25))    # threshold 0.125
    kept = torch.tensor([0.5, 0.2, 0.15, 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(probs, kept / kept.sum(), atol=1e-9)
    # temperature first: at T = 2 the same min_p keeps all five
    probs = target_probs(logits, SamplingParams(min_p=0.25, temperature=2.0))
    assert int((probs > 0).sum()) == 5
    assert torch.equal(target_probs(logits, SamplingParams(min_p=0.0)) > 0, torch.ones(5).bool())


@pytest.mark.parametrize("field,value", [
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("frequency_penalty", math.nan), ("repetition_penalty", 0.0),
    ("repetition_penalty", 101.0), ("logprobs", -1), ("logprobs", 21),
])
def test_out_of_range_controls_name_their_field(field, value):
    with pytest.raises(InvalidArgument, match=field):
        SamplingParams(**{field: value}).validate(100)


def test_a_penalized_request_decodes_without_drafts():
    spec = Speculator(SpecSetting("ngram", 4))
    spec.add("plain", SamplingParams(temperature=0))
    spec.add("penalized", SamplingParams(temperature=0, frequency_penalty=0.5))
    assert set(spec.requests) == {"plain"}


def test_token_logprobs_give_each_row_its_own_k():
    a = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    b = torch.tensor([2.0, 0.0, 1.0])
    got = token_logprobs([(a, 2, 0), (b, 1, 2)])
    assert got[0].top == () and abs(got[0].logprob - math.log(0.3)) < 1e-6
    lb = torch.log_softmax(b, -1).tolist()
    assert abs(got[1].logprob - lb[1]) < 1e-6
    assert [i for i, _ in got[1].top] == [0, 2]
    assert all(abs(v - lb[i]) < 1e-6 for i, v in got[1].top)
    assert token_logprobs([]) == []
    assert not SamplingParams(logprobs=0).draftable and SamplingParams().draftable
