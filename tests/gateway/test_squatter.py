"""A process that takes a dead service's port gets nothing from a mesh run as `kvmesh up`
runs it (mutual TLS between the services, a CA made for the run): the calls to that address
fail their handshake, so the squatter sees no prompt and no service token, and every
request is served. Checked on an engine's port, the kvstore's and the directory's.

Two squatters: a plaintext gRPC server, and a TLS one with a certificate of its own CA.
The control: a server on the same port holding the run's certificate (an engine
restarted by the run) does receive the gateway's calls, so the gateway did dial there.

`kvmesh up --plaintext` (the opt-out the banner warns about): a squatter on an engine's
port is still sent no prompt (the gateway asks who it is first, and it is not the engine
registered there) and no token (services send one-call proofs of it, kvmesh/rpc_proof.py).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from kvmesh.launch.cli import build_parser
from kvmesh.launch.mesh import Mesh
from kvmesh.launch.up import mesh_config, with_run_tls
from kvmesh.proto import gateway_pb2_grpc
from kvmesh.services.gateway.client import gateway_request
from kvmesh.tls import TlsFiles
from tests.gateway.conftest import TEST_MESH
from tests.tls_ca import TestCA

PROMPT = "the squatter must never read this prompt"
# `kvmesh up`'s settings on free ports: its own (7000, ...) may be taken by a mesh of another
# test run, or by this module's other mesh
FREE_PORTS = dict(TEST_MESH, gateway_port=0, http_port=0, metrics_port=0)


@pytest.fixture(scope="module")
def up_mesh(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("squatter") / "logs"
    args = build_parser().parse_args(["up", "--log-dir", str(log_dir)])
    cfg = with_run_tls(replace(mesh_config(args), **FREE_PORTS), args)
    assert cfg.tls.mutual and not cfg.tls_public            # what `kvmesh up` runs
    m = Mesh(cfg).start()
    try:
        yield m
    finally:
        m.stop()


class Squatter:
    """A gRPC server on `port` that records every call it receives (method, metadata,
    request bytes) and answers UNAVAILABLE."""

    def __init__(self, port: int, tls: TlsFiles | None):
        self.calls: list[tuple[str, dict, bytes]] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers([self])
        address = f"127.0.0.1:{port}"
        bound = (self.server.add_secure_port(address, tls.server_credentials()) if tls
                 else self.server.add_insecure_port(address))
        assert bound == port
        self.server.start()

    def service(self, details):
        meta = dict(details.invocation_metadata)

        def record(request, context):
            with self.lock:
                self.calls.append((details.method, meta, request))
            context.abort(grpc.StatusCode.UNAVAILABLE, "squatter")

        identity = lambda b: b  # noqa: E731 - raw bytes in and out
        return grpc.unary_unary_rpc_method_handler(record, identity, identity) \
            if "Stream" not in details.method and "Generate" != details.method.rsplit("/")[-1] \
            else grpc.unary_stream_rpc_method_handler(record, identity, identity)

    def stop(self):
        self.server.stop(0)


def _serve_requests(mesh: Mesh, n: int, seconds: float, until=None) -> list[str]:
    """n requests spread over `seconds` (past the gateway's 2 s down time, so it redials
    the dead engine's address), or fewer once `until()` holds; the engine each was served by."""
    served = []
    with grpc.insecure_channel(mesh.gateway) as ch:        # the public port: plaintext
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        for i in range(n):
            r = stub.Generate(gateway_request(f"{PROMPT} #{i}", max_tokens=2, temperature=0.0),
                              timeout=60)
            served.append(r.engine_id)
            if until is not None and until():
                break
            time.sleep(seconds / n)
    return served


@pytest.mark.parametrize("service", ["engine-b", "kvstore", "directory"])
@pytest.mark.parametrize("kind", ["plaintext", "foreign CA"])
def test_a_squatter_on_a_dead_services_port_gets_no_prompt_and_no_token(up_mesh, kind, service,
                                                                       tmp_path):
    port = int(up_mesh.endpoints[service].rsplit(":", 1)[1])
    up_mesh.kill(service)
    tls = None if kind == "plaintext" else TestCA("an attacker's CA").issue(tmp_path, "fake")
    squatter = Squatter(port, tls)
    try:
        served = _serve_requests(up_mesh, 12, 10.0)
    finally:
        squatter.stop()
    # every request answered (by the live engine when one is dead: a dead kvstore or
    # directory is a cache miss, never a failed request)
    assert set(served) <= {"engine-a", "engine-b"} and len(served) == 12, served
    if service == "engine-b":
        assert set(served) == {"engine-a"}, served
    assert squatter.calls == [], [c[:2] for c in squatter.calls]
    up_mesh.restart(service)


def test_control_a_server_with_the_runs_certificate_is_dialled(up_mesh):
    """The same squatter holding the run's certificate (as a restarted engine does) gets
    the gateway's calls: the test above would see them if TLS let them through."""
    port = int(up_mesh.endpoints["engine-b"].rsplit(":", 1)[1])
    up_mesh.kill("engine-b")
    squatter = Squatter(port, up_mesh.tls)
    try:     # up to 40 requests over 30 s: on a busy machine gRPC's redial backoff grows
        _serve_requests(up_mesh, 40, 30.0, until=lambda: bool(squatter.calls))
    finally:
        squatter.stop()
    gateway_log = (Path(up_mesh.cfg.log_dir) / "gateway.log")
    assert squatter.calls, ("the gateway never dialled the dead engine's address:\n"
                            + (gateway_log.read_text()[-3000:] if gateway_log.exists() else ""))
    method, meta, _ = squatter.calls[0]
    assert method.startswith("/kvmesh.engine.") and "authorization" in meta
    up_mesh.restart("engine-b")


def test_healthcheck_public_flag_checks_the_gateways_plaintext_port(up_mesh):
    """Compose's gateway healthcheck: with the mesh's TLS files in the environment,
    `--public` dials the public port in plaintext (KVMESH_TLS_PUBLIC=off); an engine's port
    is checked over mutual TLS."""
    import os
    import subprocess
    import sys

    env = {**os.environ, **up_mesh.tls.env(), "KVMESH_TLS_PUBLIC": "off"}

    def health(*args):
        return subprocess.run([sys.executable, "-m", "kvmesh.healthcheck", *args], env=env,
                              timeout=60).returncode

    assert health(up_mesh.gateway, "--public") == 0
    assert health(up_mesh.gateway) == 1                      # TLS to a plaintext port
    assert health(up_mesh.endpoints["engine-a"]) == 0


@pytest.fixture(scope="module")
def plaintext_mesh(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("squatter-plain") / "logs"
    args = build_parser().parse_args(["up", "--plaintext", "--log-dir", str(log_dir)])
    cfg = with_run_tls(replace(mesh_config(args), **FREE_PORTS), args)
    assert not cfg.tls.server_enabled and cfg.service_token
    m = Mesh(cfg).start()
    try:
        yield m
    finally:
        m.stop()


def test_in_plaintext_mode_a_squatter_gets_no_prompt_and_no_token(plaintext_mesh):
    mesh = plaintext_mesh
    port = int(mesh.endpoints["engine-b"].rsplit(":", 1)[1])
    mesh.kill("engine-b")
    squatter = Squatter(port, None)
    try:
        served = _serve_requests(mesh, 12, 10.0)
    finally:
        squatter.stop()
    assert set(served) == {"engine-a"}, served
    # it was dialled (it is plaintext, as the mesh is), and asked only who it is
    assert squatter.calls, "the gateway never dialled the dead engine's address"
    assert {m for m, _, _ in squatter.calls} == {"/kvmesh.engine.v1.EngineService/GetModelInfo"}
    token = mesh.cfg.service_token
    for _, meta, request in squatter.calls:
        assert meta["authorization"].startswith("Kvmesh-Proof ")
        assert token not in repr(meta) and token.encode() not in request
        assert PROMPT.encode() not in request
    mesh.restart("engine-b")
