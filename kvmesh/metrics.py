"""Prometheus metrics shared by every service (gateway, engine, kvstore, directory).

Metric families are defined once per process (module level) and labelled by
`service`, so two cores in one test process never register twice.

    serve_metrics(port)                start /metrics on a port (0 = free port); returns it
    RequestMetrics(service)            per-request: status counts, latency, TTFT, tokens
                                       (the engine counts its tokens in EngineServicer.events,
                                       the one path of Generate calls and Session generations)
    StatsExporter(service, read, counters)
                                       expose a dict of numbers (e.g. engine GetStats) as
                                       kvmesh_<service>_<name>: counters (`_total`) for the
                                       names `counters()` gives, gauges for the rest
    VllmEngineStats(read, model_name)  the same engine numbers under vLLM's names
    GenerationTimes(model_name)        vLLM's TTFT, inter-token and end-to-end histograms, and
                                       each generation's speculative acceptance

For engines: `StatsExporter("engine", lambda: last_stats)` where `last_stats` is the
dict the engine's heartbeat loop refreshes from `Engine.stats()` (slots_in_use,
blocks_in_use, blocks_cached, running, waiting, aborted, ...). For the kvstore:
`StatsExporter("kvstore", lambda: {...bytes_stored, objects, gc_deleted_total...})`
and `RequestMetrics("kvstore")` for its RPCs.
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping

import grpc
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Latency buckets from 1 ms to 60 s: a CPU engine's TTFT is tens of ms, a long
# generation tens of seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, math.inf)

REQUESTS = Counter("kvmesh_requests_total", "Requests finished, by final status",
                   ["service", "method", "status"])
LATENCY = Histogram("kvmesh_request_duration_seconds", "Whole-request latency",
                    ["service", "method"], buckets=LATENCY_BUCKETS)
IN_FLIGHT = Gauge("kvmesh_in_flight_requests", "Requests being served now", ["service"])


@functools.cache
def ttft_histogram() -> Histogram:
    """kvmesh_time_to_first_token_seconds: only services that generate (gateway, engine)
    register it."""
    return Histogram("kvmesh_time_to_first_token_seconds", "Time to the first generated token",
                     ["service", "method"], buckets=LATENCY_BUCKETS)


@functools.cache
def token_counter() -> Counter:
    """kvmesh_tokens_total: only services that generate (gateway, engine) register it."""
    return Counter("kvmesh_tokens_total",
                   "Tokens by kind: prompt, cached (from cache), replayed (bounded replay), "
                   "generated", ["service", "kind"])


@functools.cache
def spec_acceptance() -> Histogram:
    """Per finished generation that drafted: accepted / drafted tokens (an engine's only)."""
    return Histogram("kvmesh_engine_spec_request_acceptance",
                     "Accepted / drafted tokens of each finished generation that drafted",
                     ["model_name"], buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))


@functools.cache
def vllm_phase_histograms() -> tuple[Histogram, Histogram, Histogram, Histogram]:
    """vLLM's phases of a finished generation, from when the engine first scheduled it:
    queue (arrival -> scheduled), prefill (scheduled -> first token), decode (first -> last
    token), inference (scheduled -> last token). Registered on first use: only an engine
    has them."""
    return tuple(Histogram(f"vllm:request_{name}_time_seconds", text, ["model_name"],
                           buckets=LATENCY_BUCKETS)
                 for name, text in (("queue", "Arrival to first scheduled"),
                                    ("prefill", "First scheduled to the first token"),
                                    ("decode", "First token to the last"),
                                    ("inference", "First scheduled to the last token")))


@functools.cache
def request_success() -> Counter:
    """vllm:request_success_total: an engine's finished generations by vLLM's finished_reason
    (stop, length, abort). Registered on first use: only an engine has it."""
    return Counter("vllm:request_success", "Finished generations by why they ended",
                   ["model_name", "finished_reason"])


# kvmesh's finish reasons in vLLM's words; a handoff is not an end (a decode engine goes on)
FINISHED_REASONS = {"stop": "stop", "length": "length", "aborted": "abort"}


@functools.cache
def gateway_counters() -> tuple[Counter, Counter]:
    """The gateway's own families (retries, migrations), registered on first use so that no
    other service's page shows them."""
    return (Counter("kvmesh_retries_total",
                    "Requests moved to another engine before the first token", ["service"]),
            Counter("kvmesh_migrations_total",
                    "Streams continued on another engine after their engine failed mid-stream",
                    ["service"]))




