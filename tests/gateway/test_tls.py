"""TLS with real processes: a mesh started with certificates from a test CA (`Mesh`, the
code of `kvmesh up --tls-*`) serves Generate over mutual TLS, its internal calls run over
mutual TLS too (a generation crosses gateway -> engine -> kvstore/directory), every gRPC
port refuses a client without a certificate of the CA, and the HTTP API serves HTTPS."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.proto import gateway_pb2_grpc
from kvmesh.services.gateway.client import GatewayClient, gateway_request
from kvmesh.shipped import DEFAULT_MODEL
from kvmesh.tls import TlsFiles
from tests.gateway.conftest import start_mesh
from tests.tls_ca import TestCA

SERVICES = ("gateway", "directory", "kvstore", "engine-a", "engine-b")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    mesh_files = TestCA("kvmesh test CA").issue(root / "mesh", "mesh")
    rogue = TestCA("some other CA").issue(root / "rogue", "rogue")
    return mesh_files, rogue


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory, pki):
    m = start_mesh(tmp_path_factory, "test_tls", tls=pki[0])
    try:
        yield m
    finally:
        m.stop()


def _secure(address: str, files: TlsFiles, with_cert: bool = True) -> grpc.Channel:
    read = lambda p: open(p, "rb").read()  # noqa: E731
    creds = grpc.ssl_channel_credentials(
        root_certificates=read(files.ca),
        private_key=read(files.key) if with_cert else None,
        certificate_chain=read(files.cert) if with_cert else None)
    return grpc.secure_channel(address, creds)


def _health(ch: grpc.Channel) -> int:
    with ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=10).status


def test_generate_over_mutual_tls(tls_mesh, pki):
    with _secure(tls_mesh.gateway, pki[0]) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        # 301 tokens: a block before the decoder's cut (167), so the second request hits
        resp = stub.Generate(gateway_request("t " * 300, max_tokens=3, temperature=0.0),
                             timeout=60)
        again = stub.Generate(gateway_request("t " * 300, max_tokens=3, temperature=0.0),
                              timeout=60)
    assert resp.usage.generated_tokens == 3 and resp.engine_id
    # the engines reached each other's blocks / snapshots over internal mutual TLS
    assert again.usage.cached_tokens > 0 and list(again.token_ids) == list(resp.token_ids)


def test_the_async_client_uses_tls_from_the_environment(tls_mesh, pki, monkeypatch):
    for var, value in pki[0].env().items():
        monkeypatch.setenv(var, value)

    async def call():
        async with GatewayClient(tls_mesh.gateway) as gw:
            return await gw.generate("u" * 50, max_tokens=2, temperature=0.0, timeout=60)

    assert asyncio.run(call()).usage.generated_tokens == 2


@pytest.mark.parametrize("name", SERVICES)
def test_every_grpc_port_needs_a_certificate_of_the_ca(tls_mesh, pki, name):
    where = tls_mesh.endpoints[name]
    assert _health(_secure(where, pki[0])) == health_pb2.HealthCheckResponse.SERVING
    refused = {
        "no certificate": _secure(where, pki[0], with_cert=False),
        "another CA's certificate": grpc.secure_channel(where, grpc.ssl_channel_credentials(
            root_certificates=open(pki[0].ca, "rb").read(),
            private_key=open(pki[1].key, "rb").read(),
            certificate_chain=open(pki[1].cert, "rb").read())),
        "plaintext": grpc.insecure_channel(where),
    }
    for why, ch in refused.items():
        with pytest.raises(grpc.RpcError) as err:
            _health(ch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (name, why)


def test_a_client_that_does_not_trust_the_server_refuses_it(tls_mesh, pki):
    rogue = pki[1]
    ch = grpc.secure_channel(tls_mesh.gateway, grpc.ssl_channel_credentials(
        root_certificates=open(rogue.ca, "rb").read(),
        private_key=open(pki[0].key, "rb").read(),
        certificate_chain=open(pki[0].cert, "rb").read()))
    with pytest.raises(grpc.RpcError) as err:
        _health(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_http_api_serves_https(tls_mesh, pki):
    url = tls_mesh.endpoints["gateway-http"]
    assert url.startswith("https://")
    ctx = ssl.create_default_context(cafile=pki[0].ca)
    with urllib.request.urlopen(url + "/v1/models", context=ctx, timeout=30) as resp:
        assert json.load(resp)["data"][0]["id"] == DEFAULT_MODEL.name
    with pytest.raises(urllib.error.URLError):  # a client that does not trust the CA
        urllib.request.urlopen(url + "/v1/models", timeout=30)
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP
        urllib.request.urlopen(url.replace("https://", "http://") + "/v1/models", timeout=30)


def test_cli_flags_reach_the_client(tls_mesh, pki):
    files = pki[0]
    base = [sys.executable, "-m", "kvmesh.launch.cli", "generate", "hello", "--max-tokens", "2",
            "--gateway", tls_mesh.gateway]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_TLS_")}
    ok = subprocess.run([*base, "--tls-cert", files.cert, "--tls-key", files.key,
                         "--tls-ca", files.ca], env=env, capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "2 generated" in ok.stderr
    plain = subprocess.run(base, env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr, plain.stderr[-2000:]


@pytest.mark.parametrize("kw,why", [(dict(cert="/x.pem"), "both a certificate"),
                                    (dict(key="/x.key"), "both a certificate"),
                                    (dict(ca="/nonexistent/ca.pem"), "not a readable file")])
def test_incomplete_tls_settings_are_refused(kw, why):
    with pytest.raises(ValueError, match=why):
        TlsFiles(**kw)


def test_the_health_port_serves_health_in_plaintext_and_nothing_else(pki, monkeypatch):
    """KVMESH_TLS_HEALTH_PORT (Kubernetes' gRPC probes present no certificate): a plaintext
    port beside a mutual-TLS server that answers health, and no other service."""
    from kvmesh.launch.backing.proc import free_port
    from kvmesh.proto import engine_pb2, engine_pb2_grpc
    from kvmesh.rpc import Server

    files = pki[0]
    health_port = free_port()
    monkeypatch.setenv("KVMESH_TLS_HEALTH_PORT", str(health_port))

    async def go():
        server = Server("127.0.0.1:0", ["kvmesh.engine.v1.EngineService"], tls=files,
                        service_token="t" * 20)
        await server.start()
        try:
            plain = f"127.0.0.1:{health_port}"
            assert await asyncio.to_thread(_health, grpc.insecure_channel(plain)) == \
                health_pb2.HealthCheckResponse.SERVING
            with grpc.insecure_channel(plain) as ch, pytest.raises(grpc.RpcError) as info:
                await asyncio.to_thread(engine_pb2_grpc.EngineServiceStub(ch).GetModelInfo,
                                        engine_pb2.GetModelInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            main = f"127.0.0.1:{server.port}"              # the main port: TLS only
            with pytest.raises(grpc.RpcError):
                await asyncio.to_thread(_health, grpc.insecure_channel(main))
            await server.set_serving(False)                # one health, both ports
            assert await asyncio.to_thread(_health, grpc.insecure_channel(plain)) == \
                health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            await server.stop(0)

    asyncio.run(go())
