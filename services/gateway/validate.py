"""Request checks: bad fields -> InvalidArgument, oversize -> TooLarge (RESOURCE_EXHAUSTED).

Every message names the field and says why, so a caller can fix the request
without reading the code. The engine checks again (it is the authority on its
vocabulary and cache size); these checks stop bad requests before they cost a
route and a hop.
"""

from __future__ import annotations

import math
import re

from kvmesh.errors import InvalidArgument, TooLarge
from kvmesh.generation import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    check_traffic_class,
    parse_speculative,
)
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.model import GenRequest

# Salts and request ids end up in logs and cache keys: keep them printable and short.
SALT_RE = re.compile(r"[A-Za-z0-9._:-]{0,128}")
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# The wire's ranges (int32 top_k, uint32 token ids, float32 temperature): HTTP's JSON
# numbers are unbounded, and a value past them must be a 400, not a failed conversion.
INT32_MAX = 2**31 - 1
TOKEN_ID_LIMIT = 2**32
FLOAT32_MAX = 3.4028234663852886e38


def check_sampling(req: GenRequest, cfg: GatewayConfig) -> None:
    t = req.temperature
    if t is not None and not (math.isfinite(t) and 0 <= t <= FLOAT32_MAX):
        raise InvalidArgument(f"sampling.temperature must be a finite number in [0, {FLOAT32_MAX:.4g}]"
                              f" (0 = greedy), got {t}",
                              param="temperature")
    p = req.top_p
    if p is not None and not (0 < p <= 1):  # NaN fails both comparisons
        raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {p}", param="top_p")
    if req.top_k is not None and not 0 <= req.top_k <= INT32_MAX:
        raise InvalidArgument(f"sampling.top_k must be in [0, {INT32_MAX}] (0 = off), "
                              f"got {req.top_k}", param="top_k")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise InvalidArgument(f"sampling.seed must be in [0, 2**63), got {req.seed}", param="seed")
    if req.min_p is not None and not 0 <= req.min_p <= 1:
        raise InvalidArgument(f"sampling.min_p must be in [0, 1] (0 = off), got {req.min_p}",
                              param="min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not -2 <= v <= 2:
            raise InvalidArgument(f"sampling.{name} must be in [-2, 2], got {v}", param=name)
    r = req.repetition_penalty
    if r is not None and not 0 < r <= MAX_REPETITION_PENALTY:
        raise InvalidArgument(f"sampling.repetition_penalty must be in (0, "
                              f"{MAX_REPETITION_PENALTY:g}] (1 = off), got {r}",
                              param="repetition_penalty")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}",
                              param="logprobs")
    if req.speculative is not None:
        parse_speculative(req.speculative)      # the engine checks it against its own setting
    if req.max_tokens is not None:
        if req.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be > 0, got {req.max_tokens}", param="max_tokens")
        if req.max_tokens > cfg.max_tokens_limit:
            raise InvalidArgument(f"max_tokens must be <= {cfg.max_tokens_limit}, got {req.max_tokens}",
                                  param="max_tokens")


def check_stops(req: GenRequest, cfg: GatewayConfig, vocab_size: int | None) -> None:
    if len(req.stop) > cfg.max_stop:
        raise InvalidArgument(f"stop has {len(req.stop)} strings; at most {cfg.max_stop}",
                              param="stop")
    for i, s in enumerate(req.stop):
        if not s:
            raise InvalidArgument(f"stop[{i}] must not be empty", param="stop")
        if len(s.encode()) > cfg.max_stop_bytes:
            raise InvalidArgument(f"stop[{i}] is longer than {cfg.max_stop_bytes} bytes", param="stop")
    if len(req.stop_token_ids) > cfg.max_stop:
        raise InvalidArgument(f"stop_token_ids has {len(req.stop_token_ids)} ids; at most {cfg.max_stop}",
                              param="stop_token_ids")
    limit = TOKEN_ID_LIMIT if vocab_size is None else vocab_size
    bad = [t for t in req.stop_token_ids if not 0 <= t < limit]
    if bad:
        raise InvalidArgument(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {limit})",
                              param="stop_token_ids")


def check_request(req: GenRequest, cfg: GatewayConfig, vocab_size: int | None = None) -> None:
    """Everything that does not need the tokenizer. `vocab_size` None = not known yet."""
    if req.request_id and not REQUEST_ID_RE.fullmatch(req.request_id):
        raise InvalidArgument("request_id must be 1-128 characters of [A-Za-z0-9._:-]")
    check_traffic_class(req.traffic_class)
    if not SALT_RE.fullmatch(req.cache_salt):
        raise InvalidArgument("cache_salt must be at most 128 characters of [A-Za-z0-9._:-]",
                              param="cache_salt")
    if req.prompt is not None:
        if not req.prompt:
            raise InvalidArgument("prompt is empty: give prompt text or prompt_token_ids", param="prompt")
        size = len(req.prompt.encode("utf-8", "surrogatepass"))
        if size > cfg.max_prompt_bytes:
            raise TooLarge(f"prompt is {size} bytes; the limit is {cfg.max_prompt_bytes}", param="prompt")
    else:
        ids = req.prompt_token_ids or ()
        if not ids:
            raise InvalidArgument("prompt_token_ids is empty: give prompt text or token ids",
                                  param="prompt")
        check_prompt_tokens(len(ids), cfg)
        limit = TOKEN_ID_LIMIT if vocab_size is None else vocab_size
        bad = [t for t in ids if not 0 <= t < limit]
        if bad:
            raise InvalidArgument(f"prompt_token_ids {bad[:5]} are outside the vocabulary "
                                  f"[0, {limit})", param="prompt")
    check_sampling(req, cfg)
    check_stops(req, cfg, vocab_size)


def check_prompt_tokens(n: int, cfg: GatewayConfig) -> None:
    if n > cfg.max_prompt_tokens:
        raise TooLarge(f"prompt is {n} tokens; the limit is {cfg.max_prompt_tokens}", param="prompt")