@functools.cache
def vllm_histograms() -> tuple[Histogram, Histogram, Histogram]:
    """vLLM's names for an engine's latencies (TTFT, inter-token, end-to-end), labelled by
    the served model as vLLM's are, so a dashboard built on vLLM's /metrics reads a kvmesh
    engine's unchanged (docs/metrics.md). Registered on first use: only an engine has them."""
    return (Histogram("vllm:time_to_first_token_seconds", "Time to the first generated token",
                      ["model_name"], buckets=LATENCY_BUCKETS),
            Histogram("vllm:inter_token_latency_seconds",
                      "Time between generated tokens (tokens that arrive together share the gap)",
                      ["model_name"], buckets=LATENCY_BUCKETS),
            Histogram("vllm:e2e_request_latency_seconds", "Whole-generation latency",
                      ["model_name"], buckets=LATENCY_BUCKETS))


def serve_metrics(port: int, host: str) -> int:
    """Serve /metrics in a daemon thread; returns the bound port (useful with port 0).
    `host` is the service's gRPC listen address: a service bound to loopback keeps its
    metrics on loopback too (no separate, forgotten wildcard port)."""
    server, _thread = start_http_server(port, addr=host.strip("[]"))
    return server.server_port


class RequestMetrics:
    """Bound children for one service; call `observe` once per finished request."""

    def __init__(self, service: str):
        self.service = service
        self.in_flight = IN_FLIGHT.labels(service)
        generates = service in ("gateway", "engine")
        self._tokens = {k: token_counter().labels(service, k)
                        for k in ("prompt", "cached", "replayed", "generated")
                        } if generates else {}
        self._ttft = ttft_histogram() if generates else None
        if service == "gateway":      # only a gateway moves requests between engines
            retries, migrations = gateway_counters()
            self.retries, self.migrations = retries.labels(service), migrations.labels(service)

    def observe(self, method: str, status: str, total_s: float, ttft_s: float | None = None,
                usage: Mapping[str, int] | None = None) -> None:
        REQUESTS.labels(self.service, method, status).inc()
        LATENCY.labels(self.service, method).observe(total_s)
        if ttft_s is not None and self._ttft is not None:
            self._ttft.labels(self.service, method).observe(ttft_s)
        self.count_tokens(usage or {})

    def count_tokens(self, usage: Mapping[str, int]) -> None:
        """Add to kvmesh_tokens_total by kind (prompt, cached, replayed, generated)."""
        for kind, n in usage.items():
            if n:
                self._tokens[kind].inc(n)


_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


class StatsExporter:
    """Exposes `read()` (name -> number) as `kvmesh_<service>_<name>` at scrape time: a
    counter (`kvmesh_<service>_<name>_total`, so `rate()` works) for each name in
    `counters()`, which only ever grow; a gauge for the rest (levels: slots in use, ...).

    `read` and `counters` run in the HTTP server's thread: give them something cheap and
    thread-safe, such as returning what a service loop stored last.
    """

    def __init__(self, service: str, read: Callable[[], Mapping[str, float]], registry=REGISTRY,
                 counters: Callable[[], Iterable[str]] = lambda: ()):
        self.service = service
        self.read = read
        self.counters = counters
        registry.register(self)

    def collect(self):
        try:
            stats = dict(self.read() or {})
            monotonic = set(self.counters())
        except Exception:  # noqa: BLE001 - a failed read must not break the scrape
            stats, monotonic = {}, set()
        for name, value in sorted(stats.items()):
            metric = f"kvmesh_{self.service}_{_NAME_RE.sub('_', name)}"
            kind = CounterMetricFamily if name in monotonic else GaugeMetricFamily
            yield kind(metric, f"{self.service} stat {name}", value=float(value))


class VllmEngineStats:
    """An engine's GetStats numbers under vLLM's metric names, labelled model_name:

        vllm:num_requests_running / _waiting     running, waiting
        vllm:kv_cache_usage_perc                 blocks_in_use / blocks_total (0..1)
        vllm:prompt_tokens_total                 prompt_tokens
        vllm:generation_tokens_total             generated_tokens
        vllm:prefix_cache_queries_total          prompt_tokens
        vllm:prefix_cache_hits_total             cache_hit_tokens - replayed_tokens (tokens
                                                 whose state was reused, not recomputed)
    """

    def __init__(self, read: Callable[[], Mapping[str, float]], model_name: Callable[[], str],
                 registry=REGISTRY):
        self.read, self.model_name = read, model_name
        registry.register(self)

    def collect(self):
        try:
            s, model = dict(self.read() or {}), self.model_name()
        except Exception:  # noqa: BLE001 - a failed read must not break the scrape
            return
        if not s:
            return
        gauges = {"vllm:num_requests_running": ("Requests running", s.get("running", 0)),
                  "vllm:num_requests_waiting": ("Requests waiting", s.get("waiting", 0)),
                  "vllm:kv_cache_usage_perc": (
                      "Fraction of KV-cache blocks in use",
                      s.get("blocks_in_use", 0) / s["blocks_total"] if s.get("blocks_total") else 0.0)}
        counters = {"vllm:prompt_tokens": ("Prompt tokens", s.get("prompt_tokens", 0)),
                    "vllm:generation_tokens": ("Generated tokens", s.get("generated_tokens", 0)),
                    "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                                  s.get("prompt_tokens", 0)),
                    "vllm:prefix_cache_hits": (
                        "Prompt tokens served from the prefix cache",
                        s.get("cache_hit_tokens", 0) - s.get("replayed_tokens", 0))}
        for kind, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, (doc, value) in table.items():
                family = kind(name, doc, labels=["model_name"])
                family.add_metric([model], float(value))
                yield family


