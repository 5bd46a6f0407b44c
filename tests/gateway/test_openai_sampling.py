"""The OpenAI API's generation controls on a real mesh, through the official `openai`
package: `echo`, `stop_token_ids`, penalties and `min_p`, logprobs, `n` choices, unary and
streamed (the routes, errors and limits: test_openai_http.py, whose helpers this module
shares)."""

from __future__ import annotations

import re

from tests.gateway.conftest import tokens
from tests.gateway.test_openai_http import GREEDY, MODEL, grpc_text, raw, uniq

MESH_OVERRIDES = dict(engines=2)


def test_echo_puts_the_prompt_first_unary_and_streamed(client):
    prompt = uniq("echo me: ")
    plain = client.completions.create(model=MODEL, prompt=prompt, **GREEDY).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=prompt, echo=True, **GREEDY)
    assert echoed.choices[0].text == prompt + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, echo=True, stream=True, **GREEDY))
    assert streamed == prompt + plain
    ids = tokens(prompt)                                 # token ids: echoed as their text
    by_ids = client.completions.create(model=MODEL, prompt=ids, echo=True, **GREEDY)
    assert by_ids.choices[0].text == prompt + plain


def test_stop_token_ids_end_the_generation(client, gw):
    prompt = uniq("stop tokens: ")
    # the first token's id from gRPC (its text may be part of a UTF-8 character)
    first = gw.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids[0]
    out = client.completions.create(model=MODEL, prompt=prompt,
                                    extra_body={"stop_token_ids": [first], "ignore_eos": True},
                                    temperature=0, max_tokens=8)
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("", "stop")
    assert out.usage.completion_tokens == 1


def test_penalties_and_min_p_reach_the_engine_unary_and_streamed(client, gw):
    # a fixed prompt (under one block: no cache hit changes the numbers) whose plain greedy
    # answer repeats itself, so strong penalties must change it
    prompt = "def f(x):\n    return x + x + x + x + x + x"
    pen = dict(frequency_penalty=2.0, presence_penalty=2.0)
    extra = {"repetition_penalty": 2.0, "min_p": 0.05, "ignore_eos": True}
    out = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16,
                                    extra_body=extra, **pen)
    want = gw.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True,
                       repetition_penalty=2.0, min_p=0.05, **pen).text
    assert out.choices[0].text == want != grpc_text(gw, prompt, 16)
    streamed = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                         max_tokens=16, stream=True, extra_body=extra, **pen)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_logprobs_unary_and_streamed_completions_and_chat(client, gw):
    prompt = uniq("log probabilities of ")
    out = client.completions.create(model=MODEL, prompt=prompt, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    text = out.choices[0].text
    # each token named by its text (or bytes:\xNN, a piece of a character), where it starts
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    assert all(text.startswith(t, at) for t, at in zip(lp.tokens, lp.text_offset, strict=True)
               if not t.startswith("bytes:"))
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and chosen <= 0
        assert abs(max(top.values()) - chosen) < 1e-6    # greedy: the likeliest
    # gRPC carries the same numbers
    ref = gw.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    assert [round(x.logprob, 5) for x in ref.logprobs] == [round(x, 5) for x in lp.token_logprobs]
    assert len(ref.logprobs[0].top_ids) == 2
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, logprobs=2,
                                              stream=True, **GREEDY))
    assert [t for c in streamed for t in c.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs
    assert [t for c in streamed for t in c.choices[0].logprobs.text_offset] == lp.text_offset
    chat = client.chat.completions.create(model=MODEL, logprobs=True, top_logprobs=3, messages=[
        {"role": "user", "content": prompt}], **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(e.top_logprobs) == 3 for e in content)
    # the text is the tokens' bytes, less special tokens (named, but not in the text)
    words = [bytes(e.bytes) for e in content if not re.fullmatch(r"<｜.*｜>", e.token)]
    assert b"".join(words).decode() == chat.choices[0].message.content
    assert all(abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6 for e in content)
    plain = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": prompt}], **GREEDY)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == chat.choices[0].message.content
    status, body, _ = raw(client.base_url.__str__().removesuffix("/v1/"), "POST",
                          "/v1/chat/completions", {"model": MODEL, "top_logprobs": 2,
                                                   "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and body["error"]["param"] == "top_logprobs"


def test_n_choices_unary_and_streamed(client):
    prompt = uniq("three ways: ")
    one = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    three = client.completions.create(model=MODEL, prompt=prompt, n=3, **GREEDY)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.text for c in three.choices} == {one.choices[0].text}         # greedy: the same
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.prompt_tokens == one.usage.prompt_tokens              # counted once
    sampled = dict(model=MODEL, prompt=prompt, n=3, temperature=1.0, seed=11, max_tokens=8,
                   extra_body={"ignore_eos": True})
    a = [c.text for c in client.completions.create(**sampled).choices]
    assert a == [c.text for c in client.completions.create(**sampled).choices]  # reproducible
    assert len(set(a)) > 1                          # choice i samples with seed + i
    texts = {}
    for chunk in client.completions.create(stream=True, **sampled):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == a
    chat = client.chat.completions.create(model=MODEL, n=2, messages=[
        {"role": "user", "content": prompt}], **GREEDY)
    assert [c.index for c in chat.choices] == [0, 1]
