"""`python -m kvmesh.healthcheck HOST:PORT`: exit 0 when the gRPC health check says SERVING.

For container health checks (docker-compose.yml): no grpcurl in the image needed.
"""

from __future__ import annotations

import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.tls import TlsFiles


def sync_channel(address: str, tls: TlsFiles | None = None) -> grpc.Channel:
    """A blocking channel, TLS as `kvmesh.rpc.channel` decides it ($KVMESH_TLS_*)."""
    tls = TlsFiles.from_env() if tls is None else tls
    if tls.client_enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), tls.channel_options())
    return grpc.insecure_channel(address)


def check(address: str, timeout: float = 2.0, tls: TlsFiles | None = None) -> bool:
    with sync_channel(address, tls) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=timeout)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def wait_healthy(address: str, timeout: float = 60.0, proc=None) -> float:
    """Seconds until `address` is SERVING; raises if `proc` (a ManagedProcess) dies first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check(address, timeout=0.5):
            return time.monotonic() - t0
        if proc is not None and not proc.alive:
            raise RuntimeError(f"{proc.name} exited before it became healthy:\n{proc.tail()}")
        time.sleep(0.1)
    raise TimeoutError(f"{address} not healthy after {timeout}s")


if __name__ == "__main__":
    # python -m kvmesh.healthcheck ADDRESS [--public]: --public checks a gateway's public
    # port, plaintext when $KVMESH_TLS_PUBLIC is "off" (kvmesh/tls.py)
    args = sys.argv[1:]
    public = "--public" in args
    addresses = [a for a in args if a != "--public"]
    tls = TlsFiles.public_from_env() if public else None
    sys.exit(0 if len(addresses) == 1 and check(addresses[0], tls=tls) else 1)
