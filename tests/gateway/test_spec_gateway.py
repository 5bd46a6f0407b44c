"""Speculative decoding through the gateway of a real mesh (gateway, directory, kvstore, one
engine over gRPC) on the shipped checkpoint, whose MTP module the engine drafts with
(`--speculative mtp:4`; an mtp engine serves ngram requests too): a request asking for
`ngram:4` or `mtp:2` returns the tokens of the same request with `off`, and its usage
reports what was drafted and accepted. The engine serves V4-mini's checkpoint (model ""):
the shipped DeepSeek V4.1-layout model has no MTP module (V4.1 drafts with DSpark layers,
not served yet), and MTP through the gateway is what this module pins."""

from __future__ import annotations

import pytest

from services.gateway.client import gateway_request

MESH_OVERRIDES = dict(engines=1, model="", engine_extra=("--fetch-deadline-ms", "5000",
                                                         "--speculative", "mtp:4"))
PROMPT = ("def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"
          "    parser.add_argument('--name', default='x')\n"
          "    parser.add_argument('--count', type=int, default=1)\n"
          "    parser.add_argument('")


def _generate(gw, speculative: str, salt: str):
    req = gateway_request(PROMPT, max_tokens=48, temperature=0.0, ignore_eos=True, cache_salt=salt)
    req.sampling.speculative = speculative
    return gw.stub.Generate(req, timeout=120)


@pytest.mark.parametrize("method", ["ngram:4", "mtp:2"])
def test_speculative_request_through_the_gateway_equals_off(gw, method):
    off = _generate(gw, "off", salt=f"off-{method}")
    spec = _generate(gw, method, salt=f"spec-{method}")
    assert list(spec.token_ids) == list(off.token_ids) and len(off.token_ids) == 48
    assert spec.text == off.text
    assert off.usage.drafted_tokens == 0
    assert spec.usage.drafted_tokens > 0
    assert 0 < spec.usage.accepted_tokens <= spec.usage.drafted_tokens


def test_engine_stats_count_drafts_per_position(gw):
    stats = gw.engine_stats("engine-a")
    assert stats["spec_accepted_pos1"] > 0 and stats["spec_drafted_pos2"] > 0
    assert stats["spec_drafted_tokens"] >= stats["spec_accepted_tokens"] > 0
    assert "spec_acceptance_pos4" in stats          # the engine's K = 4 (the ngram request's)
