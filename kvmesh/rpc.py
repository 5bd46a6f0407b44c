"""gRPC plumbing shared by every service: server start-up and error mapping.

Every servicer stays thin: it converts messages and calls a transport-free core.
`serve()` adds the stock health servicer (liveness + readiness through the
per-service status) and reflection, so `grpcurl` works against any service.
`map_errors` turns domain errors into status codes; anything else is logged and
reported as INTERNAL (a bug, never the caller's fault). `DecodeGuard` answers a
request that cannot be parsed (bad UTF-8 in a string field, a truncated message)
with INVALID_ARGUMENT on every server, instead of gRPC's bare UNKNOWN. `TokenGuard`
requires the service token (admin RPCs: the admin token) on every internal server when
one is configured; `channel()` sends it (kvmesh/auth.py says which token is which).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal
from collections.abc import Callable, Iterable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvmesh import auth, errors, grpc_logs
from kvmesh.rpc_auth import TokenGuard, token_interceptors
from kvmesh.tls import TlsFiles, health_port_from_env

log = logging.getLogger("kvmesh.rpc")

# Explicit message limits: large payloads (KV blocks, snapshots) stream in chunks
# well below this, so the limit only stops runaway requests.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A peer that restarts must be usable again within about a second: gRPC's default
    # reconnect backoff grows to minutes and would keep failing calls fast meanwhile.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # A peer that hangs (stopped process, host gone without a FIN) keeps its TCP connection
    # open; only HTTP/2 pings notice. While a call is open (a gateway's Session stream to
    # an engine always is) each side pings after 5 s without traffic and drops the
    # connection when a ping (keepalive or grpc's own flow-control probe, whose default
    # timeout is 60 s) goes unanswered for 5 s: the calls on it fail and the gateway
    # retries or reports, instead of waiting. Pings are answered by grpc's C threads, so a
    # busy interpreter does not miss them. Servers accept a ping every 4 s even with no
    # data in between (the default allows one per 5 min and answers more with GOAWAY).
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.ping_timeout_ms", 5000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 4000),
]

_STATUS = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (auth.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (auth.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
]



def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, exc: Exception):
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error in handler")
        await context.abort(code, f"internal error: {type(exc).__name__}: {exc}")
    await context.abort(code, str(exc))


def map_errors(fn: Callable) -> Callable:
    """Decorate an async unary or async-generator servicer method."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def gen_wrapper(self, request, context):
            try:
                async for item in fn(self, request, context):
                    yield item
            except errors.KvmeshError as exc:
                await _abort(context, exc)
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as exc:  # noqa: BLE001 - reported as INTERNAL
                await _abort(context, exc)

        return gen_wrapper

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped or reported as INTERNAL
            await _abort(context, exc)

    return wrapper


class _Undecodable:
    """What a guarded deserializer returns for bytes that are not a valid message."""

    def __init__(self, method: str, exc: Exception):
        self.message = (f"{method}: the request is not a valid protobuf message ({exc}); "
                        "string fields must be valid UTF-8")


