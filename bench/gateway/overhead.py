"""Latency and throughput through the gateway vs calling the engine directly.

Same mesh, same run, same engine (the mesh has one engine so every path hits it):

    direct   client -> engine (EngineService.Generate, streamed)
    gateway  client -> gateway (GatewayService.Generate) -> engine, over the gateway's
             Session stream to the engine (the default)
    calls    client -> a second gateway started with --engine-calls -> engine: the same
             gateway code making one Generate call per request (the plain path; --no-calls
             to skip)
    proxy    client -> empty pass-through gRPC proxy -> engine (reference row, --no-proxy
             to skip): a grpc.aio server in its own process, shaped like the gateway path
             (a unary call in front, the engine's server stream behind), that forwards the
             serialized request as bytes and answers with the engine's last message as
             bytes (the whole answer for the 1-token latency requests): no parsing, no
             routing, no logging. It runs on the gateway's event loop (--event-loop) and
             is the cost of the extra Python gRPC hop alone: the floor for any gateway
             written on grpc.aio.

    1. latency:    N sequential short requests (max_tokens=1), the paths interleaved so
                   drift hits all alike -> p50 / p95 / mean, plus the CPU time the
                   gateway and proxy processes spent per request (from /proc, so it
                   does not depend on how busy the machine is)
    2. throughput: concurrency C, M requests of T tokens each, per path, rounds
                   alternating -> mean req/s, tok/s

Prints a table with the added p50 latency in ms and the ratios, writes
bench/out/gateway_overhead.{png,json}.   Target: <= 1 ms added at p50.

    python -m bench.gateway.overhead [--n 600] [--concurrency 8] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import OUT, cpu_s, parser, pct
from kvmesh.launch.mesh import Mesh, MeshConfig
from kvmesh.services.engine.rpc.client import EngineClient
from kvmesh.services.gateway.client import GatewayClient
from kvmesh.services.gateway.config import EVENT_LOOPS, GatewayConfig
from kvmesh.services.gateway.service import loop_name
from kvmesh.services.gateway.service import run as run_on_loop

PROMPT = "Hi there"
PATHS = ("direct", "gateway", "calls", "proxy")
ENGINE_GENERATE = "/kvmesh.engine.v1.EngineService/Generate"
PROXY_SERVICE = "bench.PassThrough"


# --- reference: an empty pass-through proxy -------------------------------------------
async def _serve_proxy(upstream: str) -> None:
    """Forward EngineService.Generate as raw bytes; prints the bound port, runs until killed."""
    import grpc

    from kvmesh.rpc import CHANNEL_OPTIONS

    same = lambda b: b  # noqa: E731 - no (de)serialization on either side
    ch = grpc.aio.insecure_channel(upstream, options=CHANNEL_OPTIONS)
    call_engine = ch.unary_stream(ENGINE_GENERATE, request_serializer=same,
                                  response_deserializer=same)

    async def generate(request: bytes, context) -> bytes:
        last = b""
        async for msg in call_engine(request, timeout=context.time_remaining()):
            last = msg
        return last

    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        PROXY_SERVICE, {"Generate": grpc.unary_unary_rpc_method_handler(
            generate, request_deserializer=same, response_serializer=same)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


@contextlib.contextmanager
def proxy_process(upstream: str, event_loop: str):
    proc = subprocess.Popen([sys.executable, "-m", "bench.gateway.overhead", "--serve-proxy", upstream,
                             "--event-loop", event_loop], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield proc, f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def calls_gateway(mesh: Mesh, event_loop: str):
    """A second gateway on the same engine and directory, one engine call per request."""
    from kvmesh.healthcheck import wait_healthy
    from kvmesh.launch.backing.proc import ManagedProcess, free_port
    from kvmesh.launch.mesh import KVMESH

    port = free_port()
    proc = ManagedProcess("gateway-calls", [
        *KVMESH, "gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--engines", mesh.endpoints["engine-a"], "--directory", mesh.endpoints["directory"],
        "--engine-calls", "--event-loop", event_loop], Path(mesh.cfg.log_dir),
        env=mesh.cfg.env).start()
    try:
        wait_healthy(f"127.0.0.1:{port}", timeout=60, proc=proc)
        yield proc, f"127.0.0.1:{port}"
    finally:
        proc.stop()


class ProxyClient:
    """Unary calls to the pass-through proxy, engine messages on both sides."""

    def __init__(self, address: str):
        from kvmesh.proto import engine_pb2
        from kvmesh.rpc import channel
        from kvmesh.services.engine.rpc.client import generate_request

        self.channel = channel(address)
        self._request = generate_request
        self._call = self.channel.unary_unary(
            f"/{PROXY_SERVICE}/Generate",
            request_serializer=engine_pb2.GenerateRequest.SerializeToString,
            response_deserializer=engine_pb2.GenerateResponse.FromString)

    async def generate(self, prompt, timeout: float | None = None, **kw):
        return await self._call(self._request(prompt, **kw), timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()


async def one(path, client, max_tokens: int) -> float:
    t0 = time.perf_counter()
    if path != "direct":
        await client.generate(PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    else:
        await client.complete(PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return time.perf_counter() - t0


async def latency(clients, n: int, pids: dict[str, int]
                  ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Interleaved sequential requests; also CPU ms per request of the in-between processes.

    Each round sends one request per path in a shuffled order (seeded): whatever a request
    leaves behind (a gateway's deferred log line, engine bookkeeping) lands on each path
    equally often instead of always on the path that follows it in a fixed order."""
    out = {p: [] for p in clients}
    for p, c in clients.items():  # warm-up: channels connected, code paths hot
        for _ in range(10):
            await one(p, c, 1)
    rng = random.Random(0)
    order = list(clients)
    cpu0 = {p: cpu_s(pid) for p, pid in pids.items()}
    for i in range(n):
        rng.shuffle(order)
        for p in order:
            out[p].append(await one(p, clients[p], 1))
        if (i + 1) % 100 == 0 or i + 1 == n:
            print(f"latency: {i + 1}/{n} rounds of {len(clients)} requests", file=sys.stderr,
                  flush=True)
    cpu = {p: 1e3 * (cpu_s(pid) - cpu0[p]) / n for p, pid in pids.items()}
    return out, cpu


