"""Prefill/decode disaggregation through the real mesh (`kvmesh up --pd`: engine-a prefills,
engine-b and engine-c decode; real processes, sockets, directory, kvstore).

One uninterrupted stream per request, the tokens of a unified engine, usage naming both
engines and the bytes handed off; and the faults: a decode engine dead after the handoff
(retried on the other one), no decode engine left (a unified engine continues from the
first token), the prefill engine killed mid-prefill (served elsewhere). The client never
sees an error.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest

from kvmesh.proto import engine_pb2, engine_pb2_grpc
from kvmesh.services.engine.rpc.client import generate_request
from tests.engine.engines import random_prompt
from tests.gateway.conftest import TEST_MESH

MESH_OVERRIDES = dict(engines=3, pd=True, num_blocks=96)
# The shipped model (`kvmesh engine layout --config models/deepseek-v41-tiny/config.json`):
# the decode engine's 134-row slot, 6 rings x 134 rows x 66 B (head_dim 64 in MXFP8) + the KV
# sources' tails 73,728 B = 126,792 B, and 3 serialized blocks (a 300-token prompt), each
# 12,672 B (layer 1: 1 entry, layer 2: 32 entries, 384 B an entry) + 48 B header/digest.
HANDOFF_300 = 6 * 134 * 66 + 73_728 + 3 * (12_672 + 48)


def _collect(gw, prompt, **kw):
    msgs = list(gw.stream(prompt, timeout=120, **kw))
    return msgs, [t for m in msgs for t in m.token_ids]


def _direct(mesh, name, prompt, **kw):
    """The same request served whole by one engine (a decode engine is a unified 134-ring
    engine for plain requests); another salt, so no cache of the PD run is involved."""
    with grpc.insecure_channel(mesh.endpoints[name]) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        req = generate_request(prompt, cache_salt="direct", **kw)
        return [t for m in stub.Generate(req, timeout=120) for t in m.token_ids]


def _retries(mesh) -> float:
    text = urllib.request.urlopen(mesh.endpoints["gateway-metrics"], timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvmesh_retries_total{"))


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=5)])
def test_one_stream_with_a_unified_engines_tokens(mesh, gw, sampling):
    prompt = random_prompt(300, 11 if sampling["temperature"] else 12)
    msgs, tokens = _collect(gw, prompt, max_tokens=8, **sampling)
    assert len(tokens) == 8 and msgs[0].token_ids and not msgs[0].finish_reason
    u = msgs[-1].usage
    assert u.prefill_engine == "engine-a" and u.decode_engine in ("engine-b", "engine-c")
    assert u.handoff_bytes == HANDOFF_300
    assert u.generated_tokens == 8 and u.prompt_tokens == 300
    assert msgs[-1].engine_id == u.decode_engine
    assert tokens == _direct(mesh, "engine-b", prompt, max_tokens=8, **sampling)
    stats = gw.engine_stats("engine-a")
    assert stats["handoffs_out"] >= 1 and stats["generated_tokens"] == stats["handoffs_out"]


def test_decode_engine_dead_after_handoff_is_retried(mesh, gw):
    """The decode engine that served a prompt is the one its next request goes to (prefix
    affinity: it holds the blocks); killed, it fails after the handoff and before its first
    token, and the other decode engine takes the handoff: the client sees no error."""
    prompt = random_prompt(260, 100)
    msgs, _ = _collect(gw, prompt, max_tokens=3, temperature=0.0)
    first = msgs[-1].usage.decode_engine
    other = {"engine-b": "engine-c", "engine-c": "engine-b"}[first]
    before = _retries(mesh)
    mesh.kill(first)
    try:
        msgs, tokens = _collect(gw, prompt, max_tokens=4, temperature=0.0)
        assert len(tokens) == 4
        assert msgs[-1].usage.decode_engine == other
        assert _retries(mesh) == before + 1          # the affine engine was tried and failed
    finally:
        mesh.restart(first)


def test_no_decode_engine_left_falls_back_to_a_unified_engine(mesh, gw):
    """Both decode engines dead: the handoff cannot go anywhere; the prefill engine's first
    token has been sent and a unified engine continues from it (same seed): no error."""
    prompt = random_prompt(260, 21)
    want = _direct(mesh, "engine-b", prompt, max_tokens=6, temperature=0.9, seed=3)
    mesh.kill("engine-b")
    mesh.kill("engine-c")
    try:
        msgs, tokens = _collect(gw, prompt, max_tokens=6, temperature=0.9, seed=3)
        assert msgs[-1].engine_id == "engine-a"          # the only engine left, serving whole
        assert msgs[-1].usage.decode_engine == ""
        assert len(tokens) == 6 and tokens[0] == want[0]
    finally:
        mesh.restart("engine-b")
        mesh.restart("engine-c")


def test_prefill_engine_killed_mid_prefill_is_served_elsewhere(mesh, gw):
    prompt = random_prompt(3000, 31)
    out: dict = {}

    def run():
        try:
            out["msgs"] = list(gw.stream(prompt, timeout=180, max_tokens=4, temperature=0.0))
        except grpc.RpcError as exc:      # recorded: the assertion below names it
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not gw.engine_stats("engine-a").get("running"):
        time.sleep(0.02)
    mesh.kill("engine-a")
    t.join(180)
    try:
        assert "error" not in out, out.get("error")
        msgs = out["msgs"]
        assert len([x for m in msgs for x in m.token_ids]) == 4
        assert msgs[-1].engine_id in ("engine-b", "engine-c")
    finally:
        mesh.restart("engine-a")


def test_the_pd_mesh_runs_the_roles(mesh):
    for name, role in (("engine-a", "prefill"), ("engine-b", "decode"), ("engine-c", "decode")):
        assert mesh.procs[name].argv[mesh.procs[name].argv.index("--role") + 1] == role
    assert TEST_MESH["engines"] == 2      # the other modules keep unified meshes
    assert engine_pb2.HandoffSource.DESCRIPTOR is not None
