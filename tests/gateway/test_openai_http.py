"""The OpenAI-compatible HTTP API on a real mesh (the same `Mesh` as `kvmesh up`), through
the official `openai` package (sync and async) and raw HTTP.

Reference for the text: the gateway's own gRPC `Generate` with the same greedy request
(prompts under one block, so no cache hit changes the numbers between the two).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
import urllib.parse
import uuid

import openai
import pytest

from kvmesh.chat_deepseek_v4 import encode_chat
from kvmesh.shipped import DEFAULT_MODEL
from tests.gateway.conftest import TOKENIZER, tokens, wait_for

MESH_OVERRIDES = dict(engines=2)
MODEL = DEFAULT_MODEL.name       # the served model's name: its directory's
GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


def raw(base: str, method: str, path: str, body=None, headers=None) -> tuple[int, dict, dict]:
    """One HTTP request -> (status, JSON body, headers)."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    try:
        conn.request(method, path, data, {"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        text = resp.read()
        return resp.status, json.loads(text) if text else {}, dict(resp.getheaders())
    finally:
        conn.close()


def grpc_text(gw, prompt: str, max_tokens: int = 8) -> str:
    return gw.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True).text


def uniq(text: str) -> str:
    return f"{uuid.uuid4().hex[:8]} {text}"


# --- the openai package -------------------------------------------------------------------

def test_completion_sync_matches_grpc_and_reports_usage(client, gw):
    prompt = uniq("The gateway speaks HTTP too.")
    out = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    [choice] = out.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert choice.text == grpc_text(gw, prompt)
    u = out.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (
        len(tokens(prompt)), 8, len(tokens(prompt)) + 8)
    assert u.prompt_tokens_details.cached_tokens == 0
    assert u.prompt_tokens_details.replayed_tokens == 0  # kvmesh extension field


def test_completion_stream_with_usage_equals_unary(client):
    prompt = uniq("Stream me.")
    unary = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *text_chunks, last = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == unary.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks)
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens == len(tokens(prompt))
    # without include_usage no usage chunk comes
    plain = list(client.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY))
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)


def test_completion_token_id_prompt(client, gw):
    ids = tokens(uniq("ids"))
    out = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert out.choices[0].text == grpc_text(gw, TOKENIZER.decode(ids))
    assert out.usage.prompt_tokens == len(ids)


def test_chat_async_stream_and_unary_apply_the_models_chat_encoding(base, gw):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": uniq("Hello there")}]
    prompt = encode_chat(messages)          # DeepSeek V4's, non-thinking: the shipped model's
    assert prompt.endswith(f"<｜User｜>{messages[1]['content']}<｜Assistant｜></think>")

    async def run():
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as c:
            unary = await c.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
            stream = await c.chat.completions.create(
                model=MODEL, messages=messages, stream=True,
                stream_options={"include_usage": True}, **GREEDY)
            chunks = [ch async for ch in stream]
            return unary, chunks

    unary, chunks = asyncio.run(run())
    assert unary.object == "chat.completion" and unary.id.startswith("chatcmpl-")
    msg = unary.choices[0].message
    assert msg.role == "assistant" and msg.content == grpc_text(gw, prompt)
    assert unary.usage.prompt_tokens == len(tokens(prompt))
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == msg.content
    assert deltas[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 8


def test_second_request_sharing_a_long_prefix_reports_cached_tokens(client):
    prefix = uniq("kvmesh keeps compressed attention entries in a shared store. " * 20)
    assert len(tokens(prefix)) > 134 + 128      # a block before the truncation cut
    first = client.completions.create(model=MODEL, prompt=prefix, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "x"}], **GREEDY)  # an unrelated request in between
    assert second.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prefix + " And more.", **GREEDY)
    cached = again.usage.prompt_tokens_details.cached_tokens
    # a whole number of 128-token blocks, within prompt - KEEP (134) (docs/design.md §5)
    assert cached > 0 and cached % 128 == 0 and cached <= again.usage.prompt_tokens - 134


def test_models_list_and_retrieve(client):
    [m] = client.models.list().data
    assert m.id == MODEL and m.object == "model" and m.owned_by == "kvmesh"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.status_code == 404 and "gpt-4" in err.value.message


def test_openai_client_raises_the_mapped_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", n=17)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


# --- raw HTTP: error shape, limits, disconnects ---------------------------------------------

BAD_FIELDS = [
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": 10_000}, "max_tokens"),          # the core's limit
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "cache_salt": "no spaces allowed"}, "cache_salt"),  # the core's checks
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    # past the wire's ranges (int32 top_k, uint32 ids, float32 temperature): not a 500
    ({"prompt": "x", "top_k": 2**31}, "top_k"),
    ({"prompt": "x", "top_k": 10**30}, "top_k"),
    ({"prompt": "x", "temperature": 1e300}, "temperature"),
    ({"prompt": [5, 2**32]}, "prompt"),
    ({"prompt": "x", "stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -2.01}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": 2, "echo": True}, "logprobs"),
    # lone surrogates cannot be tokenized: refused by the body's Unicode check
    ({"prompt": "abc\ud800"}, "prompt"),
    ({"prompt": "x", "stop": ["ok", "\udfff"]}, "stop[1]"),
]


