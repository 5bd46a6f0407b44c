"""OpenAI body -> GenRequest mapping and the chat templates, without a mesh."""

from __future__ import annotations

import json

import pytest

from kvmesh.errors import InvalidArgument, NotFound, TooLarge, Unavailable
from kvmesh.services.gateway.model import Usage
from kvmesh.services.gateway.openai_api import fields
from kvmesh.services.gateway.openai_api.chat import JinjaTemplate, load_template, plain_template
from kvmesh.services.gateway.openai_api.render import Renderer, http_error, total_usage, usage_json


def test_completion_fields_map_to_the_gateway_request():
    req, opts = fields.completion_request({
        "model": "tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
        "seed": 7, "stop": "\n", "n": 1, "stream": True,
        "stream_options": {"include_usage": True}, "user": "u1", "cache_salt": "t-1",
        "top_k": 3, "ignore_eos": True, "traffic_class": "agent"})
    assert (req.prompt, req.prompt_token_ids, req.max_tokens, req.temperature, req.top_p,
            req.seed, req.stop, req.top_k, req.ignore_eos, req.cache_salt, req.traffic_class) == (
        "hi", None, 5, 0.5, 0.9, 7, ("\n",), 3, True, "t-1", "agent")
    assert opts == fields.Options(model="tiny", stream=True, include_usage=True)
    # `user` is not a cache salt
    req, _ = fields.completion_request({"model": "m", "prompt": "x", "user": "alice"})
    assert req.cache_salt == ""


@pytest.mark.parametrize("prompt,text,ids", [
    ("abc", "abc", None), (["abc"], "abc", None), ([1, 2, 3], None, (1, 2, 3)),
    ([[4, 5]], None, (4, 5)), ([7], None, (7,))])
def test_prompt_forms(prompt, text, ids):
    req, _ = fields.completion_request({"model": "m", "prompt": prompt})
    assert (req.prompt, req.prompt_token_ids) == (text, ids)


def test_stop_list_and_defaults():
    req, opts = fields.completion_request({"model": "m", "prompt": "x", "stop": ["a", "b"]})
    assert req.stop == ("a", "b") and req.max_tokens is None and req.temperature is None
    assert opts == fields.Options(model="m")


def test_chat_max_completion_tokens_wins_and_parts_join():
    seen = []
    req, _ = fields.chat_request({
        "model": "m", "max_tokens": 9, "max_completion_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None}]},
        lambda msgs: seen.append(msgs) or "PROMPT")
    assert req.max_tokens == 4 and req.prompt == "PROMPT"
    assert seen == [[{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x"}, "model"), ({"model": "m", "prompt": "x", "n": 17}, "n"),
    ({"model": "m", "prompt": "x", "temperature": True}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"model": "m", "prompt": "x", "presence_penalty": "high"}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "min_p": float("inf")}, "min_p"),
    ({"model": "m", "prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": "m", "prompt": "x", "stop_token_ids": [1, -2]}, "stop_token_ids"),
    ({"model": "m", "prompt": "x", "stop_token_ids": 7}, "stop_token_ids"),
    ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": [1, -1]}, "prompt"), ({"model": "m", "prompt": None}, "prompt"),
])
def test_bad_fields_name_the_param(body, param):
    with pytest.raises(fields.FieldError) as err:
        fields.completion_request(body)
    assert err.value.param == param and isinstance(err.value, InvalidArgument)


def test_min_p_and_penalties_reach_the_request_as_given():
    req, _ = fields.completion_request({"model": "m", "prompt": "x", "min_p": 0.1,
                                        "presence_penalty": 0.5, "frequency_penalty": -1,
                                        "repetition_penalty": 1.2})
    assert req.controls() == {"min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -1.0,
                              "repetition_penalty": 1.2, "logprobs": None}
    req, _ = fields.chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                                 lambda msgs: "x")
    assert set(req.controls().values()) == {None}       # unset: the engine's defaults


def test_logprobs_in_each_apis_form():
    req, _ = fields.completion_request({"model": "m", "prompt": "x", "logprobs": 3})
    assert req.logprobs == 3
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for extra, want in (({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0),
                        ({"logprobs": True, "top_logprobs": 5}, 5)):
        assert fields.chat_request({**chat, **extra}, lambda msgs: "x")[0].logprobs == want
    with pytest.raises(fields.FieldError) as err:
        fields.chat_request({**chat, "top_logprobs": 2}, lambda msgs: "x")
    assert err.value.param == "top_logprobs"


def test_unknown_fields_are_ignored_unless_strict():
    _, opts = fields.chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                   "frobnicate": 1}, lambda msgs: "x")
    assert opts.ignored == ("frobnicate",)
    with pytest.raises(fields.FieldError) as err:
        fields.completion_request({"model": "m", "prompt": "x", "frobnicate": 1}, strict=True)
    assert err.value.param == "frobnicate"
    assert "unrecognized request argument supplied: frobnicate" in str(err.value)


