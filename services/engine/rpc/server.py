"""Run one engine as a gRPC server until SIGINT/SIGTERM, then shut down gracefully."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kvmesh.proto import engine_pb2, engine_pb2_grpc
from kvmesh.rpc import Server, shutdown_signal
from kvmesh.services.engine.core.async_engine import AsyncEngine
from kvmesh.services.engine.rpc.service import EngineServicer

if TYPE_CHECKING:
    from kvmesh.services.engine.core.engine import Engine

log = logging.getLogger("kvmesh.engine")
SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


async def serve(core: Engine, address: str, engine_id: str = "", advertise: str = "",
                directory: str = "", kvstore: str = "", fetch_mode: str = "auto",
                fetch_deadline_s: float = 1.0, metrics_port: int | None = None) -> None:
    engine = AsyncEngine(core)
    stats_task = None
    if metrics_port is not None:
        stats_task = asyncio.create_task(_export_stats(engine, metrics_port,
                                                       address.rpartition(":")[0]))
    # A Session carries many generations and counts each one itself (as Generate).
    server = Server(address, [SERVICE_NAME], metrics_service="engine", metrics_skip=("Session",))
    remote = await _remote(engine, server.port, engine_id, advertise or address, directory,
                           kvstore, fetch_mode, fetch_deadline_s)
    servicer = EngineServicer(engine, remote, engine_id or f"engine-{server.port}")
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server.server)
    await server.start()
    if remote is not None:
        await remote.start()
    log.info("engine %s serving on port %d (preset %s, directory %s, kvstore %s)", engine_id,
             server.port, core.cfg.name, directory or "-", kvstore or "-")
    stop = shutdown_signal()
    await stop.wait()
    log.info("engine shutting down")
    servicer.sessions.drain()  # open sessions stop taking generations (gateways retry elsewhere)
    await server.stop(grace=5.0)
    if remote is not None:
        await remote.stop()
    if stats_task is not None:
        stats_task.cancel()
    engine.shutdown()


async def _export_stats(engine: AsyncEngine, port: int, host: str, every_s: float = 1.0
                        ) -> None:
    """/metrics: engine counters (slots, blocks, cache hits, ...) refreshed once a second
    on the event loop, so a scrape never touches the engine thread."""
    from kvmesh.metrics import (
        FINISHED_REASONS,
        StatsExporter,
        VllmEngineStats,
        request_success,
        serve_metrics,
        spec_acceptance,
        vllm_histograms,
        vllm_phase_histograms,
    )

    latest: dict[str, float] = {}
    counters: frozenset[str] = frozenset()
    model = engine.core.cfg.name
    StatsExporter("engine", lambda: latest, counters=lambda: counters)
    VllmEngineStats(lambda: latest, lambda: model)
    for histogram in (*vllm_histograms(), *vllm_phase_histograms(), spec_acceptance()):
        histogram.labels(model)       # on the page from the start (zero counts), as vLLM's are
    for reason in sorted(set(FINISHED_REASONS.values())):
        request_success().labels(model, reason)
    bound = serve_metrics(port, host)  # the gRPC host: loopback stays loopback
    log.info("engine metrics on port %d", bound)
    while True:
        latest, counters = await engine.call(lambda core: (core.stats(), counter_names(core)))
        await asyncio.sleep(every_s)


def counter_names(core) -> frozenset[str]:
    """The stats that only grow (exported as counters): the engine's event counters (its own,
    and those the remote tiers add) and speculative decoding's."""
    spec = core.spec
    return frozenset(core.counters) | frozenset(spec.counters) | frozenset(spec.policy.counters)


async def _remote(engine, port, engine_id, advertise, directory, kvstore, fetch_mode, deadline):
    if not directory and not kvstore:
        return None
    from kvmesh.services.engine.rpc.fetch_policy import FetchPolicy
    from kvmesh.services.engine.rpc.remote import RemoteTiers

    host = advertise.rsplit(":", 1)[0]
    address = f"{host}:{port}" if advertise.endswith(":0") else advertise
    dir_client = kv_client = None
    if directory:
        from kvmesh.directory_client import DirectoryClient

        dir_client = DirectoryClient(directory)
    if kvstore:
        from kvmesh.services.kvstore.client import connect

        kv_client = connect(kvstore)  # "a,b": replicas sharing one index, spread by key
    return RemoteTiers(engine, engine_id or f"engine-{port}", address, dir_client, kv_client,
                       FetchPolicy(fetch_mode), fetch_deadline_s=deadline)