@pytest.mark.parametrize("body,param", BAD_FIELDS, ids=[str(p) for _, p in BAD_FIELDS])
def test_bad_field_is_400_in_openai_error_shape(base, body, param):
    status, out, _ = raw(base, "POST", "/v1/completions", {"model": MODEL, **body})
    assert status == 400, out
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_argument"
    assert err["param"] == param
    if param:
        assert param in err["message"]


def test_unknown_fields_are_ignored_and_named_in_a_header(base):
    """As vLLM: a field this API does not know is ignored, with a warning (the header
    names it; `kvmesh gateway serve --strict-fields` refuses it instead)."""
    status, out, headers = raw(base, "POST", "/v1/completions",
                               {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                "frobnicate": 1, "best_effort": True})
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] in ("length", "stop")
    assert {k.lower(): v for k, v in headers.items()}["x-kvmesh-ignored-fields"] == \
        "best_effort,frobnicate"
    status, out, headers = raw(base, "POST", "/v1/completions",
                               {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert status == 200 and "x-kvmesh-ignored-fields" not in {k.lower() for k in headers}


def test_chat_bad_fields(base):
    cases = [({"messages": []}, "messages"),
             ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
              "messages[0].content[0]"),
             ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
              "max_completion_tokens"),
             ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
              "tools"),
             ({"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content"),
             ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
              "messages[0].content[0].text")]
    for body, param in cases:
        status, out, _ = raw(base, "POST", "/v1/chat/completions", {"model": MODEL, **body})
        assert (status, out["error"]["param"]) == (400, param), out


def test_bodies_that_attack_the_parser_are_400(base):
    """Deep nesting and raw surrogate bytes: refused with the field named, never a 500."""
    deep = b"[" * 100_000 + b"]" * 100_000
    status, out, _ = raw(base, "POST", "/v1/completions", deep)
    assert status == 400 and "nests deeper" in out["error"]["message"], out
    nested = {"model": MODEL, "prompt": "x", "metadata": {}}
    inner = nested["metadata"]
    for _ in range(40):                     # parses, but deeper than any field of this API
        inner["a"] = {}
        inner = inner["a"]
    status, out, _ = raw(base, "POST", "/v1/completions", nested)
    assert status == 400 and out["error"]["param"].startswith("metadata.a"), out
    body = b'{"model": "%s", "prompt": "abc\xed\xa0\x80"}' % MODEL.encode()
    status, out, _ = raw(base, "POST", "/v1/completions", body)
    assert (status, out["error"]["param"]) == (400, "prompt"), out
    status, out, _ = raw(base, "POST", "/tokenize", {"model": MODEL, "prompt": "\ud800"})
    assert (status, out["error"]["param"]) == (400, "prompt"), out
    status, out, _ = raw(base, "POST", "/v1/completions", {"model": MODEL, "prompt": "ok",
                                                          "max_tokens": 2})
    assert status == 200, out                                   # and the gateway still serves


