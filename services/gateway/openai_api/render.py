"""Gateway results -> OpenAI JSON: completion and chat objects, stream chunks (server-sent
events), usage, and errors in OpenAI's shape with an HTTP status.

Usage: `prompt_tokens`, `completion_tokens`, `total_tokens`, and
`prompt_tokens_details.cached_tokens` (prompt tokens served from the prefix cache, not
computed, as OpenAI and vLLM mean it); `prompt_tokens_details.replayed_tokens` is a kvmesh
extension (cached tokens recomputed anyway by the bounded replay to rebuild the sliding
window, docs/design.md §6). gRPC's Usage counts both in its `cached_tokens` (the blocks a
request started on); here the replayed ones are taken out.
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Callable, Sequence

from kvmesh.errors import NotFound
from kvmesh.generation import TokenLogprob
from kvmesh.services.gateway.model import Usage, http_status, status_name
from kvmesh.tokenizer import token_text

# HTTP status -> OpenAI's error type (the statuses: services/gateway/model.py HTTP_STATUS)
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
              499: "cancelled", 503: "service_unavailable", 504: "timeout", 500: "internal_error"}
# OpenAI has no "aborted"; vLLM's name for it.
FINISH = {"length": "length", "stop": "stop", "aborted": "abort"}


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "error"),
                      "param": param, "code": code}}


class ModelNotFound(NotFound):
    """A `model` this gateway does not serve: 404 with OpenAI's own type and code for it
    (invalid_request_error, model_not_found)."""


def http_error(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) for a domain error; the gRPC status name is the code."""
    name = status_name(exc)
    status = http_status(exc)
    message = str(exc) if name != "INTERNAL" else f"internal error: {type(exc).__name__}: {exc}"
    body = error_body(status, message, name.lower(), getattr(exc, "param", None))
    if isinstance(exc, ModelNotFound):
        body["error"].update(type="invalid_request_error", code="model_not_found")
    return status, body


def total_usage(usages: list[Usage]) -> Usage:
    """The usage of n choices of one prompt: the prompt counted once (as OpenAI does), the
    completions added up."""
    first = usages[0]
    return first._replace(generated_tokens=sum(u.generated_tokens for u in usages),
                          drafted_tokens=sum(u.drafted_tokens for u in usages),
                          accepted_tokens=sum(u.accepted_tokens for u in usages))


def usage_json(u: Usage) -> dict:
    """OpenAI's usage; speculative decoding's drafts under OpenAI's names for predicted
    outputs (accepted / rejected prediction tokens)."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.generated_tokens,
            "total_tokens": u.prompt_tokens + u.generated_tokens,
            "prompt_tokens_details": {
                "cached_tokens": max(0, u.cached_tokens - u.replayed_tokens),
                "replayed_tokens": u.replayed_tokens},
            "completion_tokens_details": {
                "accepted_prediction_tokens": u.accepted_tokens,
                "rejected_prediction_tokens": u.drafted_tokens - u.accepted_tokens}}


class Logprobs:
    """Tokens' log-probabilities in OpenAI's two shapes: completions' parallel lists
    (`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`: where
    in the choice's text each token's characters start) and chat's `content` entries
    ({token, logprob, bytes, top_logprobs}). A token is named by its text, or
    `bytes:\\xNN` when it holds part of a character (kvmesh.tokenizer.token_text)."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self.bytes = token_bytes
        # completions, per choice index: characters of text so far and the decoder of the
        # bytes so far (a character split over tokens starts where its first piece is)
        self.offset: dict[int, int] = {}
        self.utf8: dict[int, codecs.IncrementalDecoder] = {}

    def _name(self, token: int) -> str:
        return token_text(self.bytes(token))

    def completion(self, index: int, start: int, pairs: Sequence[tuple[int, TokenLogprob]]
                   ) -> dict:
        at = self.offset.get(index, start)
        utf8 = self.utf8.setdefault(index, codecs.getincrementaldecoder("utf-8")("replace"))
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for token, lp in pairs:
            out["tokens"].append(self._name(token))
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self._name(i): v for i, v in lp.top})
            out["text_offset"].append(at)
            at += len(utf8.decode(self.bytes(token)))
        self.offset[index] = at
        return out

    def chat(self, pairs: Sequence[tuple[int, TokenLogprob]]) -> dict:
        def entry(token: int, logprob: float) -> dict:
            raw = self.bytes(token)
            return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}
        return {"content": [{**entry(token, lp.logprob),
                             "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for token, lp in pairs]}


class Renderer:
    """Shapes of one response: `chat` picks chat.completion(.chunk) over text_completion."""

    def __init__(self, chat: bool, request_id: str, model: str, include_usage: bool = False,
                 echo: str = "", logprobs: Logprobs | None = None):
        """`echo`: text put before the generated text (completions' `echo`); `logprobs`:
        set when the request asked for them."""
        self.chat = chat
        self.echo = echo
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.logprobs = logprobs

    def _logprobs(self, index: int, pairs) -> dict | None:
        if self.logprobs is None:
            return None
        if self.chat:
            return self.logprobs.chat(pairs)
        return self.logprobs.completion(index, len(self.echo), pairs)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, results: list[tuple[str, str | None, list]], usage: Usage) -> dict:
        """The whole (non-streaming) response: one choice per (text, finish, [(token id,
        TokenLogprob)]) of `results`."""
        out = self._head("chat.completion" if self.chat else "text_completion")
        out["choices"] = []
        for index, (text, finish, pairs) in enumerate(results):
            choice = {"index": index, "finish_reason": FINISH.get(finish, finish)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = self.echo + text
            choice["logprobs"] = self._logprobs(index, pairs)
            out["choices"].append(choice)
        out["usage"] = usage_json(usage)
        return out

    def chunk(self, text: str, finish: str | None = None, first: bool = False,
              index: int = 0, pairs=()) -> bytes:
        """One stream event with `text` for choice `index` (chat: a choice's first delta
        also carries the role), and its tokens' (id, TokenLogprob) `pairs`."""
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        choice = {"index": index}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = self.echo + text if first else text
        choice["logprobs"] = self._logprobs(index, pairs)
        choice["finish_reason"] = FINISH.get(finish, finish)
        out["choices"] = [choice]
        if self.include_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last, usage-only one
        return sse(out)

    def usage_chunk(self, usage: Usage) -> bytes:
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = usage_json(usage)
        return sse(out)


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
