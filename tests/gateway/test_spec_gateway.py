"""Speculative decoding through the gateway of a real mesh (gateway, directory, kvstore, one
engine over gRPC) on the shipped model (`--speculative ngram:4`): a request asking for
`ngram:4` or `ngram:2` returns the tokens of the same request with `off`, and its usage
reports what was drafted and accepted. (The shipped V4.1-layout model has no MTP module:
V4.1 drafts with DSpark layers, not served yet; MTP drafts are pinned on a DeepSeek V4
checkpoint in tests/engine/deepseek_v4/test_mtp.py.)"""

from __future__ import annotations

import urllib.request

import pytest

from kvmesh.services.gateway.client import gateway_request

MESH_OVERRIDES = dict(engines=1, engine_extra=("--fetch-deadline-ms", "5000",
                                               "--speculative", "ngram:4",
                                               "--spec-policy", "always"))
PROMPT = ("def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"
          "    parser.add_argument('--name', default='x')\n"
          "    parser.add_argument('--count', type=int, default=1)\n"
          "    parser.add_argument('")


def _generate(gw, speculative: str, salt: str):
    req = gateway_request(PROMPT, max_tokens=48, temperature=0.0, ignore_eos=True, cache_salt=salt)
    req.sampling.speculative = speculative
    return gw.stub.Generate(req, timeout=120)


@pytest.mark.parametrize("method", ["ngram:4", "ngram:2"])
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


def test_metrics_show_each_requests_acceptance_and_the_policys_choices(gw, mesh):
    """Per-request acceptance on the engine's /metrics (a histogram of accepted / drafted per
    finished generation) and the adaptive policy's counters, as counters."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.gateway.conftest import wait_for

    _generate(gw, "ngram:4", salt="metrics")

    def families():
        body = urllib.request.urlopen(mesh.endpoints["engine-a-metrics"], timeout=5).read()
        return {f.name: f for f in text_string_to_metric_families(body.decode())}

    def drafting_generations():
        hist = families()["kvmesh_engine_spec_request_acceptance"]
        return sum(s.value for s in hist.samples if s.name.endswith("_count"))

    assert wait_for(lambda: drafting_generations() >= 1), drafting_generations()
    fams = families()
    for name in ("kvmesh_engine_spec_drafted_tokens", "kvmesh_engine_spec_policy_drafted_steps",
                 "kvmesh_engine_spec_withheld_tokens"):
        assert fams[name].type == "counter", name