class GenerationTimes:
    """One generation's vLLM latency histograms: `token(n)` as each message of n generated
    tokens leaves, `done()` once at the end. Tokens that arrive together (speculative
    decoding, a handoff's first token) share the gap since the previous message."""

    def __init__(self, model_name: str, clock=time.monotonic):
        self.ttft, self.itl, self.e2e = (h.labels(model_name) for h in vllm_histograms())
        self.acceptance = spec_acceptance().labels(model_name)
        self.model_name = model_name
        self.clock = clock
        self.t0 = self.last = clock()
        self.first = True
        self.first_s = 0.0             # when the first token left
        self.scheduled_s = 0.0         # when the engine first scheduled it (`scheduled`)

    def token(self, n: int) -> None:
        if n <= 0:
            return
        now = self.clock()
        if self.first:               # the first token ends the TTFT; any with it come at once
            self.ttft.observe(now - self.t0)
            n, self.first, self.last, self.first_s = n - 1, False, now, now
        for _ in range(n):
            self.itl.observe((now - self.last) / n)
        self.last = now

    def scheduled(self, at: float) -> None:
        """The engine first scheduled the generation at `at` (the same clock; 0: unknown)."""
        if at and not self.scheduled_s:
            self.scheduled_s = at

    def done(self, drafted: int = 0, accepted: int = 0, finish: str = "") -> None:
        """The generation finished (`finish`: kvmesh's reason, e.g. "stop"); `drafted` /
        `accepted`: its speculative tokens."""
        end = self.clock()
        self.e2e.observe(end - self.t0)
        if self.scheduled_s and self.first_s:
            queue, prefill, decode, inference = (h.labels(self.model_name)
                                                 for h in vllm_phase_histograms())
            queue.observe(max(0.0, self.scheduled_s - self.t0))
            prefill.observe(max(0.0, self.first_s - self.scheduled_s))
            decode.observe(end - self.first_s)
            inference.observe(max(0.0, end - self.scheduled_s))
        if drafted:
            self.acceptance.observe(accepted / drafted)
        if finish in FINISHED_REASONS:
            request_success().labels(self.model_name, FINISHED_REASONS[finish]).inc()


class RpcMetrics(grpc.aio.ServerInterceptor):
    """Server interceptor: every RPC of a service counted by method and final status, with
    its latency (and, for server streams, the time to the first message as TTFT).

    Methods in `skip` are left alone: they carry many requests per call and record each
    of them themselves (the engine's Session stream counts its generations as Generate)."""

    def __init__(self, service: str, skip: tuple[str, ...] = ()):
        self.metrics = RequestMetrics(service)
        self.skip = frozenset(skip)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        if method in self.skip:
            return handler
        m = self.metrics
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)

        def status(context, exc):
            code = context.code() if hasattr(context, "code") else None
            if code is not None and code != grpc.StatusCode.OK:
                return code.name
            return "OK" if exc is None else ("CANCELLED" if isinstance(exc, asyncio.CancelledError)
                                             else "UNKNOWN")

        def unary(fn):
            async def wrapped(request, context):
                t0, exc = time.perf_counter(), None
                m.in_flight.inc()
                try:
                    return await fn(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    m.in_flight.dec()
                    m.observe(method, status(context, exc), time.perf_counter() - t0)
            return wrapped

        def streaming(fn):
            async def wrapped(request, context):
                t0, first, exc = time.perf_counter(), None, None
                m.in_flight.inc()
                try:
                    async for item in fn(request, context):
                        if first is None:
                            first = time.perf_counter() - t0
                        yield item
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    m.in_flight.dec()
                    m.observe(method, status(context, exc), time.perf_counter() - t0, first)
            return wrapped

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kw)
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kw)