def test_not_json_unknown_model_unknown_route_wrong_method(base):
    status, out, _ = raw(base, "POST", "/v1/completions", b"{not json")
    assert status == 400 and "JSON" in out["error"]["message"]
    status, out, _ = raw(base, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert (status, out["error"]["type"], out["error"]["code"], out["error"]["param"]) == \
        (404, "invalid_request_error", "model_not_found", "model")      # as OpenAI answers
    status, out, _ = raw(base, "GET", "/v2/nothing")
    assert status == 404 and out["error"]["code"] == "not_found"
    status, out, _ = raw(base, "GET", "/v1/completions")
    assert status == 405 and out["error"]["message"].startswith("GET /v1/completions")


def test_too_large_body_and_prompt_are_413_and_counted(base):
    big = {"model": MODEL, "prompt": "a" * (5 << 20)}  # over the 4 MiB request limit
    status, out, _ = raw(base, "POST", "/v1/completions", big)
    assert status == 413 and out["error"]["code"] == "resource_exhausted", out
    assert "limit" in out["error"]["message"]
    # a 2 MiB prompt fits the body limit but not the 1 MiB prompt limit (the core's check)
    status, out, _ = raw(base, "POST", "/v1/completions",
                         {"model": MODEL, "prompt": "a" * (2 << 20)})
    assert status == 413 and "prompt is" in out["error"]["message"], out
    metrics = _get_text(base, "/metrics")
    assert ('kvmesh_requests_total{method="http_completions",service="gateway",'
            'status="413"} 2.0') in metrics              # the HTTP API's: by HTTP status


def test_a_5_mib_request_is_counted_and_logged_like_the_others(base, gw, mesh):
    """Refused for size before the core sees it, on both front ends: RESOURCE_EXHAUSTED,
    one kvmesh_requests_total count and one `request id=- status=...` log line each."""
    import grpc

    from kvmesh.services.gateway.client import gateway_request

    def count(method: str) -> float:
        status = "413" if method.startswith("http_") else "RESOURCE_EXHAUSTED"
        want = (f'kvmesh_requests_total{{method="{method}",service="gateway",'
                f'status="{status}"}} ')
        line = [x for x in _get_text(base, "/metrics").splitlines() if x.startswith(want)]
        return float(line[0].split()[-1]) if line else 0.0

    log = mesh.procs["gateway"].log_path
    lines_before = log.read_text().count("status=RESOURCE_EXHAUSTED")
    before = {m: count(m) for m in ("unary", "stream", "http_completions")}
    big = "a" * (5 << 20)
    with pytest.raises(grpc.RpcError) as info:
        gw.stub.Generate(gateway_request(big, max_tokens=1), timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(gw.stub.GenerateStream(gateway_request(big, max_tokens=1), timeout=60))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status, _, _ = raw(base, "POST", "/v1/completions", {"model": MODEL, "prompt": big})
    assert status == 413
    assert wait_for(lambda: {m: count(m) - before[m] for m in before} ==
                    {"unary": 1.0, "stream": 1.0, "http_completions": 1.0}, timeout=10)
    assert wait_for(lambda: log.read_text().count("status=RESOURCE_EXHAUSTED")
                    - lines_before == 3, timeout=10), log.read_text()[-2000:]
    refused = [x for x in log.read_text().splitlines()
               if "request id=- status=RESOURCE_EXHAUSTED" in x][-3:]
    assert {x.split(" method=")[1].split(":")[0] for x in refused} == {
        "unary", "stream", "http_completions"}


def _get_text(base: str, path: str) -> str:
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def test_health_and_metrics(base, client):
    status, out, _ = raw(base, "GET", "/health")
    assert status == 200 and out == {"status": "ok", "engines": 2}
    client.completions.create(model=MODEL, prompt=uniq("count me"), **GREEDY)
    text = _get_text(base, "/metrics")
    assert 'kvmesh_requests_total{method="http_completions",service="gateway",status="200"}' in text
    assert "kvmesh_tokens_total" in text


def _engines_idle(gw, mesh):
    stats = [gw.engine_stats(n) for n in mesh.engine_names]
    return all(s["slots_in_use"] == 0 for s in stats)


def _aborted(gw, mesh) -> float:
    return sum(gw.engine_stats(n).get("aborted", 0) for n in mesh.engine_names)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_client_disconnect_cancels_the_engine_request(base, gw, mesh, stream):
    before = _aborted(gw, mesh)
    body = json.dumps({"model": MODEL, "prompt": uniq("long"), "max_tokens": 3000,
                       "temperature": 0, "ignore_eos": True, "stream": stream}).encode()
    u = urllib.parse.urlsplit(base)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)
    if stream:
        assert b"200" in sock.recv(4096).split(b"\r\n", 1)[0]  # the stream has started
    # the engine is generating this request now
    assert wait_for(lambda: not _engines_idle(gw, mesh), timeout=20)
    time.sleep(0.3)
    sock.close()
    assert wait_for(lambda: _engines_idle(gw, mesh), timeout=20), "engine slot not freed"
    assert _aborted(gw, mesh) >= before + 1


# --- vLLM's tokenizer routes and /version ---------------------------------------------------
def test_tokenize_and_detokenize_round_trip(base):
    status, out, _ = raw(base, "POST", "/tokenize", {"model": MODEL, "prompt": "héllo"})
    assert status == 200 and out["tokens"] == tokens("héllo") and out["count"] == len(tokens("héllo"))
    assert out["max_model_len"] > 0
    status, back, _ = raw(base, "POST", "/detokenize", {"tokens": out["tokens"]})
    assert (status, back) == (200, {"prompt": "héllo"})
    chat = [{"role": "user", "content": "hi"}]
    status, out, _ = raw(base, "POST", "/tokenize", {"messages": chat})
    assert status == 200 and out["tokens"] == tokens(encode_chat(chat))


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "frob": 1}, "frob"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [1, TOKENIZER.vocab_size]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenizer_routes_name_the_bad_field(base, path, body, param):
    status, out, _ = raw(base, "POST", path, body)
    assert status in (400, 404) and out["error"]["param"] == param, out


def test_version(base):
    status, out, _ = raw(base, "GET", "/version")
    assert status == 200 and out["version"]


def test_limits_are_advertised_as_enforced_and_errors_name_the_field(base, mesh):
    status, models, _ = raw(base, "GET", "/v1/models")
    cfg_limit = 65536 + 8192                     # the gateway's defaults: prompt + max_tokens
    assert models["data"][0]["max_model_len"] <= cfg_limit
    status, out, _ = raw(base, "POST", "/v1/completions",
                         {"model": MODEL, "prompt": "x", "max_tokens": 10_000})
    assert (status, out["error"]["param"]) == (400, "max_tokens")
