"""Wait until a gRPC server reports SERVING on the standard health service."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 1.0) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def wait_healthy(address: str, timeout: float = 60.0, proc=None, service: str = "") -> float:
    """Seconds until healthy; raises if the process dies or time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check(address, service):
            return time.monotonic() - t0
        if proc is not None and not proc.alive:
            raise RuntimeError(f"{proc.name} exited before it became healthy:\n{proc.tail()}")
        time.sleep(0.1)
    raise TimeoutError(f"{address} not healthy after {timeout}s")