async def _reject(context, bad: _Undecodable):
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.message)


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Server interceptor: an undecodable request gets INVALID_ARGUMENT naming the problem.

    gRPC calls the deserializer before any handler code runs and reports its exception
    as UNKNOWN. Here the deserializer returns an `_Undecodable` marker instead, and the
    handler wrapper aborts with INVALID_ARGUMENT when it sees one. For client streams
    the marker is found while the handler reads its request iterator: the iterator
    raises InvalidArgument there, which reaches the stream's end as that status.
    """

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method, deserialize = details.method, handler.request_deserializer

        def guarded(data: bytes):
            try:
                return deserialize(data)
            except (DecodeError, UnicodeDecodeError) as exc:
                return _Undecodable(method, exc)

        kw = dict(request_deserializer=guarded, response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_server_stream(handler.unary_stream),
                                                        **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_client_stream(handler.stream_unary),
                                                        **kw)
        return grpc.stream_stream_rpc_method_handler(_bidi(handler.stream_stream), **kw)


def _unary(fn):
    async def wrapped(request, context):
        if isinstance(request, _Undecodable):
            await _reject(context, request)
        return await fn(request, context)
    return wrapped


def _server_stream(fn):
    if not inspect.isasyncgenfunction(fn):
        return _unary(fn)  # a coroutine that writes with context.write (health's Watch)

    async def wrapped(request, context):
        if isinstance(request, _Undecodable):
            await _reject(context, request)
        async for item in fn(request, context):
            yield item
    return wrapped


async def _checked(requests):
    async for req in requests:
        if isinstance(req, _Undecodable):
            raise errors.InvalidArgument(req.message)
        yield req


def _client_stream(fn):
    async def wrapped(requests, context):
        try:
            return await fn(_checked(requests), context)
        except errors.InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    return wrapped


def _bidi(fn):
    if not inspect.isasyncgenfunction(fn):
        return _client_stream(fn)

    async def wrapped(requests, context):
        try:
            async for item in fn(_checked(requests), context):
                yield item
        except errors.InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    return wrapped


class Server:
    """A grpc.aio server with health and reflection; `start()` then `stop()`."""

    def __init__(self, address: str, service_names: Iterable[str], metrics_service: str = "",
                 options: list | None = None, metrics_skip: tuple[str, ...] = (),
                 service_token: str | None = None, admin_token: str | None = None,
                 tls: TlsFiles | None = None):
        """`service_token`/`admin_token`: None = $KVMESH_SERVICE_TOKEN/$KVMESH_ADMIN_TOKEN;
        '' = no check (the public gateway passes '': its callers hold API keys).
        `tls`: None = $KVMESH_TLS_* (kvmesh/tls.py); with a certificate the port is TLS
        only, with a CA as well clients need a certificate it signed (mutual TLS)."""
        tls = TlsFiles.from_env() if tls is None else tls
        if service_token is None:
            service_token = auth.read_token(auth.SERVICE_TOKEN_ENV)
        if admin_token is None:
            admin_token = auth.read_token(auth.ADMIN_TOKEN_ENV)
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if metrics_service:  # per-RPC status, latency and TTFT on the shared /metrics families
            from kvmesh.metrics import RpcMetrics

            interceptors.append(RpcMetrics(metrics_service, metrics_skip))
        if service_token:  # inside metrics: refused calls are counted
            interceptors.append(TokenGuard(service_token, admin_token))
        interceptors.append(DecodeGuard())  # inside metrics: refused requests are counted
        self.server = grpc.aio.server(options=options or CHANNEL_OPTIONS,
                                      interceptors=interceptors)
        self.health = HealthServicer()
        self.service_names = list(service_names)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = self.service_names + [
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, self.server)
        self.tls = tls.server_enabled
        self.port = (self.server.add_secure_port(address, tls.server_credentials())
                     if tls.server_enabled else self.server.add_insecure_port(address))
        if self.port == 0:
            raise errors.Unavailable(f"cannot bind {address}")
        # a plaintext port serving only health, beside a TLS one (kvmesh/tls.py)
        self.health_server, self.health_port = None, health_port_from_env()
        if self.tls and self.health_port is not None:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            host = address.rpartition(":")[0]
            if self.health_server.add_insecure_port(f"{host}:{self.health_port}") == 0:
                raise errors.Unavailable(f"cannot bind the health port {host}:{self.health_port}")

    async def start(self) -> None:
        grpc_logs.install()       # a reply to a caller that left is not a crash (grpc_logs.py)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        await self.set_serving(True)

    async def set_serving(self, ok: bool) -> None:
        """Readiness: '' (overall) and each named service report SERVING or NOT_SERVING."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ok
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        """Graceful shutdown: report NOT_SERVING, let in-flight calls finish."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def shutdown_signal() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: every server's `serve` waits on it, then stops
    gracefully. Call from inside the running loop, before the server starts."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def channel(address: str, tls: TlsFiles | None = None) -> grpc.aio.Channel:
    """An internal channel; it sends $KVMESH_SERVICE_TOKEN ($KVMESH_ADMIN_TOKEN on admin
    RPCs) when set. Without either it is a plain channel (no interceptor on the hot path).
    TLS (mutual when this process has a certificate) when $KVMESH_TLS_CA or
    $KVMESH_TLS_CERT is set, or `tls` says so."""
    service, admin = auth.read_token(auth.SERVICE_TOKEN_ENV), auth.read_token(auth.ADMIN_TOKEN_ENV)
    interceptors = token_interceptors(service, admin) if service or admin else None
    tls = TlsFiles.from_env() if tls is None else tls
    if tls.client_enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(),
                                       options=CHANNEL_OPTIONS + tls.channel_options(),
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)


# Statuses that mean "fix the request": command-line clients exit 2 on them (the usage-error
# code), 1 on every other failure (unreachable, refused, failed).
BAD_INPUT = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.OUT_OF_RANGE)


def exit_code(exc: grpc.aio.AioRpcError) -> int:
    return 2 if exc.code() in BAD_INPUT else 1


class RpcClient:
    """Base of the typed clients: one channel to `address` and the service's stub on it.
    Use as `async with Client(addr) as c:` or call `close()`."""

    def __init__(self, address: str, stub_class):
        self.address = address
        self.channel = channel(address)
        self.stub = stub_class(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
