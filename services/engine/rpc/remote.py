"""RemoteTiers: the engine's asynchronous side of the cache tiers.

Runs on the server's event loop; never on the engine thread. It owns the
clients for the kvstore and the directory, and three background jobs. It
reads or writes nothing of Engine's mutable state directly: views, the
cost model's prefill speed and every counter go through the engine thread
(`AsyncEngine.call` to read, `AsyncEngine.post` to count); only facts fixed at
start-up (model and layout fingerprints, sizes) are copied here once.

    heartbeat   every lease/3: address + load to the directory
    uploader    write-through of completed blocks to the kvstore, batched; a full
                queue drops blocks (the cache is best effort; decode never waits)
    publisher   publish stored snapshots to the directory, withdraw evicted ones

Before a request is admitted, `prefetch()` gathers what the local ledger lacks:
the kvstore's continuation of the prompt's block run, and the SWA snapshot at
its end from a peer (when the cost model prefers fetching to replay). Every
failure or deadline is a miss: the request then replays or runs cold.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvmesh.cachekeys import snapshot_key
from kvmesh.errors import KvmeshError
from kvmesh.generation import DEFAULT_TRAFFIC_CLASS
from kvmesh.services.engine.cache.prefetch import Prefetched
from kvmesh.services.engine.core.async_engine import AsyncEngine
from kvmesh.services.engine.core.events import Hooks
from kvmesh.services.engine.rpc.fetch_policy import FetchPolicy
from kvmesh.services.engine.rpc.peers import FetchError, fetch_snapshot

log = logging.getLogger("kvmesh.engine.remote")
UPLOAD_QUEUE = 4096


async def next_batch(queue: asyncio.Queue, limit: int) -> list:
    """Wait for one item, then take what else is already queued, up to `limit` in all."""
    batch = [await queue.get()]
    while not queue.empty() and len(batch) < limit:
        batch.append(queue.get_nowait())
    return batch


class RemoteTiers(Hooks):
    def __init__(self, engine: AsyncEngine, engine_id: str, address: str, directory=None,
                 kvstore=None, policy: FetchPolicy | None = None, fetch_deadline_s: float = 1.0,
                 kvstore_timeout_s: float = 1.0):
        self.engine = engine
        core = engine.core            # start-up facts only; they never change
        self.block_size, self.window = core.cfg.block_size, core.cfg.window
        self.model_fp, self.layout_fp = core.cfg.fingerprint(), core.prefix.layout_fp
        self.snapshot_size = core.snapshot_size
        self.engine_id, self.address = engine_id, address
        self.directory, self.kvstore = directory, kvstore
        self.policy = policy or FetchPolicy()
        self.fetch_deadline_s = fetch_deadline_s
        self.kvstore_timeout_s = kvstore_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.uploads: asyncio.Queue = asyncio.Queue(UPLOAD_QUEUE)
        self.publishes: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.wants_blocks = kvstore is not None
        self.lease_s = 10.0
        self.registered = False
        self.republish_needed = False    # a publish failed: send the whole store again

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.engine.call(lambda core: setattr(core, "hooks", self))
        if self.directory is not None:
            self.tasks += [asyncio.create_task(self._heartbeats()),
                           asyncio.create_task(self._publisher())]
        if self.kvstore is not None:
            self.tasks.append(asyncio.create_task(self._uploader()))

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # --- hooks (engine thread): only enqueue ---------------------------------------------
    def block_done(self, block_hash: bytes, payload: bytes, traffic_class: str) -> None:
        self._post(self._enqueue_upload, (block_hash.hex(), payload, traffic_class or DEFAULT_TRAFFIC_CLASS))

    def snapshot_stored(self, key: str, snap) -> None:
        self._post(self.publishes.put_nowait, ("publish", key, snap.position, len(snap.data)))

    def snapshot_evicted(self, key: str) -> None:
        self._post(self.publishes.put_nowait, ("withdraw", key, 0, 0))

    def _post(self, fn, item) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn, item)

    def _enqueue_upload(self, item) -> None:
        try:
            self.uploads.put_nowait(item)
        except asyncio.QueueFull:
            self._count("kvstore_upload_dropped")

    def _count(self, key: str, n: float = 1) -> None:
        """Add to an engine counter on the engine thread (Engine owns the counters)."""
        self.engine.post(lambda core: core.counters.update({key: n}))

    # --- prefetch (event loop, before admission) --------------------------------------
    async def prefetch(self, prompt_ids: list[int], salt: str) -> Prefetched | None:
        if self.kvstore is None and self.directory is None:
            return None
        view, prefill_token_s = await self.engine.call(
            lambda core: (core.local_view(prompt_ids, salt), core.prefill_token_s))
        hashes = view.hashes
        if not hashes:
            return None
        out = Prefetched(hashes)
        n = view.n_local + await self._fetch_blocks(hashes[view.n_local:], out)
        if n == 0:
            return out
        key = snapshot_key(hashes[n - 1], self.layout_fp)
        if key not in view.snapshot_keys and self.directory is not None:
            await self._fetch_snapshot(key, n * self.block_size, prefill_token_s, out)
        return out

    async def _fetch_blocks(self, hashes: list[bytes], out: Prefetched) -> int:
        if self.kvstore is None or not hashes:
            return 0
        keys = [h.hex() for h in hashes]
        try:
            n = await asyncio.wait_for(self.kvstore.lookup(keys), self.kvstore_timeout_s)
            payloads = await asyncio.wait_for(self.kvstore.get(keys[:n]), self.kvstore_timeout_s) if n else []
        except (TimeoutError, KvmeshError, grpc.aio.AioRpcError, OSError) as exc:
            self._count("kvstore_misses_on_error")
            log.warning("kvstore unavailable, treating as a miss: %s", exc)
            return 0
        got = 0
        for h, p in zip(hashes, payloads, strict=False):
            if p is None:
                break
            out.blocks[h] = p
            got += 1
        self._count("kvstore_block_hits", got)
        return got

    async def _fetch_snapshot(self, key: str, position: int, prefill_token_s: float,
                              out: Prefetched) -> None:
        holders = [h for h in (await self.directory.find_holders([key])).get(key, [])
                   if h.engine_id != self.engine_id]
        if not holders:
            self._count("peer_snapshot_unheld")
            return
        size = self.snapshot_size
        replay_s = prefill_token_s * self.window
        if not self.policy.should_fetch(size, replay_s):
            self._count("peer_snapshot_replay_chosen")
            return
        for holder in holders[:2]:
            try:
                snap, secs = await fetch_snapshot(
                    holder.address, key, self.fetch_deadline_s, self.layout_fp,
                    self.model_fp, size, position)
            except FetchError as exc:
                self._count("peer_snapshot_failures")
                log.warning("snapshot fetch failed, will replay: %s", exc)
                continue
            self.policy.record_fetch(size, secs)
            out.snapshots[key] = snap
            self._count("peer_snapshot_fetches")
            return

    # --- background jobs ----------------------------------------------------------------
    async def _heartbeats(self) -> None:
        from kvmesh.directory_records import EngineLoad

        restarted = True
        while True:
            try:
                stats = await self.engine.call(lambda core: core.stats())
                load = EngineLoad(int(stats["running"]), int(stats["waiting"]),
                                  int(stats["slots_total"] - stats["slots_in_use"]),
                                  int(stats["blocks_total"] - stats["blocks_in_use"]))
                grant = await self.directory.heartbeat(self.engine_id, self.address, load,
                                                       restarted=restarted)
                restarted = False
                self.lease_s = grant.lease_ttl_ms / 1000.0
                if (grant.new_lease and self.registered) or self.republish_needed:
                    self.republish_needed = False
                    await self._republish()
                self.registered = True
            except KvmeshError as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(max(0.2, self.lease_s / 3))

    async def _republish(self) -> None:
        """A new lease (directory or Redis restarted): publish what the store still holds."""
        snaps = await self.engine.call(
            lambda core: [(k, s.position, len(s.data)) for k, s in core.prefix.store.items()])
        for key, pos, size in snaps:
            self.publishes.put_nowait(("publish", key, pos, size))

    async def _publisher(self) -> None:
        from kvmesh.directory_records import Entry

        while True:
            batch = await next_batch(self.publishes, 256)
            pubs = [Entry(k, p, s, None) for op, k, p, s in batch if op == "publish"]
            gone = [k for op, k, _, _ in batch if op == "withdraw"]
            try:
                if pubs:
                    await self.directory.publish(self.engine_id, pubs)
                    self._count("directory_published", len(pubs))
                if gone:
                    await self.directory.withdraw(self.engine_id, gone)
            except KvmeshError as exc:
                self._count("directory_publish_failures")
                self.republish_needed = True        # the next good heartbeat republishes
                log.warning("directory publish failed (will republish): %s", exc)

    async def _uploader(self) -> None:
        while True:
            batch = await next_batch(self.uploads, 64)
            by_class: dict[str, list[tuple[str, bytes]]] = {}
            for key, payload, cls in batch:
                by_class.setdefault(cls, []).append((key, payload))
            t0 = time.perf_counter()
            for cls, items in by_class.items():
                try:
                    await asyncio.wait_for(self.kvstore.put(items, traffic_class=cls), 30.0)
                    self._count("kvstore_blocks_written", len(items))
                except (TimeoutError, KvmeshError, grpc.aio.AioRpcError, OSError) as exc:
                    self._count("kvstore_write_failures", len(items))
                    log.warning("kvstore write-through failed (blocks stay local): %s", exc)
            self._count("kvstore_upload_seconds", time.perf_counter() - t0)
