"""Authentication against one real mesh with auth on: gateway API keys (gRPC and HTTP),
tenant isolation of the cache and of request ids, the service/admin tokens on every
internal RPC (table-driven from the proto descriptors), and a rogue engine's heartbeat.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import grpc
import pytest

from kvmesh.proto import directory_pb2, directory_pb2_grpc, engine_pb2, engine_pb2_grpc
from kvmesh.rpc_auth import ADMIN_METHODS
from kvmesh.services.gateway.client import gateway_request
from tests.gateway import rpc_table
from tests.gateway.conftest import Gw, start_mesh, wait_for

SERVICE_TOKEN = "svc-token-for-tests-0123456789"
ADMIN_TOKEN = "admin-token-for-tests-0123456789"
KEYS = {"alice": "key-alice-0123456789abcdef", "bob": "key-bob-0123456789abcdef"}
# KEEP (134) + 3 blocks of 128 tokens: long enough that a stored window can be reused.
# 610 tokens: blocks and a window before the decoder's cut (prompt - 134), so a hit can happen
LONG = "".join(f"tenant isolation line {i:03d}. " for i in range(60))
assert len(LONG.encode()) >= 134 + 3 * 128


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("# key tenant role\n" + "".join(
        f"{k} {t} {'admin' if t == 'alice' else 'user'}\n" for t, k in KEYS.items()))
    m = start_mesh(tmp_path_factory, "test_auth", service_token=SERVICE_TOKEN,
                   admin_token=ADMIN_TOKEN, api_keys=str(keys))
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def gw(mesh):
    g = Gw(mesh)
    yield g
    g.close()


def _md(tenant: str):
    return [("authorization", f"Bearer {KEYS[tenant]}")]


def _gen(gw, tenant, prompt, **kw):
    return gw.stub.Generate(_req(prompt, **kw), metadata=_md(tenant), timeout=60)


def _req(prompt, **kw):
    return gateway_request(prompt, max_tokens=2, temperature=0.0, **kw)


# --- gateway API keys -------------------------------------------------------------------
@pytest.mark.parametrize("metadata", [None, [("authorization", "Bearer not-a-key-at-all")],
                                      [("authorization", KEYS["alice"])]])
def test_grpc_without_a_valid_key_is_unauthenticated(gw, metadata):
    with pytest.raises(grpc.RpcError) as info:
        gw.stub.Generate(_req("hello"), metadata=metadata, timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()


def test_the_cli_and_the_client_send_a_key(mesh):
    """`kvmesh generate --api-key` / $KVMESH_API_KEY and GatewayClient(api_key=...)"""
    import asyncio
    import os
    import subprocess
    import sys

    from kvmesh.services.gateway.client import GatewayClient

    cmd = [sys.executable, "-m", "kvmesh.launch.cli", "generate", "hi", "--gateway", mesh.gateway,
           "--max-tokens", "2"]
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_API_KEY"}
    runs = {"none": subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60),
            "flag": subprocess.run(cmd + ["--api-key", KEYS["bob"]], env=env,
                                   capture_output=True, text=True, timeout=60),
            "env": subprocess.run(cmd, env={**env, "KVMESH_API_KEY": KEYS["bob"]},
                                  capture_output=True, text=True, timeout=60)}
    assert runs["none"].returncode == 1 and "UNAUTHENTICATED" in runs["none"].stderr
    for name in ("flag", "env"):                # (random weights: an end token may come first)
        assert runs[name].returncode == 0, runs[name].stderr
        assert re.search(r"[12] generated; engine", runs[name].stderr), runs[name].stderr

    async def call():
        async with GatewayClient(mesh.gateway, api_key=KEYS["alice"]) as gw:
            return await gw.generate("hi", max_tokens=2)
    assert 1 <= asyncio.run(call()).usage.generated_tokens <= 2


def _http(mesh, path, body=None, key=None):
    req = urllib.request.Request(mesh.endpoints["gateway-http"] + path,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json",
                                          **({"authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_key_checked_with_openai_error_shape(mesh, gw):
    body = {"prompt": "hello", "max_tokens": 2}
    for key in (None, "wrong-key-0123456789abcdef"):
        status, out = _http(mesh, "/v1/completions", body, key)
        assert status == 401, out
        assert out["error"]["type"] == "authentication_error"
        assert out["error"]["code"] == "unauthenticated"
        assert _http(mesh, "/v1/models", key=key)[0] == 401
    status, models = _http(mesh, "/v1/models", key=KEYS["bob"])
    assert status == 200, models
    body["model"] = models["data"][0]["id"]
    status, out = _http(mesh, "/v1/completions", body, KEYS["bob"])
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 2


# --- tenants ----------------------------------------------------------------------------
def test_tenants_do_not_share_cached_prefixes(gw, mesh):
    first = _gen(gw, "alice", LONG)
    assert first.usage.cached_tokens == 0
    # Wait until the window alice's request stored is published, so a miss below is isolation.
    assert wait_for(lambda: sum(gw_stats(mesh, n).get("directory_published", 0)
                                for n in mesh.engine_names) >= 1)
    assert _gen(gw, "bob", LONG).usage.cached_tokens == 0
    again = _gen(gw, "alice", LONG)
    assert again.usage.cached_tokens > 0, again.usage


def test_a_request_salt_only_subdivides_its_own_tenant(gw, mesh):
    prompt = LONG.replace("line", "salted")
    assert _gen(gw, "alice", prompt, cache_salt="shared").usage.cached_tokens == 0
    assert wait_for(lambda: _gen(gw, "alice", prompt, cache_salt="shared").usage.cached_tokens
                    > 0), "same tenant, same salt: a hit"
    # bob names alice's salt, or alice's tenant salt as far as the regex allows: no hit.
    for salt in ("shared", "tenant:alice", "tenant:alice.shared"):
        assert _gen(gw, "bob", prompt, cache_salt=salt).usage.cached_tokens == 0, salt


def test_request_ids_are_per_tenant(gw):
    """alice's stream holds id 'dup' on its engine; bob may use 'dup' at the same time."""
    stream = gw.stub.GenerateStream(
        _req_long("x " * 50, request_id="dup"), metadata=_md("alice"), timeout=60)
    try:
        first = next(stream)
        assert first.request_id == "dup"
        resp = gw.stub.Generate(_req("hello bob", request_id="dup"), metadata=_md("bob"),
                                timeout=60)
        assert resp.request_id == "dup"        # the client sees its own id back
    finally:
        stream.cancel()


