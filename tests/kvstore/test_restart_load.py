"""A real `kvmesh kvstore serve` process SIGKILLed in the middle of a mixed put (runs,
overwrites) / get / GC load, then restarted on the same data dir: no read ever returns
wrong bytes, and every put that was acknowledged is served afterwards, exact."""

import asyncio
import hashlib
import random
import sys
import time

from kvmesh.launch.backing.proc import ManagedProcess, free_port, wait_port
from kvmesh.services.kvstore.client import KvstoreClient, connect

WRITERS = 3
BATCH = 8


def content(key: str, version: int) -> bytes:
    seed = hashlib.blake2b(f"{key}/{version}".encode()).digest()
    return (seed * (1 + (int(key[:4], 16) % 200)))[: 4000 + int(key[-3:], 16)]


class Ledger:
    """What each writer tried and what was acknowledged; one writer owns each key,
    so a key's versions are tried in order."""

    def __init__(self):
        self.tried: dict[str, set[int]] = {}
        self.acked: dict[str, int] = {}
        self.wrong: list[str] = []
        self.reads = 0

    def check(self, key: str, data: bytes | None) -> None:
        self.reads += 1
        if data is not None and all(data != content(key, v) for v in self.tried.get(key, ())):
            self.wrong.append(key)


async def writer(address: str, w: int, ledger: Ledger, stop: asyncio.Event,
                 fill: str = "a", pause_s: float = 0.0) -> None:
    """Puts batches of fresh keys and overwrites of its own until `stop`; `address` may name
    several replicas (a client pool). `fill` pads the keys, `pause_s` spaces the batches."""
    rng = random.Random(w)
    mine: list[str] = []
    n = 0
    async with connect(address, timeout=10) as c:
        while not stop.is_set():
            fresh = [f"{w:02x}{n + i:06x}".ljust(64, fill) for i in range(BATCH // 2)]
            n += BATCH // 2
            again = rng.sample(mine, min(len(mine), BATCH // 2))
            batch = [(k, ledger.acked.get(k, -1) + 1) for k in fresh + again]
            for k, v in batch:
                ledger.tried.setdefault(k, set()).add(v)
            try:
                await c.put([(k, content(k, v)) for k, v in batch])
            except Exception:  # noqa: BLE001 - no kvstore answered: not acknowledged
                await asyncio.sleep(0.1)
                continue
            for k, v in batch:
                ledger.acked[k] = v
            mine += fresh
            await asyncio.sleep(pause_s)


async def reader(address: str, ledger: Ledger, stop: asyncio.Event) -> None:
    rng = random.Random(99)
    async with KvstoreClient(address, timeout=10) as c:
        while not stop.is_set():
            keys = rng.sample(sorted(ledger.acked), min(len(ledger.acked), 12))
            try:
                got = await c.get(keys) if keys else []
                if rng.random() < 0.1:
                    await c.run_gc()
            except Exception:  # noqa: BLE001 - down: a miss, never wrong bytes
                await asyncio.sleep(0.1)
                continue
            for k, data in zip(keys, got, strict=True):
                ledger.check(k, data)


def serve(locations, tmp_path, port: int) -> ManagedProcess:
    env = {"KVMESH_KVSTORE_LOCATIONS": ",".join(str(x) for x in locations)}
    proc = ManagedProcess(
        "kvstore", [sys.executable, "-m", "kvmesh.launch.cli", "kvstore", "serve", "--port", str(port),
                    "--data-dir", str(tmp_path / "kv"), "--mem-bytes", "0", "--disk-bytes", "0",
                    "--gc-interval-s", "1"],
        tmp_path, env=env).start()
    wait_port("127.0.0.1", port, timeout=60, proc=proc.proc)
    return proc


async def kill_under_load(tasks, stop: asyncio.Event, kill, restart, up_s: float, down_s: float,
                          after_s: float) -> None:
    """Let `tasks` run for up_s, kill (SIGKILL: mid-put, mid-get, maybe mid-GC), wait down_s,
    `restart()` (blocking, run in a thread), run after_s more, then stop the tasks and wait."""
    await asyncio.sleep(up_s)
    kill()
    await asyncio.sleep(down_s)
    await asyncio.to_thread(restart)
    await asyncio.sleep(after_s)
    stop.set()
    await asyncio.gather(*tasks)


def test_kill_and_restart_under_load_no_wrong_bytes_no_lost_puts(locations, tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    ledger = Ledger()
    proc = serve(locations, tmp_path, port)

    async def load() -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(writer(address, w, ledger, stop)) for w in range(WRITERS)]
        tasks.append(asyncio.create_task(reader(address, ledger, stop)))

        def restart() -> None:
            nonlocal proc
            proc = serve(locations, tmp_path, port)

        await kill_under_load(tasks, stop, lambda: proc.kill(), restart, 3.0, 0.5, 3.0)

    t0 = time.monotonic()
    try:
        asyncio.run(load())
        keys = sorted(ledger.acked)

        async def final():
            async with KvstoreClient(address, timeout=60) as c:
                return await c.get(keys)

        got = asyncio.run(final())
    finally:
        proc.stop()
    assert ledger.wrong == []
    lost = [k for k, data in zip(keys, got, strict=True)
            if data is None or all(data != content(k, v) for v in ledger.tried[k]
                                   if v >= ledger.acked[k])]
    assert lost == []
    assert len(keys) >= 3 * BATCH and ledger.reads > 0, (len(keys), ledger.reads)
    print(f"\n{len(keys)} keys acknowledged, {ledger.reads} reads checked, "
          f"{time.monotonic() - t0:.1f} s")
