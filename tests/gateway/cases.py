"""Bad requests and the status each must get, shared by the unit and the gRPC tests.

Each case: (id, gateway_request kwargs or a proto mutator, status name, text the message names).
"""

from __future__ import annotations

import json
import math

from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.shipped import DEFAULT_MODEL

CFG = GatewayConfig()
# the shipped model's, which the tests' meshes serve
VOCAB = json.loads((DEFAULT_MODEL / "config.json").read_text())["text_config"]["vocab_size"]

BAD = [
    ("empty_prompt", dict(prompt=""), "INVALID_ARGUMENT", "prompt"),
    ("empty_token_ids", dict(prompt=[]), "INVALID_ARGUMENT", "prompt"),
    ("max_tokens_zero", dict(max_tokens=0), "INVALID_ARGUMENT", "max_tokens"),
    ("max_tokens_negative", dict(max_tokens=-5), "INVALID_ARGUMENT", "max_tokens"),
    ("max_tokens_over_limit", dict(max_tokens=CFG.max_tokens_limit + 1), "INVALID_ARGUMENT",
     "max_tokens"),
    ("temperature_negative", dict(temperature=-0.5), "INVALID_ARGUMENT", "temperature"),
    ("temperature_nan", dict(temperature=math.nan), "INVALID_ARGUMENT", "temperature"),
    ("temperature_inf", dict(temperature=math.inf), "INVALID_ARGUMENT", "temperature"),
    ("top_p_zero", dict(top_p=0.0), "INVALID_ARGUMENT", "top_p"),
    ("top_p_above_one", dict(top_p=1.5), "INVALID_ARGUMENT", "top_p"),
    ("top_p_nan", dict(top_p=math.nan), "INVALID_ARGUMENT", "top_p"),
    ("top_k_negative", dict(top_k=-1), "INVALID_ARGUMENT", "top_k"),
    ("seed_too_big", dict(seed=2**63), "INVALID_ARGUMENT", "seed"),
    ("traffic_class_unknown", lambda r: setattr(r, "traffic_class", 7), "INVALID_ARGUMENT",
     "traffic_class"),
    ("salt_with_space", dict(cache_salt="tenant a"), "INVALID_ARGUMENT", "cache_salt"),
    ("salt_too_long", dict(cache_salt="t" * 129), "INVALID_ARGUMENT", "cache_salt"),
    ("token_id_out_of_range", dict(prompt=[1, 2, VOCAB]), "INVALID_ARGUMENT", "prompt_token_ids"),
    ("stop_token_out_of_range", dict(stop_token_ids=[10**6]), "INVALID_ARGUMENT", "stop_token_ids"),
    ("stop_empty_string", dict(stop=[""]), "INVALID_ARGUMENT", "stop[0]"),
    ("too_many_stops", dict(stop=["a"] * (CFG.max_stop + 1)), "INVALID_ARGUMENT", "stop"),
    ("request_id_malformed", dict(request_id="has space"), "INVALID_ARGUMENT", "request_id"),
    ("prompt_over_byte_limit", dict(prompt="x" * (CFG.max_prompt_bytes + 1)), "RESOURCE_EXHAUSTED",
     "prompt"),
    ("prompt_over_token_limit", dict(prompt=[1] * (CFG.max_prompt_tokens + 1)),
     "RESOURCE_EXHAUSTED", "prompt"),
    ("request_over_size_limit", dict(prompt="hi", stop=["s" * 200] * 10, cache_salt="x" * 129,
                                     request_id="r" * (CFG.max_request_bytes + 1)),
     "RESOURCE_EXHAUSTED", "request"),
]


def build(spec):
    """A gateway GenerateRequest for one case (default prompt 'hello', 4 tokens)."""
    from kvmesh.services.gateway.client import gateway_request

    if callable(spec):
        req = gateway_request("hello", max_tokens=4)
        spec(req)
        return req
    kw = dict(prompt="hello", max_tokens=4)
    kw.update(spec)
    return gateway_request(kw.pop("prompt"), **kw)