def _req_long(prompt, **kw):
    return gateway_request(prompt, max_tokens=256, ignore_eos=True, **kw)


def gw_stats(mesh, name):
    with grpc.insecure_channel(mesh.endpoints[name]) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        return dict(stub.GetStats(engine_pb2.GetStatsRequest(), timeout=10,
                                  metadata=[("authorization", f"Bearer {SERVICE_TOKEN}")]
                                  ).counters)


# --- service and admin tokens on every internal RPC ---------------------------------------
def _internal_methods():
    for svc in rpc_table.services():
        if not svc.full_name.startswith("kvmesh.gateway."):  # public: API keys, tested above
            for method in svc.methods:
                yield svc, method


METHODS = list(_internal_methods())


def test_the_table_covers_engine_kvstore_and_directory():
    packages = {svc.full_name.rsplit(".", 1)[0] for svc, _ in METHODS}
    assert packages == {"kvmesh.engine.v1", "kvmesh.kvstore.v1", "kvmesh.directory.v1"}
    assert len(METHODS) >= 18


def _call(mesh, channels, svc, method, metadata):
    rpc_table.raw_call(channels, mesh, svc, method, b"", metadata)  # an empty message


@pytest.mark.parametrize("svc,method", METHODS, ids=[f"{s.name}.{m.name}" for s, m in METHODS])
def test_internal_rpc_refuses_missing_or_wrong_token(mesh, channels, svc, method):
    admin = f"/{svc.full_name}/{method.name}" in ADMIN_METHODS
    cases = [(None, grpc.StatusCode.UNAUTHENTICATED),
             ([("authorization", "Bearer wrong-token")], grpc.StatusCode.PERMISSION_DENIED)]
    if admin:  # the service token is not enough for an admin RPC
        cases.append(([("authorization", f"Bearer {SERVICE_TOKEN}")],
                      grpc.StatusCode.PERMISSION_DENIED))
    for metadata, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            _call(mesh, channels, svc, method, metadata)
        assert info.value.code() == code, (metadata, info.value.details())


def test_the_right_tokens_are_accepted(mesh, channels):
    by_name = {f"{s.name}.{m.name}": (s, m) for s, m in METHODS}
    for name, token in (("EngineService.GetModelInfo", SERVICE_TOKEN),
                        ("KvstoreService.Stats", SERVICE_TOKEN),
                        ("DirectoryService.ListEngines", SERVICE_TOKEN),
                        ("KvstoreService.List", SERVICE_TOKEN)):
        _call(mesh, channels, *by_name[name], [("authorization", f"Bearer {token}")])


