"""Penalties on the engine serving DeepSeek V4.1, against greedy decoding with the
whole-sequence reference and the penalties summed by hand (float64): the engine applies
them to every sampled row, drafts off for the request even on a speculating engine."""

from __future__ import annotations

import torch

from services.engine.core.sampling import SamplingParams
from services.engine.model.deepseek_v4.v41_forward import V41Model
from tests.engine.deepseek_v4.test_engine import random_prompt
from tests.engine.deepseek_v41.test_engine import engine, saved  # noqa: F401  (fixture)
from tests.engine.test_sampling_controls import by_hand

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
