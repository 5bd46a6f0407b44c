"""Fetch a V4.1-Flash-sized SWA snapshot from a peer engine, or replay 128 tokens?

Measures, in one run on this machine:
  fetch   a 1,415,040 B snapshot (V4.1-Flash's state_size_to_disk) from an engine
          serving FetchSwaSnapshot over loopback gRPC, verified (sha256, size)
  replay  the extra TTFT of a block hit + 128-token bounded replay over a snapshot
          hit, tiny model, prompt of 4096 tokens
and prints the ratio and what the engine's cost model (FetchPolicy) chooses.
Usage: python -m bench.engine.swa_fetch [--repeats 20]
"""

from __future__ import annotations

import asyncio
import statistics
import sys

import torch

from bench.common import OUT, ROOT, parser, plot, table
from bench.engine.first_token import engine, ttft
from kvmesh.proto import engine_pb2_grpc
from kvmesh.rpc import Server
from kvmesh.services.engine.cache.snapshots import Snapshot
from kvmesh.services.engine.core.async_engine import AsyncEngine
from kvmesh.services.engine.model.deepseek_v4 import v41_layout
from kvmesh.services.engine.model.deepseek_v4.v41_config import read_v41_config
from kvmesh.services.engine.rpc.fetch_policy import FetchPolicy
from kvmesh.services.engine.rpc.peers import fetch_snapshot
from kvmesh.services.engine.rpc.server import SERVICE_NAME
from kvmesh.services.engine.rpc.service import EngineServicer

# a DeepSeek V4.1-Flash snapshot: 20 KV-source rings x 134 rows x 528 B = 1,415,040 B
SIZE = v41_layout.report(read_v41_config(ROOT / "configs/deepseek-v4.1-flash.json")
                         )["state_slot"]["snapshot_bytes"]
KEY = "ab" * 32


async def fetch_times(repeats: int) -> list[float]:
    core = engine(1024, "full")
    store = core.prefix.store
    store.capacity = 64 << 20
    data = torch.randint(0, 256, (SIZE,), dtype=torch.uint8).numpy().tobytes()
    store.put(Snapshot(KEY, 128, store.layout_fp, store.model_fp, data, store.clock()))
    eng = AsyncEngine(core)
    server = Server("127.0.0.1:0", [SERVICE_NAME])
    engine_pb2_grpc.add_EngineServiceServicer_to_server(EngineServicer(eng), server.server)
    await server.start()
    addr = f"127.0.0.1:{server.port}"
    times = []
    try:
        for _ in range(repeats + 1):
            snap, secs = await fetch_snapshot(addr, KEY, 5.0, store.layout_fp, store.model_fp,
                                              SIZE, 128)
            assert snap.data == data
            times.append(secs)
    finally:
        await server.stop(0.1)
        eng.shutdown()
    return times[1:]                      # the first call pays for channel set-up


def replay_times(repeats: int, length: int = 4096) -> tuple[list[float], list[float]]:
    prompt = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    l1 = (length - 134) // 128 * 128
    out = {}
    for name, policy in (("snapshot", "full"), ("replay", "zero")):
        core = engine(length, policy)
        ttft(core, prompt[: l1 + 1])
        out[name] = [ttft(core, prompt)[0] for _ in range(repeats)]
    return out["snapshot"], out["replay"]


def main(argv=None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    fetch = asyncio.run(fetch_times(args.repeats))
    snap, replay = replay_times(max(3, args.repeats // 4))
    f = statistics.median(fetch)
    extra = max(statistics.median(replay) - statistics.median(snap), 1e-6)
    policy = FetchPolicy()
    for t in fetch:
        policy.record_fetch(SIZE, t)
    choice = "fetch" if policy.should_fetch(SIZE, extra) else "replay"
    print(table(["what", "median ms", "p90 ms"], [
        [f"fetch {SIZE:,} B", f * 1e3, sorted(fetch)[int(0.9 * len(fetch))] * 1e3],
        ["TTFT snapshot hit (L=4096)", statistics.median(snap) * 1e3, max(snap) * 1e3],
        ["TTFT replay hit (L=4096)", statistics.median(replay) * 1e3, max(replay) * 1e3],
        ["replay cost (difference)", extra * 1e3, float("nan")],
    ]))
    print(f"\nfetch / replay = {f / extra:.3f}   bandwidth {SIZE / f / 1e6:.0f} MB/s")
    print(f"cost model: fetch estimate {policy.fetch_estimate(SIZE) * 1e3:.2f} ms vs replay "
          f"{extra * 1e3:.2f} ms -> {choice}")
    path = plot(OUT / "swa_fetch.png", "Peer fetch vs 128-token replay", "run", "ms",
                {"fetch": (list(range(len(fetch))), [t * 1e3 for t in fetch]),
                 "replay extra": (list(range(len(replay))),
                                  [(r - statistics.median(snap)) * 1e3 for r in replay])},
                logx=False, logy=False)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
