"""What the kvstore benches share: a kvstore process over a SeaweedFS cluster, plain S3
clients to set beside it, CPU per object of a group of processes, timed concurrent ops."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from bench.common import cpu_s
from kvmesh.launch.backing.proc import ManagedProcess, free_port, wait_port
from kvmesh.s3 import s3_client


async def timed(n_ops: int, concurrency: int, op) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(i):
        async with sem:
            await op(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n_ops)))
    return time.perf_counter() - t0


class CpuMeter:
    """CPU ms per object spent by groups of processes between start() and stop(n)."""

    def __init__(self, groups: dict[str, list[int]]):
        self.groups = groups  # name -> pids; "bench" is this process

    def _now(self) -> dict[str, float]:
        return {g: sum(cpu_s(p) for p in pids) for g, pids in self.groups.items()}

    def start(self) -> None:
        self._t0 = self._now()

    def stop(self, n: int) -> dict[str, float]:
        t1 = self._now()
        return {g: 1e3 * (t1[g] - self._t0[g]) / n for g in t1}


def raw_clients(cluster, bucket: str) -> list:
    """One plain boto3 client per SeaweedFS server, each with `bucket` made (the raw rows)."""
    clients = [s3_client(s.endpoint, read_timeout=60) for s in cluster.servers]
    for c in clients:
        try:
            c.create_bucket(Bucket=bucket)
        except Exception:  # noqa: BLE001 - exists already
            pass
    return clients


def start_kvstore(cluster, tmp: Path, name: str, tiers: bool, run_blocks: int = 16,
                  index: str = "sqlite", index_prefix: str = "kvmesh:kv"
                  ) -> tuple[ManagedProcess, str]:
    port = free_port()
    mem = str(2 << 30) if tiers else "0"
    env = {"KVMESH_KVSTORE_LOCATIONS": ",".join(cluster.locations),
           "KVMESH_KVSTORE_RUN_BLOCKS": str(run_blocks)}
    proc = ManagedProcess(name, [sys.executable, "-m", "kvmesh.launch.cli", "--log-level", "WARNING",
                                 "kvstore", "serve", "--port", str(port),
                                 "--data-dir", str(tmp / name), "--mem-bytes", mem,
                                 "--disk-bytes", "0", "--capacity-bytes", str(1 << 40),
                                 "--index", index, "--index-prefix", index_prefix],
                          tmp, env=env).start()
    wait_port("127.0.0.1", port, timeout=60, proc=proc.proc)
    return proc, f"127.0.0.1:{port}"
