"""Resuming a generation another engine started (the gateway's mid-stream migration).

A second engine given prompt + the first k generated tokens with `resume=k` must go on
exactly as the uninterrupted run: the same tokens (greedy and seeded sampling), logits
(each token's top-5 log-probabilities) within float64 noise, the same text in total (held-back stop-string text included), and
the same finish.
"""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.services.engine.core.output import OutputState
from kvmesh.services.engine.core.sampling import SamplingParams
from tests.engine.engines import random_prompt, serve_core


def make_engine():
    return serve_core("--dtype", "float64", "--num-slots", "2", "--num-blocks", "128")


def run(prompt, params, resume=0):
    """(tokens, text, finish, log-probabilities) of one request on a fresh float64 engine."""
    engine = make_engine()
    seq = engine.add_request(prompt, params, request_id="r", resume=resume)
    text, logprobs = [], []
    while engine.has_work:
        for ev in engine.step():
            text.append(ev.text)
            logprobs.extend(ev.logprobs or [])
        engine.check_integrity()
    return seq.output, "".join(text), seq.finish, logprobs


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=24, ignore_eos=True,
                        logprobs=5)


@pytest.mark.parametrize("params,k", [(GREEDY, 1), (GREEDY, 17), (SEEDED, 23)],
                         ids=["greedy-1", "greedy-17", "seeded-23"])
def test_resume_continues_exactly(params, k):
    prompt = random_prompt(37, 3)
    full, full_text, finish, full_logits = run(prompt, params)
    assert len(full) == 24
    # What the first engine sent for its first k tokens: run it with max_tokens = k.
    cut = SamplingParams(**{**params.__dict__, "max_tokens": k})
    first, _, _, _ = run(prompt, cut)
    assert first == full[:k]
    out, text, fin, logits = run(prompt + first, params, resume=k)
    assert out == full and fin == finish
    assert len(logits) == len(full) - k
    for a, b in zip(logits, full_logits[k:], strict=True):
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top, strict=True)) <= 1e-9
    # Its text is everything the first engine had not sent yet.
    sent = engine_sent_text(prompt, params, k)
    assert sent + text == full_text


def engine_sent_text(prompt, params, k) -> str:
    """Text an engine sent after its first k tokens of `params` (stop holds included)."""
    engine = make_engine()
    engine.add_request(prompt, params, request_id="s")
    sent, seen = [], 0
    while seen < k:
        for ev in engine.step():
            seen += len(ev.token_ids)
            sent.append(ev.text)
    return "".join(sent)


def test_resume_across_a_held_stop_string():
    """A stop string that starts in the first engine's tokens and ends in the second's:
    the held text is sent by the second engine, cut at the stop string as one run would."""
    prompt = random_prompt(37, 3)
    full, full_text, _, _ = run(prompt, GREEDY)
    stop = full_text[6:12]
    sp = SamplingParams(**{**GREEDY.__dict__, "stop": (stop,)})
    one, one_text, one_finish, _ = run(prompt, sp)
    # Cut where the engine holds text back (it may start the stop string).
    tokenizer = make_engine().tokenizer
    state = OutputState(sp, tokenizer.eos_id, tokenizer.stream())
    k = next(i + 1 for i, t in enumerate(one) if state.push(t, i + 1) and state.stops.hold)
    assert k < len(one)
    sent = engine_sent_text(prompt, sp, k)
    _, text, finish, _ = run(prompt + one[:k], sp, resume=k)
    assert sent + text == one_text == full_text[: full_text.find(stop)]
    assert finish == one_finish


def test_resume_refuses_what_cannot_continue():
    engine = make_engine()
    p = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(InvalidArgument, match="resume_generated"):
        engine.add_request([1, 2, 3], p, resume=4)
    with pytest.raises(InvalidArgument, match="resume_generated"):
        engine.add_request([1, 2, 3], p, resume=3)
    eos = engine.tokenizer.eos_id
    if eos is not None:
        with pytest.raises(InvalidArgument, match="already finished"):
            engine.add_request([1, 2, eos], p, resume=1)
    assert engine.stats()["waiting"] == 0
