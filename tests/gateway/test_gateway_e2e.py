"""Through the gateway on a real mesh (valkey, directory, two engines, gateway processes).

Failure tests (engines killed) run last in this module and restart what they kill.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.proto import engine_pb2, engine_pb2_grpc
from kvmesh.services.gateway.client import gateway_request
from tests import readme_facts
from tests.gateway.cases import BAD, build
from tests.gateway.conftest import tokens, wait_for

# These tests pin the plain failure behaviour (a stream whose engine dies mid-stream ends
# UNAVAILABLE); test_migration.py covers the default, where it continues elsewhere.
MESH_OVERRIDES = dict(gateway_extra=("--migration-limit", "0"))
PROMPT = "The gateway routes by prefix."
LONG = dict(max_tokens=3000, ignore_eos=True, temperature=0.0)  # ~30 s of tokens: killed early


def test_gateway_health_and_reflection(gw):
    ch = gw.channel
    resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    [answer] = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]), timeout=5)
    names = {s.name for s in answer.list_services_response.service}
    assert "kvmesh.gateway.v1.GatewayService" in names


def test_stream_and_unary_agree_greedy(gw):
    unary = gw.generate(PROMPT, max_tokens=12, temperature=0.0)
    msgs = list(gw.stream(PROMPT, max_tokens=12, temperature=0.0))
    assert [t for m in msgs for t in m.token_ids] == list(unary.token_ids)
    assert "".join(m.text for m in msgs) == unary.text
    last = msgs[-1]
    assert last.finish_reason == unary.finish_reason != 0
    assert last.usage == unary.usage
    assert unary.usage.prompt_tokens == len(tokens(PROMPT))
    assert unary.usage.generated_tokens == len(unary.token_ids) <= 12
    assert unary.engine_id and last.engine_id and unary.attempts == 1


@pytest.mark.parametrize("spec,status,field", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_field_over_grpc(gw, spec, status, field):
    for call in (gw.stub.Generate, gw.stub.GenerateStream):
        with pytest.raises(grpc.RpcError) as info:
            out = call(build(spec), timeout=30)
            list(out) if not hasattr(out, "token_ids") else None
        assert info.value.code().name == status, info.value.details()
        assert field in info.value.details()


def test_message_over_grpc_limit_is_resource_exhausted(gw):
    req = gateway_request("x" * (65 << 20), max_tokens=1)
    with pytest.raises(grpc.RpcError) as info:
        gw.stub.Generate(req, timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_engine_invalid_argument_passes_through_unchanged(gw, mesh):
    prompt = "y " * (64 * 128 + 10)  # more blocks than a test engine has (64)
    assert len(tokens(prompt)) > 64 * 128
    with grpc.insecure_channel(mesh.endpoints["engine-a"]) as ch:
        with pytest.raises(grpc.RpcError) as direct:
            list(engine_pb2_grpc.EngineServiceStub(ch).Generate(
                engine_pb2.GenerateRequest(prompt=prompt, max_tokens=1), timeout=30))
    with pytest.raises(grpc.RpcError) as via:
        gw.generate(prompt, max_tokens=1)
    assert via.value.code() == direct.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert via.value.details() == direct.value.details()


def _engines_idle(gw, mesh):
    stats = [gw.engine_stats(n) for n in mesh.engine_names]
    return all(s["slots_in_use"] == 0 and s["blocks_in_use"] == 0 for s in stats), stats


def _aborted(gw, mesh):
    return sum(gw.engine_stats(n).get("aborted", 0) for n in mesh.engine_names)


def test_cancelled_request_frees_slot_and_blocks(gw, mesh):
    before = _aborted(gw, mesh)
    call = gw.stream(PROMPT, **LONG)
    next(call), next(call)
    busy = [gw.engine_stats(n) for n in mesh.engine_names]
    assert sum(s["slots_in_use"] for s in busy) == 1
    call.cancel()
    assert wait_for(lambda: _engines_idle(gw, mesh)[0]), _engines_idle(gw, mesh)[1]
    assert _aborted(gw, mesh) >= before + 1


def test_deadline_reaches_the_engine(gw, mesh):
    before = _aborted(gw, mesh)
    with pytest.raises(grpc.RpcError) as info:
        list(gw.stream(PROMPT, timeout=0.5, **LONG))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: _engines_idle(gw, mesh)[0]), _engines_idle(gw, mesh)[1]
    assert _aborted(gw, mesh) >= before + 1


def test_metrics_endpoint_counts_requests_and_tokens(gw, mesh):
    gw.generate(PROMPT, max_tokens=3, temperature=0.0)
    text = urllib.request.urlopen(mesh.endpoints["gateway-metrics"], timeout=5).read().decode()
    assert 'kvmesh_requests_total{method="unary",service="gateway",status="OK"}' in text
    assert 'kvmesh_requests_total{method="unary",service="gateway",status="INVALID_ARGUMENT"}' in text
    assert "kvmesh_time_to_first_token_seconds_bucket" in text
    for kind in ("prompt", "cached", "replayed", "generated"):
        assert f'kvmesh_tokens_total{{kind="{kind}",service="gateway"}}' in text


def test_deepest_snapshot_holder_is_preferred(gw, mesh):
    """The engine that stored and published a prompt's window attracts prompts extending it,
    and they resume from that window (cached 256, nothing replayed)."""
    # 400 tokens: the decoder's cut is at 266, the window stored at the boundary before it
    prompt = tokens("snapshot routing " * 200)[:400]
    holder = gw.generate(prompt, max_tokens=1, cache_salt="tenant-s").engine_id
    assert wait_for(lambda: gw.engine_stats(holder).get("directory_published", 0) >= 1)
    for i in range(3):
        resp = gw.generate(prompt + tokens(f" follow-up number {i}, " * 4), max_tokens=1,
                           cache_salt="tenant-s")
        assert resp.engine_id == holder
        assert (resp.usage.cached_tokens, resp.usage.replayed_tokens) == (256, 0)
    # Another tenant's salt names other keys: no holder; the first request goes by load,
    # the rest follow it by prefix affinity.
    other = {gw.generate(prompt, max_tokens=1, cache_salt="tenant-t").engine_id
             for _ in range(4)}
    assert len(other) == 1, other


def test_directory_down_requests_still_served(gw, mesh):
    mesh.kill("directory")
    try:
        long_prompt = "shared prefix " * 30  # > one block: the gateway asks the directory
        for _ in range(3):
            assert gw.generate(long_prompt, max_tokens=2, temperature=0.0).usage.generated_tokens
    finally:
        mesh.restart("directory")


def _directory_load(mesh, engine_id: str) -> int:
    """running + waiting sequences of an engine as its last heartbeat told the directory; 0
    while the directory cannot be reached (a wait_for poll asks again: in a fresh-clone run, a
    new channel's handshake missed its 2 s deadline beside six busy streams and failed the test)."""
    import asyncio

    from kvmesh.directory_client import DirectoryClient
    from kvmesh.errors import Unavailable

    async def engines():
        async with DirectoryClient(mesh.endpoints["directory"]) as d:
            return await d.list_engines()

    try:
        listed = asyncio.run(engines())
    except Unavailable:
        return 0
    return sum(e.load.running_seqs + e.load.waiting_seqs for e in listed if e.engine_id == engine_id)


def _holders_of(gw, mesh, prefix: list[int], salt: str) -> set[str]:
    """Engines the directory lists for the snapshot at the end of `prefix` (block-aligned),
    named from the engine's model info as the gateway names it."""
    import asyncio

    from kvmesh.directory_client import DirectoryClient
    from kvmesh.services.gateway.core import ModelInfo

    with grpc.insecure_channel(mesh.endpoints["engine-a"]) as ch:
        info = engine_pb2_grpc.EngineServiceStub(ch).GetModelInfo(
            engine_pb2.GetModelInfoRequest(), timeout=10)
    key = ModelInfo(info).snapshot_keys(prefix, salt)[-1]

    async def lookup():
        async with DirectoryClient(mesh.endpoints["directory"]) as d:
            return await d.find_holders([key])

    return {h.engine_id for h in asyncio.run(lookup()).get(key, [])}


def test_shared_prefix_on_two_engines_reuses_blocks_and_snapshot(gw, mesh):
    """Request 1 runs on engine X (400 tokens: stores its window at 256, the boundary before
    its decoder's cut, writes blocks to the kvstore, publishes to the directory). X is then
    made busy with direct requests, so the gateway routes request 2, which shares the
    256-token prefix, to the other engine Y by load. Y takes the blocks from the kvstore and
    X's window through the directory."""
    from kvmesh.services.engine.rpc.client import generate_request

    base = tokens("shared prefix on two engines. " * 100)[:400]
    first = gw.generate(base, max_tokens=1, temperature=0.0, cache_salt="two-engines")
    holder = first.engine_id
    other = next(n for n in mesh.engine_names if n != holder)
    assert wait_for(lambda: gw.engine_stats(holder).get("kvstore_blocks_written", 0) >= 2)
    assert wait_for(lambda: holder in _holders_of(gw, mesh, base[:256], "two-engines")), \
        "the holder's window at 256 is published"
    # keep the holder busy: 6 streams on 4 slots -> the directory reports load 6
    ch = grpc.insecure_channel(mesh.endpoints[holder])
    stub = engine_pb2_grpc.EngineServiceStub(ch)
    busy = [stub.Generate(generate_request([7 + i] * 20, max_tokens=3000, temperature=0.0,
                                           ignore_eos=True), timeout=60) for i in range(6)]
    try:
        assert wait_for(lambda: gw.engine_stats(holder)["running"] + gw.engine_stats(holder)["waiting"] >= 6)
        assert wait_for(lambda: _directory_load(mesh, holder) >= 6, timeout=30), \
            "the holder's heartbeat reports its load"
        time.sleep(1.5)                          # > one gateway ListEngines refresh (1 s)
        # 160 tokens more: the cut (at 282) leaves the 256-token prefix usable
        second = gw.generate(base[:256] + tokens(" and a different question follows " * 40)[:160],
                             max_tokens=4, temperature=0.0, cache_salt="two-engines")
    finally:
        for call in busy:
            call.cancel()
        ch.close()
    assert second.engine_id == other, (second.engine_id, holder)
    stats = gw.engine_stats(other)
    peer = {k: v for k, v in stats.items() if k.startswith("peer_") or k.startswith("kvstore")}
    assert (second.usage.cached_tokens, second.usage.replayed_tokens) == (256, 0), peer
    assert stats["kvstore_block_hits"] >= 2 and stats["peer_snapshot_fetches"] >= 1


# --- engine failures (last: they kill engines) ------------------------------------------
def _serving_engine(gw, mesh):
    for name in mesh.engine_names:
        if gw.engine_stats(name).get("running", 0) >= 1:
            return name
    return None


def test_engine_killed_mid_stream_gives_clear_status_and_other_engine_serves(gw, mesh):
    call = gw.stream(PROMPT, **LONG)
    next(call), next(call)
    victim = wait_for(lambda: _serving_engine(gw, mesh))
    assert victim
    try:
        mesh.kill(victim)
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "failed mid-stream after" in info.value.details()
        resp = gw.generate(PROMPT, max_tokens=4, temperature=0.0)
        assert resp.usage.generated_tokens == 4 or resp.finish_reason == 2
        assert mesh.alive("gateway")
    finally:
        mesh.restart(victim)


def test_hung_engine_mid_stream_is_noticed_by_keepalive(gw, mesh):
    """SIGSTOP keeps the engine's sockets open: only HTTP/2 pings (5 s idle + 5 s timeout)
    can tell that it stopped answering. The client gets a clear status, not a hang."""
    call = gw.stream(PROMPT, timeout=120, **LONG)
    next(call), next(call)
    victim = wait_for(lambda: _serving_engine(gw, mesh))
    assert victim
    pid = mesh.pid(victim)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        waited = time.monotonic() - t0
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        assert "failed mid-stream after" in info.value.details()
        assert waited < 20, waited
        resp = gw.generate(PROMPT, max_tokens=4, temperature=0.0)  # the other engine
        assert resp.usage.generated_tokens == 4 or resp.finish_reason == 2
    finally:
        os.kill(pid, signal.SIGCONT)
        mesh.restart(victim)


def _load_balanced(gw) -> bool:
    """The gateway spreads plain requests over both engines: its view of their load is
    current. Right after an engine restart it can still hold the load the old process
    last reported (a generation running) until the new one heartbeats, and send
    everything to the other engine meanwhile."""
    return len({gw.generate(PROMPT, max_tokens=1).engine_id for _ in range(4)}) == 2


def test_engine_down_before_first_token_is_retried_elsewhere(gw, mesh):
    assert wait_for(lambda: _load_balanced(gw))
    mesh.kill("engine-a")
    try:
        answers = [gw.generate(f"{PROMPT} {i}", max_tokens=2, temperature=0.0) for i in range(6)]
        assert all(a.usage.generated_tokens >= 1 for a in answers)
        assert any(a.attempts == 2 for a in answers), [a.attempts for a in answers]
        # Static engines are named by address until the directory names them.
        assert {a.engine_id for a in answers} <= {mesh.endpoints["engine-b"], "engine-b"}
    finally:
        mesh.restart("engine-a")
    assert gw.generate(PROMPT, max_tokens=2).usage.generated_tokens >= 1


def test_every_service_exports_metrics(gw, mesh):
    gw.generate("metrics " * 40, max_tokens=2, temperature=0.0)

    def scrape(name):
        return urllib.request.urlopen(mesh.endpoints[f"{name}-metrics"], timeout=5).read().decode()

    def engine_ok():
        text = "".join(scrape(n) for n in mesh.engine_names)
        return ("kvmesh_engine_slots_in_use" in text and "kvmesh_engine_blocks_in_use" in text
                and 'method="Generate",service="engine",status="OK"' in text)

    assert wait_for(engine_ok)
    # The gateway's Session streams are not requests: only their generations are counted,
    # so an idle engine shows nothing in flight even while a session is open.
    for name in mesh.engine_names:
        text = scrape(name)
        assert 'method="Session"' not in text, name
        assert 'kvmesh_in_flight_requests{service="engine"} 0.0' in text, name
    assert wait_for(lambda: "kvmesh_kvstore_durable_bytes" in scrape("kvstore"))
    assert wait_for(lambda: 'method="Heartbeat",service="directory",status="OK"'
                    in scrape("directory"))


def _engine_totals(gw, mesh) -> dict[str, float]:
    """GetStats summed over the engines (exact and immediate, unlike the 1 s gauges)."""
    out: dict[str, float] = {}
    for name in mesh.engine_names:
        for k, v in gw.engine_stats(name).items():
            out[k] = out.get(k, 0.0) + v
    return out


def _token_totals(mesh, service: str) -> dict[str, float]:
    urls = ([mesh.endpoints[f"{n}-metrics"] for n in mesh.engine_names] if service == "engine"
            else [mesh.endpoints["gateway-metrics"]])
    pages = [readme_facts.scrape(u) for u in urls]
    return {kind: sum(readme_facts.total(p, "kvmesh_tokens_total", service=service, kind=kind)
                      for p in pages) for kind in ("prompt", "cached", "replayed", "generated")}


def test_every_metric_the_readme_names_is_exported_and_counts(gw, mesh):
    """README truth: each `kvmesh_*` metric, token kind and engine counter the README names
    is on a live /metrics page, and a cold request, a snapshot miss, a snapshot hit and an
    abort move the counters by exactly what the hit policy says (docs/design.md §5)."""
    text = readme_facts.readme()
    names, kinds = readme_facts.metric_names(text), readme_facts.token_kinds(text)
    counters = readme_facts.engine_counters(text)
    assert {"kvmesh_requests_total", "kvmesh_tokens_total"} <= names and counters, \
        "the README parser found nothing: did a heading change?"

    aborted0 = _engine_totals(gw, mesh)["aborted"]
    with pytest.raises(grpc.RpcError):
        list(gw.stream(PROMPT, timeout=0.5, **LONG))
    assert wait_for(lambda: _engines_idle(gw, mesh)[0]), _engines_idle(gw, mesh)[1]
    assert wait_for(lambda: _engine_totals(gw, mesh)["aborted"] >= aborted0 + 1)

    # In tokens, KEEP = 134: cold 520 (cut 386: stores its window at 384), then a prompt
    # sharing only its first two blocks (L1 = 256, no window there: replay 128), then one
    # extending the first (cut 566: 4 blocks cached, the window at 384 wins: exact, and it
    # stores its own at 512).
    ids = tokens("".join(f"metric line {i:03d}. " for i in range(200)))
    cold, miss, hit = ids[:520], ids[:300] + tokens("other words " * 200)[:250], ids[:700]
    before = (_engine_totals(gw, mesh), _token_totals(mesh, "engine"),
              _token_totals(mesh, "gateway"))
    usages = []
    for prompt, (cached, replayed) in ((cold, (0, 0)), (miss, (256, 128)), (hit, (384, 0))):
        u = gw.generate(prompt, max_tokens=1, temperature=0.0, cache_salt="readme").usage
        assert (u.prompt_tokens, u.cached_tokens, u.replayed_tokens, u.generated_tokens) == \
            (len(prompt), cached, replayed, 1), len(prompt)
        usages.append(u)
    kinds_ = dict(prompt=1770, cached=640, replayed=128, generated=3)
    want = dict(requests=3, finished=3, prompt_tokens=1770, cache_hit_tokens=640,
                replayed_tokens=128, snapshot_hits=1, snapshot_misses=1, snapshot_stores=3,
                generated_tokens=3, computed_tokens=520 + (550 - 256 + 128) + (700 - 384))

    def deltas():
        stats, eng, gate = (_engine_totals(gw, mesh), _token_totals(mesh, "engine"),
                            _token_totals(mesh, "gateway"))
        return ({k: stats[k] - before[0][k] for k in want},
                {k: eng[k] - before[1][k] for k in kinds_},
                {k: gate[k] - before[2][k] for k in kinds_})

    assert wait_for(lambda: deltas() == (want, kinds_, kinds_)), deltas()

    pages = {n: readme_facts.scrape(mesh.endpoints[f"{n}-metrics"])
             for n in (*mesh.engine_names, "gateway", "kvstore", "directory")}
    for name in sorted(names):
        owners = (mesh.engine_names if name.startswith("kvmesh_engine_") else
                  ["kvstore"] if name.startswith("kvmesh_kvstore_") else list(pages))
        assert any(readme_facts.exported(pages[o], name) for o in owners), name
    for n in mesh.engine_names:
        stats = gw.engine_stats(n)
        for c in counters:
            assert c in stats, (n, c)
            assert readme_facts.exported(pages[n], f"kvmesh_engine_{c}"), (n, c)
    for service, page in (("gateway", pages["gateway"]), ("engine", pages[mesh.engine_names[0]])):
        for kind in kinds:
            assert (("kind", kind), ("service", service)) in {lab for _, lab in page}, (service, kind)
    levels = _engine_totals(gw, mesh)
    assert levels["snapshot_bytes"] > 0 and levels["blocks_cached"] > 0
    assert wait_for(lambda: readme_facts.total(readme_facts.scrape(
        mesh.endpoints["kvstore-metrics"]), "kvmesh_kvstore_durable_bytes") > 0)