def test_proofs_are_taken_once_for_their_own_method(mesh, channels):
    """What kvmesh's clients send (kvmesh/rpc_proof.py): a proof of the token, good for one
    call of its method; replayed, sent to another method, or of a wrong token: refused."""
    from kvmesh.rpc_proof import prove

    by_name = {f"{s.name}.{m.name}": (s, m) for s, m in METHODS}
    svc, method = by_name["EngineService.GetModelInfo"]
    path = f"/{svc.full_name}/{method.name}"
    proof = [("authorization", prove(SERVICE_TOKEN, path))]
    _call(mesh, channels, svc, method, proof)
    for metadata, why in ((proof, "used before"),
                          ([("authorization", prove(SERVICE_TOKEN, "/other/Method"))], "wrong token"),
                          ([("authorization", prove("guess", path))], "wrong token")):
        with pytest.raises(grpc.RpcError) as info:
            _call(mesh, channels, svc, method, metadata)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert why in info.value.details()
    admin_svc, delete = by_name["KvstoreService.Delete"]
    with pytest.raises(grpc.RpcError) as info:       # the service token's proof: not admin
        _call(mesh, channels, admin_svc, delete, [(
            "authorization", prove(SERVICE_TOKEN, f"/{admin_svc.full_name}/Delete"))])
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_health_stays_open(mesh):
    from kvmesh.healthcheck import check

    for name in ("directory", "kvstore", mesh.engine_names[0]):
        assert check(mesh.endpoints[name], timeout=5)


# --- engine identity ----------------------------------------------------------------------
def test_rogue_heartbeat_is_refused_and_gets_no_traffic(mesh, gw):
    rogue = directory_pb2.HeartbeatRequest(engine_id="rogue", address="127.0.0.1:1")
    with grpc.insecure_channel(mesh.endpoints["directory"]) as ch:
        stub = directory_pb2_grpc.DirectoryServiceStub(ch)
        for metadata, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                               ([("authorization", "Bearer guess")],
                                grpc.StatusCode.PERMISSION_DENIED)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Heartbeat(rogue, metadata=metadata, timeout=10)
            assert info.value.code() == code
        listed = stub.ListEngines(directory_pb2.ListEnginesRequest(), timeout=10, metadata=[
            ("authorization", f"Bearer {SERVICE_TOKEN}")])
    assert {e.engine_id for e in listed.engines} == set(mesh.engine_names)
    served = {_gen(gw, "bob", f"who serves request {i}?").engine_id for i in range(8)}
    assert served <= set(mesh.engine_names), served


# --- kvmesh up's token file ---------------------------------------------------------------
def test_up_token_file_is_private_and_found_by_address(tmp_path):
    from kvmesh.running import tokens_for, write_tokens

    env = {"KVMESH_HOME": str(tmp_path)}
    tokens = {"KVMESH_SERVICE_TOKEN": "s" * 20, "KVMESH_ADMIN_TOKEN": "a" * 20}
    path = write_tokens({"kvstore": "127.0.0.1:7100", "gateway": "127.0.0.1:7000"}, tokens, env)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert tokens_for("127.0.0.1:7100", env) == tokens
    assert tokens_for("127.0.0.1:7101", env) == {}
    path.unlink()
    assert tokens_for("127.0.0.1:7100", env) == {}


# --- the keys file ------------------------------------------------------------------------
@pytest.mark.parametrize("text,why", [
    ("", "no keys"),
    ("key-0123456789abcdef alice\n", "expected 'key tenant role'"),
    ("short alice user\n", "at least 16"),
    ("key-0123456789abcdef al/ice user\n", "tenant must be"),
    ("key-0123456789abcdef alice root\n", "role must be"),
    ("key-0123456789abcdef a user\nkey-0123456789abcdef b user\n", "duplicate"),
])
def test_bad_keys_file_is_refused_with_the_reason(tmp_path, text, why):
    from kvmesh.auth import ApiKeys
    from kvmesh.errors import InvalidArgument

    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(InvalidArgument, match=why):
        ApiKeys.load(path)


def test_keys_map_to_tenant_and_role(tmp_path):
    from kvmesh.auth import ApiKeys, Principal, Unauthenticated

    path = tmp_path / "keys"
    path.write_text("# comment\nkey-0123456789abcdef alice admin  # trailing\n"
                    "key-fedcba9876543210 bob user\n")
    keys = ApiKeys.load(path)
    assert keys.authenticate("Bearer key-0123456789abcdef") == Principal("alice", "admin")
    assert keys.authenticate("bearer  key-fedcba9876543210 ") == Principal("bob", "user")
    for bad in (None, "", "Bearer", "Basic key-0123456789abcdef", "key-0123456789abcdef",
                "Bearer key-0123456789abcdeF"):
        with pytest.raises(Unauthenticated):
            keys.authenticate(bad)
