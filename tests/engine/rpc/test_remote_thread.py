"""RemoteTiers runs on the event loop and reaches the engine core only through the engine thread:
its counters, the prefill speed it reads for the fetch-or-replay choice, and the hooks it
installs. Here the kvstore is down (a real client to a port nobody listens on), so the
prefetch counts a miss and the write-through counts failures, all from the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

from kvmesh.launch.backing.proc import free_port
from kvmesh.services.engine.core.async_engine import AsyncEngine
from kvmesh.services.engine.core.engine import Engine
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.rpc.remote import RemoteTiers
from kvmesh.services.kvstore.client import KvstoreClient
from tests.engine.engines import random_prompt, serve_core

ENGINE_THREAD = "engine-loop"


class WatchedCounter(Counter):
    """Records the thread of every write."""

    def __init__(self):
        super().__init__()
        self.writers: set[str] = set()

    def __setitem__(self, key, value):
        self.writers.add(threading.current_thread().name)
        super().__setitem__(key, value)


class WatchedCore(Engine):
    """Records the thread of every access to the state RemoteTiers used to touch directly.
    (An engine built as `engine serve` builds it, then given this class: construction
    happens on the test thread and is not watched.)"""

    touched: set[str]

    @classmethod
    def watch(cls, core: Engine) -> WatchedCore:
        core.__class__ = cls
        assert isinstance(core, WatchedCore)
        object.__setattr__(core, "touched", set())
        counters = WatchedCounter()
        dict.update(counters, core.counters)
        core.counters = counters
        return core

    def _watch(self, name):
        if name in ("prefill_token_s", "hooks"):
            self.touched.add(threading.current_thread().name)

    def __getattribute__(self, name):
        if name in ("prefill_token_s", "hooks"):
            object.__getattribute__(self, "_watch")(name)
        return object.__getattribute__(self, name)

    def __setattr__(self, name, value):
        if name in ("prefill_token_s", "hooks") and hasattr(self, "touched"):
            self._watch(name)
        object.__setattr__(self, name, value)


def test_remote_tiers_touch_the_core_only_on_the_engine_thread():
    core = WatchedCore.watch(serve_core())
    engine = AsyncEngine(core)
    prompt = random_prompt(300, 71)

    async def main():
        kvstore = KvstoreClient(f"127.0.0.1:{free_port()}")
        remote = RemoteTiers(engine, "e1", "127.0.0.1:1", kvstore=kvstore, kvstore_timeout_s=2.0)
        await remote.start()
        pre = await remote.prefetch(prompt, "")
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        events = [ev async for ev in engine.generate(prompt, params, prefetched=pre)]
        stats = {}
        for _ in range(100):                      # the uploader's failed put is counted later
            stats = await engine.call(lambda c: c.stats())
            if stats.get("kvstore_write_failures"):
                break
            await asyncio.sleep(0.1)
        await remote.stop()
        await kvstore.close()
        return events, stats

    try:
        events, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert events[-1].finish is not None
    assert stats["kvstore_misses_on_error"] == 1
    assert stats["kvstore_write_failures"] >= 1 and "kvstore_upload_seconds" in stats
    assert core.counters.writers == {ENGINE_THREAD}
    assert core.touched == {ENGINE_THREAD}
