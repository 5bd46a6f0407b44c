"""The generation contract every service shares: defaults, traffic classes, finish reasons.

The numbers on the wire are the enums of protos/common.proto; the names below are
what the services use inside (logs, the kvstore's metadata, CLI flags) and the one
place those names are written. Importing this module checks that both agree, so a
class added to the proto without a name here fails at start-up, not on a request.

    name (Python)     common.v1 enum
    ""                TRAFFIC_CLASS_UNSPECIFIED   (the kvstore files it as "chatbot")
    "agent"           TRAFFIC_CLASS_AGENT
    "chatbot"         TRAFFIC_CLASS_CHATBOT
    None              FINISH_REASON_UNSPECIFIED   (not finished)
    "length" | "stop" | "aborted"   FINISH_REASON_LENGTH | _STOP | _ABORTED
    "handoff"         FINISH_REASON_HANDOFF  (a prefill engine's last message: a decode
                      engine continues the generation, docs/design.md §9)
"""

from __future__ import annotations

import argparse
from typing import NamedTuple, Protocol, TypeVar

from kvmesh.errors import InvalidArgument
from kvmesh.proto import common_pb2

# Tokens generated when a request leaves max_tokens unset (gateway, engine, CLI).
DEFAULT_MAX_TOKENS = 64

TRAFFIC_CLASSES = ("agent", "chatbot")     # "" (none given) is also accepted
DEFAULT_TRAFFIC_CLASS = "chatbot"           # what the kvstore files "" under
FINISH_REASONS = ("length", "stop", "aborted", "handoff")

_TRAFFIC_TO_PROTO = {"": common_pb2.TRAFFIC_CLASS_UNSPECIFIED} | {
    name: common_pb2.TrafficClass.Value("TRAFFIC_CLASS_" + name.upper()) for name in TRAFFIC_CLASSES}
_TRAFFIC_FROM_PROTO = {v: k for k, v in _TRAFFIC_TO_PROTO.items()}
_FINISH_TO_PROTO = {None: common_pb2.FINISH_REASON_UNSPECIFIED} | {
    name: common_pb2.FinishReason.Value("FINISH_REASON_" + name.upper()) for name in FINISH_REASONS}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}
if set(_TRAFFIC_FROM_PROTO) != set(common_pb2.TrafficClass.values()) or \
        set(_FINISH_FROM_PROTO) != set(common_pb2.FinishReason.values()):
    raise ImportError("kvmesh/generation.py names differ from protos/common.proto's enums")


def check_traffic_class(name: str) -> str:
    """`name` if it is a known class or "" (none), else InvalidArgument naming it."""
    if name and name not in TRAFFIC_CLASSES:
        raise InvalidArgument(f"traffic_class must be agent or chatbot, not {name!r}")
    return name


def traffic_class_to_proto(name: str) -> int:
    """The common.v1 TrafficClass number of a class name (InvalidArgument if unknown)."""
    return _TRAFFIC_TO_PROTO[check_traffic_class(name)]


def traffic_class_name(value: int) -> str:
    """The name of a TrafficClass number. A number outside the enum (proto3 enums are
    open, so one can arrive) becomes "TrafficClass(N)", which `check_traffic_class`
    rejects with the number in the message."""
    return _TRAFFIC_FROM_PROTO.get(value, f"TrafficClass({value})")


def finish_to_proto(name: str | None) -> int:
    return _FINISH_TO_PROTO[name]


def finish_name(value: int) -> str | None:
    """"length" | "stop" | "aborted", or None for UNSPECIFIED and unknown numbers."""
    return _FINISH_FROM_PROTO.get(value)


class _SamplingRequest(Protocol):
    """A gateway or engine GenerateRequest: both carry these two fields."""
    max_tokens: int

    @property
    def sampling(self) -> common_pb2.SamplingParams: ...


_Req = TypeVar("_Req", bound=_SamplingRequest)


# SamplingParams fields that every hop carries by name, unchanged, with their defaults
# (the gateway's GenRequest, the engine's SamplingParams and the proto share the names)
SAMPLING_CONTROLS: dict[str, float | None] = {
    "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "logprobs": None}
# vLLM takes any positive repetition penalty; past a few it only flattens every seen
# logit to ~0, so a bound keeps float overflow out of the question.
MAX_REPETITION_PENALTY = 100.0
MAX_LOGPROBS = 20           # top log-probabilities per token (OpenAI's top_logprobs bound)


def set_sampling(req: _Req, max_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 speculative: str | None = None, **controls: float | None) -> _Req:
    """Fill max_tokens and the common.v1 SamplingParams fields that were given, on a gateway
    or engine GenerateRequest (both carry `max_tokens` and `sampling`); unset ones keep
    the server-side defaults. `controls`: SAMPLING_CONTROLS by name."""
    unknown = set(controls) - set(SAMPLING_CONTROLS)
    if unknown:
        raise TypeError(f"set_sampling: unknown sampling fields {sorted(unknown)}")
    if max_tokens is not None:
        req.max_tokens = max_tokens
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                        ("seed", seed), ("speculative", speculative), *controls.items()):
        if value is not None:
            setattr(req.sampling, name, value)
    return req


def sampling_controls(s: common_pb2.SamplingParams) -> dict[str, float | None]:
    """The SAMPLING_CONTROLS a SamplingParams message sets (None: unset)."""
    return {name: getattr(s, name) if s.HasField(name) else None for name in SAMPLING_CONTROLS}


class TokenLogprob(NamedTuple):
    """A generated token's log-probability, and the k likeliest tokens' (id, log-prob),
    likeliest first (common.v1 TokenLogprob)."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_proto(self) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(logprob=self.logprob, top_ids=[i for i, _ in self.top],
                                       top_logprobs=[v for _, v in self.top])

    @classmethod
    def from_proto(cls, m: common_pb2.TokenLogprob) -> TokenLogprob:
        return cls(m.logprob, tuple(zip(m.top_ids, m.top_logprobs, strict=True)))


def controls_given(args: argparse.Namespace) -> dict[str, float]:
    """The SAMPLING_CONTROLS a command line gave (`--min-p`, `--presence-penalty`, ...)."""
    return {name: v for name in SAMPLING_CONTROLS if (v := getattr(args, name, None)) is not None}


SPECULATIVE_METHODS = ("ngram", "mtp")


def parse_speculative(text: str, field: str = "sampling.speculative") -> tuple[str, int]:
    """'off' (or empty) -> ("off", 0); 'ngram:K' / 'mtp:K' (K >= 1) -> (method, K). The
    syntax only: each engine bounds it by its own setting (services/engine/core/speculative.py)."""
    text = text.strip()
    if text in ("", "off"):
        return "off", 0
    method, _, k = text.partition(":")
    if method not in SPECULATIVE_METHODS:
        raise InvalidArgument(f"{field}: unknown method {method!r}; use off, ngram:K or mtp:K")
    if not k.isdigit() or int(k) < 1:
        raise InvalidArgument(f"{field}: {text!r} needs a draft count K >= 1, as in {method}:4")
    return method, int(k)
