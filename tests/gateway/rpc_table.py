"""Every service and method of the mesh, read from the generated proto descriptors, and a
raw call to any of them: tables of tests over all RPCs (bad input, auth) are built from
this, so a new service, method or field is covered without editing the tests."""

from __future__ import annotations

import importlib
import pkgutil

import grpc

import kvmesh.proto


def services():
    for info in pkgutil.iter_modules(kvmesh.proto.__path__):
        if info.name.endswith("_pb2"):
            mod = importlib.import_module(f"kvmesh.proto.{info.name}")
            yield from mod.DESCRIPTOR.services_by_name.values()


def address(mesh, svc) -> str:
    """Where a service of `mesh` listens (KeyError for a service the mesh does not run)."""
    package = svc.full_name.rsplit(".", 1)[0]
    return {"kvmesh.gateway.v1": mesh.gateway,
            "kvmesh.engine.v1": mesh.endpoints[mesh.engine_names[0]],
            "kvmesh.directory.v1": mesh.endpoints["directory"],
            "kvmesh.kvstore.v1": mesh.endpoints["kvstore"]}[package]


def raw_call(channels: dict, mesh, svc, method, payload: bytes, metadata=None):
    """Send one serialized request message to `method`, drain a streamed answer; raises
    grpc.RpcError. `channels` caches one channel per address."""
    where = address(mesh, svc)
    ch = channels.setdefault(where, grpc.insecure_channel(where))
    kinds = {(False, False): ch.unary_unary, (False, True): ch.unary_stream,
             (True, False): ch.stream_unary, (True, True): ch.stream_stream}
    call = kinds[(method.client_streaming, method.server_streaming)](
        f"/{svc.full_name}/{method.name}")
    out = call(iter([payload]) if method.client_streaming else payload, timeout=20,
               metadata=metadata)
    if method.server_streaming:
        list(out)
