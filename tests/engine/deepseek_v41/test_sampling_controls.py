"""Penalties on the engine serving DeepSeek V4.1, against greedy decoding with the
whole-sequence reference and the penalties summed by hand (float64): the engine applies
them to every sampled row, drafts off for the request even on a speculating engine."""

from __future__ import annotations

import torch

from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from tests.engine.core.test_sampling_controls import by_hand
from tests.engine.deepseek_v4.test_engine import random_prompt
from tests.engine.deepseek_v41.test_engine import engine, saved  # noqa: F401  (fixture)

TOKENS = 24
REP, FREQ, PRES = 1.4, 0.7, 0.5


def penalized_greedy(m: V41Model, prompt: list[int], n: int = TOKENS) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        logits = m.logits(torch.tensor(ids))[-1].tolist()
        scores = by_hand(logits, prompt, out, REP, FREQ, PRES)
        out.append(max(range(len(scores)), key=scores.__getitem__))
        ids.append(out[-1])
    return out


def test_penalized_greedy_equals_the_reference_beside_a_plain_request(saved):  # noqa: F811
    directory, m = saved
    prompt, other = random_prompt(150, 11), random_prompt(60, 12)
    core = engine(directory, "--speculative", "ngram:4", "--spec-policy", "always")
    pen = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True,
                         repetition_penalty=REP, frequency_penalty=FREQ, presence_penalty=PRES)
    plain = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    a, b, c = (core.add_request(prompt, pen), core.add_request(other, plain),
               core.add_request(prompt, plain))
    assert a.request_id not in core.spec.requests and c.request_id in core.spec.requests
    while core.has_work:
        core.step()
    want = penalized_greedy(m, prompt)
    assert a.output == want
    # the penalties changed the answer (the plain request of the same prompt did not repeat it)
    assert c.output != want
    assert len(b.output) == TOKENS


def test_logprobs_are_the_full_forwards_log_softmax(saved):  # noqa: F811
    """Each token's log-probability and its 3 likeliest, from the events, against the
    log-softmax of the whole-sequence reference at that position; sampled (T = 0.8) so the
    chosen token is not always the likeliest, beside a request without logprobs."""
    directory, m = saved
    prompt = random_prompt(150, 13)
    core = engine(directory, "--speculative", "ngram:4", "--spec-policy", "always")
    asked = core.add_request(prompt, SamplingParams(temperature=0.8, seed=5, max_tokens=12,
                                                    ignore_eos=True, logprobs=3))
    other = core.add_request(random_prompt(40, 14), SamplingParams(temperature=0.0,
                                                                   max_tokens=12))
    assert asked.request_id not in core.spec.requests
    got = []
    while core.has_work:
        for ev in core.step():
            if ev.request_id == asked.request_id:
                assert ev.logprobs is not None and len(ev.logprobs) == len(ev.token_ids)
                got += zip(ev.token_ids, ev.logprobs, strict=True)
            else:
                assert ev.logprobs is None
    assert [t for t, _ in got] == asked.output and len(other.output) > 0
    for i, (token, lp) in enumerate(got):
        ref = torch.log_softmax(m.logits(torch.tensor(prompt + asked.output[:i]))[-1], -1)
        assert abs(lp.logprob - float(ref[token])) < 1e-5
        top = torch.topk(ref, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert max(abs(v - r) for (_, v), r in zip(lp.top, top.values.tolist(), strict=True)) < 1e-5
    assert any(token != lp.top[0][0] for token, lp in got)    # sampling chose below the top
