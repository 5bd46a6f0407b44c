"""Serving under load: Poisson arrivals over the gateway's OpenAI-compatible HTTP API.

Starts a mesh with one engine and default engine flags (kvstore, directory, gateway: what
`kvmesh up` runs), then for each request rate sends --requests streamed `/v1/completions`
(distinct --prompt-tokens-token prompts as token ids, --tokens greedy tokens each, ignore_eos)
at exponentially distributed intervals (seeded), as vLLM's `benchmark_serving` does, and
reports per rate:

    throughput   generated tokens / (last response end - first request sent)
    TTFT         request sent -> first streamed chunk with text, p50 / p99
    ITL          gaps between a stream's chunks, p50 / p99
    latency      request sent -> stream done, p50

Writes bench/out/serving.{json,png}.

    python -m bench.gateway.serving [--rates 1,2,3] [--requests 48]
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.common import OUT, model_vocab, parser, pct, prompts, table
from kvmesh.launch.mesh import Mesh, MeshConfig


async def one(session, url: str, model: str, prompt: list[int], tokens: int, start_at: float
              ) -> dict:
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    sent = time.perf_counter()
    arrivals = []
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                break
            if line.startswith(b"data: "):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    arrivals.append(time.perf_counter())
    return {"sent": sent, "arrivals": arrivals, "end": time.perf_counter()}


async def run_rate(url: str, rate: float, n: int, length: int, tokens: int, vocab: int,
                   seed: int) -> dict:
    import aiohttp

    rng = random.Random(seed)
    batch = prompts(n, length, vocab, seed)
    t0 = time.perf_counter() + 0.2
    at, starts = t0, []
    for _ in range(n):
        starts.append(at)
        at += rng.expovariate(rate)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(url.replace("/completions", "/models")) as resp:
            model = (await resp.json())["data"][0]["id"]
        done = 0

        async def tracked(p, s):
            nonlocal done
            r = await one(session, url, model, p, tokens, s)
            done += 1
            print(f"  rate {rate}/s: {done}/{n} done", end="\r", flush=True)
            return r

        runs = await asyncio.gather(*(tracked(p, s) for p, s in zip(batch, starts, strict=True)))
    print()
    first = min(r["sent"] for r in runs)
    last = max(r["end"] for r in runs)
    ttft = [r["arrivals"][0] - r["sent"] for r in runs if r["arrivals"]]
    itl = [b - a for r in runs for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    lat = [r["end"] - r["sent"] for r in runs]
    return {"rate": rate, "requests": n, "seconds": last - first,
            "tok_s": n * tokens / (last - first),
            "ttft_p50_ms": 1e3 * pct(ttft, 0.5), "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
            "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99),
            "latency_p50_s": pct(lat, 0.5)}


def main() -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1,2,3", help="requests per second, comma-separated")
    p.add_argument("--requests", type=int, default=48, help="requests per rate")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of the mesh's processes (kvmesh up's: 1)")
    p.add_argument("--engine-flags", default="", help="extra `engine serve` flags")
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    cfg = MeshConfig(engines=1, log_dir=Path(tempfile.mkdtemp(prefix="kvmesh-serving-")),
                     engine_extra=tuple(args.engine_flags.split()),
                     env={"OMP_NUM_THREADS": str(args.threads)})
    vocab = model_vocab([])
    results = []
    with Mesh(cfg) as mesh:
        url = mesh.endpoints["gateway-http"] + "/v1/completions"
        asyncio.run(run_rate(url, 1.0, 2, args.prompt_tokens, 4, vocab, 999))     # warm-up
        for k, rate in enumerate(rates):
            results.append(asyncio.run(run_rate(url, rate, args.requests, args.prompt_tokens,
                                                args.tokens, vocab, seed=k + 1)))
    print(table(["rate req/s", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                 "latency p50 s"],
                [[r["rate"], round(r["tok_s"], 1), round(r["ttft_p50_ms"]),
                  round(r["ttft_p99_ms"]), round(r["itl_p50_ms"], 1), round(r["itl_p99_ms"], 1),
                  round(r["latency_p50_s"], 2)] for r in results]))
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {k: getattr(args, k) for k in ("requests", "prompt_tokens", "tokens", "threads",
                                          "engine_flags")}
    (OUT / "serving.json").write_text(json.dumps({"args": meta, "results": results}, indent=1))
    plot(results, OUT / "serving.png", args)
    print(f"wrote {OUT / 'serving.json'} and serving.png", flush=True)
    return 0


def plot(results: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    left.plot(rates, [r["tok_s"] for r in results], "o-")
    left.set(xlabel="request rate (req/s, Poisson)", ylabel="generated tokens/s",
             title="throughput")
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"),
                       ("itl_p50_ms", "ITL p50"), ("itl_p99_ms", "ITL p99")):
        right.plot(rates, [r[key] for r in results], "o-", label=label)
    right.set(xlabel="request rate (req/s, Poisson)", ylabel="ms", yscale="log",
              title="latency")
    right.legend()
    fig.suptitle(f"{args.requests} requests a rate, {args.prompt_tokens}-token prompts, "
                 f"{args.tokens} tokens each, over the HTTP API")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")     # this client process: one thread
    sys.exit(main())
