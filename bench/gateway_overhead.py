"""Latency and throughput through the gateway vs calling the engine directly.

Same mesh, same run, same engine (the mesh has one engine so both paths hit it):

    1. latency:    N sequential short requests (max_tokens=1), gateway and direct
                   interleaved so drift hits both alike -> p50 / p95 / mean
    2. throughput: concurrency C, M requests of T tokens each, per path, rounds
                   alternating -> mean req/s, tok/s

Prints a table with the added p50 latency in ms and the ratios, writes
bench/out/gateway_overhead.{png,json}.   Target: <= 1 ms added at p50.

    .venv/bin/python bench/gateway_overhead.py [--n 300] [--concurrency 8] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvmesh.mesh_runner import Mesh, MeshConfig  # noqa: E402
from services.engine.client import EngineClient  # noqa: E402
from services.gateway.client import GatewayClient  # noqa: E402

OUT = ROOT / "bench" / "out"
PROMPT = "Hi there"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one(path, client, max_tokens: int) -> float:
    t0 = time.perf_counter()
    if path == "gateway":
        await client.generate(PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    else:
        await client.complete(PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return time.perf_counter() - t0


async def latency(clients, n: int) -> dict[str, list[float]]:
    out = {p: [] for p in clients}
    for p, c in clients.items():  # warm-up: channels connected, code paths hot
        for _ in range(10):
            await one(p, c, 1)
    for _ in range(n):
        for p, c in clients.items():
            out[p].append(await one(p, c, 1))
    return out


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


async def run(mesh: Mesh, args) -> dict:
    clients = {"direct": EngineClient(mesh.endpoints["engine-a"]),
               "gateway": GatewayClient(mesh.gateway)}
    try:
        lat = await latency(clients, args.n)
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
                   mean_ms=1e3 * statistics.fmean(v), req_s=thr[p][0], tok_s=thr[p][1])
           for p, v in lat.items()}
    res["added_p50_ms"] = res["gateway"]["p50_ms"] - res["direct"]["p50_ms"]
    # Requests were interleaved, so pairs share the machine's state at that moment: the
    # median paired difference is the steadier estimate on a busy machine.
    res["paired_median_added_ms"] = 1e3 * statistics.median(
        g - d for g, d in zip(lat["gateway"], lat["direct"], strict=True))
    res["added_p95_ms"] = res["gateway"]["p95_ms"] - res["direct"]["p95_ms"]
    res["p50_ratio"] = res["gateway"]["p50_ms"] / res["direct"]["p50_ms"]
    res["throughput_ratio"] = res["gateway"]["req_s"] / res["direct"]["req_s"]
    res["settings"] = vars(args)
    res["samples_ms"] = {p: [1e3 * x for x in v] for p, v in lat.items()}
    return res


def report(res: dict) -> None:
    print(f"\n{'path':<9}{'p50 ms':>9}{'p95 ms':>9}{'mean ms':>9}{'req/s':>9}{'tok/s':>9}")
    for p in ("direct", "gateway"):
        r = res[p]
        print(f"{p:<9}{r['p50_ms']:9.2f}{r['p95_ms']:9.2f}{r['mean_ms']:9.2f}"
              f"{r['req_s']:9.1f}{r['tok_s']:9.1f}")
    s = res["settings"]
    print(f"\nadded latency: p50 {res['added_p50_ms']:+.2f} ms, p95 {res['added_p95_ms']:+.2f} ms "
          f"(p50 ratio {res['p50_ratio']:.2f}x; target <= 1 ms at p50: "
          f"{'met' if res['added_p50_ms'] <= 1.0 else 'NOT met'})")
    print(f"median paired difference (interleaved requests): "
          f"{res['paired_median_added_ms']:+.2f} ms")
    print(f"throughput at concurrency {s['concurrency']} ({s['tokens']} tokens/request): "
          f"gateway/direct = {res['throughput_ratio']:.2f}x")


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
    a.legend()
    b.bar(["direct", "gateway"], [res["direct"]["req_s"], res["gateway"]["req_s"]],
          color=["tab:blue", "tab:orange"])
    b.set(ylabel="requests/s", title=f"concurrency {res['settings']['concurrency']}: "
          f"{res['throughput_ratio']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="sequential requests per path")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64, help="requests per path at concurrency")
    ap.add_argument("--tokens", type=int, default=8, help="max_tokens in the throughput phase")
    ap.add_argument("--rounds", type=int, default=2, help="throughput rounds per path")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    cfg = MeshConfig(engines=1, num_slots=8, num_blocks=128,
                     log_dir=Path(tempfile.mkdtemp(prefix="kvmesh-bench-")))
    with Mesh(cfg) as mesh:
        res = asyncio.run(run(mesh, args))
    report(res)
    (OUT / "gateway_overhead.json").write_text(json.dumps(
        {k: v for k, v in res.items() if k != "samples_ms"}, indent=2))
    plot(res, OUT / "gateway_overhead.png")
    print(f"wrote {OUT / 'gateway_overhead.png'} and gateway_overhead.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