def test_body_must_be_an_object():
    with pytest.raises(fields.FieldError):
        fields.completion_request(["model"])


def test_error_mapping_to_http():
    assert http_error(InvalidArgument("x"))[0] == 400
    assert http_error(TooLarge("big"))[0] == 413
    assert http_error(NotFound("m"))[0] == 404
    assert http_error(Unavailable("down"))[0] == 503
    status, body = http_error(RuntimeError("boom"))
    assert status == 500 and body["error"]["code"] == "internal" and "boom" in body["error"]["message"]
    status, body = http_error(fields.FieldError("n", "n must be 1"))
    assert body == {"error": {"message": "n must be 1", "type": "invalid_request_error",
                              "param": "n", "code": "invalid_argument"}}


def test_usage_and_chunks():
    assert usage_json(Usage(300, 256, 128, 8)) == {
        "prompt_tokens": 300, "completion_tokens": 8, "total_tokens": 308,
        "prompt_tokens_details": {"cached_tokens": 128, "replayed_tokens": 128},  # 128 recomputed
        "completion_tokens_details": {"accepted_prediction_tokens": 0,
                                      "rejected_prediction_tokens": 0}}
    # speculative decoding: 12 drafted, 9 accepted in one choice, 4 and 1 in the other
    both = total_usage([Usage(300, 0, 0, 8, drafted_tokens=12, accepted_tokens=9),
                        Usage(300, 0, 0, 6, drafted_tokens=4, accepted_tokens=1)])
    assert usage_json(both)["completion_tokens_details"] == {
        "accepted_prediction_tokens": 10, "rejected_prediction_tokens": 6}
    assert usage_json(both)["completion_tokens"] == 14
    r = Renderer(True, "rid", "tiny", include_usage=True)
    ev = r.chunk("hi", first=True)
    assert ev.startswith(b"data: ") and ev.endswith(b"\n\n")
    obj = json.loads(ev[6:])
    assert obj["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    assert obj["usage"] is None and obj["id"] == "chatcmpl-rid"
    assert json.loads(r.usage_chunk(Usage(1, 0, 0, 1))[6:])["choices"] == []


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_hf_chat_template_from_tokenizer_config(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    assert load_template(str(tok)) is plain_template  # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ bos_token }}" + CHATML, "bos_token": {"content": "<s>"},
        "eos_token": "</s>"}))
    t = load_template(str(tok))
    assert isinstance(t, JinjaTemplate)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert t(msgs) == ("<s><|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                       "<|im_start|>assistant\n")
    # a list of named templates: the "default" one
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": CHATML}]}))
    assert load_template(str(tok))(msgs[1:]).startswith("<|im_start|>user\nU")
    assert load_template("") is plain_template


def test_hf_chat_template_errors_and_sandbox():
    t = JinjaTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidArgument, match="roles must alternate"):
        t([{"role": "user", "content": "x"}])
    # a template is code from a config file: sandboxed, no dunder attributes, no mutation
    assert JinjaTemplate("{{ messages.__class__ }}")([]) == ""
    with pytest.raises(InvalidArgument, match="unsafe"):  # jinja2's SecurityError -> 400
        JinjaTemplate("{% set _ = messages.append(1) %}")([])


def test_plain_template_exact():
    assert plain_template([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"


def test_template_failures_are_invalid_argument_and_body_errors_have_null_param():
    with pytest.raises(InvalidArgument, match="no element 5"):  # jinja's UndefinedError
        JinjaTemplate("{{ messages[5]['content'] }}")([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidArgument, match="TypeError"):
        JinjaTemplate("{{ 1 + messages }}")([])
    with pytest.raises(fields.FieldError) as err:
        fields.completion_request("not an object")
    assert err.value.param is None


def test_deepseek_v4_checkpoint_dir_gets_its_chat_encoding(tmp_path):
    """A tokenizer in a DeepSeek V4 checkpoint directory (no chat_template: DeepSeek ships
    none) renders chat with DeepSeek V4's encoding; a chat_template still wins; bad roles
    are a 400 naming the field."""
    from kvmesh.services.gateway.openai_api.chat import deepseek_v4_template
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    t = load_template(str(tok))
    assert t is deepseek_v4_template
    assert t([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == (
        "<｜begin▁of▁sentence｜>S<｜User｜>U<｜Assistant｜></think>")
    with pytest.raises(InvalidArgument, match=r"messages\[0\]\.role"):
        t([{"role": "tool", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    assert isinstance(load_template(str(tok)), JinjaTemplate)
    (tmp_path / "config.json").write_text("{broken")
    (tmp_path / "tokenizer_config.json").unlink()
    assert load_template(str(tok)) is plain_template


def test_echo_and_stop_token_ids_are_read():
    req, opts = fields.completion_request({"model": "m", "prompt": "x", "echo": True,
                                           "stop_token_ids": [5, 9]})
    assert opts.echo and req.stop_token_ids == (5, 9)
