"""OpenAI request bodies -> `GenRequest` plus how to answer (`Options`).

kvmesh follows the OpenAI field names and types, and refuses what it cannot honour
with a 400 naming the field (`tools`, `logit_bias`, ...) instead of
answering something else. A field it does not know at all is ignored, as vLLM does (the
response names it), or refused in strict mode. `echo` (completions) puts the prompt's text before the answer. The ranges the gateway core checks again (max_tokens limit,
prompt size, stop counts) are left to it, so there is one rule for gRPC and HTTP.

Extension fields (not in OpenAI's API): `cache_salt` (prefix-cache namespace),
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids` (as vLLM's),
`traffic_class` (agent | chatbot). `user` is accepted and
ignored: it is not a cache salt (a salt must be chosen on purpose; see README).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from kvmesh.errors import InvalidArgument
from kvmesh.generation import SAMPLING_CONTROLS
from kvmesh.services.gateway.model import GenRequest


class FieldError(InvalidArgument):
    """A bad request field: HTTP 400 with `param` set to the field's name."""

    def __init__(self, param: str, message: str):
        super().__init__(message, param=param or None)  # "" = the body as a whole: JSON null


@dataclass(frozen=True)
class Options:
    model: str
    stream: bool = False
    include_usage: bool = False
    echo: bool = False          # completions: the prompt's text comes first in the answer
    n: int = 1                  # choices: n generations of the prompt
    ignored: tuple[str, ...] = ()   # unknown fields, ignored (the response names them)


# Accepted and without effect here (clients send them by habit).
IGNORED = frozenset({"user", "store", "metadata", "service_tier", "parallel_tool_calls"})
COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
                    "stream_options", "presence_penalty", "frequency_penalty", "logit_bias",
                    "logprobs", "cache_salt", "top_k", "ignore_eos", "traffic_class",
                    "stop_token_ids", "min_p", "repetition_penalty"}) | IGNORED
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                        "tool_choice", "response_format"}
ROLES = ("system", "developer", "user", "assistant")
# choices per request: each is a generation of its own, with its own slot on an engine
MAX_N = 16
# JSON nesting deeper than any request of this API needs (chat content parts: 4 levels)
MAX_DEPTH = 32


