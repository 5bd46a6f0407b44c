"""Prefill/decode disaggregation vs unified engines, side by side on the same machine.

Two meshes of two engine processes each (the real `kvmesh up` processes: gateway,
directory, kvstore, valkey, SeaweedFS) serving the shipped DeepSeek V4.1-layout model
(models/deepseek-v41-tiny, or --model DIR), run one after the other with the same workload:

    unified   engine-a, engine-b: both prefill and decode (the 134-row ring)
    pd        engine-a prefills (--role prefill, 396-row ring), engine-b decodes (--role decode)

Workload (through the gateway, streaming, greedy, ignore_eos): `--long` prompts of
`--long-len` (4K) tokens with 4 output tokens, arriving while `--short` requests of 64-token
prompts decode `--short-tokens` tokens each. Every token's arrival time is recorded.

Reported per setup: TTFT p50/p99 of long and short requests, inter-token latency (ITL)
p50/p99 of the short requests' decodes, and for pd the handoff bytes and fetch time per
request (the decode engine's `handoff_fetch_ms` / `handoff_in_bytes` counters). Then one
4K request alone on the pd mesh: its prefill time (TTFT) vs its transfer time.

Targets: transfer time <= 10 % of the 4K prefill; short decodes' ITL p99 under concurrent
long prefills lower with pd than unified.
Usage: python -m bench.engine.pd [--long 4] [--short 6] [--long-len 4096] [--short-tokens 48]
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.common import OUT, parser, pct, plot, table
from kvmesh.launch.mesh import Mesh, MeshConfig
from kvmesh.proto import engine_pb2, engine_pb2_grpc, gateway_pb2_grpc
from kvmesh.services.gateway.client import gateway_request
from kvmesh.shipped import DEFAULT_MODEL


def prompt(n: int, seed: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(256) for _ in range(n)]


def stream(stub, ids: list[int], max_tokens: int, out: list, key: str) -> None:
    """One streamed request; appends (key, [arrival times], usage) to out."""
    t0 = time.perf_counter()
    times, usage = [], None
    req = gateway_request(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for msg in stub.GenerateStream(req, timeout=600):
        now = time.perf_counter() - t0
        times += [now] * len(msg.token_ids)
        if msg.finish_reason:
            usage = msg.usage
    out.append((key, times, usage))


def engine_stats(address: str) -> dict:
    with grpc.insecure_channel(address) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        return dict(stub.GetStats(engine_pb2.GetStatsRequest(), timeout=30).counters)


def run_mix(mesh: Mesh, args, seed: int) -> list:
    out: list = []
    with grpc.insecure_channel(mesh.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        stream(stub, prompt(200, seed), 2, [], "warm")          # model info, sessions
        threads = [threading.Thread(target=stream, args=(
            stub, prompt(64, seed + 100 + i), args.short_tokens, out, "short"))
            for i in range(args.short)]
        for t in threads:
            t.start()
        time.sleep(0.5)                       # the decodes are running when the prefills arrive
        longs = [threading.Thread(target=stream, args=(
            stub, prompt(args.long_len, seed + 200 + i), 4, out, "long"))
            for i in range(args.long)]
        for t in longs:
            t.start()
            time.sleep(0.2)
        for t in threads + longs:
            t.join()
    return out


def summarize(out: list) -> dict:
    short = [t for k, t, _ in out if k == "short"]
    long_ = [t for k, t, _ in out if k == "long"]
    itl = [b - a for t in short for a, b in zip(t, t[1:], strict=False)]
    return {"ttft_long_p50": pct([t[0] for t in long_], 0.5),
            "ttft_long_p99": pct([t[0] for t in long_], 0.99),
            "ttft_short_p50": pct([t[0] for t in short], 0.5),
            "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99), "itl": itl}


def start(pd: bool, tmp: Path, model: str) -> Mesh:
    """A started mesh; a start that fails (SeaweedFS now and then does on a loaded box) is
    tried again in a fresh directory."""
    for attempt in range(3):
        cfg = MeshConfig(engines=2, pd=pd, num_slots=16, num_blocks=512, http_port=-1, model=model,
                         log_dir=tmp / f"{'pd' if pd else 'unified'}-{attempt}" / "logs",
                         engine_extra=("--max-batched-tokens", "512", "--long-prefill-chunk", "256"))
        try:
            return Mesh(cfg).start()
        except RuntimeError as exc:
            if attempt == 2:
                raise
            print(f"mesh start failed ({str(exc).splitlines()[0]}); again", file=sys.stderr)
    raise AssertionError("unreachable")


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--short", type=int, default=6)
    ap.add_argument("--long-len", type=int, default=4096)
    ap.add_argument("--short-tokens", type=int, default=48)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="a DeepSeek V4 / V4.1 checkpoint directory")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-pd-"))
    results, alone = {}, {}
    for name, pd in (("unified", False), ("pd", True)):
        mesh = start(pd, tmp, args.model)
        try:
            ce = mesh.endpoints["engine-b"]
            before = engine_stats(ce)
            results[name] = summarize(run_mix(mesh, args, seed=1))
            after = engine_stats(ce)
            if pd:
                n = after["handoffs_in"] - before["handoffs_in"]
                results[name]["handoffs"] = n
                results[name]["bytes_per_req"] = (after["handoff_in_bytes"] - before["handoff_in_bytes"]) / n
                results[name]["fetch_ms_per_req"] = (after["handoff_fetch_ms"] - before["handoff_fetch_ms"]) / n
                # one 4K request alone: prefill time vs transfer time
                s0 = engine_stats(ce)
                one: list = []
                with grpc.insecure_channel(mesh.gateway) as ch:
                    stream(gateway_pb2_grpc.GatewayServiceStub(ch), prompt(args.long_len, 999), 4,
                           one, "alone")
                s1 = engine_stats(ce)
                alone = {"ttft_s": one[0][1][0], "fetch_ms": s1["handoff_fetch_ms"] - s0["handoff_fetch_ms"],
                         "bytes": s1["handoff_in_bytes"] - s0["handoff_in_bytes"],
                         "usage": str(one[0][2]).replace("\n", " ")}
        finally:
            mesh.stop()
    rows = [[name, r["ttft_long_p50"], r["ttft_long_p99"], r["ttft_short_p50"],
             r["itl_p50"] * 1000, r["itl_p99"] * 1000] for name, r in results.items()]
    print(f"{args.long} x {args.long_len}-token prompts (4 tokens) during {args.short} x 64-token "
          f"prompts decoding {args.short_tokens} tokens; 2 engine processes each, same machine")
    print(table(["setup", "TTFT long p50 s", "TTFT long p99 s", "TTFT short p50 s",
                 "ITL p50 ms", "ITL p99 ms"], rows))
    pdr = results["pd"]
    print(f"\npd handoffs: {pdr['handoffs']:.0f}, {pdr['bytes_per_req'] / 1e6:.2f} MB and "
          f"{pdr['fetch_ms_per_req']:.0f} ms fetch per request (mixed load)")
    ratio = alone["fetch_ms"] / 1000 / alone["ttft_s"]
    print(f"one {args.long_len}-token request alone on pd: TTFT {alone['ttft_s']:.2f} s, transfer "
          f"{alone['fetch_ms']:.0f} ms ({alone['bytes'] / 1e6:.2f} MB) = {ratio * 100:.1f} % of the "
          f"prefill (target <= 10 %)")
    itl_ratio = results["unified"]["itl_p99"] / pdr["itl_p99"]
    print(f"short decodes' ITL p99: unified / pd = {itl_ratio:.2f}x (target > 1)")
    series = {}
    for name, r in results.items():
        xs = sorted(r["itl"])
        series[name] = ([100 * (i + 1) / len(xs) for i in range(len(xs))], [x * 1000 for x in xs])
    path = plot(OUT / "pd_itl.png", "inter-token latency of short decodes under 4K prefills",
                "percentile", "ITL (ms)", series, logx=False, logy=True)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
