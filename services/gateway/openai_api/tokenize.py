"""vLLM's tokenizer routes: POST /tokenize and /detokenize (and GET /version), over the
gateway's tokenizer, the one its routing keys and chat template use.

    POST /tokenize    {"prompt": "text"} or {"messages": [...]} (rendered by the chat
                      template first) -> {"count", "max_model_len", "tokens"}
    POST /detokenize  {"tokens": [ids]} -> {"prompt": "text"}

`model` is optional and, when given, must be the served model. Bad fields are a 400 naming
the field (fields.FieldError), as on the generation routes.
"""

from __future__ import annotations

from kvmesh.services.gateway.openai_api import fields

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens",
                             "add_generation_prompt"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tokenize_text(body, render) -> tuple[str, str | None]:
    """The text to tokenize (a chat rendered by `render`) and the `model` asked for."""
    _check(body, TOKENIZE_FIELDS)
    if ("prompt" in body) == ("messages" in body):
        raise fields.FieldError("prompt", "give `prompt` (a string) or `messages`, one of them")
    if "messages" in body:
        return render(fields.chat_messages(body)), _model(body)
    if not isinstance(body["prompt"], str):
        raise fields.FieldError("prompt", "prompt must be a string")
    return body["prompt"], _model(body)


def detokenize_ids(body, vocab_size: int) -> tuple[list[int], str | None]:
    _check(body, DETOKENIZE_FIELDS)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in ids):
        raise fields.FieldError("tokens", "tokens must be a list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise fields.FieldError("tokens", f"tokens {bad[:5]} are outside [0, {vocab_size})")
    return ids, _model(body)


def _check(body, allowed: frozenset) -> None:
    if not isinstance(body, dict):
        raise fields.FieldError("", "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise fields.FieldError(unknown[0], f"unknown field {unknown[0]!r} (accepted: "
                                            f"{', '.join(sorted(allowed))})")


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise fields.FieldError("model", "model must be a string")
    return model