def parse_body(raw: bytes):
    """The request body as JSON, refused with a 400 before any field is read if it is not
    JSON, nests deeper than MAX_DEPTH or holds text that is not valid Unicode (a lone
    surrogate, from a `\\ud800` escape or raw bytes: it could not be tokenized or logged)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise FieldError("", f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise FieldError("", f"the request body is not valid JSON: {exc}") from None
    check_json(body)
    return body


def check_json(body) -> None:
    """Depth and Unicode checks over a parsed body, iteratively (a recursive walk is what
    a deep body attacks). The error names the value's path, e.g. `messages[0].content`."""
    stack = [(body, "", 1)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v, path)
        elif isinstance(v, dict | list):
            if depth > MAX_DEPTH:
                raise FieldError(path, f"{path or 'the request body'} nests deeper than "
                                 f"{MAX_DEPTH} levels")
            if isinstance(v, dict):
                for k, item in v.items():
                    sub = f"{path}.{k}" if path else k
                    _check_text(k, sub)
                    stack.append((item, sub, depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(v)
                             if not isinstance(item, int | float))


def _check_text(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        name = path.encode("utf-8", "backslashreplace").decode()
        raise FieldError(name, f"{name or 'the request body'} is not valid Unicode: "
                         f"{exc.reason} at character {exc.start}") from None


def _type_name(v) -> str:
    return "null" if v is None else type(v).__name__


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise FieldError(name, f"{name} must be an integer, got {_type_name(v)}")
    return v


def _opt_number(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
        raise FieldError(name, f"{name} must be a finite number, got {v!r}")
    return float(v)


def _opt_bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise FieldError(name, f"{name} must be a boolean, got {_type_name(v)}")
    return v


def _opt_str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise FieldError(name, f"{name} must be a string, got {_type_name(v)}")
    return v


def _check_fields(body, allowed: frozenset, strict: bool) -> tuple[str, ...]:
    """The fields this API does not know, which are ignored as vLLM ignores them (the
    gateway logs them and names them in a response header); strict: refused instead."""
    if not isinstance(body, dict):
        raise FieldError("", f"the request body must be a JSON object, got {_type_name(body)}")
    unknown = sorted(set(body) - allowed)
    if unknown and strict:
        raise FieldError(unknown[0], f"unrecognized request argument supplied: {unknown[0]}")
    return tuple(unknown)


def _refuse_unsupported(body: dict) -> None:
    """Fields kvmesh does not implement: refused unless they ask for the default."""
    if body.get("logit_bias"):
        raise FieldError("logit_bias", "logit_bias is not supported")
    if body.get("best_of") not in (None, 1):
        raise FieldError("best_of", "best_of must be 1 (one choice per request)")
    if body.get("suffix") is not None:
        raise FieldError("suffix", "suffix is not supported")
    if body.get("tools"):
        raise FieldError("tools", "tools are not supported")
    if body.get("tool_choice") not in (None, "none"):
        raise FieldError("tool_choice", "tool_choice is not supported (only \"none\")")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise FieldError("response_format", "response_format must be {\"type\": \"text\"}")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise FieldError("stop", "stop must be a string or a list of strings")


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    """vLLM's extension: generation also ends at any of these token ids (the gateway core
    checks them against the vocabulary and their count)."""
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise FieldError("stop_token_ids", "stop_token_ids must be a list of token ids >= 0")
    return tuple(v)


def _options(body: dict) -> Options:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise FieldError("model", "model is required: a model id from GET /v1/models")
    n = _opt_int(body, "n")
    if n is not None and not 1 <= n <= MAX_N:
        raise FieldError("n", f"n must be in [1, {MAX_N}], got {n}")
    stream = bool(_opt_bool(body, "stream"))
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(so, dict) or set(so) - {"include_usage"}:
            raise FieldError("stream_options", "stream_options must be {\"include_usage\": bool}")
        include_usage = bool(_opt_bool(so, "include_usage"))
    return Options(model=model, stream=stream, include_usage=include_usage,
                   echo=bool(_opt_bool(body, "echo")), n=n or 1)


def _sampling(body: dict, max_tokens: int | None) -> dict:
    if max_tokens is not None and max_tokens <= 0:
        raise FieldError("max_tokens", f"max_tokens must be > 0, got {max_tokens}")
    temperature = _opt_number(body, "temperature")
    if temperature is not None and temperature < 0:
        raise FieldError("temperature", f"temperature must be >= 0 (0 = greedy), got {temperature}")
    top_p = _opt_number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise FieldError("top_p", f"top_p must be in (0, 1], got {top_p}")
    top_k = _opt_int(body, "top_k")
    if top_k is not None and top_k < 0:
        raise FieldError("top_k", f"top_k must be >= 0 (0 = off), got {top_k}")
    seed = _opt_int(body, "seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise FieldError("seed", f"seed must be in [0, 2**63), got {seed}")
    _opt_str(body, "user")
    # their ranges: the gateway core's check (services/gateway/validate.py), as over gRPC
    controls = {name: _opt_number(body, name) for name in SAMPLING_CONTROLS
                if name != "logprobs"}
    return dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                seed=seed, stop=_stop(body), stop_token_ids=_stop_token_ids(body), **controls,
                cache_salt=_opt_str(body, "cache_salt") or "",
                traffic_class=_opt_str(body, "traffic_class") or "",
                ignore_eos=bool(_opt_bool(body, "ignore_eos")))


def completion_request(body, strict: bool = False) -> tuple[GenRequest, Options]:
    """POST /v1/completions: `prompt` is a string or token ids (a list of one of either
    is accepted too; more than one prompt per request is refused). strict: unknown fields
    are refused, not ignored."""
    ignored = _check_fields(body, COMPLETION_FIELDS, strict)
    _refuse_unsupported(body)
    opts = replace(_options(body), ignored=ignored)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]
    text, ids = None, None
    if isinstance(p, str):
        text = p
    elif isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p):
        ids = tuple(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, str | list) for x in p):
        raise FieldError("prompt", f"prompt holds {len(p)} prompts; send one per request")
    else:
        raise FieldError("prompt", "prompt must be a string or a non-empty list of token ids >= 0")
    kw = _sampling(body, _opt_int(body, "max_tokens"))
    # completions: `logprobs` is k, the likeliest tokens to list beside each one's own
    logprobs = _opt_int(body, "logprobs")
    if logprobs is not None and opts.echo:
        raise FieldError("logprobs", "logprobs with echo (the prompt's log-probabilities) "
                         "is not supported")
    return GenRequest(request_id="", prompt=text, prompt_token_ids=ids, logprobs=logprobs,
                      **kw), opts


def chat_messages(body) -> list[dict]:
    """The `messages` list, checked: [{role, content: str}] with text parts joined."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise FieldError("messages", "messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise FieldError(f"messages[{i}]", f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise FieldError(f"messages[{i}].role",
                             f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if m.get("tool_calls"):
            raise FieldError(f"messages[{i}].tool_calls", "tool calls are not supported")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise FieldError(f"messages[{i}].content[{j}]",
                                     f"messages[{i}].content[{j}] must be a text part "
                                     "{type: text, text}; other parts are not supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise FieldError(f"messages[{i}].content",
                             f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def chat_request(body, render, strict: bool = False) -> tuple[GenRequest, Options]:
    """POST /v1/chat/completions; `render(messages) -> prompt text` applies the template."""
    ignored = _check_fields(body, CHAT_FIELDS, strict)
    _refuse_unsupported(body)
    opts = replace(_options(body), ignored=ignored)
    messages = chat_messages(body)
    mt, mct = _opt_int(body, "max_tokens"), _opt_int(body, "max_completion_tokens")
    if mct is not None and mct <= 0:
        raise FieldError("max_completion_tokens", f"max_completion_tokens must be > 0, got {mct}")
    kw = _sampling(body, mct if mct is not None else mt)
    # chat: `logprobs` says whether, `top_logprobs` how many likeliest tokens beside
    top = _opt_int(body, "top_logprobs")
    if top is not None and not _opt_bool(body, "logprobs"):
        raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (top or 0) if _opt_bool(body, "logprobs") else None
    return GenRequest(request_id="", prompt=render(messages), prompt_token_ids=None,
                      logprobs=logprobs, **kw), opts
