"""Soak and load: N concurrent streams through the gateway for M minutes, with faults optional.

    python -m bench.gateway.soak --streams 8 --minutes 30            # starts its own mesh
    python -m bench.gateway.soak --streams 40 --requests 300 --faults  # the fault run (see --help)

Each stream loops over a realistic mix:
    agent    a few long shared system prefixes, multi-turn (each turn appends to the last)
    chatbot  a short shared preamble + a fresh question
and a fraction of requests is cancelled at a random moment (deliberate: not failures).

Reported: requests by status, TTFT and inter-token p50/p99, RSS and open fds per service
sampled over time (growth after warm-up), slots/blocks in use once idle, a table, a JSON
file and a plot under bench/out/. The exit code is 1 if a request that was not cancelled
on purpose failed, if any service's RSS grew more than --rss-limit after warm-up, or if
an engine keeps a slot or a block.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.common import OUT, parser, pct, table
from kvmesh.launch.mesh import Mesh, MeshConfig
from kvmesh.proto import engine_pb2, engine_pb2_grpc, gateway_pb2_grpc
from kvmesh.services.gateway.client import gateway_request

AGENT_PREFIXES = [f"You are agent {i}. Tools: search, read, write, run. " * 12 for i in range(3)]
CHAT_PREAMBLE = "You are a helpful assistant. Answer briefly. "


@dataclass
class Result:
    kind: str
    status: str
    ttft: float | None
    gaps: list[float]
    tokens: int
    deliberate_cancel: bool
    migrations: int = 0


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    started: int = 0              # requests begun: --requests caps these, not the finished ones
    samples: list[dict] = field(default_factory=list)   # {t, name: (rss_mb, fds)}
    snapshot_mb: list[tuple[float, dict]] = field(default_factory=list)  # (t, {engine: MB})
    faults: list[str] = field(default_factory=list)


def pick_request(rng: random.Random, turns: dict[int, str]) -> tuple[str, str, str, int]:
    """(kind, prompt, traffic class, max_tokens)."""
    if rng.random() < 0.5:
        agent = rng.randrange(len(AGENT_PREFIXES))
        history = turns.get(agent, AGENT_PREFIXES[agent])
        history += f" Step {rng.randrange(1000)}: observe, think, act." * rng.randint(1, 4)
        turns[agent] = history if len(history) < 3000 else AGENT_PREFIXES[agent]
        return "agent", history, "agent", rng.randint(16, 48)
    question = " ".join(rng.choice(["why", "how", "what", "cache", "window", "block", "token"])
                        for _ in range(rng.randint(4, 20)))
    return "chatbot", CHAT_PREAMBLE + question + "?", "chatbot", rng.randint(8, 32)


async def one_request(stub, rng, turns, cancel_rate: float, deadline: float) -> Result:
    kind, prompt, cls, max_tokens = pick_request(rng, turns)
    cancel_after = rng.uniform(0.05, 1.5) if rng.random() < cancel_rate else None
    req = gateway_request(prompt, max_tokens=max_tokens, temperature=0.7, traffic_class=cls,
                          ignore_eos=True)
    call = stub.GenerateStream(req, timeout=deadline)
    t0, last, ttft, gaps, tokens, migrations = time.perf_counter(), None, None, [], 0, 0

    async def consume():
        nonlocal last, ttft, tokens, migrations
        async for msg in call:
            now = time.perf_counter()
            if msg.token_ids:
                if ttft is None:
                    ttft = now - t0
                elif last is not None:
                    gaps.append((now - last) / len(msg.token_ids))
                last = now
                tokens += len(msg.token_ids)
            migrations = max(migrations, msg.migrations)

    task = asyncio.create_task(consume())
    try:
        if cancel_after is not None:
            done, _ = await asyncio.wait({task}, timeout=cancel_after)
            if not done:
                call.cancel()
        await task
        status = "OK"
    except asyncio.CancelledError:
        status = "CANCELLED"
    except grpc.aio.AioRpcError as exc:
        status = f"{exc.code().name}: {exc.details()[:120]}"
    return Result(kind, status, ttft, gaps, tokens, cancel_after is not None, migrations)


async def stream_worker(address, seed, stop_at, max_requests, run: Run, cancel_rate, deadline):
    rng, turns = random.Random(seed), {}
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        # a request is counted when it starts: counting finished ones let every other
        # stream start one more while the last were in flight (339 for --requests 300)
        while time.monotonic() < stop_at and run.started < max_requests:
            run.started += 1
            run.results.append(await one_request(stub, rng, turns, cancel_rate, deadline))


def proc_usage(pid: int) -> tuple[float, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kb = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmRSS")))
        return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def service_pids(mesh: Mesh) -> dict[str, int]:
    pids = {name: p.proc.pid for name, p in mesh.procs.items() if p.alive}
    if mesh.valkey is not None and mesh.valkey.alive:
        pids["valkey"] = mesh.valkey.proc.proc.pid
    return pids


async def snapshot_store_mb(mesh: Mesh) -> dict[str, float]:
    """Each live engine's snapshot store, MB (GetStats `snapshot_bytes`): the cache that
    grows to its --snapshot-mb bound while RSS is read."""
    out = {}
    for name in mesh.engine_names:
        try:
            async with grpc.aio.insecure_channel(mesh.endpoints[name]) as ch:
                stats = await engine_pb2_grpc.EngineServiceStub(ch).GetStats(
                    engine_pb2.GetStatsRequest(), timeout=5)
            out[name] = stats.counters["snapshot_bytes"] / 2**20
        except grpc.RpcError:          # killed by --faults: no sample
            continue
    return out


async def sampler(mesh: Mesh, run: Run, t0: float, stop_at: float, every: float):
    while time.monotonic() < stop_at:
        row = {"t": time.monotonic() - t0}
        for name, pid in service_pids(mesh).items():
            usage = proc_usage(pid)
            if usage is not None:
                row[name] = usage
        run.snapshot_mb.append((row["t"], await snapshot_store_mb(mesh)))
        run.samples.append(row)
        done = len(run.results)
        bad = sum(1 for r in run.results if r.status != "OK" and not r.deliberate_cancel)
        print(f"[soak] t={row['t']:6.0f}s requests={done} failed={bad} "
              + " ".join(f"{k}={v[0]:.0f}MB/{v[1]}fd" for k, v in row.items() if k != "t"),
              flush=True)
        await asyncio.sleep(every)


async def faults(mesh: Mesh, run: Run, t0: float, duration: float):
    """The fault run: an engine SIGKILLed, Valkey killed and restarted empty, an engine
    SIGSTOPped for 15 s, spread over the run."""
    a, b = mesh.engine_names[0], mesh.engine_names[-1]
    plan = [(0.2, "kill engine", lambda: mesh.kill(a)),
            (0.35, "restart engine", lambda: mesh.restart(a)),
            (0.45, "kill valkey", lambda: mesh.valkey.proc.kill()),
            (0.5, "restart valkey empty", lambda: restart_valkey(mesh)),
            (0.65, "SIGSTOP engine 15 s", lambda: os.kill(mesh.pid(b), signal.SIGSTOP)),
            (0.65 + 15 / max(duration, 1), "SIGCONT engine", lambda: os.kill(mesh.pid(b),
                                                                               signal.SIGCONT))]
    for at, what, act in plan:
        await asyncio.sleep(max(0.0, t0 + at * duration - time.monotonic()))
        await asyncio.to_thread(act)
        run.faults.append(f"{time.monotonic() - t0:.0f}s {what}")
        print(f"[soak] fault: {what}", flush=True)


def restart_valkey(mesh: Mesh) -> None:
    """Valkey back on the same port; it runs without persistence, so it comes back empty."""
    mesh.valkey.start()


async def idle_engines(mesh: Mesh, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        stats = []
        for name in mesh.engine_names:
            async with grpc.aio.insecure_channel(mesh.endpoints[name]) as ch:
                stub = engine_pb2_grpc.EngineServiceStub(ch)
                stats.append(dict((await stub.GetStats(engine_pb2.GetStatsRequest(),
                                                       timeout=10)).counters))
        if all(s["running"] == 0 and s["waiting"] == 0 for s in stats) \
                or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.5)


def rss_growth(samples: list[dict], warmup_frac: float) -> dict[str, tuple[float, float, float]]:
    """name -> (RSS MB after warm-up, RSS MB at the end, growth fraction)."""
    start = samples[min(len(samples) - 1, int(len(samples) * warmup_frac))]
    end = samples[-1]
    out = {}
    for name in end:
        if name != "t" and name in start:
            a, b = start[name][0], end[name][0]
            out[name] = (a, b, (b - a) / a if a else 0.0)
    return out


def at_start(samples: list[dict]) -> dict[str, float]:
    """name -> RSS MB at the first sample."""
    return {n: v[0] for n, v in samples[0].items() if n != "t"} if samples else {}


def plot(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = sorted({k for s in run.samples for k in s if k != "t"})
    for name in names:
        pts = [(s["t"] / 60, s[name][0]) for s in run.samples if name in s]
        ax1.plot(*zip(*pts, strict=True), label=name)
    ax1.set_xlabel("minutes")
    ax1.set_ylabel("RSS (MB)")
    ax1.set_title("RSS per service")
    ax1.legend(fontsize=7)
    ax1.grid(True, alpha=0.3)
    ok = [r for r in run.results if r.status == "OK"]
    for kind in ("agent", "chatbot"):
        ttfts = sorted(r.ttft * 1000 for r in ok if r.kind == kind and r.ttft is not None)
        if ttfts:
            ax2.plot(ttfts, [i / len(ttfts) for i in range(len(ttfts))], label=f"TTFT {kind}")
    gaps = sorted(g * 1000 for r in ok for g in r.gaps)
    if gaps:
        ax2.plot(gaps, [i / len(gaps) for i in range(len(gaps))], label="inter-token")
    ax2.set_xscale("log")
    ax2.set_xlabel("ms")
    ax2.set_ylabel("fraction")
    ax2.set_title("latency CDF")
    ax2.legend(fontsize=7)
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def soak(args) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="kvmesh-soak-")) / "logs"
    # The kvstore's memory tier and the engines' snapshot stores (256 MiB each by default)
    # fill for the first tens of minutes of a soak, which is caching, not a leak: small
    # budgets fill during warm-up, so RSS growth after it measures leaks only.
    env = {"OMP_NUM_THREADS": "1", "KVMESH_KVSTORE_MEM_BYTES": str(args.cache_mib << 20)}
    cfg = MeshConfig(engines=2, num_slots=8, num_blocks=256, log_dir=log_dir, env=env,
                     engine_extra=("--fetch-deadline-ms", "5000",
                                   "--snapshot-mb", str(args.cache_mib)))
    print(f"[soak] starting a mesh (logs in {log_dir})", flush=True)
    mesh = await asyncio.to_thread(lambda: Mesh(cfg).start())
    run = Run()
    try:
        duration = args.minutes * 60
        t0 = time.monotonic()
        stop_at = t0 + duration
        tasks = [stream_worker(mesh.gateway, args.seed * 1000 + i, stop_at, args.requests, run,
                               args.cancel_rate, args.deadline) for i in range(args.streams)]
        extra = [sampler(mesh, run, t0, stop_at, args.sample_every)]
        if args.faults:
            extra.append(faults(mesh, run, t0, duration))
        await asyncio.gather(*tasks, *extra)
        stats = await idle_engines(mesh)
        tracebacks = [p.name for p in mesh.procs.values()
                      if "Traceback" in p.log_path.read_text(errors="replace")]
    finally:
        await asyncio.to_thread(mesh.stop)
    return report(args, run, stats, tracebacks)


def report(args, run: Run, stats: list[dict], tracebacks: list[str]) -> int:
    res = run.results
    by_status: dict[str, int] = {}
    for r in res:
        key = "CANCELLED (deliberate)" if r.deliberate_cancel and r.status == "CANCELLED" \
            else r.status.split(":")[0]
        by_status[key] = by_status.get(key, 0) + 1
    failed = [r for r in res if r.status != "OK" and not r.deliberate_cancel]
    ok = [r for r in res if r.status == "OK"]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    growth = rss_growth(run.samples, args.warmup) if run.samples else {}
    print()
    print(table(["status", "requests"], [[k, v] for k, v in sorted(by_status.items())]))
    print()
    print(table(["metric", "p50 ms", "p99 ms"],
                [["TTFT", pct(ttft, .5) * 1000, pct(ttft, .99) * 1000],
                 ["inter-token", pct(gaps, .5) * 1000, pct(gaps, .99) * 1000]]))
    print()
    first = at_start(run.samples)
    print(table(["service", "RSS start MB", "RSS after warm-up MB", "RSS end MB", "growth %",
                 "fds end"],
                [[n, first.get(n, float("nan")), a, b, g * 100, run.samples[-1][n][1]]
                 for n, (a, b, g) in growth.items()]))
    if run.snapshot_mb:
        warm = run.snapshot_mb[min(len(run.snapshot_mb) - 1,
                                   int(len(run.snapshot_mb) * args.warmup))][1]
        print(table(["engine", "snapshot store start MB", "after warm-up MB", "end MB",
                     "bound MB"],
                    [[n, run.snapshot_mb[0][1].get(n, 0.0), warm.get(n, 0.0),
                      run.snapshot_mb[-1][1].get(n, 0.0), args.cache_mib]
                     for n in sorted(run.snapshot_mb[-1][1])]))
    leftovers = [(s["slots_in_use"], s["blocks_in_use"]) for s in stats]
    print(f"engine snapshot stores at the end (MB): "
          f"{[round(s['snapshot_bytes'] / 2**20, 1) for s in stats]}")
    print(f"\nengines once idle (slots, blocks in use): {leftovers}; "
          f"migrations: {sum(r.migrations for r in res)}; faults: {run.faults}")
    OUT.mkdir(parents=True, exist_ok=True)
    stem = f"soak_{args.streams}x{args.minutes:g}m" + ("_faults" if args.faults else "")
    plot(run, OUT / f"{stem}.png")
    (OUT / f"{stem}.json").write_text(json.dumps({
        "args": vars(args), "by_status": by_status, "failed": [r.status for r in failed],
        "ttft_p50": pct(ttft, .5), "ttft_p99": pct(ttft, .99), "gap_p50": pct(gaps, .5),
        "gap_p99": pct(gaps, .99), "rss_growth": growth, "rss_start": first,
        "snapshot_mb": run.snapshot_mb, "leftovers": leftovers,
        "faults": run.faults, "tracebacks": tracebacks, "samples": run.samples}, indent=1))
    print(f"wrote {OUT / (stem + '.png')} and .json")
    problems = []
    if failed:
        problems.append(f"{len(failed)} failed requests, e.g. {failed[0].status}")
    grown = {n: g for n, (_, _, g) in growth.items() if g > args.rss_limit}
    if grown:
        problems.append(f"RSS grew more than {args.rss_limit:.0%}: {grown}")
    if any(s or b for s, b in leftovers):
        problems.append(f"engines hold slots/blocks once idle: {leftovers}")
    if tracebacks:
        problems.append(f"tracebacks in the logs of {tracebacks}")
    for p in problems:
        print(f"FAIL: {p}")
    if not problems:
        print("PASS")
    return 1 if problems else 0


def main(argv=None) -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8, help="concurrent client streams")
    ap.add_argument("--minutes", type=float, default=30.0, help="run time")
    ap.add_argument("--requests", type=int, default=10**9, help="stop after this many requests")
    ap.add_argument("--cancel-rate", type=float, default=0.05,
                    help="fraction of requests cancelled on purpose at a random moment")
    ap.add_argument("--deadline", type=float, default=300.0,
                    help="client deadline per request, seconds (40 streams on 2 cores queue "
                    "for tens of seconds)")
    ap.add_argument("--faults", action="store_true",
                    help="kill an engine, restart Valkey empty and SIGSTOP an engine for 15 s")
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the run before RSS "
                    "growth is measured")
    ap.add_argument("--rss-limit", type=float, default=0.10, help="allowed RSS growth")
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--cache-mib", type=int, default=16,
                    help="kvstore memory tier and engine snapshot store budgets, MiB "
                    "(see the comment in soak())")
    ap.add_argument("--seed", type=int, default=0)
    return asyncio.run(soak(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