async def throughput(path, client, concurrency: int, requests: int, tokens: int):
    queue = list(range(requests))

    async def worker():
        while queue:
            queue.pop()
            await one(path, client, tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    dt = time.perf_counter() - t0
    return requests / dt, requests * tokens / dt


async def run(mesh: Mesh, args, proxy: str | None, calls: str | None,
              pids: dict[str, int]) -> dict:
    clients = {"direct": EngineClient(mesh.endpoints["engine-a"]),
               "gateway": GatewayClient(mesh.gateway)}
    if calls:
        clients["calls"] = GatewayClient(calls)
    if proxy:
        clients["proxy"] = ProxyClient(proxy)
    try:
        lat, cpu = await latency(clients, args.n, pids)
        # One unmeasured round warms the batch shapes; then rounds alternate direct/gateway
        # so machine drift hits both paths alike.
        for p, c in clients.items():
            await throughput(p, c, args.concurrency, args.concurrency, args.tokens)
        rounds = {p: [] for p in clients}
        for _ in range(args.rounds):
            for p, c in clients.items():
                rounds[p].append(await throughput(p, c, args.concurrency, args.requests,
                                                  args.tokens))
        thr = {p: tuple(statistics.fmean(x) for x in zip(*r, strict=True))
               for p, r in rounds.items()}
    finally:
        for c in clients.values():
            await c.close()
    res = {p: dict(p50_ms=1e3 * pct(v, 0.5), p95_ms=1e3 * pct(v, 0.95),
                   mean_ms=1e3 * statistics.fmean(v), req_s=thr[p][0], tok_s=thr[p][1],
                   cpu_ms_per_req=cpu.get(p))
           for p, v in lat.items()}
    res["added_p50_ms"] = res["gateway"]["p50_ms"] - res["direct"]["p50_ms"]
    # Requests were interleaved, so pairs share the machine's state at that moment: the
    # median paired difference is the steadier estimate on a busy machine.
    res["paired_median_added_ms"] = 1e3 * statistics.median(
        g - d for g, d in zip(lat["gateway"], lat["direct"], strict=True))
    for p in ("calls", "proxy"):
        if p in lat:
            res[f"{p}_added_p50_ms"] = res[p]["p50_ms"] - res["direct"]["p50_ms"]
            res[f"{p}_paired_median_added_ms"] = 1e3 * statistics.median(
                x - d for x, d in zip(lat[p], lat["direct"], strict=True))
    res["added_p95_ms"] = res["gateway"]["p95_ms"] - res["direct"]["p95_ms"]
    res["p50_ratio"] = res["gateway"]["p50_ms"] / res["direct"]["p50_ms"]
    res["throughput_ratio"] = res["gateway"]["req_s"] / res["direct"]["req_s"]
    res["settings"] = vars(args)
    res["samples_ms"] = {p: [1e3 * x for x in v] for p, v in lat.items()}
    return res


def report(res: dict) -> None:
    print(f"\n{'path':<9}{'p50 ms':>9}{'p95 ms':>9}{'mean ms':>9}{'req/s':>9}{'tok/s':>9}"
          f"{'paired':>9}{'cpu ms':>9}")
    paired = {"gateway": res["paired_median_added_ms"],
              "calls": res.get("calls_paired_median_added_ms"),
              "proxy": res.get("proxy_paired_median_added_ms")}
    for p in (p for p in PATHS if p in res):
        r = res[p]
        extra = "" if paired.get(p) is None else f"{paired[p]:+9.2f}"
        cpu = "" if r.get("cpu_ms_per_req") is None else f"{r['cpu_ms_per_req']:9.2f}"
        print(f"{p:<9}{r['p50_ms']:9.2f}{r['p95_ms']:9.2f}{r['mean_ms']:9.2f}"
              f"{r['req_s']:9.1f}{r['tok_s']:9.1f}{extra or ' ' * 9}{cpu}")
    print("(paired: median of per-pair differences to direct; cpu: CPU time of the gateway "
          "or proxy process per sequential request; gateway = Session stream to the engine, "
          "calls = one engine call per request)")
    s = res["settings"]
    print(f"\nadded latency: p50 {res['added_p50_ms']:+.2f} ms, p95 {res['added_p95_ms']:+.2f} ms "
          f"(p50 ratio {res['p50_ratio']:.2f}x; target <= 1 ms at p50: "
          f"{'met' if res['added_p50_ms'] <= 1.0 else 'NOT met'})")
    print(f"median paired difference (interleaved requests): "
          f"{res['paired_median_added_ms']:+.2f} ms (target <= 1 ms: "
          f"{'met' if res['paired_median_added_ms'] <= 1.0 else 'NOT met'}; steadier than the "
          "p50 difference when the engine's latency is bimodal)")
    if "calls" in res:
        print(f"plain path, a gateway making one engine call per request (--engine-calls): "
              f"p50 {res['calls_added_p50_ms']:+.2f} ms, paired "
              f"{res['calls_paired_median_added_ms']:+.2f} ms")
    if "proxy" in res:
        print(f"reference, empty pass-through gRPC proxy: p50 {res['proxy_added_p50_ms']:+.2f} ms,"
              f" paired {res['proxy_paired_median_added_ms']:+.2f} ms; gateway minus proxy "
              f"(paired): {res['paired_median_added_ms'] - res['proxy_paired_median_added_ms']:+.2f}"
              " ms")
    print(f"throughput at concurrency {s['concurrency']} ({s['tokens']} tokens/request): "
          f"gateway/direct = {res['throughput_ratio']:.2f}x; gateway event loop: "
          f"{res['event_loop']}")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for p, color in (("direct", "tab:blue"), ("gateway", "tab:orange")):
        a.hist(res["samples_ms"][p], bins=60, alpha=0.6, color=color,
               label=f"{p} p50 {res[p]['p50_ms']:.2f} ms")
    a.set(xlabel="request latency (ms), max_tokens=1", ylabel="requests",
          title=f"sequential: +{res['added_p50_ms']:.2f} ms at p50")
    if "calls" in res:
        a.hist(res["samples_ms"]["calls"], bins=60, alpha=0.4, color="tab:green",
               label=f"gateway, call per request p50 {res['calls']['p50_ms']:.2f} ms")
    if "proxy" in res:
        a.hist(res["samples_ms"]["proxy"], bins=60, alpha=0.4, color="tab:gray",
               label=f"proxy (reference) p50 {res['proxy']['p50_ms']:.2f} ms")
    a.legend()
    paths = [p for p in PATHS if p in res]
    colors = {"direct": "tab:blue", "gateway": "tab:orange", "calls": "tab:green",
              "proxy": "tab:gray"}
    b.bar(paths, [res[p]["req_s"] for p in paths], color=[colors[p] for p in paths])
    b.set(ylabel="requests/s", title=f"concurrency {res['settings']['concurrency']}: "
          f"{res['throughput_ratio']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=600, help="sequential requests per path")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64, help="requests per path at concurrency")
    ap.add_argument("--tokens", type=int, default=8, help="max_tokens in the throughput phase")
    ap.add_argument("--rounds", type=int, default=2, help="throughput rounds per path")
    ap.add_argument("--no-proxy", dest="proxy", action="store_false",
                    help="skip the pass-through proxy reference row")
    ap.add_argument("--no-calls", dest="calls", action="store_false",
                    help="skip the gateway with one engine call per request")
    ap.add_argument("--event-loop", choices=EVENT_LOOPS, default=GatewayConfig().event_loop,
                    help="gateway (and proxy) event loop, as KVMESH_GATEWAY_EVENT_LOOP")
    ap.add_argument("--serve-proxy", metavar="UPSTREAM", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_proxy:
        run_on_loop(_serve_proxy(args.serve_proxy), args.event_loop)
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    cfg = MeshConfig(engines=1, num_slots=8, num_blocks=128,
                     log_dir=Path(tempfile.mkdtemp(prefix="kvmesh-bench-")),
                     env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                          "KVMESH_GATEWAY_EVENT_LOOP": args.event_loop})
    with Mesh(cfg) as mesh, contextlib.ExitStack() as stack:
        pids, proxy, calls = {"gateway": mesh.pid("gateway")}, None, None
        if args.calls:
            proc, calls = stack.enter_context(calls_gateway(mesh, args.event_loop))
            pids["calls"] = proc.proc.pid
        if args.proxy:
            proc, proxy = stack.enter_context(proxy_process(mesh.endpoints["engine-a"],
                                                            args.event_loop))
            pids["proxy"] = proc.pid
        res = asyncio.run(run(mesh, args, proxy, calls, pids))
    res["event_loop"] = loop_name(args.event_loop)
    report(res)
    (OUT / "gateway_overhead.json").write_text(json.dumps(
        {k: v for k, v in res.items() if k != "samples_ms"}, indent=2))
    plot(res, OUT / "gateway_overhead.png")
    print(f"wrote {OUT / 'gateway_overhead.png'} and gateway_overhead.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
