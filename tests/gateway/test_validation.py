"""Validation without processes: each bad field -> the right error naming the field."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument, ResourceExhausted
from kvmesh.services.gateway import validate
from kvmesh.services.gateway.model import status_name
from kvmesh.services.gateway.service import request_from_proto
from tests.gateway.cases import BAD, CFG, VOCAB, build

ERRORS = (InvalidArgument, ResourceExhausted)


@pytest.mark.parametrize("spec,status,field", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_field_is_named(spec, status, field):
    with pytest.raises(ERRORS) as info:
        req = request_from_proto(build(spec), CFG.max_request_bytes)
        validate.check_request(req, CFG, VOCAB)
    assert status_name(info.value) == status
    assert field in str(info.value)


@pytest.mark.parametrize("kw", [
    dict(prompt="hello"), dict(prompt=[0, 1, VOCAB - 1]), dict(temperature=0.0),
    dict(top_p=1.0, top_k=0), dict(seed=2**63 - 1), dict(traffic_class="agent"),
    dict(cache_salt="tenant-1.a:b_c"), dict(stop=["\n"], stop_token_ids=[257]),
    dict(max_tokens=CFG.max_tokens_limit), dict(request_id="req-1"),
], ids=lambda kw: ",".join(kw))
def test_good_requests_pass(kw):
    validate.check_request(request_from_proto(build(kw), CFG.max_request_bytes), CFG, VOCAB)


def test_token_ids_unchecked_until_vocab_known():
    """Before any engine answered GetModelInfo the engine is the judge of token ids."""
    req = request_from_proto(build(dict(prompt=[VOCAB + 5])), CFG.max_request_bytes)
    validate.check_request(req, CFG, None)


def test_text_prompt_token_limit():
    validate.check_prompt_tokens(CFG.max_prompt_tokens, CFG)
    with pytest.raises(ResourceExhausted, match="prompt is"):
        validate.check_prompt_tokens(CFG.max_prompt_tokens + 1, CFG)
