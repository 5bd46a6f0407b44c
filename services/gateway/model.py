"""Value types of the gateway core (no I/O, no gRPC). All immutable.

`GenRequest` is what the service hands the core after reading the proto; `Chunk`
is one piece of output; `Outcome` is the summary the core reports when a
request ends (for logs and metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvmesh.auth import PermissionDenied, Unauthenticated
from kvmesh.errors import (
    InvalidArgument,
    KvmeshError,
    NotFound,
    ResourceExhausted,
    TooLarge,
    Unavailable,
)
from kvmesh.generation import SAMPLING_CONTROLS, TokenLogprob


@dataclass(frozen=True)
class GenRequest:
    request_id: str
    prompt: str | None                  # exactly one of prompt / prompt_token_ids is set
    prompt_token_ids: tuple[int, ...] | None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    traffic_class: str = ""             # kvmesh.generation.TRAFFIC_CLASSES or "" (none)
    cache_salt: str = ""
    ignore_eos: bool = False
    speculative: str | None = None      # None: the engine's setting (kvmesh.generation)
    # kvmesh.generation.SAMPLING_CONTROLS (None: the engine's default)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None         # k: each token's log-probability and the k likeliest

    def controls(self) -> dict[str, float | None]:
        return {name: getattr(self, name) for name in SAMPLING_CONTROLS}


class Usage(NamedTuple):
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replayed_tokens: int = 0
    generated_tokens: int = 0
    prefill_engine: str = ""        # disaggregated requests (pd.py): who prefilled,
    decode_engine: str = ""         # who decoded,
    handoff_bytes: int = 0          # and what moved between them
    drafted_tokens: int = 0             # speculative decoding: proposed
    accepted_tokens: int = 0            # and accepted


class HandoffInfo(NamedTuple):
    """A prefill engine's handoff (engine.v1 HandoffInfo): what the decode engine fetches."""
    total_bytes: int
    sha256: str
    block_hashes: tuple[bytes, ...] = ()


class Chunk(NamedTuple):
    """New tokens from the engine; `finish` ('length' | 'stop' | 'aborted') and usage on the last."""

    token_ids: list[int]
    text: str
    finish: str | None = None
    usage: Usage | None = None
    handoff: HandoffInfo | None = None     # finish "handoff" (a prefill engine's last chunk)
    logprobs: tuple[TokenLogprob, ...] = ()   # one per token id, when the request asked


class Outcome(NamedTuple):
    request_id: str
    engine: str           # id of the engine that served (or failed) the request
    attempts: int
    status: str           # OK or a status code name
    usage: Usage
    ttft_s: float | None  # None when no token arrived
    total_s: float


class EngineFailure(Unavailable):
    """The engine could not be reached or its stream broke: another engine may serve it."""


class DeadlineExceeded(KvmeshError):
    """The caller's deadline passed while the request was with an engine."""


class EngineInternal(KvmeshError):
    """The engine reported INTERNAL (a bug there): passed through, never retried."""


# Status code names by error class, first match wins; the servicer turns a name into
# a grpc.StatusCode. Anything not listed is INTERNAL (a bug in the gateway).
_STATUS = (
    (InvalidArgument, "INVALID_ARGUMENT"),
    (ResourceExhausted, "RESOURCE_EXHAUSTED"),
    (NotFound, "NOT_FOUND"),
    (Unavailable, "UNAVAILABLE"),
    (DeadlineExceeded, "DEADLINE_EXCEEDED"),
    (EngineInternal, "INTERNAL"),
    (Unauthenticated, "UNAUTHENTICATED"),
    (PermissionDenied, "PERMISSION_DENIED"),
)


def status_name(exc: BaseException) -> str:
    for cls, name in _STATUS:
        if isinstance(exc, cls):
            return name
    return "INTERNAL"


# gRPC status name -> HTTP status (the HTTP API's answers, and the status label of its
# requests in kvmesh_requests_total). A size limit on the request (TooLarge) is 413; other
# RESOURCE_EXHAUSTED (capacity) 429.
HTTP_STATUS = {"OK": 200, "INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401,
               "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
               "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "CANCELLED": 499, "INTERNAL": 500}
# the HTTP API's method labels: their requests are counted by HTTP status
HTTP_METHODS = ("http_completions", "http_chat_completions")


def http_status(exc: BaseException) -> int:
    return 413 if isinstance(exc, TooLarge) else HTTP_STATUS.get(status_name(exc), 500)

