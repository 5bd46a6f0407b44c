"""GatewayService servicer (thin: proto <-> domain, errors -> status) and `serve()`.

Cancellation: when the client cancels or its deadline passes, grpc cancels the
handler task; the CancelledError unwinds through `GatewayRequest`, whose
engine stream cancels the engine call. The remaining deadline is passed to the
engine call as its timeout.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
from collections.abc import Coroutine

import grpc

from kvmesh.auth import metadata_value
from kvmesh.errors import KvmeshError, TooLarge
from kvmesh.generation import finish_to_proto, sampling_controls, traffic_class_name
from kvmesh.metrics import serve_metrics
from kvmesh.proto import common_pb2
from kvmesh.proto import gateway_pb2 as pb
from kvmesh.proto import gateway_pb2_grpc as pb_grpc
from kvmesh.rpc import Server, shutdown_signal
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.core import GatewayCore
from kvmesh.services.gateway.model import GenRequest, status_name
from kvmesh.tls import TlsFiles

log = logging.getLogger("kvmesh.gateway")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GatewayService"].full_name


def request_from_proto(msg: pb.GenerateRequest, max_bytes: int) -> GenRequest:
    size = msg.ByteSize()
    if size > max_bytes:
        raise TooLarge(f"request is {size} bytes; the limit is {max_bytes}")
    s = msg.sampling
    which = msg.WhichOneof("prompt_input")
    return GenRequest(
        request_id=msg.request_id,
        prompt=msg.prompt if which != "prompt_token_ids" else None,
        prompt_token_ids=tuple(msg.prompt_token_ids.ids) if which == "prompt_token_ids" else None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        seed=s.seed if s.HasField("seed") else None,
        speculative=s.speculative if s.HasField("speculative") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
        # An unknown enum number maps to a name validation rejects with the number in it.
        traffic_class=traffic_class_name(msg.traffic_class),
        cache_salt=msg.cache_salt, ignore_eos=msg.ignore_eos,
        **sampling_controls(s),
    )


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException):
    name = status_name(exc)
    if name == "INTERNAL" and not isinstance(exc, KvmeshError):
        log.exception("internal error in gateway handler")
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
    await context.abort(grpc.StatusCode[name], str(exc))


class GatewayServicer(pb_grpc.GatewayServiceServicer):
    def __init__(self, core: GatewayCore):
        self.core = core

    def _open(self, request, context, method: str):
        t0 = time.monotonic()
        try:
            principal = None
            if self.core.keys is not None:  # auth off: no metadata scan on the hot path
                principal = self.core.authenticate(
                    metadata_value(context.invocation_metadata(), "authorization"))
            req = request_from_proto(request, self.core.cfg.max_request_bytes)
        except KvmeshError as exc:  # refused before the core saw it: counted and logged
            self.core.refused(method, exc, time.monotonic() - t0)
            raise
        return self.core.open(req, context.time_remaining(), method, principal)

    async def GenerateStream(self, request, context):
        try:
            gr = self._open(request, context, "stream")
            async for c in gr:
                msg = pb.GenerateStreamResponse(request_id=gr.req.request_id,
                                                token_ids=c.token_ids, text=c.text,
                                                logprobs=[lp.to_proto() for lp in c.logprobs])
                if c.finish is not None:
                    msg.finish_reason = finish_to_proto(c.finish)
                    msg.usage.CopyFrom(common_pb2.Usage(**c.usage._asdict()))
                    msg.engine_id = gr.engine_id
                    msg.migrations = gr.migrations
                yield msg
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, INTERNAL if unknown
            await _abort(context, exc)

    async def Generate(self, request, context):
        try:
            gr = self._open(request, context, "unary")
            out = pb.GenerateResponse()
            async for c in gr:
                out.token_ids.extend(c.token_ids)
                out.text += c.text
                out.logprobs.extend(lp.to_proto() for lp in c.logprobs)
                if c.finish is not None:
                    out.finish_reason = finish_to_proto(c.finish)
                    out.usage.CopyFrom(common_pb2.Usage(**c.usage._asdict()))
            out.request_id, out.engine_id, out.attempts = gr.req.request_id, gr.engine_id, gr.attempts
            out.migrations = gr.migrations
            return out
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, INTERNAL if unknown
            await _abort(context, exc)


async def start_gateway(cfg: GatewayConfig, directory=None) -> tuple[Server, GatewayCore]:
    core = GatewayCore(cfg, directory=directory)
    server = Server(cfg.address, [SERVICE_NAME], service_token="", admin_token="",
                    tls=TlsFiles.public_from_env())
    pb_grpc.add_GatewayServiceServicer_to_server(GatewayServicer(core), server.server)
    await core.start()
    await server.start()
    return server, core


def loop_name(choice: str) -> str:
    """The event loop `run` uses for a config's `event_loop` ("auto" resolved)."""
    if choice == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return choice


def run(main: Coroutine, event_loop: str = "asyncio"):
    """asyncio.run on the configured event loop; uvloop must be importable when asked for."""
    if loop_name(event_loop) == "uvloop":
        try:
            import uvloop
        except ImportError:
            main.close()
            raise ValueError("event_loop uvloop: the uvloop package is not installed") from None
        return uvloop.run(main)
    return asyncio.run(main)


async def serve(cfg: GatewayConfig) -> None:
    """Run until SIGTERM/SIGINT, then drain: NOT_SERVING, in-flight calls get 5 s."""
    directory = None
    if cfg.directory:
        from kvmesh.directory_client import DirectoryClient

        directory = DirectoryClient(cfg.directory)
    metrics = serve_metrics(cfg.metrics_port, cfg.host) if cfg.metrics_port >= 0 else None
    server, core = await start_gateway(cfg, directory)
    http = None
    if cfg.http_port >= 0:
        from kvmesh.services.gateway.openai_api.server import HttpServer

        http = HttpServer(core, cfg.host, cfg.http_port, tls=TlsFiles.public_from_env())
        try:
            await http.start()
        except OSError:  # port taken: stop what started; the CLI prints why and exits 2
            await server.stop(grace=0)
            await core.close()
            raise
    log.info("gateway listening on %s:%d (engines %s, directory %s, metrics %s, HTTP API %s, "
             "loop %s)", cfg.host, server.port, cfg.engines or "-", cfg.directory or "-",
             metrics or "off", http.port if http else "off",
             type(asyncio.get_running_loop()).__module__)
    stop = shutdown_signal()
    await stop.wait()
    log.info("gateway shutting down")
    if http is not None:
        await http.stop()
    await server.stop(grace=5.0)
    await core.close()
